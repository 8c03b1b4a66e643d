"""ModelConfig: one decoder description for the Qwen2 / Qwen2.5 / Qwen3 / Llama 3 families.

Built from a Hugging Face `config.json` dict. Anything the decoder does not implement (sliding-window
attention, MoE, rope types other than default / linear / llama3, biased MLPs, non-SiLU activations) is
rejected with an error that names the key, rather than silently computing a different model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from sage_jax.errors import UserError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")

# Keys that are read elsewhere or are irrelevant to the forward pass (training-time dropout of 0, init
# ranges, bookkeeping). Everything not listed here or read below is rejected, so that a checkpoint with a
# feature we do not implement cannot load silently.
_IGNORED_KEYS = frozenset({
    "architectures", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
    "initializer_range", "transformers_version", "use_cache", "torch_dtype", "dtype", "max_window_layers",
    "sliding_window", "pretraining_tp", "max_position_embeddings", "_name_or_path", "use_mrope",
    "model_type", "output_attentions", "output_hidden_states", "return_dict", "tokenizer_class",
    "quantization_config_", "generation_config", "chunk_size_feed_forward", "id2label", "label2id",
    "problem_type", "is_encoder_decoder", "tie_encoder_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "decoder_start_token_id", "prefix", "sep_token_id", "task_specific_params",
    "finetuning_task", "torchscript", "num_labels", "is_decoder", "_attn_implementation_autoset",
})

_MOE_KEYS = ("num_experts", "num_local_experts", "moe_intermediate_size", "num_experts_per_tok",
             "decoder_sparse_step", "shared_expert_intermediate_size")


class ConfigError(UserError, ValueError):
    """A config.json the decoder cannot represent; the message names the key."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static (hashable) decoder hyper-parameters."""
    model_type: str
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # K
    head_dim: int  # Dh
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    qkv_bias: bool = False  # Qwen2 family
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_kv_heads}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def max_positions(self) -> int:
        """The positions this model was made for, RoPE scaling counted: `max_position_embeddings`, which a
        llama3-scaled config already states at its extended length (at least original x factor); a linearly
        scaled rope stretches it by `factor`."""
        if self.rope_type == "linear":
            return int(self.max_position_embeddings * self.rope_factor)
        if self.rope_type == "llama3":
            return max(self.max_position_embeddings, int(self.rope_original_max_positions * self.rope_factor))
        return self.max_position_embeddings

    def check_positions(self, tokens: int, what: str) -> None:
        """Refuses `tokens` positions beyond `max_positions`, naming the fields that add up to them."""
        if tokens > self.max_positions:
            scaled = f" (RoPE {self.rope_type} x {self.rope_factor:g})" if self.rope_type != "default" else ""
            raise ConfigError(f"{what} = {tokens} positions, beyond the model's {self.max_positions}{scaled} "
                              "(max_position_embeddings of its config.json); shorten them")

    # ---------------------------------------------------------------- HF conversion
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{source}: model_type={model_type!r} is not supported "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        for key in _MOE_KEYS:
            if d.get(key):
                raise ConfigError(f"{source}: key {key!r}={d[key]!r}: mixture-of-experts models are not supported")
        get = _KeyReader(d, source)
        _check_supported_layout(get, model_type, source)
        hidden = get("hidden_size", required=True)
        heads = get("num_attention_heads", required=True)
        theta, rope_type, rope_kwargs = _rope_fields(get, source)
        eos = get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        cfg = cls(
            model_type=model_type,
            vocab_size=get("vocab_size", required=True),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size", required=True),
            num_layers=get("num_hidden_layers", required=True),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", heads),
            head_dim=get("head_dim", hidden // heads),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_type=rope_type,
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(get("tie_word_embeddings", model_type != "llama")),
            max_position_embeddings=int(d.get("max_position_embeddings") or 32768),
            bos_token_id=get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=get("pad_token_id"),
            **rope_kwargs,
        )
        unknown = sorted(set(d) - get.read - _IGNORED_KEYS - {"rope_theta", "rope_scaling", "rope_parameters"})
        if unknown:
            raise ConfigError(f"{source}: unsupported key(s) {unknown}; the decoder does not know what they mean")
        return cfg

    @classmethod
    def from_hf_dir(cls, path: str) -> tuple["ModelConfig", dict[str, Any]]:
        """Returns (config, the raw config.json dict, kept for a faithful export)."""
        file = os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise ConfigError(f"{file}: not found (an HF model directory needs config.json)")
        try:
            with open(file) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: invalid JSON ({e})") from None
        return cls.from_hf_dict(raw, source=file), raw


class _KeyReader:
    """`get(key, default, required)` over an HF config dict, remembering which keys were read (the rest must
    be known to mean nothing to the decoder)."""

    def __init__(self, d: dict[str, Any], source: str):
        self.d, self.source, self.read = d, source, set()

    def __call__(self, key, default=None, required=False):
        self.read.add(key)
        if key not in self.d or self.d[key] is None:
            if required:
                raise ConfigError(f"{self.source}: required key {key!r} is missing")
            return default
        return self.d[key]


def _check_supported_layout(get: _KeyReader, model_type: str, source: str) -> None:
    """Refuse the layouts the decoder does not implement, naming the key."""
    act = get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: key 'hidden_act'={act!r} is not supported (only 'silu')")
    if get("use_sliding_window", False):
        raise ConfigError(f"{source}: key 'use_sliding_window'=true: sliding-window attention is not supported")
    layer_types = get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        bad = sorted(set(t for t in layer_types if t != "full_attention"))
        raise ConfigError(f"{source}: key 'layer_types' contains {bad}: only full attention is supported")
    if get("mlp_bias", False):
        raise ConfigError(f"{source}: key 'mlp_bias'=true is not supported")
    if get("attention_bias", False) and model_type != "qwen2":
        # Llama / Qwen3 attention_bias also biases o_proj, a layout no released checkpoint we target uses.
        raise ConfigError(f"{source}: key 'attention_bias'=true is not supported for {model_type}")


def _rope_fields(get: _KeyReader, source: str) -> tuple[float, str, dict[str, Any]]:
    """(rope_theta, rope_type, the scaling fields). transformers<5 checkpoints have top-level rope_theta /
    rope_scaling, transformers 5 writes rope_parameters with rope_theta inside: both are read."""
    rope = dict(get("rope_parameters") or {})
    scaling = get("rope_scaling")
    if scaling:
        rope.update(scaling)
    theta = rope.get("rope_theta", get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    kwargs: dict[str, Any] = {}
    if rope_type == "linear":
        kwargs["rope_factor"] = float(rope["factor"])
    elif rope_type == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in rope:
                raise ConfigError(f"{source}: rope_scaling of type 'llama3' lacks key {k!r}")
        kwargs.update(rope_factor=float(rope["factor"]), rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]),
                      rope_original_max_positions=int(rope["original_max_position_embeddings"]))
    elif rope_type != "default":
        raise ConfigError(f"{source}: key 'rope_scaling' has rope_type={rope_type!r}, which is not supported "
                          "(supported: default, linear, llama3)")
    if "partial_rotary_factor" in rope and rope["partial_rotary_factor"] != 1.0:
        raise ConfigError(f"{source}: key 'partial_rotary_factor'={rope['partial_rotary_factor']} is not supported")
    return theta, rope_type, kwargs
