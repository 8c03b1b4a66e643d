"""Group-relative advantages (GRPO family).

Dimension key: ``B`` batch (completions), ``G`` group size (completions per prompt),
``B = num_prompts * G`` laid out group-contiguous (completions of prompt p at
``p * G ... p * G + G - 1``).

::

    A_i = (R_i - mean_G R) / (std R + eps)      eps = 1e-4
    scale_rewards="group": std over the completion's group   (GRPO)
    scale_rewards="batch": std over the whole batch          (mean is still the group mean)
    scale_rewards="none":  no division, A_i = R_i - mean_G R (Dr. GRPO)

The std is the *sample* (unbiased, ddof=1) standard deviation, as TRL's GRPOTrainer computes it
with ``torch.std`` (``rewards.view(-1, G).std(dim=1)`` / ``rewards.std()``), so advantages match
the reference code. A group of one (or a batch of one) has std 0 here instead of torch's nan;
its advantage is then exactly 0. Pass the whole generation batch: under jit with a sharded
``rewards_B`` the reductions are global, so "batch" means the global batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

SCALE_REWARDS = ("group", "batch", "none")


def _sample_std(x: Array, axis: int | None) -> Array:
    """Unbiased std (ddof=1); 0 where fewer than two samples."""
    n = x.size if axis is None else x.shape[axis]
    if n < 2:
        return jnp.zeros(jnp.mean(x, axis=axis).shape, x.dtype)
    return jnp.std(x, axis=axis, ddof=1)


def group_advantages(
    rewards_B: Array,
    group_size: int,
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> tuple[Array, dict[str, Array]]:
    """Advantages ``adv_B`` and metrics; ``group_size`` and ``scale_rewards`` are static.

    Metrics: ``reward_mean``, ``reward_std`` (batch, ddof=1), ``reward_std_group`` (mean of
    the per-group stds), ``frac_zero_std`` (fraction of groups whose rewards are all equal: they
    carry no learning signal).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards={scale_rewards!r}; expected {SCALE_REWARDS}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards_B.ndim != 1:
        raise ValueError(f"rewards_B must be 1-D [B], got shape {rewards_B.shape}")
    (B,) = rewards_B.shape
    if B % group_size:
        raise ValueError(f"batch size B={B} is not a multiple of group_size={group_size}")

    dtype = jnp.promote_types(rewards_B.dtype, jnp.float32)
    r = jax.lax.stop_gradient(rewards_B.astype(dtype))
    r_PxG = r.reshape(B // group_size, group_size)
    mean_P = r_PxG.mean(axis=1)
    std_P = _sample_std(r_PxG, axis=1)
    centered_PxG = r_PxG - mean_P[:, None]

    if scale_rewards == "group":
        adv_PxG = centered_PxG / (std_P[:, None] + eps)
    elif scale_rewards == "batch":
        adv_PxG = centered_PxG / (_sample_std(r, axis=None) + eps)
    else:
        adv_PxG = centered_PxG

    # max == min is exact, unlike a tolerance on a float std.
    zero_std_P = r_PxG.max(axis=1) == r_PxG.min(axis=1)
    metrics = {
        "reward_mean": r.mean(),
        "reward_std": _sample_std(r, axis=None),
        "reward_std_group": std_P.mean(),
        "frac_zero_std": zero_std_P.astype(dtype).mean(),
    }
    return adv_PxG.reshape(B), metrics
