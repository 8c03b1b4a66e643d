"""Independent float64 NumPy references of the policy loss (docs/design.md §2), written as explicit loops, and
the random tensors the loss tests feed them: shared by tests/test_losses.py and tests/test_loss_corrections.py."""

import jax.numpy as jnp
import numpy as np


def np_kl(lp, ref, logq, est):
    d = ref + logq - lp
    return {"k3": np.exp(d) - d - 1, "k1": -d, "k2": d * d / 2}[est]


def np_dkl_dlp(lp, ref, logq, est):
    d = ref + logq - lp
    return {"k3": 1 - np.exp(d), "k1": 1.0, "k2": -d}[est]


def np_weights(m, loss_type, n_batch=None, tmax=None):
    """Aggregation weight of each real token: loss = sum_bt w_bt l_bt. A row without loss tokens is not a row
    of the batch (grpo's mean over sequences and dr_grpo's B count the kept rows only)."""
    B, T = m.shape
    kept_rows = max(sum(1 for b in range(B) if m[b].any()), 1)
    w = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if not m[b, t]:
                continue
            if loss_type == "grpo":
                w[b, t] = 1.0 / (m[b].sum() * kept_rows)
            elif loss_type == "bnpo":
                w[b, t] = 1.0 / max(m.sum(), 1)
            elif loss_type == "dr_grpo":
                w[b, t] = 1.0 / (kept_rows * (T if tmax is None else tmax))
            else:  # dapo, cispo: the generation batch's tokens
                w[b, t] = 1.0 / max(m.sum() if n_batch is None else n_batch, 1)
    return w


def np_sampler_ratio(old, sampler, m, b, t, level):
    """The sampler/trainer importance ratio pi_old / pi_sampler of token (b, t): of the token itself, of its
    whole sequence (the product of the token ratios, TRL's sequence modes), or its geometric mean (verl)."""
    idx = [u for u in range(m.shape[1]) if m[b, u]]
    log_r = {"token": old[b, t] - sampler[b, t],
             "sequence": sum(old[b, u] - sampler[b, u] for u in idx),
             "geometric": sum(old[b, u] - sampler[b, u] for u in idx) / max(len(idx), 1)}[level]
    return float(np.exp(log_r))


def np_correction(cfg, ratio, seq_kl, adv):
    """The weight of a token's policy-gradient term, from the published definitions:
    TRL token_truncate / sequence_truncate (TIS, Yao et al.): min(ratio, cap);
    TRL token_mask / sequence_mask, verl mask mode with IS, IcePop (MIS): ratio inside [lo, hi], else 0;
    verl rollout_rs (rejection only): 1 inside [lo, hi], else 0;
    TRL off_policy_mask_threshold (OPSM, DeepSeek-V3.2 eq. 9): 0 for the whole sequence when A < 0 and its
    mean_t (log pi_sampler - log pi_theta) > threshold."""
    w = 1.0
    if cfg.tis_cap is not None:
        w = min(ratio, cfg.tis_cap)
    elif cfg.mis_bounds is not None:
        w = ratio
    bounds = cfg.mis_bounds if cfg.mis_bounds is not None else cfg.rs_bounds
    if bounds is not None and not bounds[0] <= ratio <= bounds[1]:
        w = 0.0
    if cfg.opsm_threshold is not None and adv < 0 and seq_kl > cfg.opsm_threshold:
        w = 0.0
    return w


def np_selected(ent, m, frac):
    """Top `frac` of the real tokens by entropy: k = ceil(frac n), ties at the k-th value kept."""
    if frac >= 1:
        return m.astype(bool)
    vals = sorted((ent[b, t] for b in range(m.shape[0]) for t in range(m.shape[1]) if m[b, t]), reverse=True)
    k = max(int(np.ceil(frac * len(vals))), 1)
    return m.astype(bool) & (ent >= vals[k - 1])


def np_policy_loss(lp, old, ref, logq, adv, m, cfg, n_batch=None, sampler=None, ent=None):
    """Loss, metrics and d loss / d lp, with explicit loops and branch bookkeeping."""
    B, T = lp.shape
    el, eh, delta = cfg.eps_low, cfg.eps_high, cfg.delta
    w = np_weights(m, cfg.loss_type, n_batch, cfg.max_completion_length)
    loss = pg_loss = kl_loss = 0.0
    grad = np.zeros((B, T))
    n_tok = max(m.sum(), 1)
    kl_sum = ratio_sum = low = high = corr_sum = tis_capped = band_out = mismatch = opsm = 0.0
    correcting = cfg.tis_cap is not None or cfg.mis_bounds is not None or cfg.rs_bounds is not None
    with_sampler = correcting or cfg.opsm_threshold is not None
    selected = np_selected(ent, m, cfg.entropy_top_frac) if cfg.entropy_top_frac < 1 else m.astype(bool)
    for b in range(B):
        idx = [t for t in range(T) if m[b, t]]
        n = max(len(idx), 1)
        A = adv[b]
        seq_lr = sum(lp[b, t] - old[b, t] for t in idx) / n
        seq_kl = sum(sampler[b, t] - lp[b, t] for t in idx) / n if with_sampler else 0.0
        for t in idx:
            lr = seq_lr if cfg.importance_sampling_level == "sequence" else lp[b, t] - old[b, t]
            r = np.exp(lr)
            if cfg.loss_type == "cispo":  # TRL: -clamp(r, max=epsilon_high).detach() * A * logp
                pg = -min(r, eh) * A * lp[b, t]
                dpg_dlp_own, dpg_dlr = -min(r, eh) * A, 0.0
            else:
                r1 = r if delta is None else min(r, delta)
                r2 = min(max(r, 1 - el), 1 + eh)
                dpg_dlp_own = 0.0
                if r1 * A <= r2 * A:
                    pg = -r1 * A
                    dpg_dlr = -A * r * (1.0 if (delta is None or r < delta) else 0.0)
                else:
                    pg = -r2 * A
                    dpg_dlr = -A * r * (1.0 if (1 - el < r < 1 + eh) else 0.0)
            if with_sampler:
                d = old[b, t] - sampler[b, t]  # log (pi_trainer / pi_sampler) of a token the sampler drew
                mismatch += np.exp(d) - 1 - d  # k3 (Schulman): unbiased for KL(sampler || trainer)
                ratio_s = np_sampler_ratio(old, sampler, m, b, t, cfg.mismatch_level)
                corr = np_correction(cfg, ratio_s, seq_kl, A)
                corr_sum += corr
                if cfg.tis_cap is not None:
                    tis_capped += float(ratio_s > cfg.tis_cap)
                bounds = cfg.mis_bounds if cfg.mis_bounds is not None else cfg.rs_bounds
                if bounds is not None:
                    band_out += float(not bounds[0] <= ratio_s <= bounds[1])
                if cfg.opsm_threshold is not None:
                    opsm += float(A < 0 and seq_kl > cfg.opsm_threshold)
                pg, dpg_dlr, dpg_dlp_own = pg * corr, dpg_dlr * corr, dpg_dlp_own * corr
            if not selected[b, t]:
                pg, dpg_dlr, dpg_dlp_own = 0.0, 0.0, 0.0
            kl = np_kl(lp[b, t], ref[b, t], logq[b, t], cfg.estimator) if cfg.beta else 0.0
            loss += w[b, t] * (pg + cfg.beta * kl)
            pg_loss += w[b, t] * pg
            kl_loss += w[b, t] * cfg.beta * kl
            kl_sum += kl
            ratio_sum += r
            if cfg.loss_type == "cispo":  # TRL's cispo_clip_ratio: the weight capped, on positive advantages
                high += float(r > eh and A > 0)
            else:
                low += float(r < 1 - el and A < 0)
                high += float(r > 1 + eh and A > 0)
            grad[b, t] += w[b, t] * dpg_dlp_own
            if cfg.beta:
                grad[b, t] += w[b, t] * cfg.beta * np_dkl_dlp(lp[b, t], ref[b, t], logq[b, t],
                                                              cfg.estimator)
            if cfg.importance_sampling_level == "sequence":
                # pg_bt depends on every lp of the row through the mean log-ratio.
                for t2 in idx:
                    grad[b, t2] += w[b, t] * dpg_dlr / n
            else:
                grad[b, t] += w[b, t] * dpg_dlr
    metrics = dict(pg_loss=pg_loss, ratio_mean=ratio_sum / n_tok,
                   clip_low=low / n_tok, clip_high=high / n_tok,
                   clip_region=(low + high) / n_tok)
    if cfg.beta:
        metrics.update(kl=kl_sum / n_tok, kl_loss=kl_loss)
    if with_sampler:
        metrics.update(mismatch_kl=mismatch / n_tok)
    if correcting:
        metrics.update(is_weight_mean=corr_sum / n_tok)
    if cfg.tis_cap is not None:
        metrics.update(tis_capped=tis_capped / n_tok)
    if cfg.mis_bounds is not None:
        metrics.update(mis_masked=band_out / n_tok)
    if cfg.rs_bounds is not None:
        metrics.update(rs_masked=band_out / n_tok)
    if cfg.opsm_threshold is not None:
        metrics.update(opsm_masked=opsm / n_tok)
    if cfg.entropy_top_frac < 1:
        metrics.update(pg_token_frac=(selected & m.astype(bool)).sum() / n_tok)
    if cfg.entropy_coef > 0:  # TRL: the mean entropy of the effective mask (dapo / cispo: per batch token)
        sel = selected & m.astype(bool)
        denom = (m.sum() if n_batch is None else n_batch) if cfg.loss_type in ("dapo", "cispo") else sel.sum()
        ent_loss = -cfg.entropy_coef * sum(ent[b, t] for b in range(B) for t in range(T) if sel[b, t]) / max(denom, 1)
        loss += ent_loss
        metrics.update(entropy_loss=ent_loss)
    metrics["loss"] = loss
    return loss, metrics, grad


def make_tensors(seed=0, B=7, T=13, garbage=True):
    rng = np.random.default_rng(seed)
    lp = -rng.gamma(2.0, 0.7, size=(B, T))
    old = lp + rng.normal(0, 0.3, size=(B, T))
    ref = lp + rng.normal(0, 0.5, size=(B, T))
    logq = np.log(rng.uniform(0.6, 1.4, size=(B, T)))
    adv = rng.normal(0, 1, size=B)
    lens = rng.integers(1, T + 1, size=B)
    lens[0] = 0  # all-masked row
    lens[1] = T
    m = np.arange(T)[None, :] < lens[:, None]
    clean = dict(lp=lp, old=old, ref=ref, logq=logq, adv=adv, m=m)
    dirty = {k: v.copy() for k, v in clean.items()}
    if garbage:
        for k, val in (("lp", np.nan), ("old", np.inf), ("ref", -np.inf), ("logq", np.nan)):
            dirty[k][~m] = val
    return clean, {k: jnp.asarray(v) for k, v in dirty.items()}
