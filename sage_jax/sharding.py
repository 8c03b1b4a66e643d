"""Mesh, logical-axis rules and shardings: the one place sharding is declared.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with parameters sharded over it) and
`tensor` (Megatron-style tensor parallel). Each weight names its logical axes (`axes=` on its
`nnx.Param`); `LOGICAL_RULES` maps a logical axis to the mesh axis (or axes) it is split over.
Batches are split over (`data`, `fsdp`).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical axis -> mesh axis (None = replicated). FSDP shards the model dimension of every matrix;
# tensor parallel splits heads, the MLP hidden dimension and the vocabulary.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    # activations / cache
    "batch": BATCH_AXES,
    "seq": None,
}


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh of shape (data, fsdp, tensor); one entry may be -1 (takes the remaining devices)."""
    devices = list(devices if devices is not None else jax.devices())
    shape = list(shape)
    if len(shape) != 3:
        raise ValueError(f"mesh.shape must have 3 entries (data, fsdp, tensor), got {shape}")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh.shape {shape}: at most one entry may be -1")
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if len(devices) % known:
            raise ValueError(f"mesh.shape {shape}: {len(devices)} devices are not divisible by {known}")
        shape[shape.index(-1)] = len(devices) // known
    if int(np.prod(shape)) != len(devices):
        raise ValueError(f"mesh.shape {shape} needs {int(np.prod(shape))} devices, {len(devices)} are present")
    # Explicit device order via mesh_utils so the tensor axis lands on the fastest interconnect.
    from jax.experimental import mesh_utils
    try:
        arr = mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, AssertionError, NotImplementedError):
        arr = np.asarray(devices).reshape(shape)
    return Mesh(arr, MESH_AXES)


def logical_to_spec(axes: Sequence[str | None] | None, rules=None) -> P:
    rules = LOGICAL_RULES if rules is None else rules
    if axes is None:
        return P()
    out, used = [], set()
    for a in axes:
        m = rules.get(a) if a is not None else None
        if a is not None and a not in rules:
            raise KeyError(f"logical axis {a!r} has no entry in the sharding rules")
        names = (m,) if isinstance(m, str) else tuple(m or ())
        # A mesh axis may shard only one dimension of a tensor.
        names = tuple(n for n in names if n not in used)
        used.update(names)
        out.append(None if not names else names[0] if len(names) == 1 else names)
    return P(*out)


def _fits(shape, spec: P, mesh: Mesh) -> P:
    """Drops mesh axes that do not divide a dimension (e.g. 2 kv heads over tensor=4 stay replicated)."""
    out = []
    for dim, s in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = (s,) if isinstance(s, str) else tuple(s or ())
        size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
        out.append(s if dim % size == 0 else None)
    return P(*out)


def sharding_for(shape, axes, mesh: Mesh, rules=None) -> NamedSharding:
    return NamedSharding(mesh, _fits(shape, logical_to_spec(axes, rules), mesh))


def state_shardings(state: nnx.State, mesh: Mesh, rules=None):
    """A pytree of NamedShardings matching `state` (an abstract or concrete NNX state)."""
    def one(v):
        axes = v.get_metadata().get("axes") if isinstance(v, nnx.Variable) else None
        shape = v.get_value().shape if isinstance(v, nnx.Variable) else v.shape
        return v.replace(sharding_for(shape, axes, mesh, rules)) if isinstance(v, nnx.Variable) else \
            sharding_for(shape, axes, mesh, rules)
    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))
