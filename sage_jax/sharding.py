"""Mesh, logical-axis rules and shardings: the one place sharding is declared.

Mesh axes: `data` (pure data parallel), `fsdp` (data parallel with parameters and optimizer state
sharded over it) and `tensor` (Megatron-style tensor parallel: heads, MLP hidden units and the
vocabulary split over it). Each weight names its logical axes (`axes=` on its `nnx.Param`);
`LOGICAL_RULES` maps a logical axis to the mesh axis (or axes) it is split over. Batches (rows) are
split over (`data`, `fsdp`).

Axis types: the mesh uses `AxisType.Auto` on purpose (jax 0.10's `jax.make_mesh` would default to
`Explicit`). The model code is written in the global view, without shardings in its types; the
partitioner propagates shardings from the inputs (params born sharded, batch sharded), the
`with_sharding_constraint`s this module places at block boundaries (`constrain`) and the step's
output constraints. Explicit axes would instead require every contraction over a sharded dimension to
state its output sharding.

Activation constraints are active only inside `activation_sharding(mesh)` (the sharded RL step enters
it while tracing); outside it `constrain` is the identity, so unsharded code paths are unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical axis -> mesh axis (None = replicated). FSDP shards the model dimension of every matrix;
# tensor parallel splits heads, the MLP hidden dimension and the vocabulary. A mesh axis that does
# not divide a dimension is dropped for that tensor (e.g. 2 kv heads over tensor=4 stay replicated),
# identically for the kv weights and the KV cache, so the two always agree.
LOGICAL_RULES: dict[str, str | tuple[str, ...] | None] = {
    # weights
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
    "act_embed": None,  # the residual stream is replicated over tensor between blocks (Megatron)
    "cache_seq": None,
}


# ------------------------------------------------------------------------------------------ mesh
def resolve_shape(shape: Sequence[int], num_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) with the one -1 entry filled in; errors name `mesh.shape`."""
    shape = [int(s) for s in shape]
    if len(shape) != 3:
        raise ValueError(f"mesh.shape must have 3 entries (data, fsdp, tensor), got {shape}")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh.shape {shape}: at most one entry may be -1")
    if any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"mesh.shape {shape}: entries must be positive or -1")
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if num_devices % known:
            raise ValueError(f"mesh.shape {shape}: {num_devices} devices are not divisible by {known}")
        shape[shape.index(-1)] = num_devices // known
    if int(np.prod(shape)) != num_devices:
        raise ValueError(f"mesh.shape {shape} needs {int(np.prod(shape))} devices, {num_devices} are present")
    return tuple(shape)


def make_mesh(shape: Sequence[int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh of shape (data, fsdp, tensor) with Auto axes; one entry may be -1 (the remaining devices)."""
    devices = list(devices if devices is not None else jax.devices())
    shape = resolve_shape(shape, len(devices))
    # mesh_utils orders devices so the last (tensor) axis lands on the fastest interconnect (ICI / NVLink)
    # and, across hosts, keeps each host's devices together (process-contiguous batch rows).
    from jax.experimental import mesh_utils
    try:
        arr = mesh_utils.create_device_mesh(shape, devices=devices)
    except (ValueError, AssertionError, NotImplementedError):
        arr = np.asarray(devices).reshape(shape)
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def as_auto(mesh: Mesh) -> Mesh:
    """`mesh` with every axis `Auto`, the axis types this project's sharding code is written for.

    `jax.make_mesh(shape, names)` defaults to Explicit axes in jax 0.10, under which the embedding gather
    raises `ShardingTypeError` at the first forward; the same devices with Auto axes shard identically.
    A mesh must name the axes (data, fsdp, tensor): anything else is refused in one line.
    """
    if tuple(mesh.axis_names) != tuple(MESH_AXES):
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)}: this project shards over {tuple(MESH_AXES)}; build the "
                         "mesh with sage_jax.sharding.make_mesh(shape) or name its axes so")
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def batch_size_of(mesh: Mesh) -> int:
    """Number of batch shards: the product of the (data, fsdp) axis sizes."""
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def check_rows(rows: int, mesh: Mesh, what: str = "rows") -> None:
    n = batch_size_of(mesh)
    if rows % n:
        raise ValueError(f"{what}={rows} is not divisible by the mesh's batch axes data x fsdp = "
                         f"{mesh.shape['data']} x {mesh.shape['fsdp']} = {n}; change mesh.shape or the batch size")


# ------------------------------------------------------------------------------------------ specs
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
        # Size-1 mesh axes are dropped (they split nothing) ...
        names = tuple(n for n in ((s,) if isinstance(s, str) else tuple(s or ())) if mesh.shape[n] > 1)
        size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
        out.append(None if not names or dim % size else names[0] if len(names) == 1 else names)
    # ... and trailing Nones stripped: the canonical form XLA hands back for outputs. jit's cache tells
    # P('fsdp', 'tensor') with tensor=1 from P('fsdp'), so a state born in another form would recompile once.
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def sharding_for(shape, axes, mesh: Mesh, rules=None) -> NamedSharding:
    return NamedSharding(mesh, _fits(shape, logical_to_spec(axes, rules), mesh))


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: Any, mesh: Mesh, rules=None):
    """A pytree of NamedShardings matching `state` (abstract or concrete).

    Works on any pytree holding NNX Variables: an `nnx.State`, the optimizer state (optax keeps the
    `Param` wrappers and their `axes` metadata around mu / nu), a whole `TrainState`. Variables are
    sharded by their `axes`; every other leaf (step, RNG key, Adam's count) is replicated.
    """
    def one(v):
        if _is_var(v):
            return v.replace(sharding_for(v.get_value().shape, v.get_metadata().get("axes"), mesh, rules))
        return sharding_for(np.shape(v), None, mesh, rules)
    return jax.tree.map(one, state, is_leaf=_is_var)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def batch_shardings(batch: dict, mesh: Mesh) -> dict:
    """Row-sharded over (data, fsdp) where the rows divide; replicated otherwise (single host only)."""
    return {k: sharding_for(np.shape(v), ("batch",) + (None,) * (np.ndim(v) - 1), mesh) for k, v in batch.items()}


# ------------------------------------------------------------------------------------------ placement
def born_sharded(init_fn: Callable[[], Any], mesh: Mesh, rules=None):
    """Runs `init_fn()` under jit with `out_shardings` from the rules: `jax.eval_shape` finds the
    abstract result, and each device materialises only its own shards (never the whole model)."""
    abstract = jax.eval_shape(init_fn)
    return jax.jit(init_fn, out_shardings=state_shardings(abstract, mesh, rules))()


# ------------------------------------------------------------------------------------------ activations
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("sage_jax_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None, rules=None):
    """While tracing inside this context, `constrain` pins activations / caches to the rules."""
    token = _ACTIVE.set(None if mesh is None or mesh.size == 1 else (mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x, axes: Sequence[str | None]):
    """`with_sharding_constraint` by logical axes inside `activation_sharding`; the identity outside."""
    ctx = _ACTIVE.get()
    if ctx is None:
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, sharding_for(x.shape, axes, mesh, rules))


def constrain_cache(cache):
    """A KV cache (a pytree of BxKxSxDh arrays): rows like the batch, kv heads like the kv weights."""
    if cache is None or _ACTIVE.get() is None:
        return cache
    return jax.tree.map(lambda x: constrain(x, ("batch", "kv_heads", "cache_seq", "head_dim")), cache)
