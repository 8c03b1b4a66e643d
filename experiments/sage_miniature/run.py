"""The miniature SAGE reproduction, one command (see README.md):

    python experiments/sage_miniature/run.py                 # the full study (estimate: --dry-run prints it)
    python experiments/sage_miniature/run.py --dry-run       # the plan and the time estimate, nothing run
    python experiments/sage_miniature/run.py --core          # the counted claims only, 2 seeds (about 65 minutes)
    python experiments/sage_miniature/run.py --quick --out /tmp/sage_mini_quick   # the pipeline, a few minutes
    python experiments/sage_miniature/run.py --evidence --work DIR   # issue 39's 7-seed study (about 5 hours)

Stages, each job in its own process (`worker.py`), at most `--jobs` at a time (each pinned to one core):
calibrate (entropy of the base on validation problems -> branch threshold) -> train every (method, seed)
-> evaluate the base and every final policy on the same held-out problems with the same seeds, labelling
each sample's procedure -> report (results.json, results.md, PNGs; with --write-readme also the README's
results block). Rerunning skips every finished job (its result file exists) and resumes unfinished ones
from their checkpoints / stored samples; a job whose settings changed is refused (use another --out).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # the repo root: studies import each other as experiments.<study>

from experiments import provenance  # noqa: E402
from experiments.sage_miniature import methods as M  # noqa: E402
from experiments.sage_miniature.worker import BENCH, REPO  # noqa: E402

DEFAULT_OUT = HERE / "results"
EVIDENCE_OUT = HERE / "evidence"
README = HERE / "README.md"
TINY_BASE = os.path.join(REPO, "sage_jax", "assets", "tiny_base")

# Seconds per job on this project's 2-core CPU, per --jobs value (1 = one job using both cores; 2 = two jobs,
# one core each, as this pipeline runs them). Used only for the printed estimate. Only TRAIN_STEP_S[1] is
# measured on the current testbed (configs/tiny.py: 0.8 s per step, seed 0, 200 steps); every other value is
# an ESTIMATE (scaled from the previous testbed's <= 48-token measurements), to be replaced by the measured
# wall time in the README after the first full run.
TRAIN_STEP_S = {1: 0.8, 2: 1.4}  # per RL step of configs/tiny.py (8 x 8 rollouts, <= 96 tokens); [2] estimated
TRAIN_OVERHEAD_S = 30.0  # process start, model load, compilation, checkpoints, export (estimate)
EVAL_PROBLEM_S = {1: 2.0, 2: 3.0}  # per problem at n = 256, <= 96 tokens (scales with n); both estimated
EVAL_OVERHEAD_S = 15.0  # (estimate)
CALIBRATE_S = 60.0  # preparing the 50k + 500-problem data set once, then 64 x 16 samples (estimate)


@dataclasses.dataclass
class Task:
    name: str
    stage: str  # calibrate | train | eval
    deps: list[str]
    make_spec: object  # () -> dict, called when the task starts (after its dependencies finished)
    result: Path
    est_units: float = 0.0  # train: RL steps; eval: problems x n / 256


def _json(path: Path):
    return json.loads(path.read_text())


def plan_study(b: M.Budget, work: Path, mode: str, data_dir: str | None = None) -> tuple[dict, list[Task]]:
    """The methods x seeds grid and the jobs that produce it; `data_dir`: where the task's TFDS copy is (or is
    prepared: by default WORK/tfds)."""
    data_dir = data_dir or str(work / "tfds")
    eval_settings = {"n": b.eval_n, "temperature": 1.0, "top_p": 1.0, "max_tokens": M.MAX_NEW_TOKENS, "seed": 0,
                     "problems_per_batch": max(1, b.eval_batch // b.eval_n), "batch_size": b.eval_batch}
    tasks = [Task("calibrate", "calibrate", [], lambda: {
        "model_path": TINY_BASE, "data_dir": data_dir, "template": "chat", "val_start": M.val_start(b),
        "val_count": b.val_problems, "test_size": M.TEST_SIZE, "n": b.val_n, "max_new_tokens": M.MAX_NEW_TOKENS,
        "temperature": 1.0, "seed": 0,
        "batch_size": 512, "quantile": M.CALIBRATION_QUANTILE, "rule": M.CALIBRATION_RULE,
        "result": str(work / "calibration.json")}, work / "calibration.json")]
    plan = {"mode": mode, "budget": dataclasses.asdict(b), "methods": {}, "curve_window": 1 if mode == "quick" else 5}

    def eval_task(name, model_path, deps):
        wd = work / "eval" / name
        return Task(f"eval:{name}", "eval", deps, lambda: {
            "model_path": model_path, "data_dir": data_dir, "num_problems": b.eval_problems, "template": "chat",
            "settings": eval_settings, "name": name, "reward": "exact_match", "workdir": str(wd),
            "result": str(wd / "done.json")}, wd / "done.json", b.eval_problems * b.eval_n / 256)

    for key in b.methods:
        m = M.BY_KEY[key]
        entry = {"label": m.label, "trained": m.trained, "paper": list(m.paper) if m.paper else None,
                 "overrides": m.overrides, "runs": {}}
        plan["methods"][key] = entry
        if not m.trained:
            entry["runs"]["0"] = key
            tasks.append(eval_task(key, TINY_BASE, ["calibrate"]))
            continue
        for seed in b.seeds:
            run = f"{key}_s{seed}"
            entry["runs"][str(seed)] = run
            wd = work / "runs" / run

            def spec(m=m, seed=seed, wd=wd):
                cal = _json(work / "calibration.json")
                ov = {k: M.resolve_threshold(v, cal) for k, v in m.overrides.items()}
                common = {"seed": seed, "max_steps": b.steps, "checkpoint_every": b.checkpoint_every,
                          "log_every": b.log_every, "eval.at_start": False, "eval.at_end": False,
                          "logging.progress": False, "logging.tensorboard": False, "data.data_dir": data_dir,
                          "ckpt.keep": 1}
                return {"overrides": {**common, **ov}, "workdir": str(wd), "result": str(wd / "done.json")}
            tasks.append(Task(f"train:{run}", "train", ["calibrate"], spec, wd / "done.json", b.steps))
            tasks.append(eval_task(run, str(wd / "export_hf"), [f"train:{run}"]))
    # seed-major: a study cut short (it resumes) holds whole seeds of every method, not every seed of a few
    seed_of = lambda t: int(t.name.rpartition("_s")[2]) if t.stage != "calibrate" and "_s" in t.name else -1
    tasks.sort(key=seed_of)
    return plan, tasks


def estimate_s(tasks: list[Task], jobs: int) -> float:
    """Wall-clock estimate: calibration, then the rest spread over the job slots (the rates above)."""
    j = 2 if jobs >= 2 else 1
    rate = {"train": (TRAIN_OVERHEAD_S, TRAIN_STEP_S[j]), "eval": (EVAL_OVERHEAD_S, EVAL_PROBLEM_S[j])}
    total = sum(rate[t.stage][0] + t.est_units * rate[t.stage][1] for t in tasks if t.stage != "calibrate")
    return CALIBRATE_S * any(t.stage == "calibrate" for t in tasks) + total / j


# ------------------------------------------------------------------------------------------ scheduling
def _check_spec(t: Task, work: Path) -> dict:
    """The task's spec, stored beside it; a finished or started task whose spec changed is refused."""
    spec = t.make_spec()
    path = work / "specs" / f"{t.name.replace(':', '__')}.json"
    if path.exists() and _json(path) != spec:
        raise SystemExit(f"error: {t.name} was started with other settings ({path}); use another --out")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(spec, indent=1))
    return spec


def _line(t: Task, spec: dict, dt: float) -> str:
    msg = f"{t.name} done in {dt / 60:.1f} min"
    try:
        if t.stage == "train":
            rows = [json.loads(x) for x in open(Path(spec["workdir"]) / "metrics.jsonl")]
            r = [x["reward/reward_mean"] for x in rows if "reward/reward_mean" in x]
            n = max(1, len(r) // 5)
            msg += f"  (train reward first/last 20%: {sum(r[:n]) / n:.3f} -> {sum(r[-n:]) / n:.3f})"
        elif t.stage == "eval":
            recs = next(iter(_json(Path(spec["workdir"]) / "eval" / "results.json")["models"].values()))
            recs = next(iter(recs["benchmarks"].values()))["problems"].values()
            p1 = sum(r["num_correct"] / len(r["correct"]) for r in recs) / len(recs)
            pn = sum(r["num_correct"] > 0 for r in recs) / len(recs)
            labels = [s for r in recs for s in r.get("strategies", ())]
            share = {x: sum(s == x for s in labels) / max(1, len(labels)) for x in ("rule", "terms")}
            msg += (f"  (pass@1 {p1:.3f}, pass@{spec['settings']['n']} {pn:.3f}; share of samples: rule "
                    f"{share['rule']:.3f}, terms {share['terms']:.3f})")
        elif t.stage == "calibrate":
            msg += f"  (branch threshold {_json(t.result)['threshold']:.3f} nats)"
    except Exception:  # a display line only
        pass
    return msg


def _record_commit(work: Path, name: str) -> None:
    """WORK/commits.json: the commit each finished job ran at (a study may be resumed across sessions)."""
    path = work / "commits.json"
    got = _json(path) if path.exists() else {}
    try:
        got[name] = provenance.commit(HERE)
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        got[name] = "unknown"
    path.write_text(json.dumps(got, indent=1, sort_keys=True))


def run_tasks(tasks: list[Task], work: Path, jobs: int) -> tuple[list[str], int]:
    """Runs the unfinished tasks, at most `jobs` at a time in dependency order. Returns (failed, ran)."""
    from tqdm.auto import tqdm
    done = {t.name for t in tasks if t.result.exists()}
    for t in tasks:  # a finished job whose settings changed since is refused, not silently reused
        if t.name in done and all(d in done for d in t.deps):
            _check_spec(t, work)
    pending = [t for t in tasks if t.name not in done]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    running: dict[int, tuple] = {}
    failed: list[str] = []
    ran = 0
    (work / "logs").mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(tasks), initial=len(done), unit="job", desc="study", dynamic_ncols=True)
    while pending or running:
        for t in list(pending):
            if any(d in failed for d in t.deps):
                pending.remove(t)
                failed.append(t.name)
                bar.write(f"{t.name} skipped: a dependency failed")
                continue
            free = [s for s in range(jobs) if s not in running]
            if not free or not all(d in done for d in t.deps):
                continue
            slot = free[0]
            spec = _check_spec(t, work)
            spec_path = work / "specs" / f"{t.name.replace(':', '__')}.json"
            log = open(work / "logs" / f"{t.name.replace(':', '__')}.log", "a")
            env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", TF_CPP_MIN_LOG_LEVEL="3")
            pre = None
            if jobs > 1:  # one core per job: measured ~1.5x the throughput of one two-thread job
                env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                                    " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
                if cores:
                    core = cores[slot % len(cores)]
                    pre = lambda core=core: os.sched_setaffinity(0, {core})  # noqa: E731
            proc = subprocess.Popen([sys.executable, str(HERE / "worker.py"), t.stage, str(spec_path)], cwd=REPO,
                                    env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pre)
            running[slot] = (t, spec, proc, time.time(), log)
            pending.remove(t)
            bar.set_postfix_str(", ".join(x[0].name for x in running.values()), refresh=True)
        progressed = False
        for slot, (t, spec, proc, t0, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[slot]
            progressed, ran = True, ran + 1
            if proc.returncode == 0 and t.result.exists():
                done.add(t.name)
                _record_commit(work, t.name)
                bar.write(_line(t, spec, time.time() - t0))
            else:
                failed.append(t.name)
                tail = (work / "logs" / f"{t.name.replace(':', '__')}.log").read_text()[-1500:]
                bar.write(f"{t.name} FAILED (exit {proc.returncode}); log tail:\n{tail}")
            bar.update(1)
            bar.set_postfix_str(", ".join(x[0].name for x in running.values()), refresh=True)
        if not progressed:
            time.sleep(0.3)
    bar.close()
    return failed, ran


# ------------------------------------------------------------------------------------------ main
def _timing(tasks: list[Task], work: Path, jobs: int, wall_s: float, ran: int) -> dict:
    path = work / "study_wall.json"
    prev = _json(path) if path.exists() else {"study_wall_s": 0.0, "jobs": jobs}
    if ran:  # accumulate the wall time of invocations that did work; a no-op rerun changes nothing
        prev = {"study_wall_s": prev["study_wall_s"] + wall_s, "jobs": jobs}
        path.write_text(json.dumps(prev))
    sums = {"train": 0.0, "eval": 0.0, "calibrate": 0.0}
    for t in tasks:
        sums[t.stage] += float(_json(t.result).get("wall_s", 0.0))
    return {"train_job_s": sums["train"], "eval_job_s": sums["eval"], "calibrate_job_s": sums["calibrate"],
            **prev}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="results folder (results.json, results.md, PNGs)")
    p.add_argument("--work", default=None, help="runs, checkpoints, raw eval samples (default OUT/work)")
    p.add_argument("--quick", action="store_true", help="2 methods + base, 1 seed, 4 steps, n = 8, 8 problems")
    p.add_argument("--core", action="store_true", help="the counted claims' 7 methods + base, 2 seeds, "
                   "200 steps, 128 problems x n = 128 (about 65 minutes)")
    p.add_argument("--evidence", action="store_true", help="issue 39's study: branch vs GRPO / token / random, "
                   "its reward form and the threshold study, 7 seeds, 128 problems x n = 256 (about 5 hours; "
                   f"default --out {EVIDENCE_OUT.relative_to(HERE)})")
    p.add_argument("--data-dir", default=None, help="the procedural_arithmetic/strategies TFDS copy to read (or "
                   "prepare) instead of WORK/tfds")
    p.add_argument("--jobs", type=int, default=2, help="jobs at a time (each pinned to one core when > 1)")
    p.add_argument("--write-readme", action=argparse.BooleanOptionalAction, default=None,
                   help="rewrite README.md's results block (default: on for a full run into the default --out)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate, run nothing")
    a = p.parse_args(argv)
    if a.quick + a.core + a.evidence > 1:
        raise SystemExit("error: --quick, --core and --evidence are budgets; choose one")
    mode = "quick" if a.quick else "core" if a.core else "evidence" if a.evidence else "full"
    b = {"quick": M.QUICK, "core": M.CORE, "evidence": M.EVIDENCE, "full": M.FULL}[mode]
    out = Path(a.out if a.out is not None else EVIDENCE_OUT if a.evidence else DEFAULT_OUT).resolve()
    work = Path(a.work).resolve() if a.work else out / "work"
    write_readme = a.write_readme if a.write_readme is not None else (mode != "quick" and out == DEFAULT_OUT)
    if write_readme and a.quick:
        raise SystemExit("error: --quick never rewrites the committed README")
    plan, tasks = plan_study(b, work, mode, a.data_dir and str(Path(a.data_dir).resolve()))
    todo = [t for t in tasks if not t.result.exists()]
    n_train = sum(t.stage == "train" for t in tasks)
    print(f"sage_miniature ({plan['mode']}): {len(b.methods)} methods, {len(b.seeds)} seed(s), {n_train} "
          f"training runs x {b.steps} steps, {len(b.methods) - 1} x {len(b.seeds)} + 1 evaluations x "
          f"{b.eval_problems} problems x n = {b.eval_n}; {len(todo)} of {len(tasks)} jobs to run; "
          f"estimate {estimate_s(todo, a.jobs) / 60:.1f} min with --jobs {a.jobs} (full study from scratch: "
          f"{estimate_s(tasks, a.jobs) / 60:.1f} min; an estimate from run.py's per-step and per-problem "
          f"rates, see README \"Budget\")", flush=True)
    if a.dry_run:
        return 0
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    failed, ran = run_tasks(tasks, work, a.jobs)
    if failed:
        print(f"error: {len(failed)} job(s) failed: {', '.join(failed)} (logs in {work / 'logs'}); rerun to "
              "resume", file=sys.stderr)
        return 1
    from experiments.sage_miniature import report
    timing = _timing(tasks, work, a.jobs, time.time() - t0, ran)
    commits = _json(work / "commits.json") if (work / "commits.json").exists() else {}
    timing["commits"] = sorted({commits.get(t.name, "not recorded") for t in tasks})  # the code the jobs ran
    problem_ids = _json(next(t.result for t in tasks if t.stage == "eval"))["problem_ids"]
    eval_dirs = {t.name.split(":", 1)[1]: str(t.result.parent) for t in tasks if t.stage == "eval"}
    run_dirs = {t.name.split(":", 1)[1]: str(t.result.parent) for t in tasks if t.stage == "train"}
    res = report.build_results(plan, _json(work / "calibration.json"), eval_dirs, run_dirs, problem_ids,
                               BENCH, timing)
    paths = report.write_outputs(res, out)
    if write_readme:
        rel = os.path.relpath(out, README.parent)
        report.write_readme_block(README, report.render_markdown(json.loads(paths["json"].read_text()), rel))
        print(f"rewrote the results block of {README}")
    print(f"wrote {', '.join(str(x) for x in paths.values())}")
    for c in res["claims"]:
        print(f"  {c['verdict']:>15}: {c['claim']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
