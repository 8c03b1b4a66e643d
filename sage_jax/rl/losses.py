"""Policy surrogate, KL estimators against SAGE's shaped anchor, and loss aggregation.

Dimension key: ``B`` batch (completions), ``G`` group size, ``T`` completion length,
``V`` vocab. ``m_t`` = 1 on real completion tokens, 0 on padding and after EOS.

Per token (docs/design.md §2)::

    lp_t  = log pi_theta(y_t | .)            differentiated
    old_t = same under the sampling policy    stop-gradient (None -> lp_t, one update per rollout)
    ref_t = same under pi_ref                 stop-gradient
    a_t   = ref_t + log q_t                   shaped anchor, q a constant for the gradient
    d_t   = a_t - lp_t
    kl_t  = exp(d_t) - d_t - 1  (k3, default) | -d_t  (k1) | d_t^2 / 2  (k2)
    r_t   = exp(lp_t - old_t)                                          (token level)
          | exp(sum_t m_t (lp_t - old_t) / sum_t m_t)                   (sequence level, GSPO)
    pg_t  = -min(min(r_t, delta) A_i, clip(r_t, 1 - eps_low, 1 + eps_high) A_i)
    l_t   = pg_t + beta kl_t                 (beta = 0: no KL term, no reference needed)

The optional ``delta`` cap (two-sided clipping) caps only the unclipped branch, as in TRL; with
``delta >= 1 + eps_high`` (enforced) this equals ``r_t <- min(r_t, delta)`` applied before the
clip. Aggregation (``loss_type``)::

    grpo:    mean_i [ sum_t m l / max(1, sum_t m) ]
    bnpo:    sum m l / max(1, sum m)                       over this micro-batch
    dr_grpo: sum m l / (B * T_max)                          T_max = max completion length
    dapo:    sum m l / N_gen                                N_gen = completion tokens in the whole
                                                            generation batch (``num_batch_tokens``)

With ``dapo`` the micro-batch losses *sum* to the full-batch loss, so accumulate micro-batch
gradients by summation (if your accumulator averages over M micro-batches, pass
``num_batch_tokens = N_gen / M``).

Objective-level SAGE (``sage_form="reward"``): ``KL(pi || q pi_ref) = KL(pi || pi_ref) - E[sum_t log q_t]``,
so ``a_t = ref_t`` in the KL term and ``A_i <- A_i + beta sum_t m_t log q_t`` (the reward bonus, q a constant).
In expectation over y ~ pi the code-level form's gradient is ``-beta sum_y q_y pi_ref(y) grad log pi(y)`` per
position (k3), the reward form's ``-beta sum_y (pi_ref(y) + pi(y) log q_y) grad log pi(y)``
(tests/test_losses.py enumerates both exactly).

Forward-KL baseline (``kl_mode="forward"``): ``kl_t = sum_v pi_ref(v) (log pi_ref(v) -
log pi_theta(v))`` exact per position, from ``forward_kl_from_logits`` which the caller applies
per sequence chunk (never the full [B, T, V] float32 logits) and passes in as ``forward_kl_BxT``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array

ESTIMATORS = ("k1", "k2", "k3")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
KL_MODES = ("reverse", "forward")
IS_LEVELS = ("token", "sequence")
MISMATCH_LEVELS = ("token", "sequence", "geometric")
SAGE_FORMS = ("loss", "reward")


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Static loss configuration (frozen, hashable: usable as a static jit argument)."""

    loss_type: str = "grpo"  # aggregation: grpo | bnpo | dr_grpo | dapo
    beta: float = 0.04  # KL coefficient (dimensionless, per token); 0 disables the KL term
    estimator: str = "k3"  # reverse-KL estimator against the shaped anchor: k1 | k2 | k3
    kl_mode: str = "reverse"  # reverse (shaped anchor, estimator) | forward (exact, to pi_ref)
    eps_low: float = 0.2  # PPO clip below: ratio >= 1 - eps_low (dimensionless)
    eps_high: float = 0.2  # PPO clip above: ratio <= 1 + eps_high (DAPO clip-higher: 0.28)
    delta: float | None = None  # cap on the unclipped ratio (two-sided clip); >= 1 + eps_high
    importance_sampling_level: str = "token"  # token | sequence (GSPO geometric mean)
    max_completion_length: int | None = None  # T_max of dr_grpo, tokens; None -> the T axis
    # Truncated importance sampling against the sampler (TRL's vllm_importance_sampling_correction, token
    # level): the policy-gradient term of each token is weighted by min(exp(old - sampler), tis_cap). None = off.
    tis_cap: float | None = None
    # Masked importance sampling against the sampler (verl's rollout_is with mask mode): the policy-gradient
    # term of a token (or of every token of a sequence) whose sampler weight leaves [lo, hi] is dropped.
    mis_bounds: tuple[float, float] | None = None
    # The sampler weight of TIS and MIS: per token exp(old_t - sampler_t) | per sequence exp(sum_t ...)
    # (the product of the token weights) | geometric exp(mean_t ...).
    mismatch_level: str = "token"
    # High-entropy forking tokens (Wang et al. 2025, "Beyond the 80/20 rule"): only the top fraction of the
    # micro-batch's completion tokens by policy entropy get the policy gradient (the KL term keeps all).
    # 1.0 = every token (off).
    entropy_top_frac: float = 1.0
    # Where SAGE's guide enters (reverse KL only): "loss", the code-level form (k3 against ref + log q), or
    # "reward", the objective-level form KL(pi || q pi_ref) = KL(pi || pi_ref) - E[sum_t log q_t]: the KL
    # against pi_ref alone plus a sequence reward bonus beta sum_t log q_t added to the advantage (no baseline).
    sage_form: str = "loss"

    def __post_init__(self) -> None:
        def choice(field: str, choices: tuple) -> None:
            v = getattr(self, field)
            if v not in choices:
                raise ValueError(f"LossConfig.{field}={v!r} is not one of {choices}")

        choice("loss_type", LOSS_TYPES)
        choice("estimator", ESTIMATORS)
        choice("kl_mode", KL_MODES)
        choice("importance_sampling_level", IS_LEVELS)
        if self.beta < 0:
            raise ValueError(f"LossConfig.beta must be >= 0, got {self.beta}")
        if not 0 <= self.eps_low < 1:
            raise ValueError(f"LossConfig.eps_low must be in [0, 1), got {self.eps_low}")
        if self.eps_high < 0:
            raise ValueError(f"LossConfig.eps_high must be >= 0, got {self.eps_high}")
        if self.delta is not None and self.delta < 1 + self.eps_high:
            raise ValueError(
                f"LossConfig.delta={self.delta} must be >= 1 + eps_high={1 + self.eps_high} "
                "(a cap inside the clip range would defeat the PPO clip)"
            )
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"LossConfig.tis_cap must be > 0 (or None = off), got {self.tis_cap}")
        choice("mismatch_level", MISMATCH_LEVELS)
        choice("sage_form", SAGE_FORMS)
        if self.mis_bounds is not None and not (len(self.mis_bounds) == 2
                                                and 0 <= self.mis_bounds[0] < 1 < self.mis_bounds[1]):
            raise ValueError(f"LossConfig.mis_bounds={self.mis_bounds} must be (lo, hi) with 0 <= lo < 1 < hi")
        if not 0 < self.entropy_top_frac <= 1:
            raise ValueError(f"LossConfig.entropy_top_frac={self.entropy_top_frac} must be in (0, 1]")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(
                f"LossConfig.max_completion_length must be >= 1, got {self.max_completion_length}"
            )


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


def aggregate(
    per_token_BxT: Array,
    mask_BxT: Array,
    loss_type: str = "grpo",
    num_batch_tokens: Array | int | None = None,
    max_completion_length: int | None = None,
) -> Array:
    """Reduce a per-token loss to a scalar with ``loss_type``'s normaliser (module docstring).

    ``num_batch_tokens`` (dapo): completion tokens of the whole generation batch; None -> this
    micro-batch's count. ``max_completion_length`` (dr_grpo): None -> ``T``.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type={loss_type!r}; expected one of {LOSS_TYPES}")
    m = mask_BxT.astype(bool)
    dtype = _ftype(per_token_BxT)
    mf = m.astype(dtype)
    # where (not multiply) so garbage (nan / inf) on padding cannot leak into the sum.
    ml = jnp.where(m, per_token_BxT.astype(dtype), jnp.zeros((), dtype))
    B, T = mask_BxT.shape
    if loss_type == "grpo":
        per_seq_B = ml.sum(-1) / jnp.maximum(mf.sum(-1), 1.0)
        return per_seq_B.mean()
    if loss_type == "bnpo":
        return ml.sum() / jnp.maximum(mf.sum(), 1.0)
    if loss_type == "dr_grpo":
        t_max = T if max_completion_length is None else max_completion_length
        if t_max < T:
            raise ValueError(
                f"LossConfig.max_completion_length={t_max} is smaller than the mask's T={T}"
            )
        return ml.sum() / (B * t_max)
    # dapo
    n = mf.sum() if num_batch_tokens is None else jnp.asarray(num_batch_tokens, dtype)
    return ml.sum() / jnp.maximum(n, 1.0)


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


def top_entropy_tokens(entropy_BxT: Array, mask_BxT: Array, frac: float) -> Array:
    """BxT bool: the completion tokens whose entropy is among the top `frac` of this batch's completion
    tokens (k = ceil(frac * n) of n; ties at the threshold are all kept)."""
    m = mask_BxT.astype(bool)
    flat = jnp.where(m, entropy_BxT, -jnp.inf).reshape(-1)
    n = m.sum()
    k = jnp.maximum(jnp.ceil(frac * n).astype(jnp.int32), 1)
    threshold = jnp.sort(flat)[::-1][jnp.minimum(k, flat.size) - 1]
    return m & (entropy_BxT >= threshold)


def _masked_mean(x_BxT: Array, mf_BxT: Array) -> Array:
    return jax.lax.stop_gradient((x_BxT * mf_BxT).sum() / jnp.maximum(mf_BxT.sum(), 1.0))


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
) -> tuple[Array, dict[str, Array]]:
    """SAGE / GRPO-family loss ``aggregate(pg + beta kl)`` and its metrics.

    ``old_logp_BxT=None``: on-policy (old = stop_gradient(logp), ratio 1 with the right
    gradient). ``ref_logp_BxT`` / ``log_q_BxT`` are unused when ``beta == 0`` (pass None);
    ``log_q_BxT=None`` means q = 1. ``forward_kl_BxT`` is required by ``kl_mode="forward"``.
    ``sampler_logp_BxT`` (required by ``tis_cap``): the sampler's log-prob of each token before top-k /
    top-p / min-p (temperature-scaled, what the trainer's forward computes; vLLM's raw log-probs at
    temperature 1), so the weight min(exp(old - sampler), cap) measures sampler/trainer numerics only and
    never the filters' kept mass. TRL 0.23 multiplies the clipped policy-gradient term by it, then adds
    beta kl unweighted; so does this.

    ``mis_bounds`` masks the policy-gradient term where that weight (per ``mismatch_level``) leaves
    [lo, hi]; both log ``mismatch_kl``. ``entropy_BxT`` (required by ``entropy_top_frac < 1``): the
    policy's per-token entropy, which picks the tokens that keep their policy gradient.

    Metrics (means over the micro-batch's completion tokens): ``loss``, ``pg_loss``,
    ``kl_loss`` (= aggregated beta kl, so loss = pg_loss + kl_loss), ``kl``, ``ratio_mean``,
    ``clip_low`` (r < 1 - eps_low and A < 0), ``clip_high`` (r > 1 + eps_high and A > 0),
    ``clip_region`` (either), ``delta_capped`` (r > delta, only with delta). KL entries only
    when beta > 0.
    """
    dtype = _ftype(logp_BxT)
    m = mask_BxT.astype(bool)
    mf = m.astype(dtype)
    zero = jnp.zeros((), dtype)
    # Zero padded inputs with where so padding garbage gets exactly zero (and finite) gradient.
    lp = jnp.where(m, logp_BxT.astype(dtype), zero)
    if old_logp_BxT is None:
        old = jax.lax.stop_gradient(lp)
    else:
        old = jax.lax.stop_gradient(jnp.where(m, old_logp_BxT.astype(dtype), zero))
    adv_Bx1 = jax.lax.stop_gradient(adv_B.astype(dtype))[:, None]
    log_q = None
    if log_q_BxT is not None:
        log_q = jax.lax.stop_gradient(jnp.where(m, log_q_BxT.astype(dtype), zero))
    bonus_B = None
    if cfg.sage_form == "reward" and log_q is not None and cfg.beta > 0:
        bonus_B = cfg.beta * log_q.sum(-1)  # the objective's reward bonus beta sum_t log q_t
        adv_Bx1 = adv_Bx1 + bonus_B[:, None]
        log_q = None  # the KL term is then against pi_ref alone

    log_ratio = lp - old
    if cfg.importance_sampling_level == "sequence":
        # GSPO: one ratio per sequence, the geometric mean of its token ratios.
        log_ratio_B = (log_ratio * mf).sum(-1) / jnp.maximum(mf.sum(-1), 1.0)
        log_ratio = jnp.broadcast_to(log_ratio_B[:, None], lp.shape)
    ratio = jnp.exp(log_ratio)
    ratio_clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    ratio_unclipped = ratio if cfg.delta is None else jnp.minimum(ratio, cfg.delta)
    pg = -jnp.minimum(ratio_unclipped * adv_Bx1, ratio_clipped * adv_Bx1)
    metrics: dict[str, Array] = {}
    if cfg.tis_cap is not None or cfg.mis_bounds is not None:
        if sampler_logp_BxT is None:
            raise ValueError("LossConfig.tis_cap / mis_bounds need sampler_logp_BxT (got None)")
        sampler = jax.lax.stop_gradient(jnp.where(m, sampler_logp_BxT.astype(dtype), zero))
        w_raw = sampler_weight(old, sampler, mf, cfg.mismatch_level)
        d = old - sampler  # per token: the trainer's log-prob minus the sampler's
        metrics["mismatch_kl"] = _masked_mean(jnp.expm1(-d) + d, mf)  # k3 estimate of KL(sampler || trainer)
        if cfg.tis_cap is not None:
            pg = pg * jnp.minimum(w_raw, cfg.tis_cap)
            metrics["tis_weight_mean"] = _masked_mean(jnp.minimum(w_raw, cfg.tis_cap), mf)
            metrics["tis_capped"] = _masked_mean((w_raw > cfg.tis_cap).astype(dtype), mf)
        if cfg.mis_bounds is not None:
            keep = (w_raw >= cfg.mis_bounds[0]) & (w_raw <= cfg.mis_bounds[1])
            pg = jnp.where(keep, pg, zero)
            metrics["mis_masked"] = _masked_mean((~keep).astype(dtype), mf)
    if cfg.entropy_top_frac < 1:
        if entropy_BxT is None:
            raise ValueError(f"LossConfig.entropy_top_frac={cfg.entropy_top_frac} needs entropy_BxT (got None)")
        selected = top_entropy_tokens(jax.lax.stop_gradient(entropy_BxT.astype(dtype)), m, cfg.entropy_top_frac)
        pg = jnp.where(selected, pg, zero)
        metrics["pg_token_frac"] = _masked_mean(selected.astype(dtype), mf)

    agg = lambda x: aggregate(x, m, cfg.loss_type, num_batch_tokens, cfg.max_completion_length)
    pg_loss = agg(pg)

    if cfg.beta > 0:
        if cfg.kl_mode == "reverse":
            if ref_logp_BxT is None:
                raise ValueError(f"LossConfig.beta={cfg.beta} > 0 needs ref_logp_BxT (got None)")
            ref = jax.lax.stop_gradient(jnp.where(m, ref_logp_BxT.astype(dtype), zero))
            kl = per_token_kl(lp, ref, log_q, cfg.estimator)
        else:
            if forward_kl_BxT is None:
                raise ValueError("LossConfig.kl_mode='forward' needs forward_kl_BxT (got None)")
            kl = jnp.where(m, forward_kl_BxT.astype(dtype), zero)
        kl_loss = agg(cfg.beta * kl)
        loss = agg(pg + cfg.beta * kl)
        metrics["kl"] = _masked_mean(kl, mf)
        metrics["kl_loss"] = jax.lax.stop_gradient(kl_loss)
    else:
        loss = pg_loss

    r = jax.lax.stop_gradient(ratio)
    a = jax.lax.stop_gradient(adv_Bx1)
    low = (r < 1.0 - cfg.eps_low) & (a < 0)
    high = (r > 1.0 + cfg.eps_high) & (a > 0)
    metrics.update(
        loss=jax.lax.stop_gradient(loss),
        pg_loss=jax.lax.stop_gradient(pg_loss),
        ratio_mean=_masked_mean(r, mf),
        clip_low=_masked_mean(low.astype(dtype), mf),
        clip_high=_masked_mean(high.astype(dtype), mf),
        clip_region=_masked_mean((low | high).astype(dtype), mf),
    )
    if cfg.delta is not None:
        metrics["delta_capped"] = _masked_mean((r > cfg.delta).astype(dtype), mf)
    if bonus_B is not None:
        metrics["sage_bonus"] = jax.lax.stop_gradient(bonus_B.mean())
    return loss, metrics
