"""One short run per RL option on the embedded task (configs/tiny.py), each in a setting where the option acts.

    python experiments/rl_options/run.py [--steps 6] [--out experiments/rl_options]

Each option runs `python -m sage_jax.main --config=configs/tiny.py` for a few steps from the shipped base,
without evaluation, and the mean over its steps of the metrics it adds (plus reward and KL) goes to
results.json / results.md, with the metric that shows the option did something (a masked or capped fraction,
a clipped ratio, a filtered row) and whether it was > 0 ("exercised"). This shows that every switch runs end to
end in the fused step and acts there; it makes no claim about gains (a few steps of a tiny model).
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

# The sampler corrections need a sampler that differs from the trainer: in float32 the two agree to about 1e-6
# (experiments: every weight is 1), so those rows run in bfloat16, where the decode loop and the training forward
# round differently, with bounds tight enough that the correction binds. Clip-higher and CISPO's cap bind only
# when the policy moves within a rollout: 2 iterations x 2 minibatches at a 10x learning rate. The overlong rows
# shorten the budget to 40 tokens, below the worked solutions' lengths, so that completions are truncated.
BF16 = ["--config.model.dtype=bfloat16"]
MOVES = ["--config.rl.num_iterations=2", "--config.rl.num_minibatches=2", "--config.optim.learning_rate=1e-3"]
SHORT = ["--config.rollout.max_new_tokens=40"]
OPTIONS = {  # name: (flags, the metrics it adds, the metric that shows it acted: it must be > 0)
    "baseline (GRPO + branch guide)": ([], [], None),
    "TIS cap 1.01, bf16": ([*BF16, "--config.rl.tis_cap=1.01"],
                           ["train/is_weight_mean", "train/tis_capped", "train/mismatch_kl"], "train/tis_capped"),
    "MIS [0.99, 1.01], token, bf16": ([*BF16, "--config.rl.mis_bounds=(0.99, 1.01)"],
                                      ["train/is_weight_mean", "train/mis_masked", "train/mismatch_kl"],
                                      "train/mis_masked"),
    "rejection [0.99, 1.01], token, bf16": ([*BF16, "--config.rl.rs_bounds=(0.99, 1.01)"],
                                            ["train/rs_masked", "train/mismatch_kl"], "train/rs_masked"),
    # at this size a bf16 sequence's weight stays far below 3: the preset runs, its mask does not bind
    "TRL 1.16 default (sequence_mask, 3), bf16": ([*BF16, "--config.rl.sampler_correction=trl_1.16"],
                                                  ["train/is_weight_mean", "train/mis_masked", "train/mismatch_kl"],
                                                  "train/mis_masked"),
    "OPSM threshold 0.001, bf16": ([*BF16, "--config.rl.opsm_threshold=0.001"], ["train/opsm_masked"],
                                   "train/opsm_masked"),
    "CISPO, cap 1.0, 4 updates": ([*MOVES, "--config.rl.loss_type=cispo", "--config.rl.eps_high=1.0"],
                                  ["train/clip_high"], "train/clip_high"),
    "entropy bonus 0.01": (["--config.rl.entropy_coef=0.01"], ["train/entropy_loss", "train/entropy"],
                           "train/entropy"),
    "entropy top 20%": (["--config.rl.entropy_top_frac=0.2"], ["train/pg_token_frac"], "train/pg_token_frac"),
    "pass@k advantage, k = 4": (["--config.rl.pass_at_k=4"], ["reward/pass_at_k"], "reward/pass_at_k"),
    "SAGE reward form": (["--config.sage.form=reward"], ["train/sage_bonus"], "train/sage_bonus"),
    "clip-higher 0.28 + dapo, 4 updates": ([*MOVES, "--config.rl.eps_high=0.28", "--config.rl.loss_type=dapo"],
                                           ["train/clip_high", "train/clip_low"], "train/clip_region"),
    "rows shuffled before 2 updates": (["--config.rl.num_minibatches=2", "--config.rl.update_shuffle=rows"], [],
                                       None),
    "reference in 2 row chunks": (["--config.rl.score_chunks=2"], [], None),
    "DAPO dynamic sampling, 3x prompts": (["--config.rl.dynamic_sampling=3"],
                                          ["dynamic/informative_groups", "dynamic/kept_groups",
                                           "dynamic/short_groups", "reward/kept_frac_zero_std"],
                                          "dynamic/informative_groups"),
    "overlong penalty (buffer 10) + filter, 40 tokens": ([*SHORT, "--config.rl.overlong_buffer=10",
                                                          "--config.rl.overlong_filter=True"],
                                                         ["reward/overlong_penalty_mean", "rollout/overlong_filtered",
                                                          "rollout/truncated_frac"], "rollout/overlong_filtered"),
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
    ap.add_argument("--only", action="append", default=[], help="rerun these options only, into the results there")
    a = ap.parse_args()
    results = {"steps": a.steps, "config": "configs/tiny.py", "options": {}}
    if a.only:
        with open(os.path.join(a.out, "results.json")) as f:
            results = json.load(f)
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (flags, keys, acted)) in enumerate(OPTIONS.items()):
            if a.only and name not in a.only:
                continue
            rows, wall = run_option(flags, a.steps, os.path.join(tmp, f"run{i}"))
            # metrics.jsonl writes non-finite values as strings ("nan"): float() reads them back
            mean = {k: sum(float(r[k]) for r in rows) / len(rows) for k in COMMON + keys if all(k in r for r in rows)}
            bad = [k for k, v in mean.items() if v != v or abs(v) == float("inf")]
            if bad:
                raise SystemExit(f"{name}: non-finite {bad}")
            if acted and acted not in mean:
                mean[acted] = sum(float(r[acted]) for r in rows) / len(rows)
            missing = [k for k in keys if k not in mean]
            if missing:
                raise SystemExit(f"{name}: the run logged no {missing}")
            exercised = None if acted is None else abs(mean[acted]) > 0
            results["options"][name] = {"flags": flags, "metrics": mean, "wall_s": wall, "acted_on": acted,
                                        "exercised": exercised}
            print(f"{name}: " + ", ".join(f"{k} {v:.4g}" for k, v in mean.items()), flush=True)
    results["options"] = {k: results["options"][k] for k in OPTIONS if k in results["options"]}  # the table's order
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = [f"# RL options, one short run each ({a.steps} steps of configs/tiny.py, means over the steps)", "",
             "Each row runs in a setting where its option acts (the module docstring of `run.py` says why); "
             "`acted` names the metric that shows it and whether it was > 0.", "",
             "| option | flags | acted | metrics (mean over steps) | wall s |", "|---|---|---|---|---|"]
    for name, r in results["options"].items():
        m = ", ".join(f"`{k}` {v:.4g}" for k, v in r["metrics"].items())
        acted = "-" if r["acted_on"] is None else f"`{r['acted_on']}`: {'yes' if r['exercised'] else '**no**'}"
        lines.append(f"| {name} | {' '.join(f'`{x}`' for x in r['flags']) or '-'} | {acted} | {m} | "
                     f"{r['wall_s']:.0f} |")
    with open(os.path.join(a.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
