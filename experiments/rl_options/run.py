"""One short run per RL option on the embedded task (configs/tiny.py), logging what each option logs.

    python experiments/rl_options/run.py [--steps 6] [--out experiments/rl_options]

Each option runs `python -m sage_jax.main --config=configs/tiny.py` for a few steps from the shipped base,
without evaluation, and the mean over its steps of the metrics it adds (plus reward and KL) goes to
results.json / results.md. This shows that every switch runs end to end in the fused step and what it
reports; it makes no claim about gains (a few steps of a tiny model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

OPTIONS = {  # name: (flags, the metrics it adds)
    "baseline (GRPO + branch guide)": ([], []),
    "TIS cap 2": (["--config.rl.tis_cap=2.0"], ["train/tis_weight_mean", "train/tis_capped", "train/mismatch_kl"]),
    "MIS [0.5, 2], sequence": (["--config.rl.mis_bounds=(0.5, 2.0)", "--config.rl.mismatch_level=sequence"],
                               ["train/mis_masked", "train/mismatch_kl"]),
    "entropy top 20%": (["--config.rl.entropy_top_frac=0.2"], ["train/pg_token_frac"]),
    "pass@k advantage, k = 4": (["--config.rl.pass_at_k=4"], ["reward/pass_at_k"]),
    "SAGE reward form": (["--config.sage.form=reward"], ["train/sage_bonus"]),
    "clip-higher 0.28 + dapo": (["--config.rl.eps_high=0.28", "--config.rl.loss_type=dapo"],
                                ["train/clip_high"]),
    "reference in 2 row chunks": (["--config.rl.score_chunks=2"], []),
    "DAPO dynamic sampling, 3x prompts": (["--config.rl.dynamic_sampling=3"],
                                          ["dynamic/informative_groups", "dynamic/kept_groups",
                                           "dynamic/short_groups", "reward/kept_frac_zero_std"]),
    "overlong penalty (buffer 19) + filter": (["--config.rl.overlong_buffer=19", "--config.rl.overlong_filter=True"],
                                              ["reward/overlong_penalty_mean", "rollout/overlong_filtered"]),
}
COMMON = ["reward/reward_mean", "train/kl", "train/loss", "perf/step_s"]


def run_option(flags: list[str], steps: int, work: str) -> tuple[list[dict], float]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "sage_jax.main", "--config=configs/tiny.py", f"--workdir={work}",
           f"--config.max_steps={steps}", "--config.log_every=1", "--config.checkpoint_every=0",
           "--config.eval.at_start=False", "--config.eval.at_end=False", "--config.eval_every=0",
           "--config.logging.progress=False", "--config.logging.tensorboard=False",
           f"--config.data.data_dir={os.path.join(os.path.dirname(work), 'tfds')}", *flags]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{flags}: exit {p.returncode}\n{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in open(os.path.join(work, "metrics.jsonl")) if x.strip()]
    return [r for r in rows if "train/loss" in r], time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=HERE)
    a = ap.parse_args()
    results = {"steps": a.steps, "config": "configs/tiny.py", "options": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (flags, keys)) in enumerate(OPTIONS.items()):
            rows, wall = run_option(flags, a.steps, os.path.join(tmp, f"run{i}"))
            # metrics.jsonl writes non-finite values as strings ("nan"): float() reads them back
            mean = {k: sum(float(r[k]) for r in rows) / len(rows) for k in COMMON + keys if all(k in r for r in rows)}
            bad = [k for k, v in mean.items() if v != v or abs(v) == float("inf")]
            if bad:
                raise SystemExit(f"{name}: non-finite {bad}")
            missing = [k for k in keys if k not in mean]
            if missing:
                raise SystemExit(f"{name}: the run logged no {missing}")
            results["options"][name] = {"flags": flags, "metrics": mean, "wall_s": wall}
            print(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in mean.items()), flush=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [f"# RL options, one short run each ({a.steps} steps of configs/tiny.py, means over the steps)", "",
             "| option | flags | metrics (mean over steps) | wall s |", "|---|---|---|---|"]
    for name, r in results["options"].items():
        m = ", ".join(f"`{k}` {v:.4g}" for k, v in r["metrics"].items())
        lines.append(f"| {name} | {' '.join(f'`{x}`' for x in r['flags']) or '-'} | {m} | {r['wall_s']:.0f} |")
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
