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
    """Aggregation weight of each real token: loss = sum_bt w_bt l_bt."""
    B, T = m.shape
    w = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if not m[b, t]:
                continue
            if loss_type == "grpo":
                w[b, t] = 1.0 / (max(m[b].sum(), 1) * B)
            elif loss_type == "bnpo":
                w[b, t] = 1.0 / max(m.sum(), 1)
            elif loss_type == "dr_grpo":
                w[b, t] = 1.0 / (B * (T if tmax is None else tmax))
            else:
                w[b, t] = 1.0 / max(m.sum() if n_batch is None else n_batch, 1)
    return w


def np_sampler_weights(old, sampler, m, level):
    """The sampler weight of each real token: its own, or its sequence's product / geometric mean."""
    B, T = old.shape
    ws = np.zeros((B, T))
    for b in range(B):
        idx = [t for t in range(T) if m[b, t]]
        total = sum(old[b, t] - sampler[b, t] for t in idx)
        for t in idx:
            ws[b, t] = np.exp({"token": old[b, t] - sampler[b, t], "sequence": total,
                               "geometric": total / max(len(idx), 1)}[level])
    return ws


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
    kl_sum = ratio_sum = low = high = tis_sum = tis_capped = mis_masked = mismatch = 0.0
    correcting = cfg.tis_cap is not None or cfg.mis_bounds is not None
    ws = np_sampler_weights(old, sampler, m, cfg.mismatch_level) if correcting else None
    selected = np_selected(ent, m, cfg.entropy_top_frac) if cfg.entropy_top_frac < 1 else m.astype(bool)
    for b in range(B):
        idx = [t for t in range(T) if m[b, t]]
        n = max(len(idx), 1)
        A = adv[b]
        seq_lr = sum(lp[b, t] - old[b, t] for t in idx) / n
        for t in idx:
            lr = seq_lr if cfg.importance_sampling_level == "sequence" else lp[b, t] - old[b, t]
            r = np.exp(lr)
            r1 = r if delta is None else min(r, delta)
            r2 = min(max(r, 1 - el), 1 + eh)
            if r1 * A <= r2 * A:
                pg = -r1 * A
                dpg_dlr = -A * r * (1.0 if (delta is None or r < delta) else 0.0)
            else:
                pg = -r2 * A
                dpg_dlr = -A * r * (1.0 if (1 - el < r < 1 + eh) else 0.0)
            if correcting:
                d = old[b, t] - sampler[b, t]
                mismatch += np.exp(-d) - 1 + d
            if cfg.tis_cap is not None:  # TRL: per_token_loss * clamp(exp(old - sampling), max=cap), then + beta kl
                tis = min(ws[b, t], cfg.tis_cap)
                tis_sum += tis
                tis_capped += float(ws[b, t] > cfg.tis_cap)
                pg, dpg_dlr = pg * tis, dpg_dlr * tis
            if cfg.mis_bounds is not None and not cfg.mis_bounds[0] <= ws[b, t] <= cfg.mis_bounds[1]:
                pg, dpg_dlr = 0.0, 0.0
                mis_masked += 1
            if not selected[b, t]:
                pg, dpg_dlr = 0.0, 0.0
            kl = np_kl(lp[b, t], ref[b, t], logq[b, t], cfg.estimator) if cfg.beta else 0.0
            loss += w[b, t] * (pg + cfg.beta * kl)
            pg_loss += w[b, t] * pg
            kl_loss += w[b, t] * cfg.beta * kl
            kl_sum += kl
            ratio_sum += r
            low += float(r < 1 - el and A < 0)
            high += float(r > 1 + eh and A > 0)
            if cfg.beta:
                grad[b, t] += w[b, t] * cfg.beta * np_dkl_dlp(lp[b, t], ref[b, t], logq[b, t],
                                                              cfg.estimator)
            if cfg.importance_sampling_level == "sequence":
                # pg_bt depends on every lp of the row through the mean log-ratio.
                for t2 in idx:
                    grad[b, t2] += w[b, t] * dpg_dlr / n
            else:
                grad[b, t] += w[b, t] * dpg_dlr
    metrics = dict(loss=loss, pg_loss=pg_loss, ratio_mean=ratio_sum / n_tok,
                   clip_low=low / n_tok, clip_high=high / n_tok,
                   clip_region=(low + high) / n_tok)
    if cfg.beta:
        metrics.update(kl=kl_sum / n_tok, kl_loss=kl_loss)
    if correcting:
        metrics.update(mismatch_kl=mismatch / n_tok)
    if cfg.tis_cap is not None:
        metrics.update(tis_weight_mean=tis_sum / n_tok, tis_capped=tis_capped / n_tok)
    if cfg.mis_bounds is not None:
        metrics.update(mis_masked=mis_masked / n_tok)
    if cfg.entropy_top_frac < 1:
        metrics.update(pg_token_frac=(selected & m.astype(bool)).sum() / n_tok)
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
