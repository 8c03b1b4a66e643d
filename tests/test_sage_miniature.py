"""The miniature SAGE study's pipeline (experiments/sage_miniature/) in its --quick mode, end to end.

Runs `run.py --quick` into a temporary folder (calibration, 2 methods + the base, 1 seed, 4 RL steps,
n = 8 on 8 problems), checks that every output file is produced, re-derives every number of the
results.md tables from results.json, and checks that a second invocation runs no job and changes no file.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "experiments" / "sage_miniature" / "run.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(out: Path) -> tuple[str, float]:
    t0 = time.time()
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, str(RUN), "--quick", "--out", str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout + p.stderr, time.time() - t0


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("sage_miniature") / "out"
    log, wall = _run(out)
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
    assert cal["val_problems"].startswith("train[256:")
    spec = json.loads((out / "work" / "specs" / "train__sage_branch_s0.json").read_text())
    assert spec["overrides"]["sage.branch.threshold"] == cal["threshold"]
    assert "threshold" not in json.dumps(json.loads((out / "work" / "specs" / "train__grpo_s0.json").read_text()))
    for key in ("reward/reward_mean", "train/kl", "train/entropy", "sage/q_mean"):
        assert key in res["training_curves"]["grpo"], key


def test_table_numbers_are_computed_from_results_json(study):
    out, _, _ = study
    res = json.loads((out / "results.json").read_text())
    md = (out / "results.md").read_text()
    main, diag, *claims = _tables(md)
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
    decimals = {"distinct_correct_answers": 2, "distinct_correct_completions": 2, "mean_length": 1}
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


def test_second_invocation_skips_finished_work(study):
    out, _, first_wall = study
    files = ["results.json", "results.md", "calibration.json", "pass_at_k.png", "training_curves.png",
             "entropy_hist.png"]
    before = {f: (out / f).read_bytes() for f in files}
    markers = {p: p.stat().st_mtime_ns for p in (out / "work").rglob("*") if p.name in ("done.json", "metrics.jsonl")
               or p.suffix == ".log"}
    assert len(markers) >= 7
    log, wall = _run(out)
    assert "0 of 6 jobs to run" in log
    assert wall < max(60.0, first_wall / 2)
    assert {f: (out / f).read_bytes() for f in files} == before
    assert {p: p.stat().st_mtime_ns for p in markers} == markers
