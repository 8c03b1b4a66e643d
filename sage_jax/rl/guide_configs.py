"""The guides' configs (frozen, hashable: static jit arguments) and the cosine-with-restarts schedule that
anneals the `token` and `random` guides' parameters (formula in `sage_jax.rl.guides`' docstring)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from sage_jax.rl.guide_norm import NORMS

Array = jax.Array

SOURCES = ("new", "ref")


def cosine_schedule(
    step: int | Array,
    max_steps: int | Array,
    ub: float,
    lb: float,
    num_cycles: int = 8,
    decay: float = 0.9,
) -> Array:
    """Cosine with restarts, ``lb + (ub decay^c - lb)(1 + cos(pi u)) / 2`` (module docstring).

    ``step`` is the 0-based optimizer step (traced int is fine); past the last cycle the
    formula keeps restarting with cycle index ``N - 1``.
    """
    if isinstance(num_cycles, int) and num_cycles < 1:
        raise ValueError(f"num_cycles must be >= 1, got {num_cycles}")
    s = jnp.asarray(step).astype(jnp.int32)
    cycle_len = jnp.maximum(1, jnp.asarray(max_steps).astype(jnp.int32) // num_cycles)
    c = jnp.minimum(s // cycle_len, num_cycles - 1)
    ftype = jnp.promote_types(jnp.result_type(float), jnp.float32)
    u = (s % cycle_len).astype(ftype) / cycle_len.astype(ftype)
    peak = ub * jnp.power(jnp.asarray(decay, ftype), c.astype(ftype))
    return lb + (peak - lb) * (1.0 + jnp.cos(math.pi * u)) / 2.0


def check_q_range(q_min: float, q_max: float, prefix: str = "") -> None:
    """0 < q_min <= q_max (log q is taken), for Python numbers (traced bounds are the caller's to check)."""
    if isinstance(q_min, (int, float)) and isinstance(q_max, (int, float)):
        if not q_min > 0:
            raise ValueError(f"{prefix}q_min must be > 0 (log q is taken), got {q_min}")
        if not q_min <= q_max:
            raise ValueError(f"{prefix}q_min={q_min} must be <= {prefix}q_max={q_max}")


def _check_choice(cls_name: str, field: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{cls_name}.{field}={value!r} is not one of {choices}")


@dataclasses.dataclass(frozen=True)
class GuideConfig:
    """Fields every guide has. Frozen and hashable, so it can be a static jit argument."""

    source: str = "new"  # "new": signals from pi_theta; "ref": from pi_ref
    q_min: float = 0.6  # lower clamp of q (dimensionless, > 0)
    q_max: float = 1.4  # upper clamp of q (dimensionless, >= q_min)

    def __post_init__(self) -> None:
        name = type(self).__name__
        _check_choice(name, "source", self.source, SOURCES)
        check_q_range(self.q_min, self.q_max, f"{name}.")


@dataclasses.dataclass(frozen=True)
class NoneGuideConfig(GuideConfig):
    """``guide="none"``: q = 1."""


@dataclasses.dataclass(frozen=True)
class BranchConfig(GuideConfig):
    ratio: float = 0.3  # q increase per nat of entropy above threshold
    threshold: float = 1.2  # entropy threshold, nats

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ratio < 0:
            raise ValueError(f"BranchConfig.ratio must be >= 0, got {self.ratio}")


@dataclasses.dataclass(frozen=True)
class _ScheduledConfig(GuideConfig):
    num_cycles: int = 8  # cosine restarts over max_steps
    decay: float = 0.9  # peak multiplier per cycle

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        if self.num_cycles < 1:
            raise ValueError(f"{name}.num_cycles must be >= 1, got {self.num_cycles}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"{name}.decay must be in (0, 1], got {self.decay}")


@dataclasses.dataclass(frozen=True)
class TokenConfig(_ScheduledConfig):
    norm: str = "minmax"  # per-sequence surprisal normalisation: minmax | rank | zscore
    alpha_ub: float = 0.3  # deterministic gain on w at the start of each cycle (q units)
    alpha_lb: float = 0.1  # ... at the end of each cycle
    sigma_ub: float = 0.25  # std of the multiplicative noise on w, cycle start (q units)
    sigma_lb: float = 0.1  # ... cycle end

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("TokenConfig", "norm", self.norm, NORMS)
        for f in ("sigma_ub", "sigma_lb"):
            if getattr(self, f) < 0:
                raise ValueError(f"TokenConfig.{f} must be >= 0, got {getattr(self, f)}")

    def schedule(self, step: Array, max_steps: Array | int) -> dict[str, Array]:
        """The annealed (alpha, sigma) at ``step``."""
        cs = lambda ub, lb: cosine_schedule(step, max_steps, ub, lb, self.num_cycles, self.decay)
        return {"alpha": cs(self.alpha_ub, self.alpha_lb),
                "sigma": cs(self.sigma_ub, self.sigma_lb)}


@dataclasses.dataclass(frozen=True)
class RandomConfig(_ScheduledConfig):
    eps_ub: float = 0.1  # per-token probability of reshaping, cycle start
    eps_lb: float = 0.0  # ... cycle end
    sigma_ub: float = 0.15  # std of q around 1 on reshaped tokens, cycle start (q units)
    sigma_lb: float = 0.05  # ... cycle end

    def __post_init__(self) -> None:
        super().__post_init__()
        for f in ("eps_ub", "eps_lb"):
            if not 0 <= getattr(self, f) <= 1:
                raise ValueError(f"RandomConfig.{f} must be in [0, 1], got {getattr(self, f)}")
        for f in ("sigma_ub", "sigma_lb"):
            if getattr(self, f) < 0:
                raise ValueError(f"RandomConfig.{f} must be >= 0, got {getattr(self, f)}")

    def schedule(self, step: Array, max_steps: Array | int) -> dict[str, Array]:
        """The annealed (eps, sigma) at ``step``."""
        cs = lambda ub, lb: cosine_schedule(step, max_steps, ub, lb, self.num_cycles, self.decay)
        return {"eps": cs(self.eps_ub, self.eps_lb), "sigma": cs(self.sigma_ub, self.sigma_lb)}
