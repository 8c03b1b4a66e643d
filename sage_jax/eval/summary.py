"""Metrics of stored evaluation results: per-problem columns, benchmark means, macro average.

Pure functions over the `results.json` dict (see `sage_jax.eval.evaluate`); the numbers are defined
in `sage_jax.eval.metrics`. Dimension key (as in
`sage_jax.eval.metrics`): `N` problems, `L` values of k, `R` bootstrap resamples, `E` metric columns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sage_jax.eval import metrics as em

# `settings` is an `evaluate.EvalSettings` and the benchmarks map to `evaluate.Problem`s; evaluate imports this
# module, so they are named here and typed by what is read (`.ks`, `.id`), not imported (no import circle).
EvalSettings = Problem = Any


def problem_metrics(
    records: Sequence[dict], ks: Sequence[int], settings: EvalSettings, bench: str, ids: Sequence[str],
    strategy_labels: Sequence[str] = (),
) -> dict[str, np.ndarray]:
    """Per-problem metric columns [P] of one (model, benchmark) from its stored records; with labelled
    procedures, also `share/<label>` (share of the problem's samples that follow it) per label."""
    n = len(records[0]["correct"])
    c_N = np.array([r["num_correct"] for r in records], np.int64)
    pass_NxL = em.pass_at_k(n, c_N[:, None], np.asarray(ks)[None, :])
    maj_NxL = np.stack([
        # Same subsets for every model on a problem (paired comparison), fixed by stat_seed.
        em.majority_at_k(r["answers"], np.array(r["correct"], bool), ks, settings.maj_resamples,
                         np.random.default_rng(em.stable_seed(settings.stat_seed, "maj", bench, pid)))
        for r, pid in zip(records, ids)
    ])
    cols: dict[str, np.ndarray] = {}
    for j, k in enumerate(ks):
        cols[f"pass@{k}"] = pass_NxL[:, j]
    cols["mean@n"] = c_N / n
    for j, k in enumerate(ks):
        cols[f"maj@{k}"] = maj_NxL[:, j]
    cols["distinct_correct_answers"] = np.array([
        len({a for a, ok in zip(r["answers"], r["correct"]) if ok and a is not None}) for r in records
    ], np.float64)
    cols["distinct_correct_completions"] = np.array(
        [r["distinct_correct_completions"] for r in records], np.float64)
    if all("strategies" in r for r in records):  # procedures labelled (evaluate_models' strategy_fn)
        cols["distinct_correct_strategies"] = np.array([
            len({s for s, ok in zip(r["strategies"], r["correct"]) if ok and s is not None}) for r in records
        ], np.float64)
        for label in strategy_labels:
            cols[f"share/{label}"] = np.array([np.mean([s == label for s in r["strategies"]]) for r in records])
    cols["mean_entropy"] = np.array([
        em.nanmean(np.array([np.nan if e is None else e for e in r["mean_entropy"]], np.float64))
        for r in records
    ], np.float64)
    cols["mean_length"] = np.array([np.mean(r["num_tokens"]) for r in records], np.float64)
    return cols


def summarize(
    results: dict, model_names: Sequence[str], benchmarks: Mapping[str, Sequence[Problem]],
    settings: EvalSettings,
) -> dict:
    """Per-problem metrics, per-benchmark means with CIs, and the macro average over benchmarks.

    Every model is bootstrapped with the same resampled problems of a benchmark (paired), and
    the average resamples each benchmark independently (stratified) and averages their means.
    Only (model, benchmark) pairs whose every problem is finished are summarised. `deltas[model]`
    holds each metric's difference to the base model, paired over problems (the same resamples).
    """
    base = settings.base_model or model_names[0]
    summary: dict[str, Any] = {
        "base_model": base, "ci_level": settings.ci_level, "benchmarks": {},
        "models": {m: {} for m in model_names}, "per_problem": {m: {} for m in model_names},
        "deltas": {m: {} for m in model_names if m != base},
    }
    reps: dict[str, dict[str, tuple[list[str], np.ndarray]]] = {m: {} for m in model_names}
    columns: dict[str, dict[str, dict[str, np.ndarray]]] = {m: {} for m in model_names}

    def complete(model: str, bench: str) -> list[dict] | None:
        """The records of every problem of `bench` in order, or None if any is missing."""
        entry = results["models"].get(model, {}).get("benchmarks", {}).get(bench)
        done = entry["problems"] if entry else {}
        if any(p.id not in done for p in benchmarks[bench]):
            return None
        return [done[p.id] for p in benchmarks[bench]]

    for bench, problems in benchmarks.items():
        n = settings.n_for(bench)
        ks = em.default_ks(n)
        ids = [p.id for p in problems]
        summary["benchmarks"][bench] = {"n": n, "ks": ks, "num_problems": len(problems)}
        weights_RxN = em.bootstrap_weights(
            len(problems), settings.bootstrap_resamples,
            em.stable_seed(settings.stat_seed, "bootstrap", bench))
        base_records = complete(base, bench)
        labels = sorted({x for m in model_names for r in (complete(m, bench) or ())
                         for x in r.get("strategies", ()) if x is not None})
        for model in model_names:
            records = complete(model, bench)
            if records is None:
                continue
            cols = problem_metrics(records, ks, settings, bench, ids, labels)
            if base_records is not None:
                solved_base = np.array([r["num_correct"] > 0 for r in base_records])
                solved = np.array([r["num_correct"] > 0 for r in records])
                cols["new_support"] = (solved & ~solved_base).astype(np.float64)
            stats, reps_RxE = em.summarize_columns(cols, weights_RxN, settings.ci_level)
            summary["models"][model][bench] = _clean_stats(stats)
            reps[model][bench] = (list(cols), reps_RxE)
            columns[model][bench] = cols
            summary["per_problem"][model][bench] = {
                pid: {name: em.finite_or_none(col[i]) for name, col in cols.items()}
                for i, pid in enumerate(ids)
            }
    common_ks = sorted(set.intersection(*(set(b["ks"]) for b in summary["benchmarks"].values())))
    summary["average"] = {"benchmarks": list(benchmarks), "ks": common_ks}
    for model in model_names:
        if len(reps[model]) == len(benchmarks):
            summary["models"][model]["average"] = _average(
                summary["models"][model], reps[model], settings.ci_level)
    for model in summary["deltas"]:
        delta_reps = {}
        for bench in benchmarks:
            if bench in columns[model] and bench in columns[base]:
                stats, delta_reps[bench] = _paired_delta(columns[model][bench], reps[model][bench],
                                                         columns[base][bench], reps[base][bench], settings.ci_level)
                summary["deltas"][model][bench] = stats
        if len(delta_reps) == len(benchmarks):
            summary["deltas"][model]["average"] = _average(summary["deltas"][model], delta_reps,
                                                           settings.ci_level)
    return summary


def _paired_delta(cols: dict[str, np.ndarray], reps: tuple[list[str], np.ndarray],
                  base_cols: dict[str, np.ndarray], base_reps: tuple[list[str], np.ndarray],
                  level: float) -> tuple[dict, tuple[list[str], np.ndarray]]:
    """Mean and CI of (model - base) per metric both have, from replicates over the same resampled problems."""
    names = [k for k in cols if k in base_cols]
    (mn, m_RxE), (bn, b_RxE) = reps, base_reps
    d_RxE = m_RxE[:, [mn.index(k) for k in names]] - b_RxE[:, [bn.index(k) for k in names]]
    lo, hi = em.percentile_ci(d_RxE, level)
    stats = {k: {"mean": em.finite_or_none(em.nanmean(cols[k] - base_cols[k])), "lo": em.finite_or_none(lo[j]),
                 "hi": em.finite_or_none(hi[j])} for j, k in enumerate(names)}
    return stats, (names, d_RxE)


def _clean_stats(stats: dict[str, dict[str, float]]) -> dict[str, dict[str, float | None]]:
    return {k: {s: em.finite_or_none(v) for s, v in d.items()} for k, d in stats.items()}


def _average(per_bench: dict, reps: dict[str, tuple[list[str], np.ndarray]], level: float) -> dict:
    """Macro average over benchmarks of the metrics every benchmark has, with a stratified CI."""
    names = [k for k in next(iter(reps.values()))[0] if all(k in cols for cols, _ in reps.values())]
    mean_reps = np.mean([r[:, [cols.index(k) for k in names]] for cols, r in reps.values()], axis=0)
    lo, hi = em.percentile_ci(mean_reps, level)
    out = {}
    for j, k in enumerate(names):
        means = [per_bench[b][k]["mean"] for b in reps]
        mean = None if any(m is None for m in means) else float(np.mean(means))
        out[k] = {"mean": mean, "lo": em.finite_or_none(lo[j]), "hi": em.finite_or_none(hi[j])}
    return out
