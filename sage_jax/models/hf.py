"""Hugging Face checkpoints <-> the NNX decoder.

`load(path, dtype, mesh)` reads `config.json` and `model.safetensors` (or a sharded
`model.safetensors.index.json`) tensor by tensor from memory maps, converts each through the name
table below with a shape assertion, and places it straight into its target sharding
(`jax.make_array_from_callback`: every device receives only its own shard). `save` writes the HF
layout back, loadable by `transformers.AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sage_jax.errors import UserError
from sage_jax import sharding as shd
from sage_jax.models import safetensors_io as st
from sage_jax.models.config import ConfigError, ModelConfig
from sage_jax.models import lora as lora_lib
from sage_jax.models.decoder import Decoder


INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja",
                   "added_tokens.json")
_ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


class CheckpointError(UserError, ValueError):
    """A checkpoint that does not match the model; the message names the file / key."""


@dataclasses.dataclass(frozen=True)
class Entry:
    hf_name: str
    path: tuple  # path in the NNX state
    hf_shape: tuple[int, ...]
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


def _t(x):
    return x.T


def name_table(cfg: ModelConfig) -> list[Entry]:
    """The conversion table: HF tensor name, our state path, HF shape, and the two layout maps."""
    D, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    H, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ident = lambda x: x
    rows = [Entry("model.embed_tokens.weight", ("embed",), (V, D), ident, ident),
            Entry("model.norm.weight", ("final_norm", "scale"), (D,), ident, ident)]
    if not cfg.tie_word_embeddings:
        rows.append(Entry("lm_head.weight", ("lm_head",), (V, D), _t, _t))
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", ("layers", i)
        # HF linear weights are [out, in]; ours are [in, ...out] with heads split out.
        heads = lambda n: Entry(f"{p}self_attn.{n[0]}_proj.weight", a + ("attn", f"w{n[0]}"), (n[1] * Dh, D),
                                lambda x, n=n: x.T.reshape(D, n[1], Dh), lambda x, n=n: x.reshape(D, n[1] * Dh).T)
        rows += [Entry(f"{p}input_layernorm.weight", a + ("input_norm", "scale"), (D,), ident, ident),
                 Entry(f"{p}post_attention_layernorm.weight", a + ("post_attn_norm", "scale"), (D,), ident, ident),
                 heads(("q", H)), heads(("k", K)), heads(("v", K)),
                 Entry(f"{p}self_attn.o_proj.weight", a + ("attn", "wo"), (D, H * Dh),
                       lambda x: x.T.reshape(H, Dh, D), lambda x: x.reshape(H * Dh, D).T),
                 Entry(f"{p}mlp.gate_proj.weight", a + ("mlp", "w_gate"), (F, D), _t, _t),
                 Entry(f"{p}mlp.up_proj.weight", a + ("mlp", "w_up"), (F, D), _t, _t),
                 Entry(f"{p}mlp.down_proj.weight", a + ("mlp", "w_down"), (D, F), _t, _t)]
        if cfg.qkv_bias:
            for n, nh in (("q", H), ("k", K), ("v", K)):
                rows.append(Entry(f"{p}self_attn.{n}_proj.bias", a + ("attn", f"b{n}"), (nh * Dh,),
                                  lambda x, nh=nh: x.reshape(nh, Dh), lambda x, nh=nh: x.reshape(nh * Dh)))
        if cfg.qk_norm:
            rows += [Entry(f"{p}self_attn.q_norm.weight", a + ("attn", "q_norm", "scale"), (Dh,), ident, ident),
                     Entry(f"{p}self_attn.k_norm.weight", a + ("attn", "k_norm", "scale"), (Dh,), ident, ident)]
    return rows


# ------------------------------------------------------------------------------------------ files
def is_hub_id(path: str) -> bool:
    """Whether `path` reads as a Hugging Face hub id ('org/name'), not a local path: the one rule every caller uses."""
    return path.count("/") == 1 and not path.startswith((".", "/", "~")) and not os.path.exists(path)


def resolve_path(path: str) -> str:
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ConfigError(f"{path}: not a directory (expected an HF model directory with config.json)")
    if is_hub_id(path):
        try:
            from huggingface_hub import snapshot_download
            return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
        except Exception as e:  # offline, unknown repo, auth: all end the same way for the user
            raise ConfigError(f"{path}: not a local directory and the hub download failed "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                              "download it where you are online and pass the local path") from None
    raise ConfigError(f"{path}: no such directory")


def _open_tensors(path: str) -> dict[str, st.SafetensorsFile]:
    """Maps each tensor name to the opened file that holds it."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({type(e).__name__}: {e})") from None
        files = {fn: None for fn in weight_map.values()}
        for fn in files:
            full = os.path.join(path, fn)
            if not os.path.isfile(full):
                raise CheckpointError(f"{full}: listed in {INDEX_FILE} but missing")
            files[fn] = st.SafetensorsFile(full)
        return {name: files[fn] for name, fn in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        raise CheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
    f = st.SafetensorsFile(single)
    return {name: f for name in f.keys()}


def _check_names(path, table, tensors, tied):
    expected = {e.hf_name for e in table}
    present = set(tensors)
    ignorable = {"lm_head.weight"} if tied else set()  # some tied checkpoints still store the head
    ignorable |= {n for n in present if n.endswith("rotary_emb.inv_freq")}
    missing, unexpected = sorted(expected - present), sorted(present - expected - ignorable)
    if missing or unexpected:
        show = lambda xs: ", ".join(xs[:6]) + (f" (+{len(xs) - 6} more)" if len(xs) > 6 else "")
        raise CheckpointError(f"{path}: tensors do not match the model: missing [{show(missing)}]; "
                              f"unexpected [{show(unexpected)}]")


# ------------------------------------------------------------------------------------------ load
def abstract_model(cfg: ModelConfig, dtype=jnp.float32, param_dtype=None) -> tuple[nnx.GraphDef, nnx.State]:
    """GraphDef and abstract state (ShapeDtypeStructs): nothing allocated."""
    pd = dtype if param_dtype is None else param_dtype
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, dtype=dtype, param_dtype=pd, rngs=nnx.Rngs(0))))


def load(path: str, dtype=jnp.float32, mesh: jax.sharding.Mesh | None = None, param_dtype=None,
         rules=None) -> tuple[Decoder, ModelConfig]:
    """Loads an HF checkpoint directory (or hub id when online) into a sharded NNX Decoder.

    `mesh`: axes (data, fsdp, tensor); one built by `jax.make_mesh` with its default (Explicit) axis types
    is used as the same devices with Auto axes (`sharding.as_auto`)."""
    path = resolve_path(path)
    cfg, _ = ModelConfig.from_hf_dir(path)
    graphdef, state = abstract_model(cfg, dtype, param_dtype)
    flat = dict(nnx.to_flat_state(state))
    tensors = _open_tensors(path)
    table = name_table(cfg)
    _check_names(path, table, tensors, cfg.tie_word_embeddings)
    if mesh is None:
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), shd.MESH_AXES)
    try:
        mesh = shd.as_auto(mesh)  # a jax.make_mesh mesh (Explicit axes by default) works as its Auto twin
    except ValueError as e:
        raise ConfigError(f"hf.load(mesh=...): {e}") from None
    for e in table:
        f = tensors[e.hf_name]
        if f.shape(e.hf_name) != e.hf_shape:
            raise CheckpointError(f"{f.path}: tensor {e.hf_name!r} has shape {list(f.shape(e.hf_name))}, "
                                  f"the config implies {list(e.hf_shape)}")
        var = flat[e.path]
        target = var.get_value()
        arr = np.asarray(e.to_ours(f[e.hf_name]))  # a view of the memory map where the map is a transpose
        assert arr.shape == target.shape, (e.hf_name, arr.shape, target.shape)
        sharding = shd.sharding_for(target.shape, var.get_metadata().get("axes"), mesh, rules)
        value = jax.make_array_from_callback(
            target.shape, sharding, lambda idx, arr=arr, dt=target.dtype: np.asarray(arr[idx]).astype(dt))
        flat[e.path] = var.replace(value)
    model = nnx.merge(graphdef, nnx.from_flat_state(list(flat.items())))
    return model, cfg


# ------------------------------------------------------------------------------------------ save
def to_hf_config(cfg: ModelConfig, dtype=jnp.float32) -> dict:
    d = {
        "architectures": [_ARCH[cfg.model_type]], "model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings, "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
        "eos_token_id": (list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else
                         (cfg.eos_token_ids[0] if cfg.eos_token_ids else None)),
        "torch_dtype": jnp.dtype(dtype).name, "use_cache": True,
    }
    if cfg.rope_type == "linear":
        d["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_factor}
    elif cfg.rope_type == "llama3":
        d["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_factor,
                             "low_freq_factor": cfg.rope_low_freq_factor,
                             "high_freq_factor": cfg.rope_high_freq_factor,
                             "original_max_position_embeddings": cfg.rope_original_max_positions}
    if cfg.model_type != "qwen2":
        d["attention_bias"] = False
    if cfg.model_type == "llama":
        d["mlp_bias"] = False
    else:
        d["use_sliding_window"] = False
    return d


def save(model: Decoder, config: ModelConfig, out_dir: str, tokenizer=None, dtype=None) -> str:
    """Writes config.json + model.safetensors (+ tokenizer files) that `transformers` loads.

    `tokenizer`: a transformers tokenizer (saved with `save_pretrained`) or a directory whose tokenizer
    files are copied. `dtype`: on-disk dtype (default: the parameters' own). A run's export also checks that
    outside tools read the tokenizer alike (`models.auto_tokenizer.check_auto_tokenizer`).
    """
    os.makedirs(out_dir, exist_ok=True)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    merged = lora_lib.merged_weights(model) if lora_lib.has_lora(model) else {}  # W + s A @ B
    tensors = {}
    for e in name_table(config):
        value = merged[e.path] if e.path in merged else np.asarray(jax.device_get(flat[e.path].get_value()))
        if dtype is not None:
            value = value.astype(dtype)
        hf = np.ascontiguousarray(e.to_hf(value))
        assert hf.shape == e.hf_shape, (e.hf_name, hf.shape, e.hf_shape)
        tensors[e.hf_name] = hf
    disk_dtype = next(iter(tensors.values())).dtype
    st.save_file(tensors, os.path.join(out_dir, SINGLE_FILE))
    stale = os.path.join(out_dir, INDEX_FILE)
    if os.path.exists(stale):
        os.remove(stale)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(to_hf_config(config, disk_dtype), f, indent=2)
    if isinstance(tokenizer, str):
        for fn in TOKENIZER_FILES:
            src = os.path.join(tokenizer, fn)
            if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(out_dir, fn)):
                shutil.copy(src, out_dir)
    elif tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"


def save_peft_adapter(model: Decoder, out_dir: str, base_path: str) -> str:
    """Writes only the LoRA adapters as a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`),
    loadable with `peft.PeftModel.from_pretrained(base, out_dir)` onto the HF base at `base_path`."""
    if not lora_lib.has_lora(model):
        raise ValueError("save_peft_adapter: the model has no LoRA adapters")
    os.makedirs(out_dir, exist_ok=True)
    st.save_file(lora_lib.peft_tensors(model), os.path.join(out_dir, ADAPTER_FILE))
    with open(os.path.join(out_dir, ADAPTER_CONFIG_FILE), "w") as f:
        json.dump(lora_lib.peft_config(model.lora_cfg, base_path), f, indent=2)
    return out_dir


def load_peft_adapter(model: Decoder, path: str) -> None:
    """Loads a PEFT adapter dir (ours from `save_peft_adapter`, or PEFT's own) into `model`'s adapters, in
    place. Its rank, alpha and targets must equal the model's (`model.lora`): one error line otherwise."""
    if not lora_lib.has_lora(model):
        raise ConfigError(f"{path}: an adapter to load, but the model has no LoRA adapters (set model.lora.rank)")
    cfg_path, w_path = os.path.join(path, ADAPTER_CONFIG_FILE), os.path.join(path, ADAPTER_FILE)
    for f in (cfg_path, w_path):
        if not os.path.isfile(f):
            raise CheckpointError(f"{f}: missing; a PEFT adapter dir holds {ADAPTER_CONFIG_FILE} and {ADAPTER_FILE}")
    with open(cfg_path) as f:
        saved = json.load(f)
    want = peft_config_fields(model.lora_cfg)
    for k, v in want.items():
        got = saved.get(k)
        if (sorted(got or []) if k == "target_modules" else got) != v:
            raise ConfigError(f"{cfg_path}: {k}={got!r} but model.lora gives {v!r}")
    try:
        f = st.SafetensorsFile(w_path)
        lora_lib.set_from_peft(model, {k: f[k] for k in f.keys()}, where=w_path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def peft_config_fields(cfg) -> dict:
    """The adapter_config.json fields that decide the adapters' shapes and scale."""
    full = lora_lib.peft_config(cfg, "")
    return {k: full[k] for k in ("r", "lora_alpha", "target_modules")}


# Tokenizers saved from a bare `tokenizers` object: their tokenizer.json is the whole definition.
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str):
    """The model directory's tokenizer (its own chat template applies).

    `AutoTokenizer` in transformers 5 maps a generic `tokenizer_class` to the model type's tokenizer
    (Qwen2Tokenizer for a qwen2 config), which rebuilds a byte-level BPE pre-tokenizer over the
    vocabulary: for the tiny char-level model that silently drops every space. A generic class is
    therefore loaded as exactly what tokenizer.json says.
    """
    from transformers import PreTrainedTokenizerFast  # AutoTokenizer only when needed: it imports torch (~2.5 s)
    path = resolve_path(path)
    vocab_files = ("tokenizer.json", "vocab.json", "tokenizer.model", "spiece.model", "vocab.txt")
    if not any(os.path.isfile(os.path.join(path, f)) for f in vocab_files):
        raise ConfigError(f"{path}: no tokenizer ({', '.join(vocab_files[:3])}, ... missing); copy the base "
                          "model's tokenizer files into it")
    cls = None
    cfg_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            cls = json.load(f).get("tokenizer_class")
    try:
        if cls in _GENERIC_TOKENIZER_CLASSES and os.path.isfile(os.path.join(path, "tokenizer.json")):
            return PreTrainedTokenizerFast.from_pretrained(path)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: no usable tokenizer ({str(e).splitlines()[0]})") from None


def sampling_ids(tokenizer, model_cfg) -> tuple[tuple[int, ...], int]:
    """(stop ids, pad id) to sample from a model: `stop_ids`, and the tokenizer's pad id, else config.json's,
    else 0. Training, evaluation and the notebooks all take them from here."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (model_cfg.pad_token_id or 0)
    return stop_ids(tokenizer, model_cfg), int(pad)


def stop_ids(tokenizer, model_cfg) -> tuple[int, ...]:
    """The ids that end a completion: config.json's eos ids, the tokenizer's eos, and <|im_end|> if present."""
    ids = set(model_cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if im_end is not None:
        ids.add(int(im_end))  # chat models end a turn with <|im_end|> even where config.json names <|endoftext|>
    return tuple(sorted(ids))
