"""Helpers of the Colab notebooks (`notebooks/`): training curves, new-support statistics, and the
per-token view of SAGE's guides (entropy, q of each guide, per-token KL against the shaped anchor).

Plots are drawn on `matplotlib.figure.Figure` with the Agg canvas and saved as PNG (the notebooks
display the files), so nothing depends on a display backend.

Dimension key: B completions, P prompt tokens (left padded), T completion tokens.
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# (metric key, panel title) of the training-curve figure; q gets its min / max band.
CURVES = (("reward/reward_mean", "reward (mean over rollouts)"), ("train/kl", "KL to the (shaped) anchor"),
          ("train/entropy", "token entropy (nats)"), ("sage/q_mean", "guide q (mean, min-max band)"))


def _save(fig: Figure, path: str | os.PathLike) -> str:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return os.fspath(path)


# ------------------------------------------------------------------------------------------ training
def read_curves(workdir: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{metric: (steps, values)} of every numeric metric in `workdir/metrics.jsonl`."""
    from sage_jax.train.metric_writer import read_metrics
    series: dict[str, list[tuple[int, float]]] = {}
    for row in read_metrics(workdir):
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                series.setdefault(k, []).append((int(row["step"]), float(v)))
    return {k: (np.array([s for s, _ in v]), np.array([x for _, x in v])) for k, v in series.items()}


def plot_training_curves(workdir: str, path: str | os.PathLike, smooth: int = 5) -> str:
    """Reward, KL, entropy and q against the RL step (raw points and a running mean)."""
    curves = read_curves(workdir)
    fig = Figure(figsize=(13, 3.2), layout="constrained")
    axes = fig.subplots(1, len(CURVES))
    for ax, (key, title) in zip(axes, CURVES):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        if key not in curves:
            ax.text(0.5, 0.5, f"{key}\nnot logged", ha="center", va="center", transform=ax.transAxes)
            continue
        x, y = curves[key]
        ax.plot(x, y, ".-" if len(y) < 2 * smooth else ".", ms=3, lw=0.8, alpha=0.5, color="C0")
        if len(y) >= 2 * smooth:  # running mean over `smooth` logged steps
            ax.plot(x[smooth - 1:], np.convolve(y, np.ones(smooth) / smooth, mode="valid"), color="C0")
        if key == "sage/q_mean" and "sage/q_min" in curves and "sage/q_max" in curves:
            ax.fill_between(x, curves["sage/q_min"][1], curves["sage/q_max"][1], alpha=0.2, color="C1")
    return _save(fig, path)


# ------------------------------------------------------------------------------------------ support
def support_stats(summary: Mapping[str, Any], base: str | None = None) -> list[dict[str, Any]]:
    """Per (model, benchmark): problems solved at k = n, solved only by it (new support, relative to
    `base`, default the summary's base model), solved only by the base (lost support), and the mean
    number of distinct correct final answers."""
    base = base if base in summary["per_problem"] else summary["base_model"]
    rows = []
    for bench, info in summary["benchmarks"].items():
        k = f"pass@{info['ks'][-1]}"
        base_pp = summary["per_problem"].get(base, {}).get(bench, {})
        for model, per_bench in summary["per_problem"].items():
            pp = per_bench.get(bench)
            if pp is None:
                continue
            solved = {pid for pid, m in pp.items() if (m.get(k) or 0) > 0}
            base_solved = {pid for pid, m in base_pp.items() if (m.get(k) or 0) > 0}
            n = max(len(pp), 1)
            dca = summary["models"][model][bench].get("distinct_correct_answers", {}).get("mean")
            rows.append({"model": model, "base": base, "benchmark": bench, "k": k, "problems": len(pp),
                         "solved": len(solved) / n, "new_support": len(solved - base_solved) / n,
                         "lost_support": len(base_solved - solved) / n, "distinct_correct_answers": dca})
    return rows


def support_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    head = "| model | benchmark | solved@k | new support | lost support | distinct correct answers |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in rows:
        dca = "–" if r["distinct_correct_answers"] is None else f"{r['distinct_correct_answers']:.2f}"
        lines.append(f"| {r['model']} | {r['benchmark']} ({r['k']}) | {r['solved']:.3f} | {r['new_support']:.3f} "
                     f"| {r['lost_support']:.3f} | {dca} |")
    return "\n".join(lines)


def plot_support(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> str:
    """Bars per benchmark and model: fraction of problems solved at k = n, gained (new support) and lost
    relative to the base, each bar labelled with its value."""
    benches = list(dict.fromkeys(r["benchmark"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    groups = (("solved", "solved at k = n"), ("new_support", "new support"), ("lost_support", "lost support"))
    fig = Figure(figsize=(max(5.0, 4.2 * len(benches)), 3.4), layout="constrained")
    axes = fig.subplots(1, len(benches), squeeze=False)[0]
    w = 0.8 / max(len(models), 1)
    for ax, bench in zip(axes, benches):
        for i, model in enumerate(models):
            r = next((r for r in rows if r["model"] == model and r["benchmark"] == bench), None)
            if r is None:
                continue
            xs = [g - 0.4 + w * (i + 0.5) for g in range(len(groups))]
            vals = [r[k] for k, _ in groups]
            bars = ax.bar(xs, vals, w, color=f"C{i}", label=model)
            ax.bar_label(bars, [f"{v:.2f}" for v in vals], fontsize=6)
        ax.set_xticks(range(len(groups)), [t for _, t in groups], fontsize=8)
        ax.set_ylim(0, 1.08)
        ax.set_ylabel("fraction of problems")
        ax.set_title(f"{bench} (vs {rows[0]['base']})" if rows and "base" in rows[0] else bench, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    return _save(fig, path)


# ------------------------------------------------------------------------------------------ guides
def stop_and_pad(tokenizer, model_path: str) -> tuple[tuple[int, ...], int]:
    """(stop ids, pad id) for sampling `model_path` with `tokenizer`: `hf.sampling_ids`, what training and
    evaluation use."""
    from sage_jax.models import hf
    from sage_jax.models.config import ModelConfig
    mcfg, _ = ModelConfig.from_hf_dir(hf.resolve_path(model_path))
    return hf.sampling_ids(tokenizer, mcfg)


def token_signals(policy, reference, tokenizer, prompts: Sequence[str], *, max_new_tokens: int,
                  temperature: float = 1.0, seed: int = 0, eos_ids: Sequence[int] = (), pad_id: int = 0,
                  guides: Mapping[str, Any] | None = None, step: int = 0, max_steps: int = 100,
                  estimator: str = "k3", logp_chunk: int = 256) -> list[dict[str, Any]]:
    """Samples one completion per prompt from `policy` and returns, per completion, its tokens and per
    token: policy / reference log-prob and entropy (recomputed at `temperature`, as the RL step does),
    q and log q of every guide in `guides` ({name: GuideConfig or None for its defaults}), and the
    per-token KL estimate against the shaped anchor `ref + log q` (`kl_<guide>`; `kl_none` is GRPO's)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sage_jax.rl import guides as G
    from sage_jax.policy.logprobs import sequence_logp_entropy
    from sage_jax.rl.losses import per_token_kl
    from sage_jax.sampling import SamplingConfig, left_pad, make_generate_fn

    guides = dict(guides if guides is not None else {"branch": None, "token": None, "random": None})
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    toks, pmask = left_pad(rows, pad_id)
    P = toks.shape[1]
    cfg = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, eos_ids=tuple(eos_ids),
                         pad_id=pad_id)
    gd, st = nnx.split(policy)
    out = jax.device_get(make_generate_fn(gd, cfg)(st, toks, pmask, jax.random.key(seed)))
    full = np.concatenate([toks, out.tokens_BxT], 1)
    fmask = np.concatenate([pmask, out.mask_BxT], 1)

    def stats(model):
        g, s = nnx.split(model)
        fn = jax.jit(lambda s, t, m: sequence_logp_entropy(nnx.merge(g, s), t, m, P, logp_chunk,
                                                           temperature or 1.0))
        return fn(s, full, fmask)

    logp, ent = stats(policy)
    ref_logp, ref_ent = stats(reference)
    mask = jnp.asarray(out.mask_BxT)
    inputs = G.GuideInputs(mask_BxT=mask, step=jnp.int32(step), max_steps=max_steps,
                           key=jax.random.fold_in(jax.random.key(seed), 1), entropy_BxT=ent, logp_BxT=logp,
                           ref_logp_BxT=ref_logp, ref_entropy_BxT=ref_ent)
    per = {"logp": logp, "ref_logp": ref_logp, "entropy": ent, "ref_entropy": ref_ent,
           "kl_none": per_token_kl(logp, ref_logp, None, estimator) * mask}
    for name, gcfg in guides.items():
        log_q, q = G.compute_log_q(name, gcfg, inputs)
        per[f"q_{name}"] = q
        per[f"kl_{name}"] = per_token_kl(logp, ref_logp, log_q, estimator) * mask
    per = {k: np.asarray(jax.device_get(v), np.float32) for k, v in per.items()}
    result = []
    for i, prompt in enumerate(prompts):
        m = out.mask_BxT[i].astype(bool)
        ids = out.tokens_BxT[i][m].tolist()
        result.append({"prompt": prompt, "token_ids": ids,
                       "tokens": [tokenizer.decode([t], skip_special_tokens=False) for t in ids],
                       "text": tokenizer.decode(ids, skip_special_tokens=True),
                       **{k: v[i][m] for k, v in per.items()}})
    return result


def signal_rows(sig: Mapping[str, Any]) -> list[str]:
    """The per-token signals of one `token_signals` entry, in display order."""
    qs = [k for k in sig if k.startswith("q_")]
    kls = ["kl_none"] + [f"kl_{k[2:]}" for k in qs]
    return ["entropy", "ref_entropy", *qs, *kls]


def plot_token_heatmap(sig: Mapping[str, Any], path: str | os.PathLike, per_line: int = 48) -> str:
    """Heatmap of the per-token signals of one completion (rows: signals; columns: its tokens, wrapped
    every `per_line` tokens). q uses a diverging map around 1; entropy and KL a sequential one."""
    names = signal_rows(sig)
    T = max(len(sig["tokens"]), 1)
    chunks = [(s, min(s + per_line, T)) for s in range(0, T, per_line)]
    width = min(per_line, T)  # columns per panel
    fig = Figure(figsize=(min(0.3 * width + 2.5, 16), 0.26 * len(names) * len(chunks) + 0.9 * len(chunks)),
                 layout="constrained")
    axes = fig.subplots(len(chunks), 1, squeeze=False)[:, 0]
    qs = [n for n in names if n.startswith("q_")]
    qdev = max([float(np.max(np.abs(sig[n] - 1.0))) for n in qs if len(sig[n])] + [1e-3])
    kmax = max([float(np.max(sig[n])) for n in names if n.startswith("kl_") and len(sig[n])] + [1e-6])
    hmax = max([float(np.max(sig[n])) for n in ("entropy", "ref_entropy") if len(sig[n])] + [1e-6])
    for ax, (a, b) in zip(axes, chunks):
        for j, n in enumerate(names):
            row = np.asarray(sig[n][a:b], np.float32)[None]
            if n.startswith("q_"):
                kw = dict(cmap="RdBu_r", vmin=1 - qdev, vmax=1 + qdev)
            else:
                kw = dict(cmap="viridis" if n.endswith("entropy") else "magma_r", vmin=0,
                          vmax=hmax if n.endswith("entropy") else kmax)
            ax.imshow(row, aspect="auto", extent=(a - 0.5, b - 0.5, j + 0.5, j - 0.5), **kw)
        ax.set_xlim(a - 0.5, a + width - 0.5)
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_xticks(range(a, b), [repr(t)[1:-1][:6] for t in sig["tokens"][a:b]], rotation=90, fontsize=6)
    axes[0].set_title(f"per-token signals ({T} tokens); q: red > 1 > blue", fontsize=9)
    return _save(fig, path)


def plot_guide_scatter(signals: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> str:
    """Over all sampled tokens: q of each guide against the token entropy, and each guide's per-token KL
    against GRPO's (q = 1): where the points leave the diagonal, SAGE reshapes the anchor."""
    qs = [k for k in signals[0] if k.startswith("q_")]
    cat = lambda k: np.concatenate([s[k] for s in signals]) if signals else np.zeros(0)
    fig = Figure(figsize=(4 * len(qs), 6.4), layout="constrained")
    axes = fig.subplots(2, len(qs), squeeze=False)
    ent, kl0 = cat("entropy"), cat("kl_none")
    for j, q in enumerate(qs):
        g = q[2:]
        ax = axes[0, j]
        ax.scatter(ent, cat(q), s=6, alpha=0.5, color=f"C{j}")
        ax.set_xlabel("policy entropy (nats)")
        ax.set_ylabel(f"q ({g})")
        ax.axhline(1.0, color="k", lw=0.6)
        ax.grid(alpha=0.3)
        ax = axes[1, j]
        kl = cat(f"kl_{g}")
        ax.scatter(kl0, kl, s=6, alpha=0.5, color=f"C{j}")
        hi = float(max(kl0.max(initial=0), kl.max(initial=0), 1e-6))
        ax.plot([0, hi], [0, hi], "k--", lw=0.6)
        ax.set_xlabel("per-token KL, anchor pi_ref (GRPO)")
        ax.set_ylabel(f"per-token KL, anchor q*pi_ref ({g})")
        ax.grid(alpha=0.3)
    return _save(fig, path)


def _rgb(value: float, lo: float, mid: float, hi: float) -> str:
    """White at `mid`, red towards `hi`, blue towards `lo`."""
    if value >= mid:
        t = 0.0 if hi <= mid else min((value - mid) / (hi - mid), 1.0)
        r, g, b = 255, int(255 - 140 * t), int(255 - 170 * t)
    else:
        t = 0.0 if mid <= lo else min((mid - value) / (mid - lo), 1.0)
        r, g, b = int(255 - 170 * t), int(255 - 110 * t), 255
    return f"rgb({r},{g},{b})"


def tokens_html(sig: Mapping[str, Any], color_by: str = "q_branch", lo: float | None = None,
                hi: float | None = None) -> str:
    """The completion as HTML, each token's background coloured by `color_by` (q: white at 1; other
    signals: white at 0) with every signal's value in its hover title."""
    vals = np.asarray(sig[color_by], np.float32)
    mid = 1.0 if color_by.startswith("q_") else 0.0
    lo = float(vals.min(initial=mid)) if lo is None else lo
    hi = float(vals.max(initial=mid)) if hi is None else hi
    names = signal_rows(sig)
    spans = []
    for t, tok in enumerate(sig["tokens"]):
        title = " | ".join(f"{n}={float(sig[n][t]):.3f}" for n in names)
        text = html.escape(tok).replace("\n", "&#8629;<br>")
        spans.append(f'<span title="{title}" style="background:{_rgb(float(vals[t]), lo, mid, hi)};'
                     f'font-family:monospace;white-space:pre-wrap">{text}</span>')
    return (f"<div style='line-height:1.6'><b>{html.escape(color_by)}</b> "
            f"[{lo:.3f} .. {hi:.3f}]<br>{''.join(spans)}</div>")
