"""results.json of the miniature study, and everything shown from it: results.md, the PNGs, the README block.

`build_results` gathers the raw evaluation records, the calibration and the training logs into one dict;
`render_markdown` and `write_plots` read only that dict (as loaded back from results.json), so every
number in the table and the plots is in results.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
from experiments.sage_miniature import stats
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from experiments.sage_miniature.methods import CALIBRATION_RULE, PAPER_SOURCE, TEST_SIZE, resolve_threshold

BEGIN, END = "<!-- BEGIN GENERATED RESULTS (run.py rewrites this block) -->", "<!-- END GENERATED RESULTS -->"
PLOTS = {"pass_at_k": "pass_at_k.png", "training": "training_curves.png", "entropy": "entropy_hist.png"}
CURVES = [("reward/reward_mean", "train reward (exact match)"),
          ("train/kl", "KL to the anchor (forward KL for forward_kl)"),
          ("train/entropy", "policy token entropy (nats)"), ("sage/q_mean", "guide q mean")]
STRATEGY_LABELS = ("rule", "terms", "left", "right")  # sage_jax.data.strategies.STRATEGIES, in table order
SHARES = tuple(f"share/{x}" for x in STRATEGY_LABELS)
DIAG = [("mean@n", 3), ("distinct_correct_answers", 2), ("distinct_correct_completions", 2),
        ("distinct_correct_strategies", 2), *((x, 3) for x in SHARES),
        ("new_support", 3), ("mean_entropy", 3), ("mean_length", 1)]
PER_PROBLEM_KEEP = ("mean@n", "distinct_correct_answers", "distinct_correct_completions",
                    "distinct_correct_strategies", *SHARES, "new_support", "mean_entropy", "mean_length")


def _r(x, d=6):
    return None if x is None or not np.isfinite(x) else round(float(x), d)


# ------------------------------------------------------------------------------------------ build
def summarize_evals(eval_files: dict[str, str], problem_ids: list[str], bench: str) -> dict:
    """Merge the per-model raw results and summarise them together (base = "base", paired bootstrap)."""
    from sage_jax.eval.evaluate import EvalSettings, Problem, load_results
    from sage_jax.eval.summary import summarize
    merged, settings = {"models": {}}, None
    for name, workdir in eval_files.items():
        res = load_results(workdir)
        merged["models"][name] = res["models"][name]
        if settings is None:
            keep = {f.name for f in dataclasses.fields(EvalSettings)}
            settings = EvalSettings(**{k: v for k, v in res["settings"].items() if k in keep})
    settings = dataclasses.replace(settings, base_model="base")
    problems = {bench: [Problem(pid, "", "") for pid in problem_ids]}
    return summarize(merged, list(eval_files), problems, settings), settings


def _curves(run_dirs: dict[str, str], window: int) -> dict:
    """Per-seed training series and their seed mean / min / max, smoothed by a rolling mean of `window`."""
    from sage_jax.train.metric_writer import read_metrics
    out = {}
    for key, _ in CURVES:
        series = {}
        for run, d in run_dirs.items():
            rows = [r for r in read_metrics(d) if key in r]
            if rows:
                series[run] = ([int(r["step"]) for r in rows], [float(r[key]) for r in rows])
        if not series:
            continue
        steps = sorted(set.intersection(*(set(s) for s, _ in series.values())))
        vals = np.array([[dict(zip(s, v))[t] for t in steps] for s, v in series.values()])
        kernel = np.ones(min(window, len(steps))) / min(window, len(steps))
        smooth = np.array([np.convolve(v, kernel, mode="valid") for v in vals])
        out[key] = {"steps": steps, "per_seed": {r: [_r(x) for x in vals[i]] for i, r in enumerate(series)},
                    "window": int(kernel.size), "smooth_steps": steps[kernel.size - 1:],
                    "mean": [_r(x) for x in smooth.mean(0)], "min": [_r(x) for x in smooth.min(0)],
                    "max": [_r(x) for x in smooth.max(0)]}
    return out


def _fill_unseen_shares(st: dict, pp: dict) -> None:
    """`share/<label>` of a procedure no model ever sampled is 0 (the summary only has the labels it saw);
    without procedure labels at all (an evaluation without strategy_fn) that is an error."""
    if "distinct_correct_strategies" not in st:
        raise ValueError("the evaluation has no procedure labels (evaluate_models ran without strategy_fn)")
    for m in SHARES:
        if m not in st:
            st[m] = {"mean": 0.0, "lo": 0.0, "hi": 0.0}
            for row in pp.values():
                row[m] = 0.0


def build_results(plan: dict, calibration: dict, eval_dirs: dict[str, str], run_dirs: dict[str, str],
                  problem_ids: list[str], bench: str, timing: dict) -> dict:
    """Everything the report shows. `plan["methods"][key]["runs"]` maps seed -> run name."""
    summary, settings = summarize_evals(eval_dirs, problem_ids, bench)
    ks = summary["benchmarks"][bench]["ks"]
    kmax = ks[-1]
    missing = {m for m in stats.claim_metrics() if m != "kmax" and m not in PER_PROBLEM_KEEP
               and m not in {f"pass@{k}" for k in ks}}
    if missing:
        raise ValueError(f"stats.CLAIMS reads metrics the report does not keep: {sorted(missing)}")
    runs = {}
    for name in eval_dirs:
        st = summary["models"][name][bench]
        pp = summary["per_problem"][name][bench]
        _fill_unseen_shares(st, pp)
        keep = [f"pass@{k}" for k in ks] + list(PER_PROBLEM_KEEP)
        runs[name] = {
            "metrics": {m: {s: _r(v) for s, v in st[m].items()} for m in keep + [f"maj@{kmax}"]},
            "per_problem": {m: [_r(pp[pid][m]) for pid in problem_ids] for m in keep},
        }
    methods, per_problem_SxP, curves_k = {}, {}, {}
    for key, info in plan["methods"].items():
        names = [info["runs"][s] for s in sorted(info["runs"], key=int)]
        agg = {m: stats.seed_stats([runs[n]["metrics"][m]["mean"] for n in names])
               for m in [f"pass@{k}" for k in ks] + [d for d, _ in DIAG]}
        if info["trained"]:
            for n in names:
                r = _read_rewards(run_dirs[n])
                runs[n]["train_reward_last20"] = _r(np.mean(r[-max(1, len(r) // 5):]))
            agg["train_reward_last20"] = stats.seed_stats([runs[n]["train_reward_last20"] for n in names])
        methods[key] = {**info, "seed_stats": agg}
        per_problem_SxP[key] = {m: np.array([[np.nan if x is None else x for x in runs[n]["per_problem"][m]]
                                             for n in names]) for m in runs[names[0]]["per_problem"]}
        v = np.stack([per_problem_SxP[key][f"pass@{k}"] for k in ks], axis=2)
        curves_k[key] = stats.method_curve(v, f"curve:{key}")
        if key != "base" and "base" in per_problem_SxP:
            gains = [stats.combination_ci([(1.0, v[:, :, j], key), (-1.0, per_problem_SxP["base"][f"pass@{k}"],
                                                                      "base")], f"gain:{key}:{k}")
                     for j, k in enumerate(ks)]
            curves_k[key]["gain_vs_base"] = {s: [g[s if s != "mean" else "estimate"] for g in gains]
                                             for s in ("mean", "lo", "hi")}
    base_unsolved = int(sum(1 for x in runs[plan["methods"]["base"]["runs"]["0"]]["per_problem"]["pass@1"]
                            if x == 0))
    trained = {k: {n: run_dirs[n] for n in v["runs"].values()} for k, v in plan["methods"].items() if v["trained"]}
    window = plan["curve_window"]
    return {
        "schema": 2, "mode": plan["mode"], "budget": plan["budget"], "benchmark": bench,
        "problems_available": TEST_SIZE, "strategy_labels": list(STRATEGY_LABELS),
        "eval_settings": settings.to_json(), "problem_ids": problem_ids, "ks": ks, "kmax": kmax,
        "base_unsolved_problems": base_unsolved, "calibration": calibration, "paper_source": PAPER_SOURCE,
        "methods": methods, "runs": runs, "pass_at_k_curves": curves_k,
        "training_curves": {k: _curves(d, window) for k, d in trained.items()},
        "claims": stats.decide_claims(per_problem_SxP, kmax, TEST_SIZE), "timing": timing,
        **(evidence_sections(plan, calibration, run_dirs, per_problem_SxP, kmax) if plan["mode"] == "evidence"
           else {}),
    }


SHAPING = ("sage/frac_shaped", "sage/frac_shaped_first", "sage/frac_shaped_later")


def _shaping(run_dir: str) -> dict:
    """A run's training-time shaping, mean over its logged steps: the share of tokens shaped, its parts at the
    first completion token and after it (shares of all tokens), and the share of completions whose first token
    is shaped (frac_shaped_first x tokens per completion, step by step)."""
    from sage_jax.train.metric_writer import read_metrics
    rows = [r for r in read_metrics(run_dir) if all(k in r for k in SHAPING)]
    out = {k.split("/")[1]: float(np.mean([r[k] for r in rows])) for k in SHAPING}
    out["first_tokens_shaped"] = float(np.mean([r["sage/frac_shaped_first"] * r["rollout/length_mean"]
                                                for r in rows]))
    return out


def evidence_sections(plan: dict, calibration: dict, run_dirs: dict[str, str], per_problem: dict,
                      kmax: int) -> dict:
    """The evidence study's comparisons (stats.decide_evidence) and its threshold study: one item per branch
    threshold setting, with what it shapes in training and its differences from GRPO."""
    rows = stats.decide_evidence(per_problem, kmax, TEST_SIZE)
    items = []
    for key in stats.THRESHOLD_SETTINGS:
        if key not in plan["methods"]:
            continue
        m = plan["methods"][key]
        raw = m["overrides"]["sage.branch.threshold"]
        thr = float(resolve_threshold(raw, calibration))
        q = calibration["quantile"] if raw == "calibrated" else (int(raw[-2:]) / 100 if isinstance(raw, str)
                                                                 else None)
        base_share = (1.0 - q) if q is not None else calibration["share_above_paper_threshold"]
        runs = [m["runs"][s] for s in sorted(m["runs"], key=int)]
        per_seed = [_shaping(run_dirs[r]) for r in runs]
        items.append({
            "method": key, "setting": raw if isinstance(raw, str) else f"{raw} nats", "threshold_nats": _r(thr),
            "base_tokens_above": _r(base_share),
            "training": {k: stats.seed_stats([p[k] for p in per_seed]) for k in per_seed[0]},
            "vs_grpo": {r["metric"]: {x: r[x] for x in ("estimate", "lo", "hi", "outcome")}
                        for r in rows if r["a"] == key and r["b"] == "grpo"}})
    return {"evidence": rows, "threshold_study": items}


def _read_rewards(run_dir: str) -> list[float]:
    from sage_jax.train.metric_writer import read_metrics
    return [float(r["reward/reward_mean"]) for r in read_metrics(run_dir) if "reward/reward_mean" in r]


# ------------------------------------------------------------------------------------------ markdown
def _table(header, rows):
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |"
                                                                              for r in rows]


def _paper(m: dict, i: int) -> str:
    return f"{m['paper'][i]:.3f}" if m.get("paper") else "n/a (not in the excerpt)"


def render_markdown(res: dict, image_dir: str = ".") -> str:
    """The results block: main table, diagnostics, claims, calibration, plots (links under image_dir)."""
    kmax = res["kmax"]
    b, cal = res["budget"], res["calibration"]
    ms = res["methods"]
    lines = [f"Mode `{res['mode']}`: {b['steps']} RL steps per run, seeds {b['seeds']}, held-out "
             f"`{res['benchmark']}` problems 0-{len(res['problem_ids']) - 1} ({len(res['problem_ids'])}), "
             f"n = {res['eval_settings']['n']} samples each at temperature {res['eval_settings']['temperature']}, "
             f"<= {res['eval_settings']['max_tokens']} tokens. Values: mean over problems of each run, then "
             f"mean ± std over seeds (sample std; 0 with one seed). Branch threshold {cal['threshold']:.3f} "
             f"nats (calibrated, see below).", "",
             f"| method | pass@1 | pass@{kmax} | paper pass@1 | paper pass@256 |", "|---|---|---|---|---|"]
    for key, m in ms.items():
        s = m["seed_stats"]
        lines.append(f"| {m['label']} (`{key}`) | {stats.format_pm(s['pass@1'])} | "
                     f"{stats.format_pm(s[f'pass@{kmax}'])} | {_paper(m, 0)} | {_paper(m, 1)} |")
    lines += ["", f"Paper column: {res['paper_source']}; forward KL, token and random guides are not in "
              "that excerpt. The paper evaluates 7B models on competition math; only the direction of the "
              "differences is comparable, not the values.", "", "### Diagnostics", "",
              "distinct correct answers = distinct final answers among correct samples (at most 1 for a "
              "single-answer arithmetic task); distinct correct completions = distinct completion texts among "
              "correct samples; distinct correct strategies = distinct procedures (the completion's opening "
              "tag: `rule` and `terms` are correct, `left` and `right` only where the order of operations does "
              "not change the value) among correct samples (the exploration measure); share/<procedure> = share "
              "of a problem's n samples that follow it (samples without a known tag count in none); new "
              f"support = share of all "
              f"problems solved (>= 1 correct of n) that the base never solved in its n samples (the base "
              f"left {res['base_unsolved_problems']} of {len(res['problem_ids'])} unsolved); entropy = mean "
              "per-token entropy of the completions (nats).", ""]
    header = ["method"] + [d for d, _ in DIAG] + ["train reward (last 20%)"]
    rows = []
    for key, m in ms.items():
        s = m["seed_stats"]
        rows.append([f"`{key}`"] + [stats.format_pm(s[d], dec) for d, dec in DIAG]
                    + [stats.format_pm(s["train_reward_last20"]) if "train_reward_last20" in s else "–"])
    lines += _table(header, rows) + ["", "### The paper's claims", "",
                                     f"Each comparison: difference of seed-mean values, 95% bootstrap CI over "
                                     f"problems x seeds ({stats.RESAMPLES} resamples, problems paired across "
                                     "methods). A comparison supports the claim when its CI excludes 0 on the "
                                     "predicted side, contradicts it when it excludes 0 on the other side. "
                                     "Verdict: reproduced = every counted comparison supports; not reproduced = "
                                     "one contradicts; inconclusive = otherwise. Rows marked (context) are "
                                     "shown but not counted.", ""]
    for c in res["claims"]:
        lines += [f"**{c['claim']}**: {c['verdict']} ({c['supported']} counted comparisons support it).", ""]
        rows = []
        for r in c["comparisons"]:
            pred = "> 0" if r["sign"] > 0 else "< 0"
            est = "–" if "estimate" not in r else f"{r['estimate']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}]"
            rows.append([r["name"] + ("" if r["counted"] else " (context)"), pred, est, r["outcome"]])
        lines += _table(["comparison", "predicted", "difference [95% CI]", "outcome"], rows) + [""]
    lines += render_power(res)
    if "evidence" in res:
        lines += render_evidence(res)
    q = cal["quantiles"]
    lines += ["### Calibration", "", f"Rule (fixed before any pass@k was computed): {CALIBRATION_RULE}.", "",
              f"{cal['num_tokens']} completion tokens of the base on {cal['val_problems']} "
              f"({cal['num_problems']} problems x {cal['n']} samples): mean entropy {cal['mean']:.3f} nats; "
              + ", ".join(f"{k} {v:.3f}" for k, v in q.items())
              + f". Threshold = p{round(100 * cal['quantile'])} = {cal['threshold']:.3f} nats; share of tokens "
              f"above it {cal['share_above_threshold']:.3f}; share above the paper's 1.2 nats "
              f"{cal['share_above_paper_threshold']:.3f}.", "", "### Plots", ""]
    for key, fname in PLOTS.items():
        lines.append(f"![{key}]({image_dir.rstrip('/')}/{fname})")
    t = res["timing"]
    lines += ["", f"Timing: {t['train_job_s'] / 60:.1f} min of training jobs, {t['eval_job_s'] / 60:.1f} min of "
              f"evaluation jobs, {t['calibrate_job_s']:.0f} s calibration; wall clock of the study "
              f"{t['study_wall_s'] / 60:.1f} min with --jobs {t['jobs']}."
              + (f" Code: commit {', '.join(t['commits'])}." if t.get("commits") else ""), ""]
    return "\n".join(lines)


def _ci(c: dict, d: int = 4) -> str:
    return f"{c['estimate']:+.{d}f} [{c['lo']:+.{d}f}, {c['hi']:+.{d}f}]"


def render_evidence(res: dict) -> list[str]:
    """The evidence study's comparisons and its threshold table (README "Evidence study")."""
    kmax, S = res["kmax"], len(res["budget"]["seeds"])
    lines = ["### Evidence study: the pre-registered comparisons", "",
             f"Difference of seed-mean values a - b, 95% CI over problems x seeds ({S} seeds per method, "
             f"{stats.RESAMPLES} resamples, problems paired). No side was predicted: each CI is read as it falls.",
             ""]
    lines += _table(["comparison", "difference [95% CI]", "CI"], [[r["name"], _ci(r), r["outcome"]]
                                                                    for r in res["evidence"]]) + [""]
    metrics = ["pass@1", f"pass@{kmax}", "share/terms", "distinct_correct_strategies"]
    rows = []
    for it in res["threshold_study"]:
        t = it["training"]
        rows.append([f"`{it['method']}` ({it['setting']})", f"{it['threshold_nats']:.4f}",
                     f"{it['base_tokens_above']:.3f}", stats.format_pm(t["frac_shaped"]),
                     stats.format_pm(t["first_tokens_shaped"]), stats.format_pm(t["frac_shaped_later"])]
                    + [_ci(it["vs_grpo"][m]) + f" ({it['vs_grpo'][m]['outcome']})" for m in metrics])
    lines += ["### Threshold study", "",
              "The branch guide at thresholds set by the share of the base's calibration tokens above them. "
              "Training columns: mean over a run's logged steps, then mean ± std over seeds: `sage/frac_shaped` "
              "(share of completion tokens shaped), the share of completions whose first token (the fork: which "
              "procedure) is shaped, and the share of all tokens shaped after the first. Then the difference "
              "from GRPO with its 95% CI.", ""]
    lines += _table(["setting", "threshold (nats)", "base tokens above", "frac_shaped", "first tokens shaped",
                     "later tokens shaped (share of all)"] + [f"- GRPO, {m}" for m in metrics], rows) + [""]
    return lines


def _count(n, available=None) -> str:
    if n is None:
        return "never"
    return f"{n} (> the {available} held-out)" if available is not None and n > available else str(n)


def render_power(res: dict) -> list[str]:
    """The power section: one row per comparison whose CI includes 0 (its `power` entry in results.json)."""
    rows, P, S = [], len(res["problem_ids"]), len(res["budget"]["seeds"])
    for c in res["claims"]:
        for r in c["comparisons"]:
            if "power" not in r:
                continue
            pw, two = r["power"], r["power"]["two_level"]
            rows.append([r["name"] + ("" if r["counted"] else " (context)"),
                         f"{r['estimate']:+.4f} [{r['lo']:+.4f}, {r['hi']:+.4f}]",
                         _count(pw["problems_needed"], pw["problems_available"]), _count(pw["seeds_needed"]),
                         f"{pw['seed_variance_share']:.2f}",
                         _count(two["problems_needed"], pw["problems_available"]), _count(two["seeds_needed"])])
    lines = ["### Power of the undecided comparisons", ""]
    if not rows:
        return lines + ["Every evaluated comparison's CI excludes 0.", ""]
    return lines + [
        f"For each comparison whose CI includes 0: the held-out problems (at the current {S} seed(s)) and, "
        f"separately, the seeds (at the current {P} problems) that would make the 95% CI exclude 0 if the "
        "observed difference were the true one, assuming the CI's half-width on zero's side scales as "
        "1/sqrt(count): the smallest count above count x (half-width / |difference|)^2. The problem count "
        "caps at the "
        f"{res['problems_available']} problems of the held-out split: a larger number means no evaluation of "
        "this testbed can settle the comparison at these seeds. Seeds and problems are not interchangeable: "
        "the formula credits all of the CI's width to the count that changes, but where most of the bootstrap "
        "variance is across seeds (column 'seed share': var over seeds / (var over seeds + var over "
        "problems), from one-level bootstraps) more problems barely narrow the CI. The two-level columns keep "
        "the other level's part of the variance fixed; 'never' = that part alone keeps the CI over 0 (with "
        "one seed the seed variance is not observed, so the seed columns mean nothing).", ""
    ] + _table(["comparison", "difference [95% CI]", f"problems needed ({S} seed{'s' * (S != 1)})",
                f"seeds needed ({P} problems)", "seed share", "two-level: problems", "two-level: seeds"],
               rows) + [""]


def write_readme_block(readme: Path, block: str) -> None:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{readme} has no generated-results markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + BEGIN + "\n" + block.strip() + "\n" + END + tail)


# ------------------------------------------------------------------------------------------ plots
def _save(fig, path):
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110, metadata={"Software": None})


def plot_pass_at_k(res: dict, path) -> None:
    ks = res["ks"]
    fig = Figure(figsize=(12, 4.6), layout="constrained")
    ax, ax2 = fig.subplots(1, 2)
    for i, (key, c) in enumerate(res["pass_at_k_curves"].items()):
        col, lab = f"C{i % 10}", res["methods"][key]["label"]
        ls = "--" if key == "base" else "-"
        ax.plot(ks, c["mean"], ls, marker="o", ms=3, color=col, label=lab)
        ax.fill_between(ks, c["lo"], c["hi"], color=col, alpha=0.15, linewidth=0)
        if "gain_vs_base" in c:
            g = c["gain_vs_base"]
            ax2.plot(ks, g["mean"], marker="o", ms=3, color=col, label=lab)
            ax2.fill_between(ks, g["lo"], g["hi"], color=col, alpha=0.12, linewidth=0)
    ax2.axhline(0, color="k", lw=0.8, ls="--")
    for a, yl in ((ax, "pass@k"), (ax2, "pass@k minus base")):
        a.set_xscale("log", base=2)
        a.set_xticks(ks, [str(k) for k in ks])
        a.set_xlabel("k")
        a.set_ylabel(yl)
        a.grid(alpha=0.3)
    ax.set_title("held-out pass@k (seed mean, 95% CI over problems x seeds)")
    ax2.set_title("difference from the base model")
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_training(res: dict, path) -> None:
    fig = Figure(figsize=(11, 7.5), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    keys = list(res["methods"])
    for ax, (metric, title) in zip(axes, CURVES):
        for key, cur in res["training_curves"].items():
            if metric not in cur:
                continue
            c, col = cur[metric], f"C{keys.index(key) % 10}"
            ax.plot(c["smooth_steps"], c["mean"], color=col, label=res["methods"][key]["label"], lw=1.2)
            ax.fill_between(c["smooth_steps"], c["min"], c["max"], color=col, alpha=0.12, linewidth=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    w = next((c[m]["window"] for c in res["training_curves"].values() for m in c), 1)
    fig.suptitle(f"training curves: seed mean (band: min-max over seeds), rolling mean of {w} logged points",
                 fontsize=10)
    _save(fig, path)


def plot_entropy(res: dict, path) -> None:
    cal = res["calibration"]
    edges, counts = np.array(cal["hist"]["edges"]), np.array(cal["hist"]["counts"])
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    nz = counts > 0  # log axis: empty bins are left out
    ax.bar(edges[:-1][nz], counts[nz], width=np.diff(edges)[nz], align="edge", color="C0", alpha=0.7)
    ax.set_yscale("log")
    ax.axvline(cal["threshold"], color="C3", label=f"calibrated threshold {cal['threshold']:.3f}")
    ax.axvline(cal["paper_threshold"], color="k", ls="--", label="paper threshold 1.2 (7B)")
    ax.set_xlabel("next-token entropy of the base (nats)")
    ax.set_ylabel("completion tokens")
    ax.set_title(f"tiny base, {cal['val_problems']}, {cal['num_tokens']} tokens")
    ax.legend(fontsize=8)
    _save(fig, path)


def _dumps(obj, level: int = 0) -> str:
    """JSON with one line per dict entry and every list inline (compact, still diffable)."""
    if isinstance(obj, dict) and obj:
        pad = " " * (level + 1)
        items = [f"{pad}{json.dumps(str(k))}: {_dumps(v, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, ensure_ascii=False)


def write_outputs(res: dict, out: Path) -> dict[str, Path]:
    """results.json, then results.md and the PNGs from results.json as written (JSON round trip)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "calibration": out / "calibration.json"}
    paths["calibration"].write_text(json.dumps(res["calibration"], indent=1) + "\n")
    tmp = out / "results.json.tmp"
    tmp.write_text(_dumps(res) + "\n")
    os.replace(tmp, paths["json"])
    res = json.loads(paths["json"].read_text())
    paths["md"].write_text("# SAGE miniature: results\n\n" + render_markdown(res) + "\n")
    for key, fn in (("pass_at_k", plot_pass_at_k), ("training", plot_training), ("entropy", plot_entropy)):
        paths[key] = out / PLOTS[key]
        fn(res, paths[key])
    return paths
