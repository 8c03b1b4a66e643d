"""LoRA adapters for the decoder's projections (q, k, v, o, gate, up, down).

Dimension key: r rank, plus the decoder's (D model, F MLP, H / K heads, Dh head dim).

A projection `y = x @ W` with LoRA becomes `y = x @ W + s (x @ A) @ B`, `s = alpha / r`, with
`A: [*in, r]` (Kaiming-uniform, as in PEFT) and `B: [r, *out]` (zeros, so a fresh adapter leaves the
model unchanged). Adapters are `LoRAParam` variables (a `nnx.Param` subclass, carrying `axes=`
metadata like every weight), so `nnx.split(model, LoRAParam, ...)` separates them from the base.

The reference policy under LoRA is the base model: the same base arrays with the adapters zeroed
(`x @ W + s (x @ A) @ 0 == x @ W` exactly); no second copy of the weights exists.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Array = jax.Array

# target name -> (owner module attribute in a Block, weight attribute, HF module path in the layer)
TARGETS = {
    "q": ("attn", "wq", "self_attn.q_proj"),
    "k": ("attn", "wk", "self_attn.k_proj"),
    "v": ("attn", "wv", "self_attn.v_proj"),
    "o": ("attn", "wo", "self_attn.o_proj"),
    "gate": ("mlp", "w_gate", "mlp.gate_proj"),
    "up": ("mlp", "w_up", "mlp.up_proj"),
    "down": ("mlp", "w_down", "mlp.down_proj"),
}


class LoRAParam(nnx.Param):
    """A trainable LoRA adapter matrix (the only trainable leaves when LoRA is on)."""


class DropoutKey(nnx.Variable):
    """The dropout key of a transient training copy (a Variable, so NNX transforms such as remat carry it
    as data, not as static metadata)."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int = 8  # r
    alpha: float = 16.0  # scale s = alpha / r
    dropout: float = 0.0  # on the adapter input only (as PEFT), in training only: see `set_dropout_key`
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise ValueError(f"lora.targets={self.targets!r}: each must be one of {tuple(TARGETS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRA(nnx.Module):
    """The low-rank update of one projection with input dims `in_shape` and output dims `out_shape`."""

    def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...], in_axes: tuple, out_axes: tuple,
                 cfg: LoRAConfig, *, param_dtype, rngs: nnx.Rngs):
        r, fan_in = cfg.rank, int(np.prod(in_shape))
        # PEFT / nn.Linear default: kaiming_uniform(a=sqrt(5)) -> U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(rngs.params(), (*in_shape, r), jnp.float32, -bound, bound).astype(param_dtype)
        self.a = LoRAParam(a, axes=(*in_axes, None))
        self.b = LoRAParam(jnp.zeros((r, *out_shape), param_dtype), axes=(None, *out_axes))
        self.scale = cfg.scale
        self.n_in = len(in_shape)
        self.dropout = cfg.dropout
        # `dropout_key` (a DropoutKey) exists only on a transient training copy (`set_dropout_key`)

    def __call__(self, x: Array, dtype) -> Array:
        """`s (x @ A) @ B` for x [..., *in] -> [..., *out] in the compute dtype."""
        lead, n = x.shape[:-self.n_in], self.n_in
        key = getattr(self, "dropout_key", None)
        if self.dropout > 0 and key is not None:  # inverted dropout on the adapter input
            keep = jax.random.bernoulli(key.get_value(), 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros((), x.dtype)).astype(x.dtype)
        a = self.a[...].astype(dtype)
        b = self.b[...].astype(dtype)
        h = jnp.tensordot(x, a, axes=n)  # [..., r]
        return (self.scale * jnp.tensordot(h, b, axes=1)).reshape(*lead, *b.shape[1:])

    def delta(self) -> Array:
        """The merged update `s A @ B` in the weight's own layout [*in, *out] (float32)."""
        a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
        return self.scale * jnp.tensordot(a, b, axes=1)


def adapter_name(target: str) -> str:
    return f"lora_{target}"


def adapted(module: nnx.Module, target: str, x: Array, y: Array, dtype) -> Array:
    """`y + lora(x)` when `module` carries the adapter of `target`, else `y` (the helper every projection uses)."""
    lora = getattr(module, adapter_name(target), None)
    return y if lora is None else y + lora(x, dtype)


def add_lora(model, cfg: LoRAConfig, *, seed: int = 0, param_dtype=None):
    """Attaches fresh adapters (B = 0) to `model`'s targeted projections, in place; returns the model."""
    rngs = nnx.Rngs(seed)
    for block in model.layers:
        for t in cfg.targets:
            owner_name, w_name, _ = TARGETS[t]
            owner = getattr(block, owner_name)
            w = getattr(owner, w_name)
            axes = w.get_metadata().get("axes") or (None,) * w.ndim
            n_in = 2 if w_name == "wo" else 1  # wo: [H, Dh, D]; the others [D, ...out]
            pd = w.dtype if param_dtype is None else param_dtype
            setattr(owner, adapter_name(t), LoRA(w.shape[:n_in], w.shape[n_in:], tuple(axes[:n_in]),
                                                 tuple(axes[n_in:]), cfg, param_dtype=pd, rngs=rngs))
    model.lora_cfg = cfg
    return model


def set_dropout_key(model, key) -> None:
    """Turns adapter dropout on for this (transient, training) model copy: one key per adapter, folded
    from `key`. Sampling, the reference and evaluation never call this, so they run without dropout."""
    for j, (_, _, _, lora) in enumerate(iter_adapters(model)):
        if lora.dropout > 0:
            lora.dropout_key = DropoutKey(jax.random.fold_in(key, j))


def has_lora(model) -> bool:
    return getattr(model, "lora_cfg", None) is not None


def split_trainable(model):
    """(graphdef, trainable, frozen): under LoRA the adapters and the frozen base (the reference), else
    every param and None. The one place that decides what a train state optimises and checkpoints."""
    if has_lora(model):
        return nnx.split(model, LoRAParam, ...)
    graphdef, params = nnx.split(model)
    return graphdef, params, None


def iter_adapters(model):
    """(layer index, target, weight Param, LoRA module) for every adapter of the model."""
    for i, block in enumerate(model.layers):
        for t, (owner_name, w_name, _) in TARGETS.items():
            owner = getattr(block, owner_name)
            lora = getattr(owner, adapter_name(t), None)
            if lora is not None:
                yield i, t, getattr(owner, w_name), lora


def merged_weights(model) -> dict[tuple, np.ndarray]:
    """{state path of the base weight: W + s A @ B} for every adapted projection (host float32 arrays)."""
    out = {}
    for i, t, w, lora in iter_adapters(model):
        owner_name, w_name, _ = TARGETS[t]
        merged = np.asarray(jax.device_get(w[...]), np.float32) + np.asarray(jax.device_get(lora.delta()))
        out[("layers", i, owner_name, w_name)] = merged.astype(np.asarray(w[...]).dtype)
    return out


def peft_tensors(model) -> dict[str, np.ndarray]:
    """Adapters under PEFT's key names and layout: lora_A [r, in], lora_B [out, r] (HF linear [out, in])."""
    out = {}
    for i, t, _, lora in iter_adapters(model):
        a = np.asarray(jax.device_get(lora.a[...]), np.float32)
        b = np.asarray(jax.device_get(lora.b[...]), np.float32)
        r = a.shape[-1]
        key = f"base_model.model.model.layers.{i}.{TARGETS[t][2]}"
        out[f"{key}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
        out[f"{key}.lora_B.weight"] = np.ascontiguousarray(b.reshape(r, -1).T)
    return out


def set_from_peft(model, tensors, where: str = "adapter") -> None:
    """Loads PEFT-layout adapters (the inverse of `peft_tensors`) into `model`'s adapters, in place.

    Every adapter of the model must be in `tensors` with its exact shape, and `tensors` must hold nothing
    else: a rank or target mismatch is one error naming the key, never a partial load."""
    expected = set()
    for i, t, _, lora in iter_adapters(model):
        key = f"base_model.model.model.layers.{i}.{TARGETS[t][2]}"
        a_key, b_key = f"{key}.lora_A.weight", f"{key}.lora_B.weight"
        expected |= {a_key, b_key}
        r = lora.a.shape[-1]
        want = {a_key: (r, math.prod(lora.a.shape[:-1])), b_key: (math.prod(lora.b.shape[1:]), r)}
        for k, shape in want.items():
            if k not in tensors:
                raise ValueError(f"{where}: no tensor {k!r} (the model's adapters: rank {r}, targets "
                                 f"{model.lora_cfg.targets})")
            if tuple(tensors[k].shape) != shape:
                raise ValueError(f"{where}: {k!r} has shape {tuple(tensors[k].shape)}, the model's adapter "
                                 f"needs {shape} (model.lora.rank={r})")
        a = np.asarray(tensors[a_key], np.float32).T.reshape(lora.a.shape)
        b = np.asarray(tensors[b_key], np.float32).T.reshape(lora.b.shape)
        lora.a[...] = jnp.asarray(a, lora.a.dtype)
        lora.b[...] = jnp.asarray(b, lora.b.dtype)
    extra = sorted(set(tensors) - expected)
    if extra:
        raise ValueError(f"{where}: {len(extra)} tensor(s) the model has no adapter for, e.g. {extra[0]!r} "
                         f"(model.lora.targets={model.lora_cfg.targets})")


def peft_config(cfg: LoRAConfig, base_model_path: str) -> dict:
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_path,
        "r": cfg.rank, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout,
        "target_modules": sorted({TARGETS[t][2].split(".")[-1] for t in cfg.targets}),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }
