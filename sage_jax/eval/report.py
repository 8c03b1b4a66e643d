"""Markdown table and PNG plots of an evaluation summary (see `sage_jax.eval.summary.summarize`).

Plots are drawn on `matplotlib.figure.Figure` with the Agg canvas, so no pyplot global state or
display backend is touched (safe in headless jobs and in notebooks alike).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

TABLE_FILE = "results.md"
PASS_AT_K_PLOT = "pass_at_k.png"
SCATTER_PLOT = "pass1_vs_passk.png"
AVERAGE = "average"

# Decimals per metric in the table; rates get 3.
_DECIMALS = {"distinct_correct_answers": 2, "distinct_correct_completions": 2, "mean_entropy": 3,
             "mean_length": 1}
_DIAGNOSTICS = ("mean@n", "distinct_correct_answers", "distinct_correct_completions", "mean_entropy",
                "mean_length", "new_support")


def decimals(metric: str) -> int:
    """Decimals the table shows for `metric`."""
    return _DECIMALS.get(metric, 3)


def format_stat(metric: str, stat: Mapping[str, float | None] | None) -> str:
    """`mean [lo, hi]` rounded for the table, or an en dash when missing."""
    if stat is None or stat.get("mean") is None:
        return "–"
    d = decimals(metric)
    lo, hi = stat.get("lo"), stat.get("hi")
    if lo is None or hi is None:
        return f"{stat['mean']:.{d}f}"
    return f"{stat['mean']:.{d}f} [{lo:.{d}f}, {hi:.{d}f}]"


def _panels(summary: Mapping[str, Any]) -> list[tuple[str, list[int]]]:
    """(benchmark or 'average', ks) of each panel; the average only with several benchmarks."""
    panels = [(b, info["ks"]) for b, info in summary["benchmarks"].items()]
    if len(panels) > 1 and summary["average"]["ks"]:
        panels.append((AVERAGE, summary["average"]["ks"]))
    return panels


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def markdown_table(summary: Mapping[str, Any], settings: Mapping[str, Any] | None = None) -> str:
    """Overview (pass@1, pass@k_max, maj@k_max per benchmark and averaged) and per-benchmark tables."""
    models = list(summary["models"])
    level = int(round(100 * summary.get("ci_level", 0.95)))
    out = ["# Evaluation", "", f"Mean over problems [{level}% bootstrap CI over problems]; "
           f"new support is relative to `{summary['base_model']}`.", ""]
    if settings:
        keys = ("n", "n_per_benchmark", "temperature", "top_p", "max_tokens", "seed", "sampler")
        out += ["Settings: " + ", ".join(f"{k}={settings[k]}" for k in keys if k in settings), ""]
    header, cols = ["model"], []
    for bench, ks in _panels(summary):
        for metric in ("pass@1", f"pass@{ks[-1]}", f"maj@{ks[-1]}"):
            header.append(f"{bench} {metric}")
            cols.append((bench, metric))
    rows = [[m] + [format_stat(metric, summary["models"][m].get(b, {}).get(metric))
                   for b, metric in cols] for m in models]
    out += ["## Overview", ""] + _table(header, rows) + [""]
    for bench, ks in _panels(summary):
        info = summary["benchmarks"].get(bench)
        title = f"## {bench}" + (f" (n = {info['n']}, {info['num_problems']} problems)" if info else "")
        out += [title, ""]
        for group in ([f"pass@{k}" for k in ks], [f"maj@{k}" for k in ks], list(_DIAGNOSTICS)):
            rows = [[m] + [format_stat(g, summary["models"][m].get(bench, {}).get(g)) for g in group]
                    for m in models]
            out += _table(["model"] + group, rows) + [""]
    return "\n".join(out)


def _title(summary: Mapping[str, Any], bench: str) -> str:
    info = summary["benchmarks"].get(bench)
    return f"{bench} (n={info['n']}, {info['num_problems']} problems)" if info else bench


def _color(i: int) -> str:
    return f"C{i % 10}"


def _panel_axes(num: int, width: float, height: float) -> tuple[Figure, Any]:
    """A figure of `num` panels, at most 3 a row, each `width` x `height` inches; its axes flattened."""
    cols = min(num, 3)
    rows = (num + cols - 1) // cols
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False).ravel()


def _finish_panels(fig: Figure, axes: Any, used: int, path: str | os.PathLike) -> None:
    """Hide the grid's unused axes, put the legend on the first panel and save the figure."""
    for ax in axes[used:]:
        ax.set_visible(False)
    axes[0].legend(fontsize=8)
    _save(fig, Path(path))


def _save(fig: Figure, path: Path) -> None:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120)


def plot_pass_at_k(summary: Mapping[str, Any], path: str | os.PathLike) -> None:
    """pass@k against k (log2 axis), one line per model with its CI band, a panel per benchmark."""
    panels = _panels(summary)
    fig, axes = _panel_axes(len(panels), 4.5, 3.6)
    for ax, (bench, ks) in zip(axes, panels):
        for i, (model, per_bench) in enumerate(summary["models"].items()):
            stats = per_bench.get(bench)
            if stats is None:
                continue
            pts = [(k, stats[f"pass@{k}"]) for k in ks]
            x = [k for k, _ in pts]
            ax.plot(x, [s["mean"] for _, s in pts], marker="o", ms=3, color=_color(i), label=model)
            ax.fill_between(x, [s["lo"] for _, s in pts], [s["hi"] for _, s in pts], color=_color(i),
                            alpha=0.2, linewidth=0)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(_title(summary, bench))
        ax.grid(alpha=0.3)
    _finish_panels(fig, axes, len(panels), path)


def plot_pass1_vs_passk(summary: Mapping[str, Any], path: str | os.PathLike) -> None:
    """pass@1 against pass@k_max, a point per model with CI error bars, a panel per benchmark."""
    panels = _panels(summary)
    fig, axes = _panel_axes(len(panels), 4.2, 3.8)
    for ax, (bench, ks) in zip(axes, panels):
        kmax = ks[-1]
        for i, (model, per_bench) in enumerate(summary["models"].items()):
            stats = per_bench.get(bench)
            if stats is None:
                continue
            p1, pk = stats["pass@1"], stats[f"pass@{kmax}"]
            ax.errorbar([p1["mean"]], [pk["mean"]],
                        xerr=[[p1["mean"] - p1["lo"]], [p1["hi"] - p1["mean"]]],
                        yerr=[[pk["mean"] - pk["lo"]], [pk["hi"] - pk["mean"]]],
                        fmt="o", color=_color(i), capsize=3, label=model)
            ax.annotate(model, (p1["mean"], pk["mean"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
        ax.set_xlabel("pass@1")
        ax.set_ylabel(f"pass@{kmax}")
        ax.set_xlim(-0.02, 1.02)
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(_title(summary, bench))
        ax.grid(alpha=0.3)
    _finish_panels(fig, axes, len(panels), path)


def write_reports(summary: Mapping[str, Any], eval_dir: str | os.PathLike,
                  settings: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """Write the Markdown table and both plots into `eval_dir`; returns their paths."""
    eval_dir = Path(eval_dir)
    eval_dir.mkdir(parents=True, exist_ok=True)
    paths = {"table": eval_dir / TABLE_FILE, "pass_at_k": eval_dir / PASS_AT_K_PLOT,
             "scatter": eval_dir / SCATTER_PLOT}
    paths["table"].write_text(markdown_table(summary, settings) + "\n")
    plot_pass_at_k(summary, paths["pass_at_k"])
    plot_pass1_vs_passk(summary, paths["scatter"])
    return paths


# ----------------------------------------------------------------------------- a training run

RUN_PLOT = "run.png"
_RUN_ROWS = ("distinct_correct_strategies", "mean_length")


def gain_table(summary: Mapping[str, Any], before: str, after: str, bench: str | None = None) -> str:
    """Markdown: each metric of `before` and `after` with its CI, and the paired gain `after - before`
    with its CI (same resampled problems), for one benchmark or the average over several."""
    bench = bench or (next(iter(summary["benchmarks"])) if len(summary["benchmarks"]) == 1 else AVERAGE)
    ks = summary["benchmarks"][bench]["ks"] if bench != AVERAGE else summary["average"]["ks"]
    b, a = summary["models"][before].get(bench, {}), summary["models"][after].get(bench, {})
    if summary.get("base_model") == before:
        gain = summary.get("deltas", {}).get(after, {}).get(bench, {})
    else:
        gain = {}
    metrics = [f"pass@{k}" for k in ks] + [m for m in _RUN_ROWS if m in a]
    metrics += sorted(m for m in a if m.startswith("share/"))
    level = int(round(100 * summary.get("ci_level", 0.95)))
    rows = [[m, format_stat(m, b.get(m)), format_stat(m, a.get(m)), format_stat(m, gain.get(m))] for m in metrics]
    return "\n".join(_table(["metric", before, after, f"gain [{level}% CI, paired]"], rows))


def plot_run(rows: Sequence[Mapping[str, Any]], summary: Mapping[str, Any] | None,
             path: str | os.PathLike) -> None:
    """Training reward (and KL, entropy) per step, and pass@k of every evaluated step with CI bands."""
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax_r, ax_k = fig.subplots(1, 2)
    train = [r for r in rows if "reward/reward_mean" in r]
    if train:
        x = [r["step"] for r in train]
        y = [r["reward/reward_mean"] for r in train]
        ax_r.plot(x, y, color="C0", alpha=0.35, lw=1, label="reward (per step)")
        w = max(1, len(y) // 8)
        smooth = [sum(y[max(0, i - w + 1):i + 1]) / len(y[max(0, i - w + 1):i + 1]) for i in range(len(y))]
        ax_r.plot(x, smooth, color="C0", lw=2, label=f"reward (mean of {w})")
        ax_r.set_ylim(-0.02, 1.02)
    ax_r.set_xlabel("RL step")
    ax_r.set_ylabel("training reward")
    ax_r.grid(alpha=0.3)
    ax_r.legend(fontsize=8, loc="upper left")
    if summary is not None:
        bench = next(iter(summary["benchmarks"])) if len(summary["benchmarks"]) == 1 else AVERAGE
        ks = summary["benchmarks"][bench]["ks"] if bench != AVERAGE else summary["average"]["ks"]
        for i, (model, per_bench) in enumerate(summary["models"].items()):
            stats = per_bench.get(bench)
            if stats is None:
                continue
            ax_k.plot(ks, [stats[f"pass@{k}"]["mean"] for k in ks], marker="o", ms=3, color=_color(i), label=model)
            ax_k.fill_between(ks, [stats[f"pass@{k}"]["lo"] for k in ks], [stats[f"pass@{k}"]["hi"] for k in ks],
                              color=_color(i), alpha=0.2, linewidth=0)
        ax_k.set_xscale("log", base=2)
        ax_k.set_xticks(ks, [str(k) for k in ks])
        ax_k.set_title(_title(summary, bench), fontsize=9)
        ax_k.legend(fontsize=8)
    ax_k.set_xlabel("k")
    ax_k.set_ylabel("held-out pass@k")
    ax_k.set_ylim(-0.02, 1.02)
    ax_k.grid(alpha=0.3)
    _save(fig, Path(path))
