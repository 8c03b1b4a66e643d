"""Group-relative advantages (GRPO family).

Dimension key (docs/design.md §5.4): ``N`` prompts, ``G`` completions per prompt, ``B = N * G`` rows laid out
group-contiguous (completions of prompt p at ``p * G ... p * G + G - 1``).

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
    r_NxG = r.reshape(B // group_size, group_size)
    mean_N = r_NxG.mean(axis=1)
    std_N = _sample_std(r_NxG, axis=1)
    centered_NxG = r_NxG - mean_N[:, None]

    if scale_rewards == "group":
        adv_NxG = centered_NxG / (std_N[:, None] + eps)
    elif scale_rewards == "batch":
        adv_NxG = centered_NxG / (_sample_std(r, axis=None) + eps)
    else:
        adv_NxG = centered_NxG

    # max == min is exact, unlike a tolerance on a float std.
    zero_std_N = r_NxG.max(axis=1) == r_NxG.min(axis=1)
    metrics = {
        "reward_mean": r.mean(),
        "reward_std": _sample_std(r, axis=None),
        "reward_std_group": std_N.mean(),
        "frac_zero_std": zero_std_N.astype(dtype).mean(),
    }
    return adv_NxG.reshape(B), metrics


def _ratio_of_binomials(a: Array, n: int, k: int) -> Array:
    """C(a, k) / C(n, k) for integer arrays a <= n and a static k >= 0: prod_j (a - j) / (n - j), 0 when a < k."""
    out = jnp.ones(a.shape, jnp.float32)
    for j in range(k):
        out = out * jnp.maximum(a - j, 0).astype(jnp.float32) / (n - j)
    return out


def pass_at_k_advantages(rewards_B: Array, group_size: int, k: int, eps: float = 1e-4) -> tuple[Array, dict]:
    """The analytic pass@k advantage of Pass@k Training (Chen et al., 2025) for binary rewards (correct: r > 0).

    A group of G = `group_size` with G_neg wrong samples has the unbiased pass@k (over the k-subsets of the
    group) R = 1 - C(G_neg, k) / C(G, k) and std s = sqrt(R (1 - R)). Every k-subset holding sample i scores
    max reward; its mean over those subsets, minus R, over s, is i's advantage:
        correct i: (1 - R) / (s + eps)
        wrong i:   (1 - R - C(G_neg - 1, k - 1) / C(G - 1, k - 1)) / (s + eps)
    k = 1 gives GRPO's group advantage with the population (ddof 0) std. Metrics: `pass_at_k` (mean R over
    groups, the unbiased pass@k of the training samples) and `frac_zero_std` (groups with R in {0, 1})."""
    if not 1 <= k <= group_size:
        raise ValueError(f"pass@k advantage needs 1 <= k <= group_size={group_size}, got k={k}")
    (B,) = rewards_B.shape
    if B % group_size:
        raise ValueError(f"batch size B={B} is not a multiple of group_size={group_size}")
    G = group_size
    correct_NxG = (jax.lax.stop_gradient(rewards_B) > 0).reshape(B // G, G)
    n_neg_N = G - correct_NxG.sum(axis=1)
    # R is exactly 0 (all wrong) or 1 (fewer than k wrong) by counting; float products can land a hair
    # outside [0, 1] and make sqrt(R (1 - R)) NaN, so those groups are decided on the integers.
    uniform_N = (n_neg_N == G) | (n_neg_N < k)
    R_N = jnp.where(n_neg_N == G, 0.0, jnp.where(n_neg_N < k, 1.0,
                                                 jnp.clip(1.0 - _ratio_of_binomials(n_neg_N, G, k), 0.0, 1.0)))
    s_N = jnp.sqrt(R_N * (1.0 - R_N))
    neg_N = 1.0 - R_N - _ratio_of_binomials(n_neg_N - 1, G - 1, k - 1)
    adv_NxG = jnp.where(correct_NxG, (1.0 - R_N)[:, None], neg_N[:, None]) / (s_N[:, None] + eps)
    adv_NxG = jnp.where(uniform_N[:, None], 0.0, adv_NxG)  # no signal, exactly
    metrics = {"pass_at_k": R_N.mean(), "frac_zero_std": uniform_N.astype(jnp.float32).mean()}
    return adv_NxG.reshape(B), metrics


def pass_at_k_informative(rewards_B: Array, group_size: int, k: int) -> Array:
    """Per group, whether its pass@k advantage is nonzero: some sample correct and at least k wrong (with fewer
    than k wrong every k-subset holds a correct one, R = 1, no signal)."""
    G = group_size
    n_neg_N = G - (jax.lax.stop_gradient(rewards_B) > 0).reshape(-1, G).sum(axis=1)
    return (n_neg_N >= k) & (n_neg_N < G)
