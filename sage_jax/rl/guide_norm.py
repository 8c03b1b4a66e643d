"""Per-sequence normalisation of a token signal to w in [0, 1] (the token guide's `norm`; the math is in
`sage_jax/rl/guides.py`'s docstring): minmax between robust percentiles, tie-averaged rank, or a z-score
squashed by a sigmoid, each over the real tokens of a row only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

# Added to the per-sequence std in the zscore normalisation so a constant row gives z = 0
# (w = 0.5) instead of 0/0.
ZSCORE_EPS = 1e-6
# Percentiles that bound the minmax normalisation (robust to a few extreme surprisals).
MINMAX_PERCENTILES = (5.0, 95.0)

NORMS = ("minmax", "rank", "zscore")


def float_dtype(x: Array) -> jnp.dtype:
    # Compute at least in float32 (bf16 inputs), keep float64 when x64 is on.
    return jnp.promote_types(jnp.asarray(x).dtype, jnp.float32)



def _masked_sorted(x_BxT: Array, m_BxT: Array) -> tuple[Array, Array]:
    """Rows sorted ascending with padded entries pushed to the end as +inf; real-token counts."""
    x_sorted = jnp.sort(jnp.where(m_BxT, x_BxT, jnp.inf), axis=-1)
    n_B = m_BxT.sum(axis=-1)
    return x_sorted, n_B


def _masked_percentile(x_sorted_BxT: Array, n_B: Array, p: float) -> Array:
    """Per-row percentile over the first n_B sorted entries, numpy's 'linear' method.

    Virtual index ``p/100 * (n - 1)``, linear interpolation between its floor and ceil.
    Rows with n == 0 return 0 (their q is forced to 1 anyway).
    """
    dtype = x_sorted_BxT.dtype
    n_safe = jnp.maximum(n_B, 1)
    pos_B = (p / 100.0) * (n_safe - 1).astype(dtype)
    lo_B = jnp.floor(pos_B).astype(jnp.int32)
    hi_B = jnp.minimum(lo_B + 1, n_safe - 1)
    frac_B = pos_B - lo_B.astype(dtype)
    lo_v = jnp.take_along_axis(x_sorted_BxT, lo_B[:, None], axis=-1)[:, 0]
    hi_v = jnp.take_along_axis(x_sorted_BxT, hi_B[:, None], axis=-1)[:, 0]
    # hi_v is +inf only when n == 0 (then lo_v is too); guard so no nan appears.
    hi_v = jnp.where(jnp.isfinite(hi_v), hi_v, lo_v)
    val_B = lo_v + frac_B * (hi_v - lo_v)
    return jnp.where(n_B > 0, val_B, jnp.zeros_like(val_B))


def normalize_per_sequence(x_BxT: Array, mask_BxT: Array, norm: str = "minmax") -> Array:
    """Normalise each row to ``w in [0, 1]`` over its real tokens (see module docstring).

    Padded entries are ignored (they may hold garbage) and come back as 0.
    """
    if norm not in NORMS:
        raise ValueError(f"unknown norm={norm!r}; expected one of {NORMS}")
    dtype = float_dtype(x_BxT)
    m = mask_BxT.astype(bool)
    x = jnp.where(m, x_BxT.astype(dtype), jnp.zeros((), dtype))
    zero = jnp.zeros((), dtype)

    if norm == "minmax":
        x_sorted, n_B = _masked_sorted(x, m)
        lo_B = _masked_percentile(x_sorted, n_B, MINMAX_PERCENTILES[0])[:, None]
        hi_B = _masked_percentile(x_sorted, n_B, MINMAX_PERCENTILES[1])[:, None]
        span = hi_B - lo_B
        ok = span > 0
        w = (jnp.clip(x, lo_B, hi_B) - lo_B) / jnp.where(ok, span, jnp.ones_like(span))
        # A row with no spread carries no surprisal signal: w = 0 -> q = 1.
        # clip: division may round just past 1.
        w = jnp.where(ok, jnp.clip(w, 0.0, 1.0), zero)
    elif norm == "rank":
        x_sorted, n_B = _masked_sorted(x, m)
        xq = jnp.where(m, x, jnp.inf)
        # #real entries < x and <= x; their mean minus 1/2 is the tie-averaged 0-based rank.
        less = jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="left"))(x_sorted, xq)
        leq = jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="right"))(x_sorted, xq)
        rank = (less + leq - 1).astype(dtype) / 2.0
        denom = jnp.maximum(n_B - 1, 1).astype(dtype)[:, None]
        w = jnp.where((n_B > 1)[:, None], rank / denom, zero)
    else:  # zscore
        mf = m.astype(dtype)
        n_B = jnp.maximum(mf.sum(-1, keepdims=True), 1.0)
        mean = (mf * x).sum(-1, keepdims=True) / n_B
        var = (mf * (x - mean) ** 2).sum(-1, keepdims=True) / n_B
        w = jax.nn.sigmoid((x - mean) / (jnp.sqrt(var) + ZSCORE_EPS))
    return jnp.where(m, w, zero)

