"""What `make demo` shows, measured: the demo on several seeds, and the base model at n = 256.

    python experiments/demo/run.py                      # seeds 0 1 2 + the base at n = 256 (~45 min, 2 cores)
    python experiments/demo/run.py --render             # only rewrite results.md and the README block

Each seed runs exactly the demo's command (`python -m sage_jax.main --config=configs/tiny.py`) with
`--config.seed=S`, one after the other on both cores, so its wall time is what a user waits. The base is
evaluated by `mode=eval` at n = 256 on every held-out problem, to show how much of the held-out set it
rarely or never solves (room for pass@k at large k). Writes `results.json` (every number below),
`results.md`, and the README's generated `demo` block; `tests/test_readme_numbers.py` checks that the
README and `configs/tiny.py`'s "Expected" line agree with `results.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))  # the repo root: studies import each other as experiments.<study>

from experiments import provenance  # noqa: E402
from experiments.readme_blocks import write_block  # noqa: E402

RESULTS = HERE / "results.json"
COMMAND = "python -m sage_jax.main --config=configs/tiny.py --workdir=DIR --config.seed=S"
KS = (1, 2, 4, 8, 16, 32)


def _run(cmd: list[str], log: Path) -> float:
    """Runs `cmd` into `log`; its wall clock is kept beside the log (`<log>.wall_s`) for a later invocation."""
    t = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    wall = time.perf_counter() - t
    Path(f"{log}.wall_s").write_text(f"{wall:.1f}\n")
    return wall


def _levels(data_dir: str) -> dict[str, int]:
    from sage_jax.data import builders
    from sage_jax.data.sources import decode_record
    src = builders.load_split("procedural_arithmetic", "test", data_dir=data_dir, config="strategies")
    return {r["id"]: int(r["level"]) for r in (decode_record(src[i]) for i in range(len(src)))}


def _per_level(per_problem: dict, levels: dict[str, int], metric: str) -> dict[str, float]:
    by: dict[int, list[float]] = {}
    for pid, m in per_problem.items():
        by.setdefault(levels[pid], []).append(m[metric])
    return {str(k): sum(v) / len(v) for k, v in sorted(by.items())}


def seed_result(workdir: Path, wall_s: float, levels: dict[str, int]) -> dict:
    summary = json.loads((workdir / "eval" / "results.json").read_text())["summary"]
    steps = sorted(summary["models"], key=lambda m: int(m.split("_")[1]))
    first, last = steps[0], steps[-1]
    bench = next(iter(summary["benchmarks"]))
    keep = [f"pass@{k}" for k in KS] + ["distinct_correct_strategies"] + sorted(
        k for k in summary["models"][last][bench] if k.startswith("share/"))
    rows = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    reward = [r["reward/reward_mean"] for r in rows if "reward/reward_mean" in r]
    fifth = max(1, len(reward) // 5)
    pp = summary["per_problem"]
    return {
        "wall_s": round(wall_s, 1), "steps": int(last.split("_")[1]), "num_problems": summary["benchmarks"][bench]["num_problems"],
        "n": summary["benchmarks"][bench]["n"],
        "before": {k: summary["models"][first][bench][k] for k in keep},
        "after": {k: summary["models"][last][bench][k] for k in keep},
        "gain": {k: summary["deltas"][last][bench][k] for k in keep},
        "train_reward_first_fifth": sum(reward[:fifth]) / fifth, "train_reward_last_fifth": sum(reward[-fifth:]) / fifth,
        "pass@1_by_level": {"before": _per_level(pp[first][bench], levels, "pass@1"),
                            "after": _per_level(pp[last][bench], levels, "pass@1")},
    }


def base_result(workdir: Path, levels: dict[str, int]) -> dict:
    results = json.loads((workdir / "eval" / "results.json").read_text())
    model = next(iter(results["models"]))
    bench = next(iter(results["summary"]["benchmarks"]))
    recs = results["models"][model]["benchmarks"][bench]["problems"]
    n = results["models"][model]["benchmarks"][bench]["n"]
    c = {pid: r["num_correct"] for pid, r in recs.items()}
    by_level: dict[str, dict] = {}
    for pid, k in c.items():
        d = by_level.setdefault(str(levels[pid]), {"problems": 0, "never": 0, "at_most_2": 0})
        d["problems"] += 1
        d["never"] += k == 0
        d["at_most_2"] += k <= 2
    stats = results["summary"]["models"][model][bench]
    return {"n": n, "num_problems": len(c), "never_solved": sum(v == 0 for v in c.values()) / len(c),
            "solved_at_most_2": sum(v <= 2 for v in c.values()) / len(c), "by_level": by_level,
            "pass@k": {k: stats[k] for k in stats if k.startswith("pass@")},
            "distinct_correct_strategies": stats.get("distinct_correct_strategies")}


# ----------------------------------------------------------------------------- rendering

def _ci(s: dict, d: int = 3) -> str:
    return f"{s['mean']:.{d}f} [{s['lo']:.{d}f}, {s['hi']:.{d}f}]"


def render(res: dict) -> str:
    seeds = sorted(res["seeds"], key=int)
    r0 = res["seeds"][seeds[0]]
    out = [f"Seed {seeds[0]} (`make demo`), {r0['num_problems']} held-out problems x n = {r0['n']}, "
           f"{r0['steps']} RL steps, {r0['wall_s'] / 60:.1f} min wall clock on the 2-core CPU; "
           "mean over problems [95% bootstrap CI over problems], gain paired over problems:", "",
           "| metric | before (shipped base) | after RL | gain |", "|---|---|---|---|"]
    for k in r0["before"]:
        d = 2 if k == "distinct_correct_strategies" else 3
        out.append(f"| {k} | {_ci(r0['before'][k], d)} | {_ci(r0['after'][k], d)} | {_ci(r0['gain'][k], d)} |")
    out += ["", "Every seed (the same command with `--config.seed=S`):", "",
            "| seed | pass@1 before | pass@1 after | gain [95% CI] | pass@32 gain [95% CI] | train reward (first / last fifth) | wall clock |",
            "|---|---|---|---|---|---|---|"]
    for s in seeds:
        r = res["seeds"][s]
        out.append(f"| {s} | {r['before']['pass@1']['mean']:.3f} | {r['after']['pass@1']['mean']:.3f} | "
                   f"{_ci(r['gain']['pass@1'])} | {_ci(r['gain']['pass@32'])} | "
                   f"{r['train_reward_first_fifth']:.3f} / {r['train_reward_last_fifth']:.3f} | {r['wall_s'] / 60:.1f} min |")
    after = [res["seeds"][s]["after"]["pass@1"]["mean"] for s in seeds]
    gain_lo = min(res["seeds"][s]["gain"]["pass@1"]["lo"] for s in seeds)
    out += ["", f"What a rerun should give: 200 float32 RL steps amplify rounding, so another machine, BLAS or "
            f"commit follows another trajectory from the same seed, as another seed does. What must hold: a gain "
            f"whose 95% CI excludes 0 (the lowest lower bound here: {gain_lo:.3f}); a gain whose CI includes 0 is a "
            f"failure worth reporting. Held-out pass@1 after RL lands near the seeds' values ({min(after):.3f} to "
            f"{max(after):.3f} here; {len(seeds)} seeds understate the spread, so a value a hundredth outside "
            f"them is no failure). Measured at commit `{res['commit'][:12]}` with `{res['command']}`."]
    lv = r0["pass@1_by_level"]
    out += ["", "pass@1 by number of operands (seed " + seeds[0] + "; 6 operands never appear in the base's SFT data): "
            + ", ".join(f"{k}: {lv['before'][k]:.3f} -> {lv['after'][k]:.3f}" for k in lv["before"]) + "."]
    b = res.get("base_n256")
    if b:
        lv = ", ".join(f"{k} operands {d['at_most_2'] / d['problems']:.2f}"
                       for k, d in sorted(b["by_level"].items(), key=lambda kv: int(kv[0])))
        top = b["pass@k"][f"pass@{b['n']}"]["mean"]
        out += ["", f"The shipped base at n = {b['n']} on all {b['num_problems']} held-out problems: pass@1 "
                f"{b['pass@k']['pass@1']['mean']:.3f}, pass@{b['n']} {top:.3f}; "
                f"{b['never_solved']:.1%} of the problems are never solved and {b['solved_at_most_2']:.1%} at most twice "
                f"in {b['n']} samples (share solved at most twice, by operands: {lv}); measured at commit "
                f"`{(b.get('commit') or 'not recorded')[:12]}`."]
    return "\n".join(out)


def expected_line(res: dict) -> str:
    """The figure `configs/tiny.py`'s docstring quotes (its test compares the two)."""
    r = res["seeds"][sorted(res["seeds"], key=int)[0]]
    return (f"Expected: held-out pass@1 {r['before']['pass@1']['mean']:.3f} -> {r['after']['pass@1']['mean']:.3f} "
            f"(gain {_ci(r['gain']['pass@1'])}), from experiments/demo/results.json.")


def write_outputs(res: dict) -> None:
    RESULTS.write_text(json.dumps(res, indent=1) + "\n")
    (HERE / "results.md").write_text(render(res) + "\n")
    write_block(REPO / "README.md", "demo", render(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", default="/tmp/sage_jax_demo_study")
    ap.add_argument("--no-base", action="store_true",
                    help="skip the base at n = 256 (results.json keeps its previous base_n256, with that run's commit)")
    ap.add_argument("--render", action="store_true", help="only re-render results.md and the README block")
    a = ap.parse_args()
    if a.render:
        write_outputs(json.loads(RESULTS.read_text()))
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    data_dir = str(work / "tfds")
    levels = _levels(data_dir)
    res = {"command": COMMAND, "config": "configs/tiny.py", "date": time.strftime("%Y-%m-%d"),
           "machine": f"{os.cpu_count()}-core CPU", "commit": provenance.commit(REPO), "seeds": {}}
    py = sys.executable
    for s in a.seeds:
        wd, wall_file = work / f"seed{s}", work / f"seed{s}.log.wall_s"
        if (wd / "export_hf").exists() and wall_file.exists():  # finished by an earlier invocation: reused
            res["seeds"][str(s)] = seed_result(wd, float(wall_file.read_text()), levels)
            continue
        if (wd / "export_hf").exists():
            raise SystemExit(f"{wd} holds a finished run; use another --work (its wall time would not be measured)")
        print(f"seed {s}: {COMMAND.replace('DIR', str(wd)).replace('=S', f'={s}')}", flush=True)
        wall = _run([py, "-m", "sage_jax.main", "--config=configs/tiny.py", f"--workdir={wd}", f"--config.seed={s}",
                     f"--config.data.data_dir={data_dir}", "--config.logging.progress=False"], work / f"seed{s}.log")
        res["seeds"][str(s)] = seed_result(wd, wall, levels)
        print(f"  {wall / 60:.1f} min, pass@1 gain {_ci(res['seeds'][str(s)]['gain']['pass@1'])}", flush=True)
    if not a.no_base:
        wd = work / "base_n256"
        print("base at n = 256 ...", flush=True)
        _run([py, "-m", "sage_jax.main", "--config=configs/tiny.py", f"--workdir={wd}", "--config.mode=eval",
              "--config.eval.n=256", "--config.eval.batch_size=512", f"--config.data.data_dir={data_dir}",
              "--config.logging.progress=False"], work / "base_n256.log")
        res["base_n256"] = dict(base_result(wd, levels), commit=res["commit"])
    elif RESULTS.exists() and "base_n256" in json.loads(RESULTS.read_text()):
        prev = json.loads(RESULTS.read_text())
        res["base_n256"] = dict(prev["base_n256"], commit=prev["base_n256"].get("commit", prev.get("commit")))
    write_outputs(res)
    print(render(res))


if __name__ == "__main__":
    main()
