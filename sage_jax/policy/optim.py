"""optax optimizer and learning-rate schedules.

Schedules (`step` = optimizer steps done, 0-based; `W` warmup steps, `N` total steps):
  warmup:   lr(s) = peak * (s + 1) / (W + 1) for s < W   (never exactly 0, so step 0 trains)
  constant: lr(s) = peak                          for s >= W
  linear:   lr(s) = peak * (N - s) / (N - W)      for s >= W
  cosine:   lr(s) = peak * (1 + cos(pi (s - W) / (N - W))) / 2
Warmup is applied whatever the decay (the reference implementation silently ignores its warmup
ratio with a constant schedule).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 1e-6  # peak lr
    schedule: str = "constant"  # constant | linear | cosine (after warmup)
    warmup_steps: int = 0  # optimizer steps
    total_steps: int = 1000  # optimizer steps (for the decay)
    weight_decay: float = 0.01  # AdamW decoupled decay (the reference's)
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip_norm: float | None = 1.0  # global-norm clip; None = off

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule={self.schedule!r} is not one of {SCHEDULES}")
        for f in ("learning_rate", "weight_decay", "b1", "b2", "eps", "grad_clip_norm"):
            v = getattr(self, f)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"optim.{f}={v} must be a finite number")
        if not self.learning_rate >= 0:
            raise ValueError(f"optim.learning_rate must be >= 0, got {self.learning_rate}")
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise ValueError(f"optim.grad_clip_norm must be > 0 (or None = off), got {self.grad_clip_norm}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps} must be >= 0")


def lr_schedule(cfg: OptimConfig):
    peak, W, N = cfg.learning_rate, cfg.warmup_steps, max(cfg.total_steps, 1)

    def fn(step):
        s = jnp.asarray(step, jnp.float32)
        warm = peak * (s + 1.0) / (W + 1.0)
        frac = jnp.clip((s - W) / max(N - W, 1), 0.0, 1.0)
        if cfg.schedule == "constant":
            decayed = jnp.full_like(s, peak)
        elif cfg.schedule == "linear":
            decayed = peak * (1.0 - frac)
        else:
            decayed = peak * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        return jnp.where(s < W, warm, decayed)

    return fn


def make_optimizer(cfg: OptimConfig) -> tuple[optax.GradientTransformation, callable]:
    sched = lr_schedule(cfg)
    parts = [] if cfg.grad_clip_norm is None else [optax.clip_by_global_norm(cfg.grad_clip_norm)]
    parts.append(optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    return optax.chain(*parts), sched
