"""Guide functions q for SAGE's reshaped reverse-KL anchor, and their schedules.

SAGE replaces GRPO's anchor ``pi_ref`` by ``q * pi_ref``; per completion token the shaped anchor
is ``a_t = ref_t + log q_t`` (see ``sage_jax.rl.losses``). This module computes ``q`` (pure, jittable,
no Python-side state).

Dimension key: ``B`` batch (completions, ``num_prompts * G``), ``G`` group size,
``T`` completion length, ``V`` vocab.

Every guide returns ``q_BxT`` that is

* clamped to ``[q_min, q_max]`` (``0 < q_min <= q_max``),
* exactly ``1`` where ``mask_BxT == 0`` (padding / after EOS),
* a constant for the gradient (inputs and output are ``stop_gradient``-ed),
* finite on rows with no real token and under arbitrary garbage (nan / inf) at padded positions.

Guides (defaults are the reference code's)::

    none:    q_t = 1                       (SAGE == KL-regularised GRPO exactly)
    branch:  q_t = clip(1 + ratio * relu(H_t - threshold), q_min, q_max)
             H_t: next-token entropy (nats) of pi_theta (source="new") or pi_ref (source="ref")
    token:   s_t = -lp_t (source="new") or -ref_t (source="ref")            surprisal, nats
             w_t = norm(s)_t in [0, 1], per sequence over its real tokens:
                 minmax: c = clip(s, P5, P95); w = (c - P5) / (P95 - P5)   (0 if P95 == P5)
                         P5/P95 = the row's 5th/95th percentiles, linear interpolation
                         (numpy's default method) over the real tokens only
                 rank:   w = avg_rank(s) / (n - 1), ranks 0..n-1, ties share their mean rank
                         (scipy ``rankdata(method="average") - 1``); 0 if n == 1
                 zscore: w = sigmoid((s - mean) / (std + 1e-6)), population std (ddof=0)
             q_t = clip(1 + alpha * w_t + sigma * w_t * eps_t, q_min, q_max),  eps_t ~ N(0, 1)
             eps_BxT = jax.random.normal(key, (B, T))
    random:  q_t = clip(1 + sigma * z_t, q_min, q_max) if u_t < eps else 1
             k_gate, k_noise = jax.random.split(key); u = uniform(k_gate, (B, T)),
             z = normal(k_noise, (B, T))

Schedules of ``token`` (alpha 0.3 -> 0.1, sigma 0.25 -> 0.1) and ``random``
(eps 0.1 -> 0, sigma 0.15 -> 0.05): cosine with restarts, ``guide_configs.cosine_schedule``::

    L = max(1, max_steps // N);  c = min(s // L, N - 1);  u = (s mod L) / L
    value(s) = lb + (ub * decay**c - lb) * (1 + cos(pi * u)) / 2

with ``s`` the 0-based optimizer step read from the train state (never a Python counter), so a
resumed run continues the schedule exactly.

Extending: register a new guide by name; the trainer only ever calls ``compute_log_q``::

    @dataclasses.dataclass(frozen=True)
    class MyConfig(GuideConfig):
        scale: float = 0.1       # q per nat

    @register_guide("mine", MyConfig)
    def _mine(cfg: MyConfig, inputs: GuideInputs) -> jax.Array:
        return 1.0 + cfg.scale * inputs.entropy_BxT

``compute_log_q`` clamps to ``[q_min, q_max]``, sets ``q = 1`` on padding and stops the gradient
for every guide, registered here or by a user.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from sage_jax.rl.guide_configs import (BranchConfig, GuideConfig, NoneGuideConfig, RandomConfig, TokenConfig,
                                       check_q_range)
from sage_jax.rl.guide_norm import float_dtype, normalize_per_sequence

Array = jax.Array



# ---------------------------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------------------------


def _finalize_q(q_BxT: Array, mask_BxT: Array, q_min: float, q_max: float) -> Array:
    """Clamp, force exactly 1 on padding, and make q a constant for the gradient."""
    q_BxT = jnp.clip(q_BxT, q_min, q_max)
    q_BxT = jnp.where(mask_BxT.astype(bool), q_BxT, jnp.ones_like(q_BxT))
    return jax.lax.stop_gradient(q_BxT)


# ---------------------------------------------------------------------------------------------
# The public guide functions (docs/design.md §6 interface).
# ---------------------------------------------------------------------------------------------


def branch_q(
    entropy: Array,
    mask: Array,
    ratio: float = BranchConfig.ratio,
    threshold: float = BranchConfig.threshold,
    q_min: float = GuideConfig.q_min,
    q_max: float = GuideConfig.q_max,
) -> Array:
    """Branch guide: ``q = clip(1 + ratio * relu(H - threshold), q_min, q_max)``, [B, T].

    ``entropy`` in nats; ``ratio`` in q per nat above ``threshold`` (nats).
    """
    check_q_range(q_min, q_max)
    dtype = float_dtype(entropy)
    m = mask.astype(bool)
    h = jax.lax.stop_gradient(jnp.where(m, entropy.astype(dtype), jnp.zeros((), dtype)))
    q = 1.0 + ratio * jax.nn.relu(h - threshold)
    return _finalize_q(q, m, q_min, q_max)


def token_q(
    surprisal: Array,
    mask: Array,
    key: Array,
    alpha: float | Array,
    sigma: float | Array,
    norm: str = TokenConfig.norm,
    q_min: float = GuideConfig.q_min,
    q_max: float = GuideConfig.q_max,
) -> Array:
    """Token guide: ``q = clip(1 + alpha w + sigma w eps, q_min, q_max)``, [B, T].

    ``w`` is the per-sequence normalised surprisal (``norm`` in minmax / rank / zscore);
    ``eps = jax.random.normal(key, (B, T))``. ``alpha``, ``sigma`` may be traced (schedules).
    """
    check_q_range(q_min, q_max)
    dtype = float_dtype(surprisal)
    m = mask.astype(bool)
    s = jax.lax.stop_gradient(surprisal.astype(dtype))
    w = normalize_per_sequence(s, m, norm)
    eps = jax.random.normal(key, s.shape, dtype=dtype)
    q = 1.0 + alpha * w + sigma * w * eps
    return _finalize_q(q, m, q_min, q_max)


def random_q(
    mask: Array,
    key: Array,
    eps: float | Array,
    sigma: float | Array,
    q_min: float = GuideConfig.q_min,
    q_max: float = GuideConfig.q_max,
    dtype: Any = jnp.float32,
) -> Array:
    """Random guide: with probability ``eps`` per token ``q = clip(1 + sigma z)``, else 1; [B, T].

    ``k_gate, k_noise = jax.random.split(key)``; gate ``uniform(k_gate) < eps``,
    ``z = normal(k_noise)``.
    """
    check_q_range(q_min, q_max)
    m = mask.astype(bool)
    k_gate, k_noise = jax.random.split(key)
    u = jax.random.uniform(k_gate, m.shape, dtype=dtype)
    z = jax.random.normal(k_noise, m.shape, dtype=dtype)
    q = jnp.where(u < eps, 1.0 + sigma * z, jnp.ones((), dtype))
    return _finalize_q(q, m, q_min, q_max)


def none_q(mask: Array, dtype: Any = jnp.float32) -> Array:
    """The identity guide, q = 1 everywhere (SAGE reduces to KL-regularised GRPO)."""
    return jnp.ones(mask.shape, dtype)


# ---------------------------------------------------------------------------------------------
# Uniform, config-driven entry point.
# ---------------------------------------------------------------------------------------------


@flax.struct.dataclass
class GuideInputs:
    """What a guide may look at, all [B, T] (stop-gradient'ed by the guide).

    Fields a guide does not need may be None (e.g. ``ref_logp_BxT`` when beta = 0 and the
    guide reads the policy). ``step`` is the 0-based optimizer step from the train state;
    ``key`` should be fresh per step (e.g. ``jax.random.fold_in(rng, step)``).
    """

    mask_BxT: Array
    step: Array
    max_steps: Array | int
    key: Array
    entropy_BxT: Array | None = None  # policy next-token entropy, nats
    logp_BxT: Array | None = None  # policy log-prob of the sampled token, nats
    ref_logp_BxT: Array | None = None  # reference log-prob of the sampled token, nats
    ref_entropy_BxT: Array | None = None  # reference next-token entropy, nats


GuideFn = Callable[[Any, GuideInputs], Array]


class GuideSpec(NamedTuple):
    name: str
    fn: GuideFn  # (cfg, inputs) -> q_BxT (unclamped is fine; compute_log_q finalises)
    config_cls: type


_REGISTRY: dict[str, GuideSpec] = {}


def register_guide(
    name: str, config_cls: type = GuideConfig, *, overwrite: bool = False
) -> Callable[[GuideFn], GuideFn]:
    """Decorator registering ``fn(cfg, inputs) -> q_BxT`` under ``name``.

    ``config_cls`` must be a frozen dataclass subclassing ``GuideConfig``.
    """
    if not (isinstance(config_cls, type) and issubclass(config_cls, GuideConfig)):
        raise TypeError(f"config_cls of guide {name!r} must subclass GuideConfig: {config_cls}")
    if not config_cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"config_cls for guide {name!r} must be a frozen dataclass (hashable)")

    def deco(fn: GuideFn) -> GuideFn:
        if name in _REGISTRY and not overwrite:
            raise ValueError(f"guide {name!r} is already registered (pass overwrite=True)")
        _REGISTRY[name] = GuideSpec(name, fn, config_cls)
        return fn

    return deco


def get_guide(name: str) -> GuideSpec:
    """The registered guide ``name``; a clear error listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown guide={name!r}; registered: {sorted(_REGISTRY)}") from None


def available_guides() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def make_guide_config(name: str, **fields: Any) -> GuideConfig:
    """Build and validate the config of guide ``name`` from keyword fields.

    E.g. ``make_guide_config(c.sage.guide, **c.sage.get(c.sage.guide, {}))`` from an
    ml_collections config. Unknown fields raise an error naming them.
    """
    spec = get_guide(name)
    known = {f.name for f in dataclasses.fields(spec.config_cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"unknown field(s) {unknown} for guide {name!r} ({spec.config_cls.__name__}); "
            f"known: {sorted(known)}"
        )
    return spec.config_cls(**fields)


def _signal(inputs: GuideInputs, source: str, kind: str) -> Array:
    """Entropy or logp of the policy (source="new") or the reference (source="ref")."""
    field = {("new", "entropy"): "entropy_BxT", ("ref", "entropy"): "ref_entropy_BxT",
             ("new", "logp"): "logp_BxT", ("ref", "logp"): "ref_logp_BxT"}[(source, kind)]
    x = getattr(inputs, field)
    if x is None:
        raise ValueError(f"guide with source={source!r} needs GuideInputs.{field}, got None")
    return x


@register_guide("none", NoneGuideConfig)
def _none_guide(cfg: NoneGuideConfig, inputs: GuideInputs) -> Array:
    del cfg
    return none_q(inputs.mask_BxT)


@register_guide("branch", BranchConfig)
def _branch_guide(cfg: BranchConfig, inputs: GuideInputs) -> Array:
    h = _signal(inputs, cfg.source, "entropy")
    return branch_q(h, inputs.mask_BxT, cfg.ratio, cfg.threshold, cfg.q_min, cfg.q_max)


@register_guide("token", TokenConfig)
def _token_guide(cfg: TokenConfig, inputs: GuideInputs) -> Array:
    lp = _signal(inputs, cfg.source, "logp")
    sched = cfg.schedule(inputs.step, inputs.max_steps)
    return token_q(-lp, inputs.mask_BxT, inputs.key, sched["alpha"], sched["sigma"], cfg.norm,
                   cfg.q_min, cfg.q_max)


@register_guide("random", RandomConfig)
def _random_guide(cfg: RandomConfig, inputs: GuideInputs) -> Array:
    sched = cfg.schedule(inputs.step, inputs.max_steps)
    dtype = jnp.float32 if inputs.logp_BxT is None else float_dtype(inputs.logp_BxT)
    return random_q(inputs.mask_BxT, inputs.key, sched["eps"], sched["sigma"], cfg.q_min,
                    cfg.q_max, dtype=dtype)


@dataclasses.dataclass(frozen=True)
class Guide:
    """A registered guide with its config: the one object the RL step carries (hashable, a static jit argument).
    Built by `make_guide`, which reads the registry once."""
    name: str
    cfg: GuideConfig
    fn: GuideFn = dataclasses.field(repr=False, compare=False)

    def log_q(self, inputs: GuideInputs) -> tuple[Array, Array]:
        """``(log_q_BxT, q_BxT)``: clamped to ``[cfg.q_min, cfg.q_max]``, q = 1 on padding, no gradient."""
        q = self.fn(self.cfg, inputs)
        q = _finalize_q(jnp.asarray(q), inputs.mask_BxT, self.cfg.q_min, self.cfg.q_max)
        return jnp.log(q), q


def make_guide(name: str, cfg: GuideConfig | None = None, **fields: Any) -> Guide:
    """The guide ``name`` with ``cfg`` (or its config built from ``fields``, unknown ones named in the error)."""
    spec = get_guide(name)
    if cfg is None:
        cfg = make_guide_config(name, **fields)
    elif fields:
        raise ValueError(f"make_guide({name!r}): give cfg or fields, not both")
    if not isinstance(cfg, spec.config_cls):
        raise TypeError(f"guide {name!r} expects a {spec.config_cls.__name__}, got {type(cfg).__name__}")
    return Guide(name, cfg, spec.fn)


def compute_log_q(
    name: str, cfg: GuideConfig | None, inputs: GuideInputs
) -> tuple[Array, Array]:
    """``(log_q_BxT, q_BxT)`` of guide ``name`` (cfg None -> that guide's defaults): `make_guide(name, cfg)`'s
    `log_q`. Trace-time errors name the missing input or the wrong config type."""
    return make_guide(name, cfg).log_q(inputs)


def guide_metrics(q_BxT: Array, mask_BxT: Array) -> dict[str, Array]:
    """Summaries over real tokens: mean / min / max of q, the fraction with q != 1, and that fraction split by
    where the shaped tokens sit: the completion's first token (the testbed's fork: which procedure to follow) and
    the tokens after it. Both parts are shares of all real tokens (they sum to frac_shaped), so they average
    over micro-batches and length buckets as frac_shaped does; the share of first tokens that are shaped is
    frac_shaped_first x real tokens per completion."""
    m = mask_BxT.astype(bool)
    q = jax.lax.stop_gradient(q_BxT)
    mf = m.astype(q.dtype)
    n = jnp.maximum(mf.sum(), 1.0)
    shaped = mf * (q != 1.0)
    return {
        "q_mean": (mf * q).sum() / n,
        # A batch with no real token reports 1 (the value q takes on padding).
        "q_min": jnp.where(m.any(), jnp.min(jnp.where(m, q, jnp.inf)), 1.0),
        "q_max": jnp.where(m.any(), jnp.max(jnp.where(m, q, -jnp.inf)), 1.0),
        "frac_shaped": shaped.sum() / n,
        "frac_shaped_first": shaped[:, :1].sum() / n,
        "frac_shaped_later": shaped[:, 1:].sum() / n,
    }
