"""The train state the fused step carries, and the policy model read back from it.

`TrainState` holds everything a resume needs (step, params, optimizer state, RNG; the frozen reference or
LoRA base), so nothing lives on the Python side. `cfg` below is the step's `RLConfig`: only its
`needs_ref` (a reference copy is kept when beta > 0 without LoRA) is read here.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sage_jax import sharding as shd
from sage_jax.models import lora as lora_lib

Array = jax.Array


@flax.struct.dataclass
class TrainState:
    step: Array  # int32, optimizer updates done (drives lr and guide schedules)
    params: Any  # nnx.State of the policy
    opt_state: Any
    rng: Array  # base key; each step folds in `step`
    ref_params: Any = None  # frozen reference; None when beta == 0 (no copy held) or with LoRA
    frozen_params: Any = None  # LoRA: the base weights (not trained, no optimizer state); params = adapters


def merge_policy(graphdef, params, frozen_params=None):
    """The model from trainable params (+ the frozen base under LoRA).

    `copy=True` for the base: its Variables come from an outer trace (the step's inputs) while the model
    is built inside the update scan; reusing them makes an NNX transform inside (remat) fail to update them.
    """
    if frozen_params is None:
        return nnx.merge(graphdef, params)
    return nnx.merge(graphdef, params, frozen_params, copy=True)


def reference_params(state: TrainState):
    """The frozen reference: its own copy, or under LoRA the same base with zeroed adapters (no copy)."""
    if state.frozen_params is None:
        return state.ref_params
    return jax.tree.map(jnp.zeros_like, state.params)


def policy_model(graphdef, state: TrainState):
    """The policy of a train state (under LoRA: the base with the trained adapters attached)."""
    return merge_policy(graphdef, state.params, state.frozen_params)


def policy_state(state: TrainState):
    """Every variable of the policy as one nnx.State (what `nnx.split(policy_model(...))` would give):
    the params, plus the frozen base under LoRA. Arrays are shared, not copied."""
    if state.frozen_params is None:
        return state.params
    return nnx.merge_state(state.params, state.frozen_params)


def init_train_state(model: nnx.Module, cfg, tx: optax.GradientTransformation, seed: int) -> tuple[nnx.GraphDef, TrainState]:
    """The state takes over the model's arrays (no copy) and the step donates them: after training
    starts, read the policy from `nnx.merge(graphdef, state.params)`, not from `model`."""
    # Under LoRA only the adapters train (and have optimizer state); the reference is the base with the
    # adapters zeroed, so no copy is made.
    graphdef, params, frozen = lora_lib.split_trainable(model)
    ref = jax.tree.map(jnp.copy, params) if cfg.needs_ref and frozen is None else None
    state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                       rng=jax.random.key(seed), ref_params=ref, frozen_params=frozen)
    return graphdef, _colocate_scalars(state)


def _colocate_scalars(state: TrainState) -> TrainState:
    """Puts leaves created here (step, rng, optimizer counts) on the params' mesh when the params carry a
    NamedSharding (`hf.load` places them on a 1-device mesh): the jitted step returns every leaf on that
    mesh, so otherwise the second step sees different input shardings and compiles again."""
    named = [x.sharding for x in jax.tree.leaves(state.params) if isinstance(getattr(x, "sharding", None),
                                                                            jax.sharding.NamedSharding)]
    if not named:
        return state
    rep = jax.sharding.NamedSharding(named[0].mesh, jax.sharding.PartitionSpec())
    fix = lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding) else jax.device_put(x, rep)
    return jax.tree.map(fix, state)


def init_train_state_sharded(model, cfg, tx: optax.GradientTransformation, seed: int, mesh,
                             rules=None) -> tuple[nnx.GraphDef, TrainState]:
    """`init_train_state` with every leaf born in the sharding the rules give it (docs/design.md §5.6).

    `model`: a zero-argument constructor of the Decoder (its params are created under jit, each device
    materialising only its shards), or a Decoder whose params are already placed (`hf.load(..., mesh=mesh)`):
    those are kept and only the optimizer state and the reference copy are created, directly sharded.
    """
    mesh = shd.as_auto(mesh)  # jax.make_mesh's default Explicit axes: the same devices, Auto
    if callable(model) and not isinstance(model, nnx.Module):
        graphdef = nnx.graphdef(nnx.eval_shape(model))
        return graphdef, shd.born_sharded(lambda: init_train_state(model(), cfg, tx, seed)[1], mesh, rules)
    rng = jax.jit(lambda: jax.random.key(seed), out_shardings=shd.replicated(mesh))()
    step = jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=shd.replicated(mesh))()
    if lora_lib.has_lora(model):
        # the base stays where it was placed; the (small) adapters are placed by their axes, and only
        # they get optimizer state
        graphdef, params, frozen = lora_lib.split_trainable(model)
        params = jax.device_put(params, shd.state_shardings(params, mesh, rules))
        out = shd.state_shardings(jax.eval_shape(tx.init, params), mesh, rules)
        opt_state = jax.jit(tx.init, out_shardings=out)(params)
        return graphdef, TrainState(step=step, params=params, opt_state=opt_state, rng=rng, frozen_params=frozen)
    graphdef, params = nnx.split(model)

    def extra(p):
        return tx.init(p), (jax.tree.map(jnp.copy, p) if cfg.needs_ref else None)

    out = shd.state_shardings(jax.eval_shape(extra, params), mesh, rules)
    opt_state, ref = jax.jit(extra, out_shardings=out)(params)
    # rng / step: born under jit (above), not device_put from this host: a multi-process mesh is not
    # fully addressable
    return graphdef, TrainState(step=step, params=params, opt_state=opt_state, rng=rng, ref_params=ref)
