"""Policy surrogate, KL estimators against SAGE's shaped anchor, and loss aggregation.

Dimension key: ``B`` batch (completions), ``G`` group size, ``T`` completion length,
``V`` vocab. ``m_t`` = 1 on the tokens the loss reads (real completion tokens of kept rows).

Per token (docs/design.md §2)::

    lp_t  = log pi_theta(y_t | .)            differentiated
    old_t = same under the sampling policy    stop-gradient (None -> lp_t, one update per rollout)
    ref_t = same under pi_ref                 stop-gradient
    a_t   = ref_t + log q_t                   shaped anchor, q a constant for the gradient
    d_t   = a_t - lp_t
    kl_t  = exp(d_t) - d_t - 1  (k3, default) | -d_t  (k1) | d_t^2 / 2  (k2)
    r_t   = exp(lp_t - old_t)                                          (token level)
          | exp(sum_t m_t (lp_t - old_t) / sum_t m_t)                   (sequence level, GSPO)
    pg_t  = -min(min(r_t, delta) A_i, clip(r_t, 1 - eps_low, 1 + eps_high) A_i)     (PPO clip)
          | -sg(min(r_t, eps_high)) A_i lp_t                           (loss_type cispo, MiniMax-M1 / TRL)
    l_t   = w_t pg_t + beta kl_t             (beta = 0: no KL term, no reference needed)
            - entropy_coef H_t               (aggregated as a mean, see below)

``w_t`` is the sampler correction (1 without one, `sampler_correction`). The optional ``delta`` cap
(two-sided clipping) caps only the unclipped branch, as in TRL; with ``delta >= 1 + eps_high``
(enforced) this equals ``r_t <- min(r_t, delta)`` applied before the clip.

Aggregation (``loss_type``), over the update's kept rows (``Normalizer``: a masked-out row changes neither
the sum nor its denominator)::

    grpo:    sum_i [ sum_t m l / max(1, sum_t m) ] / R        R = rows with >= 1 loss token
    bnpo:    sum m l / max(1, sum m)
    dr_grpo: sum m l / (R * T_max)                            T_max = max completion length
    dapo, cispo: sum m l / N_gen                              N_gen = completion tokens in the whole
                                                              generation batch (``num_batch_tokens``)

The denominators are the whole update's (all its micro-batches'), so the micro-batch losses of gradient
accumulation simply sum to the update's loss (pass the update's `Normalizer` to each micro-batch).

Objective-level SAGE (``sage_form="reward"``): ``KL(pi || q pi_ref) = KL(pi || pi_ref) - E[sum_t log q_t]``,
so ``a_t = ref_t`` in the KL term and ``A_i <- A_i + beta sum_t m_t log q_t`` (the reward bonus, q a constant).
In expectation over y ~ pi (on-policy, A = 0, q_t(y_<=t) any positive function of the prefix and the token),
the gradients are, with ``gl_t(v) = grad log pi(v | y_<t)`` and sums over the next token v at each prefix::

    loss form:   -beta sum_t E_{y<t} [ sum_v q_t(v) ref(v) gl_t(v) ]
    reward form: -beta sum_t E_{y<t} [ sum_v (ref(v) + pi(v) Q_t(v)) gl_t(v) ],
                 Q_t(v) = log q_t(v) + E[ sum_{t' > t} log q_t' | y<t, y_t = v ]

The reward form's bonus credits each position with the log q of its own token (the one-token form) plus the
expected log q still to come (a return-to-go the loss form lacks); the bonus terms of earlier positions have
zero mean. Both equal ``-beta sum_t E[sum_v ref(v) gl_t(v)]`` when q = 1 (tests/test_loss_corrections.py
enumerates T = 1, 2, 3 exactly). The KL part stays k3-in-loss, whose expected gradient is that of the
forward-style pull above.

Forward-KL baseline (``kl_mode="forward"``): ``kl_t = sum_v pi_ref(v) (log pi_ref(v) -
log pi_theta(v))`` exact per position, from ``forward_kl_from_logits`` which the caller applies
per sequence chunk (never the full [B, T, V] float32 logits) and passes in as ``forward_kl_BxT``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from sage_jax.rl.loss_config import (ESTIMATORS, IS_LEVELS, KL_MODES, LOSS_TYPES, MISMATCH_LEVELS,  # noqa: F401
                                     SAGE_FORMS, SAMPLER_CORRECTIONS, TOKEN_SUM_TYPES, LossConfig)

Array = jax.Array
def _ftype(x: Array) -> jnp.dtype:
    # At least float32 (bf16 logps are upcast); float64 stays float64 under x64.
    return jnp.promote_types(jnp.asarray(x).dtype, jnp.float32)


def per_token_kl(
    logp: Array, ref_logp: Array, log_q: Array | None = None, estimator: str = "k3"
) -> Array:
    """Elementwise KL estimate against the anchor ``ref_logp + log_q`` (docs/design.md §2).

    ``d = ref_logp + log_q - logp``; k3 ``exp(d) - d - 1``, k1 ``-d``, k2 ``d^2 / 2``.
    No masking here: ``policy_loss`` zeroes padded inputs before calling it.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator={estimator!r}; expected one of {ESTIMATORS}")
    d = ref_logp - logp
    if log_q is not None:
        d = d + log_q
    if estimator == "k3":
        # expm1 keeps precision for small |d|, where k3 ~ d^2 / 2.
        return jnp.expm1(d) - d
    if estimator == "k1":
        return -d
    return 0.5 * d * d


def forward_kl_from_logits(
    policy_logits_BxTxV: Array, ref_logits_BxTxV: Array, mask_BxT: Array | None = None
) -> Array:
    """Exact forward KL per position: ``sum_v pi_ref(v) (log pi_ref(v) - log pi_theta(v))``.

    Any leading shape works (``[..., V]`` -> ``[...]``), so the caller applies it per sequence
    chunk (e.g. ``lax.map`` over T-chunks next to the unembedding) and concatenates; it never
    needs the whole float32 [B, T, V]. Differentiable w.r.t. the policy logits; the reference is
    stop-gradient'ed. Padded positions (mask 0) return exactly 0 with zero gradient.
    """
    dtype = jnp.promote_types(policy_logits_BxTxV.dtype, jnp.float32)
    logp_pol = jax.nn.log_softmax(policy_logits_BxTxV.astype(dtype), axis=-1)
    logp_ref = jax.nn.log_softmax(jax.lax.stop_gradient(ref_logits_BxTxV).astype(dtype), axis=-1)
    p_ref = jnp.exp(logp_ref)
    # p_ref * (logp_ref - logp_pol) with the 0 * log 0 = 0 convention (p_ref underflow).
    term = jnp.where(p_ref > 0, p_ref * (logp_ref - logp_pol), jnp.zeros((), dtype))
    kl = term.sum(axis=-1)
    if mask_BxT is not None:
        kl = jnp.where(mask_BxT.astype(bool), kl, jnp.zeros((), dtype))
    return kl


# ------------------------------------------------------------------------------------------ aggregation
class Normalizer(NamedTuple):
    """The denominators of one update, counted over all of its micro-batches."""
    rows: Array  # rows with at least one loss token (a masked-out row is not a row of the update)
    tokens: Array  # loss tokens
    pg_tokens: Array  # loss tokens that keep the policy gradient (entropy_top_frac's selection; = tokens)
    batch_tokens: Array  # dapo / cispo: the generation batch's loss tokens (num_batch_tokens), else = tokens


def normalizer(mask_BxT: Array, num_batch_tokens: Array | int | None = None,
               selected_BxT: Array | None = None) -> Normalizer:
    """The `Normalizer` of an update whose loss mask is `mask_BxT` (all its micro-batches' rows)."""
    m = mask_BxT.astype(bool)
    f = jnp.float32
    tokens = m.sum().astype(f)
    pg = tokens if selected_BxT is None else (m & selected_BxT.astype(bool)).sum().astype(f)
    batch = tokens if num_batch_tokens is None else jnp.asarray(num_batch_tokens, f)
    return Normalizer(m.any(axis=-1).sum().astype(f), tokens, pg, batch)


def aggregate(
    per_token_BxT: Array,
    mask_BxT: Array,
    loss_type: str = "grpo",
    num_batch_tokens: Array | int | None = None,
    max_completion_length: int | None = None,
    norm: Normalizer | None = None,
) -> Array:
    """Reduce a per-token loss to a scalar with ``loss_type``'s normaliser (module docstring).

    ``norm``: the update's denominators (None: this batch is the whole update). ``num_batch_tokens``
    (dapo, cispo; used when ``norm`` is None): completion tokens of the whole generation batch; None -> this
    batch's count. ``max_completion_length`` (dr_grpo): None -> ``T``.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type={loss_type!r}; expected one of {LOSS_TYPES}")
    m = mask_BxT.astype(bool)
    dtype = _ftype(per_token_BxT)
    if norm is None:
        norm = normalizer(m, num_batch_tokens)
    one = jnp.ones((), dtype)
    # where (not multiply) so garbage (nan / inf) on padding cannot leak into the sum.
    ml = jnp.where(m, per_token_BxT.astype(dtype), jnp.zeros((), dtype))
    T = mask_BxT.shape[-1]
    if loss_type == "grpo":
        per_seq_B = ml.sum(-1) / jnp.maximum(m.sum(-1).astype(dtype), one)
        return per_seq_B.sum() / jnp.maximum(norm.rows.astype(dtype), one)
    if loss_type == "bnpo":
        return ml.sum() / jnp.maximum(norm.tokens.astype(dtype), one)
    if loss_type == "dr_grpo":
        t_max = T if max_completion_length is None else max_completion_length
        if t_max < T:
            raise ValueError(f"rollout.max_new_tokens={t_max} (dr_grpo's T_max) is smaller than the mask's T={T}")
        return ml.sum() / (jnp.maximum(norm.rows.astype(dtype), one) * t_max)
    return ml.sum() / jnp.maximum(norm.batch_tokens.astype(dtype), one)  # dapo, cispo


# ------------------------------------------------------------------------------------------ corrections
def sampler_weight(old_BxT: Array, sampler_BxT: Array, mf_BxT: Array, level: str = "token") -> Array:
    """The sampler/trainer importance weight of each token, BxT: exp(old_t - sampler_t) ("token"), or one
    value per sequence broadcast over its tokens, exp(sum_t m_t (old_t - sampler_t)) ("sequence") or
    exp of the mean ("geometric")."""
    d = (old_BxT - sampler_BxT) * mf_BxT
    if level == "token":
        return jnp.exp(d)
    s_B = d.sum(-1)
    if level == "geometric":
        s_B = s_B / jnp.maximum(mf_BxT.sum(-1), 1.0)
    return jnp.broadcast_to(jnp.exp(s_B)[:, None], d.shape)


def _masked_mean(x_BxT: Array, mf_BxT: Array) -> Array:
    return jax.lax.stop_gradient((x_BxT * mf_BxT).sum() / jnp.maximum(mf_BxT.sum(), 1.0))


def sampler_correction(old_BxT: Array, sampler_BxT: Array, lp_BxT: Array, adv_Bx1: Array, mf_BxT: Array,
                       cfg: LossConfig) -> tuple[Array, dict[str, Array]]:
    """The weight of each token's policy-gradient term against the sampler that drew it (stop-gradient), BxT:
    TIS min(w, cap), MIS w inside [lo, hi], RS 1 inside [lo, hi] (0 outside both), times OPSM's sequence mask
    (0 for a sequence with A < 0 whose mean_t (sampler_t - lp_t) > opsm_threshold). And its metrics, among them
    `mismatch_kl`, the k3 estimate of KL(sampler || trainer) on the sampler's draws: E_s[exp(d) - d - 1],
    d = old - sampler."""
    dtype = mf_BxT.dtype
    w_raw = sampler_weight(old_BxT, sampler_BxT, mf_BxT, cfg.mismatch_level)
    d = old_BxT - sampler_BxT
    metrics = {"mismatch_kl": _masked_mean(jnp.expm1(d) - d, mf_BxT)}
    weight = jnp.ones_like(w_raw)
    if cfg.tis_cap is not None:
        weight = jnp.minimum(w_raw, cfg.tis_cap)
        metrics["tis_capped"] = _masked_mean((w_raw > cfg.tis_cap).astype(dtype), mf_BxT)
    elif cfg.mis_bounds is not None:
        weight = w_raw
    bounds, name = (cfg.mis_bounds, "mis_masked") if cfg.mis_bounds is not None else (cfg.rs_bounds, "rs_masked")
    if bounds is not None:
        inside = (w_raw >= bounds[0]) & (w_raw <= bounds[1])
        weight = jnp.where(inside, weight, 0.0)
        metrics[name] = _masked_mean((~inside).astype(dtype), mf_BxT)
    if cfg.opsm_threshold is not None:
        n_B = jnp.maximum(mf_BxT.sum(-1), 1.0)
        seq_kl_B = ((sampler_BxT - jax.lax.stop_gradient(lp_BxT)) * mf_BxT).sum(-1) / n_B
        keep_B = (adv_Bx1[:, 0] >= 0) | (seq_kl_B <= cfg.opsm_threshold)
        weight = weight * keep_B[:, None].astype(dtype)
        metrics["opsm_masked"] = _masked_mean(jnp.broadcast_to(~keep_B[:, None], mf_BxT.shape).astype(dtype),
                                              mf_BxT)
    if cfg.corrects_sampler:
        metrics["is_weight_mean"] = _masked_mean(weight, mf_BxT)
    return jax.lax.stop_gradient(weight), metrics


def top_entropy_tokens(entropy_BxT: Array, mask_BxT: Array, frac: float) -> Array:
    """BxT bool: the completion tokens whose entropy is among the top `frac` of this batch's completion
    tokens (k = ceil(frac * n) of n; ties at the threshold are all kept)."""
    m = mask_BxT.astype(bool)
    flat = jnp.where(m, entropy_BxT, -jnp.inf).reshape(-1)
    n = m.sum()
    k = jnp.maximum(jnp.ceil(frac * n).astype(jnp.int32), 1)
    threshold = jnp.sort(flat)[::-1][jnp.minimum(k, flat.size) - 1]
    return m & (entropy_BxT >= threshold)


def clip_metrics(ratio_BxT: Array, adv_Bx1: Array, mf_BxT: Array, cfg: LossConfig) -> dict[str, Array]:
    """The clip's bookkeeping: mean ratio, and the token fractions clipped below (r < 1 - eps_low, A < 0), above
    (r > 1 + eps_high, A > 0; cispo: its weight capped, r > eps_high, A > 0, as TRL counts it), in either, and
    capped by delta."""
    dtype = mf_BxT.dtype
    r, a = jax.lax.stop_gradient(ratio_BxT), jax.lax.stop_gradient(adv_Bx1)
    cispo = cfg.loss_type == "cispo"
    low = jnp.zeros(r.shape, bool) if cispo else (r < 1.0 - cfg.eps_low) & (a < 0)
    high = (r > (cfg.eps_high if cispo else 1.0 + cfg.eps_high)) & (a > 0)
    out = dict(ratio_mean=_masked_mean(r, mf_BxT), clip_low=_masked_mean(low.astype(dtype), mf_BxT),
               clip_high=_masked_mean(high.astype(dtype), mf_BxT),
               clip_region=_masked_mean((low | high).astype(dtype), mf_BxT))
    if cfg.delta is not None:
        out["delta_capped"] = _masked_mean((r > cfg.delta).astype(dtype), mf_BxT)
    return out


def _surrogate(lp: Array, ratio: Array, adv_Bx1: Array, cfg: LossConfig) -> Array:
    """pg_t before the sampler correction: PPO's clipped surrogate, or CISPO's -sg(min(r, eps_high)) A lp."""
    if cfg.loss_type == "cispo":
        return -jax.lax.stop_gradient(jnp.minimum(ratio, cfg.eps_high)) * adv_Bx1 * lp
    ratio_clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    ratio_unclipped = ratio if cfg.delta is None else jnp.minimum(ratio, cfg.delta)
    return -jnp.minimum(ratio_unclipped * adv_Bx1, ratio_clipped * adv_Bx1)


def policy_loss(
    logp_BxT: Array,
    old_logp_BxT: Array | None,
    ref_logp_BxT: Array | None,
    log_q_BxT: Array | None,
    adv_B: Array,
    mask_BxT: Array,
    cfg: LossConfig = LossConfig(),
    num_batch_tokens: Array | int | None = None,
    forward_kl_BxT: Array | None = None,
    sampler_logp_BxT: Array | None = None,
    entropy_BxT: Array | None = None,
    norm: Normalizer | None = None,
    selected_BxT: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """SAGE / GRPO-family loss ``aggregate(w pg + beta kl) - entropy_coef H`` and its metrics.

    ``old_logp_BxT=None``: on-policy (old = stop_gradient(logp), ratio 1 with the right
    gradient). ``ref_logp_BxT`` / ``log_q_BxT`` are unused when ``beta == 0`` (pass None);
    ``log_q_BxT=None`` means q = 1. ``forward_kl_BxT`` is required by ``kl_mode="forward"``.
    ``sampler_logp_BxT`` (required by the sampler corrections and OPSM): the sampler's log-prob of each token
    before top-k / top-p / min-p (temperature-scaled, what the trainer's forward computes; vLLM's raw log-probs
    at temperature 1), so the weight measures sampler/trainer numerics only and never the filters' kept mass.
    As TRL, the weight multiplies the policy-gradient term only; beta kl is added unweighted.

    ``entropy_BxT`` (required by ``entropy_top_frac < 1`` and ``entropy_coef > 0``): the policy's per-token
    entropy; differentiated by the bonus, a constant for the selection. ``selected_BxT``: the tokens that keep
    the policy gradient when chosen over a larger set than this batch (the update); None = chosen here.
    ``norm``: the update's denominators (`normalizer`), when this batch is one of its micro-batches.

    Metrics (means over the batch's loss tokens): ``loss``, ``pg_loss``, ``kl_loss`` (= aggregated beta kl),
    ``entropy_loss`` (= -entropy_coef x the mean entropy, with the bonus), so loss = pg_loss + kl_loss +
    entropy_loss; ``kl``, the clip metrics (`clip_metrics`) and the sampler correction's
    (`sampler_correction`). KL entries only when beta > 0.
    """
    dtype = _ftype(logp_BxT)
    m = mask_BxT.astype(bool)
    mf, zero = m.astype(dtype), jnp.zeros((), dtype)
    masked = lambda x: jnp.where(m, x.astype(dtype), zero)  # where: padding garbage gets exactly zero gradient
    lp = masked(logp_BxT)
    old = jax.lax.stop_gradient(lp if old_logp_BxT is None else masked(old_logp_BxT))
    log_q = None if log_q_BxT is None else jax.lax.stop_gradient(masked(log_q_BxT))
    adv_Bx1, log_q, metrics = _advantage(adv_B, log_q, dtype, cfg)
    ratio = _ratio(lp, old, mf, cfg)
    pg = _surrogate(lp, ratio, adv_Bx1, cfg)
    if cfg.corrects_sampler or cfg.opsm_threshold is not None:
        if sampler_logp_BxT is None:
            raise ValueError("rl.tis_cap / mis_bounds / rs_bounds / opsm_threshold need sampler_logp_BxT (got None)")
        weight, corr = sampler_correction(old, jax.lax.stop_gradient(masked(sampler_logp_BxT)), lp, adv_Bx1, mf, cfg)
        pg = pg * weight
        metrics.update(corr)
    if (cfg.entropy_top_frac < 1 or cfg.entropy_coef > 0) and entropy_BxT is None:
        raise ValueError("rl.entropy_top_frac < 1 and rl.entropy_coef > 0 need entropy_BxT (got None)")
    selected = m
    if cfg.entropy_top_frac < 1:
        selected = m & (selected_BxT.astype(bool) if selected_BxT is not None else
                        top_entropy_tokens(jax.lax.stop_gradient(masked(entropy_BxT)), m, cfg.entropy_top_frac))
        pg = jnp.where(selected, pg, zero)
        metrics["pg_token_frac"] = _masked_mean(selected.astype(dtype), mf)
    norm = normalizer(m, num_batch_tokens, selected) if norm is None else norm
    agg = lambda x: aggregate(x, m, cfg.loss_type, max_completion_length=cfg.max_completion_length, norm=norm)
    pg_loss = loss = agg(pg)
    if cfg.beta > 0:
        kl = _kl(lp, masked, ref_logp_BxT, log_q, forward_kl_BxT, cfg)
        kl_loss = agg(cfg.beta * kl)
        loss = loss + kl_loss
        metrics.update(kl=_masked_mean(kl, mf), kl_loss=jax.lax.stop_gradient(kl_loss))
    if cfg.entropy_coef > 0:
        # the mean entropy of the tokens that keep the policy gradient (TRL: of its effective mask): over the
        # update's such tokens, or the generation batch's tokens for dapo / cispo
        denom = norm.batch_tokens if cfg.loss_type in TOKEN_SUM_TYPES else norm.pg_tokens
        ent_mean = jnp.where(selected, entropy_BxT.astype(dtype), zero).sum() / jnp.maximum(denom.astype(dtype), 1.0)
        entropy_loss = -cfg.entropy_coef * ent_mean
        loss = loss + entropy_loss
        metrics["entropy_loss"] = jax.lax.stop_gradient(entropy_loss)
    metrics.update(loss=jax.lax.stop_gradient(loss), pg_loss=jax.lax.stop_gradient(pg_loss),
                   **clip_metrics(ratio, adv_Bx1, mf, cfg))
    return loss, metrics


def _advantage(adv_B, log_q, dtype, cfg: LossConfig):
    """(A_Bx1, log q for the KL term, metrics): the objective-level SAGE form moves beta sum_t log q_t into the
    advantage as a reward bonus, and the KL term is then against pi_ref alone."""
    adv_Bx1 = jax.lax.stop_gradient(adv_B.astype(dtype))[:, None]
    if cfg.sage_form == "reward" and log_q is not None and cfg.beta > 0:
        bonus_B = cfg.beta * log_q.sum(-1)
        return adv_Bx1 + bonus_B[:, None], None, {"sage_bonus": jax.lax.stop_gradient(bonus_B.mean())}
    return adv_Bx1, log_q, {}


def _ratio(lp, old, mf, cfg: LossConfig):
    """r_t = exp(lp_t - old_t), or GSPO's one ratio per sequence, the geometric mean of its token ratios."""
    log_ratio = lp - old
    if cfg.importance_sampling_level == "sequence":
        log_ratio_B = (log_ratio * mf).sum(-1) / jnp.maximum(mf.sum(-1), 1.0)
        log_ratio = jnp.broadcast_to(log_ratio_B[:, None], lp.shape)
    return jnp.exp(log_ratio)


def _kl(lp, masked, ref_logp_BxT, log_q, forward_kl_BxT, cfg: LossConfig):
    """kl_t: the estimator against the (shaped) anchor, or the exact forward KL the caller computed."""
    if cfg.kl_mode == "reverse":
        if ref_logp_BxT is None:
            raise ValueError(f"rl.beta={cfg.beta} > 0 needs ref_logp_BxT (got None)")
        return per_token_kl(lp, jax.lax.stop_gradient(masked(ref_logp_BxT)), log_q, cfg.estimator)
    if forward_kl_BxT is None:
        raise ValueError("rl.kl_mode='forward' needs forward_kl_BxT (got None)")
    return masked(forward_kl_BxT)
