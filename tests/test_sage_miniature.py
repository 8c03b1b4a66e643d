"""The miniature SAGE study's pipeline (experiments/sage_miniature/) in its --quick mode, end to end.

Runs `run.py --quick` into a temporary folder (calibration, 2 methods + the base, 1 seed, 4 RL steps,
n = 8 on 8 problems), checks that every output file is produced, that the procedure metrics
(distinct correct strategies, share per procedure) reach results.json, re-derives every number of the
results.md tables from results.json, and checks that a second invocation runs no job and changes no file.
The power-estimate arithmetic (`stats.required_counts`, `stats.two_level_counts`) is checked on
hand-computed cases without running anything.
"""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "experiments" / "sage_miniature"
RUN = STUDY / "run.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PROCEDURES = ("rule", "terms", "left", "right")
POWER_HEADING = "### Power of the undecided comparisons"


def _run(out: Path, data_dir: str) -> tuple[str, float]:
    t0 = time.time()
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, str(RUN), "--quick", "--out", str(out), "--data-dir", data_dir], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr, time.time() - t0


@pytest.fixture(scope="module")
def study(tmp_path_factory, tiny_task_data_dir):
    out = tmp_path_factory.mktemp("sage_miniature") / "out"
    log, wall = _run(out, tiny_task_data_dir)  # the suite's prepared copy of the task (conftest)
    return out, log, wall


def _pm(values, decimals=3):
    v = np.asarray(values, np.float64)
    std = float(np.std(v, ddof=1)) if v.size > 1 else 0.0
    return f"{np.mean(v):.{decimals}f} ± {std:.{decimals}f}"


def _tables(md: str) -> list[list[list[str]]]:
    """Every Markdown table of `md` as rows of cells (header and separator dropped)."""
    tables, cur = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            cur.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif cur:
            tables.append(cur[2:])
            cur = []
    return tables


def test_every_output_file_is_produced(study):
    out, log, _ = study
    for name in ("results.json", "results.md", "calibration.json"):
        assert (out / name).stat().st_size > 0, name
    for name in ("pass_at_k.png", "training_curves.png", "entropy_hist.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000, name
    res = json.loads((out / "results.json").read_text())
    assert set(res["methods"]) == {"base", "grpo", "sage_branch"}
    assert res["mode"] == "quick" and res["kmax"] == 8 and res["ks"] == [1, 2, 4, 8]
    cal = json.loads((out / "calibration.json").read_text())
    assert cal == res["calibration"]
    # the rule: the branch threshold is the 80th percentile of the base's validation-token entropy
    assert cal["quantile"] == 0.8 and abs(cal["threshold"] - cal["quantiles"]["p80"]) < 1e-3
    # validation problems: the last V of the 50k training problems (no RL pool any more)
    assert cal["val_problems"] == f"train[{50000 - res['budget']['val_problems']}:50000]"
    assert res["eval_settings"]["max_tokens"] == 96 and cal["spec"]["max_new_tokens"] == 96
    spec = json.loads((out / "work" / "specs" / "train__sage_branch_s0.json").read_text())
    assert spec["overrides"]["sage.branch.threshold"] == cal["threshold"]
    assert "threshold" not in json.dumps(json.loads((out / "work" / "specs" / "train__grpo_s0.json").read_text()))
    for key in ("reward/reward_mean", "train/kl", "train/entropy", "sage/q_mean"):
        assert key in res["training_curves"]["grpo"], key
    # the code every job ran: one commit of this checkout (the suite may run on a dirty tree)
    (commit,) = res["timing"]["commits"]
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", commit), commit


def test_strategy_metrics_reach_results_json(study):
    out, _, _ = study
    res = json.loads((out / "results.json").read_text())
    assert res["strategy_labels"] == list(PROCEDURES) and res["problems_available"] == 500
    shares = [f"share/{x}" for x in PROCEDURES]
    for name, r in res["runs"].items():
        for metric in ["distinct_correct_strategies", "distinct_correct_completions", *shares]:
            assert metric in r["metrics"] and metric in r["per_problem"], (name, metric)
        dcs, p1 = r["per_problem"]["distinct_correct_strategies"], r["per_problem"]["pass@1"]
        for i, d in enumerate(dcs):
            # left / right count too where the order of operations does not change the value
            assert d in (0.0, 1.0, 2.0, 3.0, 4.0) and (d == 0 or p1[i] > 0), (name, i)
            total = sum(r["per_problem"][m][i] for m in shares)
            assert -1e-9 <= total <= 1 + 1e-9, (name, i)
        # the shares agree with the raw per-sample labels of the evaluation
        raw = json.loads((out / "work" / "eval" / name / "eval" / "results.json").read_text())
        recs = list(next(iter(raw["models"][name]["benchmarks"].values()))["problems"].values())
        labels = [x for rec in recs for x in rec["strategies"]]
        assert len(labels) == res["eval_settings"]["n"] * len(res["problem_ids"])
        for x in PROCEDURES:
            assert abs(np.mean([y == x for y in labels]) - r["metrics"][f"share/{x}"]["mean"]) < 1e-5, (name, x)
    for key, m in res["methods"].items():
        for metric in ["distinct_correct_strategies", *shares]:
            assert metric in m["seed_stats"], (key, metric)
    claim = next(c for c in res["claims"] if c["id"] == "branch_keeps_exploration")
    assert claim["verdict"] != "not evaluated"  # base, grpo and sage_branch all run in --quick
    metrics = {t[2] for comp in claim["comparisons"] for t in comp["terms"]}
    assert {"share/terms", "distinct_correct_strategies"} <= metrics
    for c in res["claims"]:
        for comp in c["comparisons"]:
            assert ("power" in comp) == (comp["outcome"] == "neither"), comp["name"]


def test_table_numbers_are_computed_from_results_json(study):
    out, _, _ = study
    res = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    assert POWER_HEADING in md
    main, diag, *claims = _tables(md.split(POWER_HEADING)[0])
    kmax = res["kmax"]
    runs = res["runs"]

    def seeds(key):
        m = res["methods"][key]
        return [m["runs"][s] for s in sorted(m["runs"], key=int)]

    # per-run means are the means of the stored per-problem values
    for name, r in runs.items():
        for metric, vals in r["per_problem"].items():
            if all(v is not None for v in vals):
                assert abs(np.mean(vals) - r["metrics"][metric]["mean"]) < 1e-5, (name, metric)
    assert len(main) == len(res["methods"])
    for row, key in zip(main, res["methods"]):
        assert row[0].endswith(f"(`{key}`)")
        assert row[1] == _pm([runs[n]["metrics"]["pass@1"]["mean"] for n in seeds(key)])
        assert row[2] == _pm([runs[n]["metrics"][f"pass@{kmax}"]["mean"] for n in seeds(key)])
        paper = res["methods"][key]["paper"]
        assert row[3:5] == ([f"{paper[0]:.3f}", f"{paper[1]:.3f}"] if paper else [row[3]] * 2)
    header = md.split("### Diagnostics")[1].split("| method |")[1].split("\n")[0]
    cols = [c.strip() for c in header.strip().strip("|").split("|")]
    decimals = {"distinct_correct_answers": 2, "distinct_correct_completions": 2, "distinct_correct_strategies": 2,
                "mean_length": 1}
    assert {"distinct_correct_strategies", "share/rule", "share/terms", "share/left", "share/right"} <= set(cols)
    for row, key in zip(diag, res["methods"]):
        assert row[0] == f"`{key}`"
        for cell, col in zip(row[1:], cols):
            if col.startswith("train reward"):
                expect = (_pm([runs[n]["train_reward_last20"] for n in seeds(key)])
                          if res["methods"][key]["trained"] else "–")
            else:
                expect = _pm([runs[n]["metrics"][col]["mean"] for n in seeds(key)], decimals.get(col, 3))
            assert cell == expect, (key, col)
    # claims: one table per claim; each estimate re-derived from the per-problem values
    assert len(claims) == len(res["claims"])
    for table, claim in zip(claims, res["claims"]):
        assert f"**{claim['claim']}**: {claim['verdict']}" in md
        for row, comp in zip(table, claim["comparisons"]):
            if comp["outcome"] == "not evaluated":
                assert row[2] == "–"
                continue
            est = sum(c * np.mean([np.mean(runs[n]["per_problem"][metric]) for n in seeds(m)])
                      for c, m, metric in comp["terms"])
            lo, hi = (float(x) for x in re.findall(r"[+-]\d+\.\d+", row[2])[1:])
            assert row[2].startswith(f"{est:+.4f} "), (row, est)
            assert (lo, hi) == (round(comp["lo"], 4), round(comp["hi"], 4))
            assert lo <= hi
            assert row[3] == comp["outcome"]
    # power: one row per undecided comparison, the counts re-derived from its estimate and CI
    power_rows = _tables(md.split(POWER_HEADING)[1].split("### Calibration")[0])
    undecided = [comp for c in res["claims"] for comp in c["comparisons"] if "power" in comp]
    rows = power_rows[0] if power_rows else []
    assert len(rows) == len(undecided)
    P, S = len(res["problem_ids"]), len(res["budget"]["seeds"])
    for row, comp in zip(rows, undecided):
        assert row[0].startswith(comp["name"])
        d = comp["estimate"]
        h = d - comp["lo"] if d >= 0 else comp["hi"] - d
        if d == 0:
            assert row[2] == row[3] == "never"
            continue
        need_p, need_s = math.floor(P * (h / d) ** 2 + 1e-9) + 1, math.floor(S * (h / d) ** 2 + 1e-9) + 1
        assert (comp["power"]["problems_needed"], comp["power"]["seeds_needed"]) == (need_p, need_s)
        assert row[2] == (str(need_p) if need_p <= 500 else f"{need_p} (> the 500 held-out)")
        assert row[3] == str(need_s)
        assert comp["power"]["problems_within_available"] == (need_p <= 500)


def _study_modules(*names):
    """The study's modules (`stats`, `report`, ...) as its scripts import them: experiments.sage_miniature.<name>
    from the repo root (qualified names shadow no other test's modules)."""
    import importlib
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    return [importlib.import_module(f"experiments.sage_miniature.{n}") for n in names]


def test_power_estimate_arithmetic():
    """Hand-computed: difference +0.02, CI [-0.004, +0.05] -> half-width toward 0 = 0.024, (0.024 / 0.02)^2
    = 1.44; 128 problems x 1.44 = 184.3 -> 185; 3 seeds x 1.44 = 4.32 -> 5 (the smallest count above). Negative differences use the
    upper bound. Two-level with seed share f: problems = 128 h^2 (1 - f) / (d^2 - h^2 f), seeds = 3 h^2 f /
    (d^2 - h^2 (1 - f)); f = 0.5: 128 x 0.000288 / 0.000112 = 329.1 -> 330, 3 x 0.000288 / 0.000112 =
    7.7 -> 8; f = 0.9: h^2 f = 0.000518 > d^2 = 0.0004, so no number of problems suffices at 3 seeds."""
    (stats,) = _study_modules("stats")
    r = stats.required_counts(0.02, -0.004, 0.05, problems=128, seeds=3)
    assert r["half_width"] == pytest.approx(0.024)
    assert (r["problems_needed"], r["seeds_needed"]) == (185, 5)
    r = stats.required_counts(-0.02, -0.05, 0.004, problems=128, seeds=3)
    assert (r["problems_needed"], r["seeds_needed"]) == (185, 5)
    # a CI bound exactly at 0 (ratio 1) does not exclude it: one more than there are now
    r = stats.required_counts(0.25, 0.0, 0.5, problems=64, seeds=3)
    assert (r["problems_needed"], r["seeds_needed"]) == (65, 4)
    # ratio (0.03 / 0.02)^2 = 2.25, 128 x 2.25 = 288 exactly (up to rounding) -> 289
    assert stats.required_counts(0.02, -0.01, 0.05, problems=128, seeds=3)["problems_needed"] == 289
    assert stats.required_counts(0.0, -0.1, 0.1, problems=64, seeds=3)["problems_needed"] is None
    assert stats.two_level_counts(0.02, -0.004, 0.05, 128, 3, 0.5) == {"problems_needed": 330, "seeds_needed": 8}
    assert stats.two_level_counts(0.02, -0.004, 0.05, 128, 3, 0.9) == {"problems_needed": None, "seeds_needed": 5}
    assert stats.two_level_counts(0.02, -0.004, 0.05, 128, 1, 0.0)["seeds_needed"] is None  # no seed variance


def test_claims_read_metrics_the_report_keeps():
    report, stats = _study_modules("report", "stats")
    kept = set(report.PER_PROBLEM_KEEP) | {"pass@1", "kmax"}
    assert stats.claim_metrics() <= kept
    assert {"distinct_correct_strategies", "share/terms"} <= stats.claim_metrics()


def test_second_invocation_skips_finished_work(study, tiny_task_data_dir):
    out, _, first_wall = study
    files = ["results.json", "results.md", "calibration.json", "pass_at_k.png", "training_curves.png",
             "entropy_hist.png"]
    before = {f: (out / f).read_bytes() for f in files}
    markers = {p: p.stat().st_mtime_ns for p in (out / "work").rglob("*") if p.name in ("done.json", "metrics.jsonl")
               or p.suffix == ".log"}
    assert len(markers) >= 7
    log, wall = _run(out, tiny_task_data_dir)
    assert "0 of 6 jobs to run" in log
    assert wall < max(60.0, first_wall / 2)
    assert {f: (out / f).read_bytes() for f in files} == before
    assert {p: p.stat().st_mtime_ns for p in markers} == markers


def test_readme_methods_table_is_what_the_study_runs():
    """README's methods table lists each method's overrides exactly as methods.py sets them (the calibrated
    threshold as <calibrated>), so the text cannot drift from what runs; the DAPO rows are configs/dapo.py's."""
    (methods,) = _study_modules("methods")
    table = next(t for t in _tables((STUDY / "README.md").read_text()) if t and t[0][0] == "`base`")
    rows = {r[0].strip("`"): r[2] for r in table}
    for m in methods.METHODS:
        want = "(no training)" if not m.trained else ", ".join(
            f"`{k}=<calibrated>`" if v == methods.THRESHOLD else f"`{k}={v!r}`" for k, v in m.overrides.items())
        assert rows[m.key] == want, m.key
    assert {"rl.dynamic_sampling", "rl.overlong_buffer", "rl.eps_high"} <= set(methods.BY_KEY["dapo"].overrides)
    assert methods.BY_KEY["dapo"].overrides["rl.eps_high"] == 0.28


def test_evidence_comparisons_are_the_preregistered_ones():
    """README "Evidence study": every guided method minus GRPO, branch minus token and random, the reward form
    minus the loss form, each on pass@1, pass@kmax, share/terms and distinct_correct_strategies."""
    methods, stats = _study_modules("methods", "stats")
    got = {(c["a"], c["b"], c["metric"]) for c in stats.evidence_comparisons(list(methods.EVIDENCE.methods))}
    guided = ["sage_branch", "sage_token", "sage_random", "sage_branch_reward", "sage_branch_p95",
              "sage_branch_p99", "sage_branch_paper"]
    pairs = [(g, "grpo") for g in guided] + [("sage_branch", "sage_token"), ("sage_branch", "sage_random"),
                                             ("sage_branch_reward", "sage_branch")]
    metrics = ("pass@1", "kmax", "share/terms", "distinct_correct_strategies")
    assert got == {(a, b, k) for a, b in pairs for k in metrics}
    assert set(stats.THRESHOLD_SETTINGS) <= set(methods.EVIDENCE.methods)
    assert len(methods.EVIDENCE.seeds) >= 7 and methods.EVIDENCE.eval_n == 256


def test_decide_evidence_reads_each_ci_as_it_falls():
    """Hand-made values over 7 seeds x 40 problems: branch = GRPO + 0.1 on every problem and seed (estimate
    exactly +0.1; the seeds are resampled per method, so the CI has width: values uniform on [0, 0.8] give a
    seed-mean spread of ~0.014 over 40 problems, far from reaching 0), random = GRPO - 0.1, token = GRPO exactly
    (0: no side, and a power entry)."""
    (stats,) = _study_modules("stats")
    rng = np.random.default_rng(0)
    grpo = {m: rng.uniform(0, 0.8, (7, 40)) for m in ("pass@1", "pass@256", "share/terms",
                                                     "distinct_correct_strategies")}
    per = {"grpo": grpo, "sage_branch": {m: v + 0.1 for m, v in grpo.items()},
           "sage_token": {m: v.copy() for m, v in grpo.items()}, "sage_random": {m: v - 0.1 for m, v in grpo.items()}}
    rows = {r["name"]: r for r in stats.decide_evidence(per, 256, 500)}
    up = rows["sage_branch - grpo, pass@256"]
    assert up["estimate"] == pytest.approx(0.1) and 0 < up["lo"] < 0.1 < up["hi"] and up["outcome"] == "> 0"
    down = rows["sage_random - grpo, pass@1"]
    assert down["estimate"] == pytest.approx(-0.1) and down["outcome"] == "< 0"
    assert rows["sage_branch - sage_random, distinct_correct_strategies"]["estimate"] == pytest.approx(0.2)
    flat = rows["sage_token - grpo, share/terms"]
    assert flat["estimate"] == 0 and flat["outcome"] == "includes 0" and "power" in flat
    assert "sage_branch_reward - sage_branch, pass@1" not in rows  # a method not run: its comparisons left out


def test_shaping_summary_of_a_run(tmp_path):
    """`sage/frac_shaped_first` is a share of all tokens: x tokens per completion gives the share of completions
    whose first token is shaped (0.01 x 50 = 0.5 and 0.02 x 40 = 0.8: mean 0.65)."""
    (report,) = _study_modules("report")
    rows = [{"step": 5, "sage/frac_shaped": 0.2, "sage/frac_shaped_first": 0.01, "sage/frac_shaped_later": 0.19,
             "rollout/length_mean": 50.0},
            {"step": 10, "sage/frac_shaped": 0.1, "sage/frac_shaped_first": 0.02, "sage/frac_shaped_later": 0.08,
             "rollout/length_mean": 40.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = report._shaping(str(tmp_path))
    assert got == pytest.approx({"frac_shaped": 0.15, "frac_shaped_first": 0.015, "frac_shaped_later": 0.135,
                                 "first_tokens_shaped": 0.65})


def test_threshold_study_items(tmp_path):
    """One item per branch setting that ran, fewest tokens shaped first: the threshold in nats (the calibration's
    quantile, or 1.2 as given), the share of the base's calibration tokens above it (1 - q by construction; the
    measured share for 1.2), the runs' shaping in training and the differences from GRPO; results.md's table."""
    (report,) = _study_modules("report")
    cal = {"threshold": 0.0051, "quantile": 0.8, "quantiles": {"p95": 0.3309, "p99": 0.87224},
           "share_above_paper_threshold": 0.0066}
    row = {"step": 5, "sage/frac_shaped": 0.3, "sage/frac_shaped_first": 0.01, "sage/frac_shaped_later": 0.29,
           "rollout/length_mean": 50.0}
    plan, run_dirs, per = {"mode": "evidence", "methods": {}}, {}, {}
    rng = np.random.default_rng(1)
    base = {m: rng.uniform(0, 0.8, (2, 10)) for m in ("pass@1", "pass@256", "share/terms",
                                                     "distinct_correct_strategies")}
    for key, thr in (("grpo", None), ("sage_branch", "calibrated"), ("sage_branch_p99", "calibrated:p99"),
                     ("sage_branch_paper", 1.2)):
        plan["methods"][key] = {"overrides": {} if thr is None else {"sage.branch.threshold": thr},
                                "runs": {"0": f"{key}_s0", "1": f"{key}_s1"}}
        per[key] = {m: v + (0.0 if thr is None else 0.05) for m, v in base.items()}
        for s in (0, 1):
            d = tmp_path / f"{key}_s{s}"
            d.mkdir()
            (d / "metrics.jsonl").write_text(json.dumps(row) + "\n")
            run_dirs[f"{key}_s{s}"] = str(d)
    sec = report.evidence_sections(plan, cal, run_dirs, per, 256)
    items = sec["threshold_study"]
    assert [i["method"] for i in items] == ["sage_branch_p99", "sage_branch_paper", "sage_branch"]
    assert [i["threshold_nats"] for i in items] == [0.8722, 1.2, 0.0051]
    assert [i["base_tokens_above"] for i in items] == pytest.approx([0.01, 0.0066, 0.2])
    assert items[0]["training"]["first_tokens_shaped"]["mean"] == pytest.approx(0.5)
    assert items[0]["vs_grpo"]["pass@1"]["estimate"] == pytest.approx(0.05)
    assert set(items[0]["vs_grpo"]) == {"pass@1", "pass@256", "share/terms", "distinct_correct_strategies"}
    res = {"kmax": 256, "budget": {"seeds": [0, 1]}, **sec}
    md = "\n".join(report.render_evidence(res))
    assert "### Threshold study" in md and "| `sage_branch_p99` (calibrated:p99) | 0.8722 | 0.010 |" in md
