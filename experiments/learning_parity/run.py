"""Learning parity with TRL: GRPOTrainer and this project on the same base, task, prompts and recipe.

    python experiments/learning_parity/run.py                 # 3 seeds per side + evaluation (~1.5 h, 2 cores)
    python experiments/learning_parity/run.py --render        # only re-render results.md, the plot, the README block

Per seed S: this project runs `configs/tiny.py:grpo` (the demo's recipe with the guide off, since TRL has
no guide) with `--config.seed=S`; TRL 1.16's GRPOTrainer (the bench's pinned venv) runs the same recipe on
the same base with this project's own training prompts of seed S, in the same order (trl_grpo.py). Both
final policies and the base are then evaluated by this project's `mode=eval` on every held-out problem,
with the same prompts, seeds and n for every model. A run that finished is skipped on a rerun.

Writes results.json, results.md, parity.png and the README's generated `learning_parity` block.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))  # the repo root: studies import each other as experiments.<study>

from experiments.readme_blocks import write_block  # noqa: E402

TINY_BASE = str(REPO / "sage_jax" / "assets" / "tiny_base")
KS = (1, 2, 4, 8, 16, 32)
STEPS, PROMPTS_PER_STEP = 200, 8


def _run(cmd, log: Path, env=None) -> float:
    """Runs `cmd` into `log`; its wall clock is kept beside the log (`<log>.wall_s`) for later invocations."""
    t = time.perf_counter()
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    wall = time.perf_counter() - t
    Path(str(log) + ".wall_s").write_text(f"{wall:.1f}\n")
    return wall


def _wall(log: Path) -> float:
    return float(Path(str(log) + ".wall_s").read_text())


def dump_prompts(seed: int, data_dir: str, path: Path) -> None:
    """This project's training prompts of `seed`, in the order its pipeline gives them (configs/tiny.py)."""
    from sage_jax import config_lib
    from sage_jax.models import hf
    from sage_jax.train import data as train_data
    spec = config_lib.resolve(_config(seed, data_dir))
    tok = hf.load_tokenizer(TINY_BASE)
    source = train_data.train_source(spec.data, spec.mode, tok, str(path.parent))
    it = train_data.prompt_iterator(spec.data, tok, source, spec.seed)
    rows = []
    for _ in range(STEPS):
        b = next(it)
        rows += [{"prompt": p, "answer": a} for p, a in zip(b["prompt"], b["answer"])]
    path.write_text(json.dumps(rows))


def _config(seed: int, data_dir: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location("tiny_cfg", REPO / "configs" / "tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config("grpo")
    c.seed, c.data.data_dir = seed, data_dir
    return c


def train_ours(seed: int, work: Path, data_dir: str) -> Path:
    wd = work / f"ours_s{seed}"
    if not (wd / "export_hf").exists():
        print(f"ours seed {seed} ...", flush=True)
        _run([sys.executable, "-m", "sage_jax.main", "--config=configs/tiny.py:grpo", f"--workdir={wd}",
              f"--config.seed={seed}", f"--config.data.data_dir={data_dir}", "--config.eval.at_start=False",
              "--config.eval.at_end=False", "--config.logging.progress=False"], work / f"ours_s{seed}.log")
    return wd


def train_trl(seed: int, work: Path, data_dir: str) -> Path:
    from experiments.bench.trl_runner import ensure_trl_venv
    out = work / f"trl_s{seed}"
    c = _config(seed, data_dir)
    if not (out / "log.json").exists():
        prompts = work / f"prompts_s{seed}.json"
        dump_prompts(seed, data_dir, prompts)
        print(f"TRL seed {seed} ...", flush=True)
        _run([ensure_trl_venv(), str(HERE / "trl_grpo.py"), "--model", TINY_BASE, "--prompts", str(prompts),
              "--seed", str(seed), "--out", str(out), "--steps", str(STEPS),
              "--max-new-tokens", str(c.rollout.max_new_tokens), "--group", str(c.rollout.group_size),
              "--lr", str(c.optim.learning_rate), "--warmup", str(c.optim.warmup_steps), "--beta", str(c.rl.beta)], work / f"trl_s{seed}.log",
             env=dict(os.environ, OMP_NUM_THREADS="2"))
    return out


def evaluate(models: dict[str, str], work: Path, data_dir: str) -> dict:
    wd = work / "eval"
    _run([sys.executable, "-m", "sage_jax.main", "--config=configs/tiny.py", f"--workdir={wd}", "--config.mode=eval",
          "--config.eval.model_list=" + ",".join(f"{k}={v}" for k, v in models.items()),
          f"--config.data.data_dir={data_dir}", "--config.logging.progress=False"], work / "eval.log")
    return json.loads((wd / "eval" / "results.json").read_text())


# ----------------------------------------------------------------------------- analysis

def analyse(results: dict, curves: dict, seeds: list[int], walls: dict) -> dict:
    from experiments.sage_miniature.stats import combination_ci
    summ = results["summary"]
    bench = next(iter(summ["benchmarks"]))
    ids = list(summ["per_problem"]["base"][bench])
    metrics = [f"pass@{k}" for k in KS] + ["distinct_correct_strategies", "share/rule", "share/terms", "share/left",
                                          "share/right"]

    def V(side: str, m: str) -> np.ndarray:  # [S, P]
        return np.array([[summ["per_problem"][f"{side}_s{s}"][bench][p].get(m, np.nan) for p in ids] for s in seeds])

    base = {m: np.array([[summ["per_problem"]["base"][bench][p].get(m, np.nan) for p in ids]]) for m in metrics}
    out = {"num_problems": len(ids), "n": summ["benchmarks"][bench]["n"], "seeds": seeds, "metrics": {}}
    for m in metrics:
        row = {"base": combination_ci([(1.0, base[m], "base")], f"base:{m}")}
        for side in ("ours", "trl"):
            row[side] = combination_ci([(1.0, V(side, m), side)], f"{side}:{m}")
            row[f"{side}_gain"] = combination_ci([(1.0, V(side, m), side), (-1.0, base[m], "base")], f"{side}-base:{m}")
            row[f"{side}_per_seed"] = [float(np.mean(v)) for v in V(side, m)]
        row["ours_minus_trl"] = combination_ci([(1.0, V("ours", m), "ours"), (-1.0, V("trl", m), "trl")], f"diff:{m}")
        out["metrics"][m] = row
    out["curves"] = curves
    out["wall_s"] = walls
    return out


def reward_curves(work: Path, seeds: list[int]) -> dict:
    ours, trl = [], []
    for s in seeds:
        rows = [json.loads(ln) for ln in (work / f"ours_s{s}" / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        ours.append([r["reward/reward_mean"] for r in rows if "reward/reward_mean" in r])
        trl.append([r["reward"] for r in json.loads((work / f"trl_s{s}" / "log.json").read_text())["rows"]])
    return {"ours": ours, "trl": trl, "ours_log_every": 5}


def _ci(s: dict, d: int = 3) -> str:
    return f"{s['estimate']:.{d}f} [{s['lo']:.{d}f}, {s['hi']:.{d}f}]"


def render(res: dict) -> str:
    out = [f"{len(res['seeds'])} seeds per side, {res['num_problems']} held-out problems x n = {res['n']}; seed-mean of "
           "the per-problem means, [95% bootstrap CI over problems x seeds], problems paired across columns:", "",
           "| metric | base | this project (GRPO) | TRL GRPOTrainer | this project - TRL |", "|---|---|---|---|---|"]
    for m, r in res["metrics"].items():
        d = 2 if m == "distinct_correct_strategies" else 3
        out.append(f"| {m} | {_ci(r['base'], d)} | {_ci(r['ours'], d)} | {_ci(r['trl'], d)} | {_ci(r['ours_minus_trl'], d)} |")
    g = res["metrics"]["pass@1"]
    c = res["curves"]
    last = lambda xs: float(np.mean([np.mean(x[-max(1, len(x) // 5):]) for x in xs]))  # noqa: E731
    out += ["", f"pass@1 gain over the base: this project {_ci(g['ours_gain'])} (seeds "
            + ", ".join(f"{v:.3f}" for v in g["ours_per_seed"]) + f"), TRL {_ci(g['trl_gain'])} (seeds "
            + ", ".join(f"{v:.3f}" for v in g["trl_per_seed"]) + "). Training reward, mean of the last fifth of the "
            f"steps: this project {last(c['ours']):.3f}, TRL {last(c['trl']):.3f}. Wall clock per run: this project "
            f"{np.mean(res['wall_s']['ours']) / 60:.1f} min, TRL {np.mean(res['wall_s']['trl']) / 60:.1f} min."]
    return "\n".join(out)


def plot(res: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    ax_r, ax_k = fig.subplots(1, 2)
    c = res["curves"]
    for i, side in enumerate(("ours", "trl")):
        runs = c[side]
        L = min(len(r) for r in runs)
        y = np.array([r[:L] for r in runs])
        step = c["ours_log_every"] if side == "ours" else 1
        x = np.arange(1, L + 1) * step
        if side == "trl":  # per step: smooth over the ours logging window for comparability
            k = c["ours_log_every"]
            y = np.array([np.convolve(r, np.ones(k) / k, mode="same") for r in y])
        ax_r.plot(x, y.mean(0), color=f"C{i}", label="this project" if side == "ours" else "TRL")
        ax_r.fill_between(x, y.min(0), y.max(0), color=f"C{i}", alpha=0.2, linewidth=0)
    ax_r.set_xlabel("RL step")
    ax_r.set_ylabel("training reward (seed mean, min-max band)")
    ax_r.legend(fontsize=8)
    ax_r.grid(alpha=0.3)
    for i, side in enumerate(("base", "ours", "trl")):
        s = [res["metrics"][f"pass@{k}"][side] for k in KS]
        ax_k.plot(KS, [v["estimate"] for v in s], marker="o", ms=3, color=f"C{i if side != 'base' else 7}",
                  label={"base": "base", "ours": "this project", "trl": "TRL"}[side])
        ax_k.fill_between(KS, [v["lo"] for v in s], [v["hi"] for v in s], color=f"C{i if side != 'base' else 7}",
                          alpha=0.2, linewidth=0)
    ax_k.set_xscale("log", base=2)
    ax_k.set_xticks(KS, [str(k) for k in KS])
    ax_k.set_xlabel("k")
    ax_k.set_ylabel("held-out pass@k (95% CI)")
    ax_k.legend(fontsize=8)
    ax_k.grid(alpha=0.3)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120)


def write_outputs(res: dict) -> None:
    (HERE / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (HERE / "results.md").write_text(render(res) + "\n")
    plot(res, HERE / "parity.png")
    write_block(REPO / "README.md", "learning_parity", render(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", default="/tmp/sage_jax_learning_parity")
    ap.add_argument("--render", action="store_true")
    a = ap.parse_args()
    if a.render:
        write_outputs(json.loads((HERE / "results.json").read_text()))
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    data_dir = str(work / "tfds")
    models = {"base": TINY_BASE}
    for s in a.seeds:
        models[f"ours_s{s}"] = str(train_ours(s, work, data_dir))
        models[f"trl_s{s}"] = str(train_trl(s, work, data_dir) / "model")
    walls = {side: [_wall(work / f"{side}_s{s}.log") for s in a.seeds] for side in ("ours", "trl")}
    print("evaluating ...", flush=True)
    results = evaluate(models, work, data_dir)
    res = analyse(results, reward_curves(work, a.seeds), a.seeds, walls)
    write_outputs(res)
    print(render(res))


if __name__ == "__main__":
    main()
