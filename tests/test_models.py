"""Decoder parity with transformers, HF load / save, and clear errors on bad checkpoints."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from hf_fixtures import FAMILIES, hf_logits, make_hf_model
from sage_jax.models import hf, safetensors_io
from sage_jax.models.config import ConfigError, ModelConfig

LOGIT_TOL = 1e-4  # fp32 end to end (docs/design.md §5.9)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {f: make_hf_model(str(root / f), f, seed=i) for i, f in enumerate(FAMILIES)}


def _batch(seed=0, B=3, T=11, V=97):
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, V, size=(B, T)).astype(np.int32)
    mask = np.ones_like(toks)
    mask[1, :4] = 0  # left padding of different lengths
    mask[2, :1] = 0
    toks[mask == 0] = 0
    return toks, mask


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("padded", [False, True])
def test_logits_parity(ckpts, family, padded):
    model, _ = hf.load(ckpts[family])
    toks, mask = _batch()
    if not padded:
        mask = np.ones_like(mask)
    ref = hf_logits(ckpts[family], toks, mask)
    ours = np.asarray(model(jnp.asarray(toks), jnp.asarray(mask)))
    real = mask.astype(bool)  # padded query rows are undefined in both
    assert ours.shape == ref.shape
    assert np.abs(ours - ref)[real].max() <= LOGIT_TOL


def test_left_padding_matches_unpadded_row(ckpts):
    model, _ = hf.load(ckpts["qwen2_untied_gqa4"])
    toks, mask = _batch()
    full = np.asarray(model(jnp.asarray(toks), jnp.asarray(mask)))
    alone = np.asarray(model(jnp.asarray(toks[1:2, 4:])))
    np.testing.assert_allclose(full[1, 4:], alone[0], atol=1e-5)


def test_llama3_rope_scaling_is_applied(ckpts, tmp_path):
    # Same weights with the scaling removed must give different logits, or the parity test proves nothing.
    d = str(tmp_path / "noscale")
    shutil.copytree(ckpts["llama3"], d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    toks, _ = _batch(T=40)
    a = np.asarray(hf.load(ckpts["llama3"])[0](jnp.asarray(toks)))
    b = np.asarray(hf.load(d)[0](jnp.asarray(toks)))
    assert np.abs(a - b).max() > 1e-3


@pytest.mark.parametrize("family", ["qwen2_untied_gqa4", "qwen2_tied_gqa2", "qwen3", "llama3"])
def test_save_round_trip(ckpts, family, tmp_path):
    model, cfg = hf.load(ckpts[family])
    out = hf.save(model, cfg, str(tmp_path / "out"))
    toks, mask = _batch(1)
    ours = np.asarray(model(jnp.asarray(toks), jnp.asarray(mask)))
    ref = hf_logits(out, toks, mask)
    assert np.abs(ours - ref)[mask.astype(bool)].max() <= LOGIT_TOL
    again, cfg2 = hf.load(out)
    assert cfg2 == cfg


def test_sharded_index(ckpts, tmp_path):
    src = ckpts["qwen2_untied_gqa4"]
    f = safetensors_io.SafetensorsFile(os.path.join(src, "model.safetensors"))
    names = sorted(f.keys())
    d = tmp_path / "sharded"
    d.mkdir()
    shutil.copy(os.path.join(src, "config.json"), d)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fn = f"model-{i + 1:05d}-of-00002.safetensors"
        safetensors_io.save_file({n: np.array(f[n]) for n in part}, str(d / fn))
        weight_map.update({n: fn for n in part})
    json.dump({"metadata": {}, "weight_map": weight_map}, open(d / "model.safetensors.index.json", "w"))
    toks, _ = _batch()
    a = np.asarray(hf.load(src)[0](jnp.asarray(toks)))
    b = np.asarray(hf.load(str(d))[0](jnp.asarray(toks)))
    np.testing.assert_array_equal(a, b)


def test_bfloat16_checkpoint(ckpts, tmp_path):
    model, cfg = hf.load(ckpts["qwen3"])
    out = hf.save(model, cfg, str(tmp_path / "bf16"), dtype=jnp.bfloat16)
    m16, _ = hf.load(out, dtype=jnp.bfloat16)
    toks, _ = _batch()
    a = np.asarray(model(jnp.asarray(toks)))
    b = np.asarray(m16(jnp.asarray(toks)))
    assert b.dtype == np.float32 and np.isfinite(b).all()
    assert np.abs(a - b).max() < 0.1 * np.abs(a).max()  # bf16 weights and compute: ~1% error, not garbage


# ------------------------------------------------------------------------------------------ errors
def _one_line(excinfo, *needles):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError) as e:
        hf.load(str(tmp_path))
    _one_line(e, "config.json")


def test_truncated_safetensors(ckpts, tmp_path):
    d = tmp_path / "trunc"
    shutil.copytree(ckpts["qwen2_tied_gqa2"], d)
    p = d / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(safetensors_io.SafetensorsError) as e:
        hf.load(str(d))
    _one_line(e, str(p), "truncated")


def test_wrong_shape(ckpts, tmp_path):
    d = tmp_path / "shape"
    shutil.copytree(ckpts["qwen2_tied_gqa2"], d)
    f = safetensors_io.SafetensorsFile(str(d / "model.safetensors"))
    tensors = {n: np.array(f[n]) for n in f.keys()}
    del f
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-1]
    safetensors_io.save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(hf.CheckpointError) as e:
        hf.load(str(d))
    _one_line(e, name, "shape")


def test_missing_and_unexpected_tensors(ckpts, tmp_path):
    d = tmp_path / "names"
    shutil.copytree(ckpts["qwen2_untied_gqa4"], d)
    f = safetensors_io.SafetensorsFile(str(d / "model.safetensors"))
    tensors = {n: np.array(f[n]) for n in f.keys()}
    del f
    tensors["model.layers.0.extra.weight"] = tensors.pop("model.layers.0.self_attn.k_proj.bias")
    safetensors_io.save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(hf.CheckpointError) as e:
        hf.load(str(d))
    _one_line(e, "missing [model.layers.0.self_attn.k_proj.bias]", "unexpected [model.layers.0.extra.weight]")


@pytest.mark.parametrize("edit, key", [
    ({"model_type": "mixtral"}, "model_type"),
    ({"num_experts": 8}, "num_experts"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope_type='yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"some_new_feature": 1}, "some_new_feature"),
])
def test_unsupported_config(ckpts, tmp_path, edit, key):
    d = tmp_path / "cfg"
    shutil.copytree(ckpts["qwen2_tied_gqa2"], d)
    cfg = json.load(open(d / "config.json"))
    cfg.update(edit)
    json.dump(cfg, open(d / "config.json", "w"))
    with pytest.raises(ConfigError) as e:
        hf.load(str(d))
    _one_line(e, key, "config.json")


def test_legacy_rope_layout():
    # transformers<5 / hub checkpoints: top-level rope_theta and rope_scaling.
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1)
    old = ModelConfig.from_hf_dict(dict(base, rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    new = ModelConfig.from_hf_dict(dict(base, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert old == new and old.rope_theta == 5e5 and old.rope_type == "llama3"


def test_max_positions_count_rope_scaling():
    """The positions a config allows, from transformers' semantics: unscaled, max_position_embeddings; linear
    scaling stretches it by `factor`; a llama3-scaled config states its extended length, at least original x
    factor. Beyond them, one line naming the fields and the limit."""
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    assert ModelConfig.from_hf_dict(base).max_positions == 4096
    linear = ModelConfig.from_hf_dict(dict(base, rope_scaling={"rope_type": "linear", "factor": 4.0}))
    assert linear.max_positions == 16384
    llama3 = ModelConfig.from_hf_dict(dict(base, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024}))
    assert llama3.max_positions == 8192
    llama3.check_positions(8192, "a + b")
    with pytest.raises(ConfigError, match=r"a \+ b = 8193 positions, beyond the model's 8192 \(RoPE llama3 x 8\)"):
        llama3.check_positions(8193, "a + b")


def test_hub_id_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as e:
        hf.load("Qwen/not-a-real-model-xyz")
    _one_line(e, "Qwen/not-a-real-model-xyz", "hub")
