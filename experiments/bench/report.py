"""The benchmark's Markdown tables and scaling plot, from its results dict (bench.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root
from experiments.bench.trl_runner import TRL_VARIANTS  # noqa: E402


def plot_scaling(scal, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, (key, label) in zip(axes, (("completion_len", "completion length T (G=8)"),
                                       ("group_size", "group size G (T=64)"))):
        xs = sorted(int(x) for x in scal[key])
        ys = [scal[key][x] for x in xs]
        ax.plot(xs, ys, "o-", label="measured")
        ax.plot(xs, [ys[0] * x / xs[0] for x in xs], "--", color="gray", label="linear from first point")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel(label)
        ax.set_ylabel("step time, s")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("sage_jax RL step (tiny h128/L4, 8 prompts, beta=0.04), CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(res, shapes):
    labels = dict(fp32="TRL fp32", fp32_1thread="TRL fp32 1 thread", bf16="TRL bf16 autocast",
                  defaults="TRL defaults (bf16, GC)")
    present = [v for v in TRL_VARIANTS if any(f"trl_{v}" in res[sh] for sh in shapes)]
    mem = any(res[sh]["ours_none"].get("device_peak_bytes") for sh in shapes)
    L = ["| shape | rows x T | ours s/step | TRL s/step (fastest config) | speedup | " +
         "".join(f"{labels[v]} | " for v in present) +
         "ours tok/s | TRL tok/s | branch/none | recompiles |" + (" ours peak GiB (process) | TRL peak GiB |" if mem else ""),
         "|" + "---|" * (11 + len(present) - 2 + 2 * mem)]
    gib = lambda b: f"{b / 2**30:.2f}" if b else "-"
    for sh in shapes:
        r = res[sh]
        f = lambda k, fmt="{:.3f}": fmt.format(r[k]) if k in r else "-"
        t = lambda v: f"{r['trl_' + v]['median_step_s']:.3f}" if "trl_" + v in r else "-"
        rec = max(r[k]["compiles_after_first_step"] for k in r if k.startswith("ours_") and isinstance(r[k], dict))
        row = (f"| {sh} | {r['rows']} x {r['completion_len']} | {f('ours_step_s')} | "
               f"{f('trl_step_s')} ({r.get('trl_best_variant', '-')}) | {f('speedup', '{:.2f}x')} | " +
               "".join(f"{t(v)} | " for v in present) +
               f"{f('ours_tokens_per_s', '{:,.0f}')} | {f('trl_tokens_per_s', '{:,.0f}')} | "
               f"{f('branch_over_none', '{:.2f}')} | {rec} |")
        if mem:
            best = r.get(f"trl_{r.get('trl_best_variant')}", {})  # the fastest TRL configuration's peak
            ours_peak = max(r[k].get("device_peak_bytes") or 0 for k in r if k.startswith("ours_") and isinstance(r[k], dict))
            row += f" {gib(ours_peak)} | {gib(best.get('cuda_peak_bytes'))} |"
        L.append(row)
    pk = res["meta"].get("peak_key", "square_2048")
    L += ["", "Phases of our step (separately jitted, median s) and roofline "
          f"({res['meta'].get('dtype', 'float32')} matmul {pk.split('_')[1]}^3: "
          f"{res['matmul_gflops'][pk]:.0f} GFLOP/s):", "",
          "| shape | rollout | reward | ref fwd | train (fwd+bwd+adamw) | sum | fused | decode GFLOP/s (frac) | "
          "ref fwd GFLOP/s (frac) | train GFLOP/s (frac) |", "|" + "---|" * 10]
    for sh in (sh for sh in shapes if "phases_s" in res[sh]):
        r = res[sh]
        p, rf = r["phases_s"], r["roofline"]
        g = lambda k: f"{rf[k]['gflops']:.0f} ({100 * rf[k]['frac_of_square']:.0f}%)"
        L.append(f"| {sh} | {p['rollout']:.3f} | {p['reward']:.4f} | {p['ref_forward']:.3f} | {p['train']:.3f} | "
                 f"{sum(p.values()):.3f} | {r['ours_none']['median_step_s']:.3f} | {g('decode')} | "
                 f"{g('ref_forward')} | {g('train')} |")
    if all("ceiling" in res[sh] for sh in shapes):
        L += ["", "The step against this machine's ceiling (bench.summarise): all FLOPs at the square matmul rate, "
              "and shape-aware (the decode's B x D matmuls at their own measured rate):", "",
              "| shape | ours s | ceiling s | share of ceiling reached | TRL / ceiling = best possible speedup | ours speedup | "
              "shape-aware ceiling s | share reached | best possible, shape-aware |", "|" + "---|" * 9]
        for sh in shapes:
            r, c = res[sh], res[sh]["ceiling"]
            x = lambda k: f"{c[k]:.2f}x" if k in c else "-"
            L.append(f"| {sh} | {r['ours_step_s']:.3f} | {c['step_s']:.3f} | {100 * c['frac']:.0f}% | {x('speedup')} | "
                     f"{r['speedup']:.2f}x | {c['shape_aware_step_s']:.3f} | {100 * c['shape_aware_frac']:.0f}% | "
                     f"{x('shape_aware_speedup')} |" if "speedup" in r else
                     f"| {sh} | {r['ours_step_s']:.3f} | {c['step_s']:.3f} | {100 * c['frac']:.0f}% | - | - | "
                     f"{c['shape_aware_step_s']:.3f} | {100 * c['shape_aware_frac']:.0f}% | - |")
    if "scaling_tiny" in res:
        sc = res["scaling_tiny"]
        L += ["", "Scaling (tiny shape, s/step): completion length T at G=8 | group size G at T=64", "",
              "| T | " + " | ".join(str(k) for k in sc["completion_len"]) + " |",
              "|---|" + "---|" * len(sc["completion_len"]),
              "| s | " + " | ".join(f"{v:.3f}" for v in sc["completion_len"].values()) + " |", "",
              "| G | " + " | ".join(str(k) for k in sc["group_size"]) + " |",
              "|---|" + "---|" * len(sc["group_size"]),
              "| s | " + " | ".join(f"{v:.3f}" for v in sc["group_size"].values()) + " |"]
    return "\n".join(L) + "\n"


# ----------------------------------------------------------------------------- the top-level README's table

# (results file relative to this folder, shape, machine label): the rows of the README's "RL step vs TRL"
# table, each read from the results file its run wrote (bench.py / h200.sh)
README_ROWS = [
    ("results.json", "tiny", "2-core CPU, fp32 (idle, one run)"),
    ("results.json", "small", "2-core CPU, fp32 (idle, one run)"),
    ("h200/results_h200_bf16.json", "tiny", "H200, bf16"),
    ("h200/results_h200_bf16.json", "small", "H200, bf16"),
    ("h200/bf16.log", "medium", "H200, bf16"),
    ("h200/results_h200_fp32_small.json", "small", "H200, fp32"),
]
SHAPES = {"tiny": "tiny h128/L4 (64 x 64)", "small": "small h512/L8 (64 x 128)",
          "medium": "medium h896/L12, 179M params (64 x 256)"}


def _row(here, path, shape):
    """(ours s/step, TRL s/step) of one shape from a results file. The H200 medium shape's results file was
    lost with the run's time limit (bench README): ours is the `medium none` line of the run's log, TRL the
    `trl_medium_defaults.json` that run wrote."""
    import ast
    import json
    import os
    if path.endswith(".log"):
        line = next(ln for ln in open(os.path.join(here, path)) if ln.startswith(f"{shape} none "))
        ours = ast.literal_eval(line.split(" ", 2)[2])["median_step_s"]
        trl = json.load(open(os.path.join(here, "h200", f"trl_{shape}_defaults.json")))["median_step_s"]
        return ours, trl
    r = json.load(open(os.path.join(here, path)))[shape]
    return r["ours_step_s"], r["trl_step_s"]


def readme_table(here):
    L = ["| machine, dtype | shape (rows x tokens) | ours s/step | TRL s/step | speedup | results file |",
         "|---|---|---|---|---|---|"]
    for path, shape, machine in README_ROWS:
        ours, trl = _row(here, path, shape)
        L.append(f"| {machine} | {SHAPES[shape]} | {ours:.3g} | {trl:.3g} | {trl / ours:.2f}x | "
                 f"`experiments/bench/{path}` |")
    return "\n".join(L)


if __name__ == "__main__":  # python experiments/bench/report.py --readme: rewrite the README's table
    from experiments.readme_blocks import write_block
    here = os.path.dirname(os.path.abspath(__file__))
    if "--readme" in sys.argv:
        write_block(os.path.join(here, "..", "..", "README.md"), "bench", readme_table(here))
    print(readme_table(here))


def varlen_markdown(res) -> str:
    """The variable-length workload's table (bench.measure_varlen), or "" when the results have none."""
    rows = res.get("varlen") or {}
    if not rows:
        return ""
    phases = ("decode", "reference", "old", "policy")
    r0 = next(iter(rows.values()))
    real = [k for k in r0["settings"] if k != "padded"]  # the real-token settings, each timed beside the padded step
    settings = ", ".join(f"{k} = {', '.join(f'rl.{f} {v}' for f, v in real.items()) or 'no real-token setting'}"
                         for k, real in r0["settings"].items())
    L = [f"Variable-length workload: {r0['workload']}; {r0['minibatches']} updates per rollout. Our settings: "
         f"{settings}; ours = the faster of the real-token settings in the run. Useful fraction: FLOPs on real "
         f"tokens / FLOPs executed, per phase ({' / '.join(phases)}).", "",
         "| shape | N x G, P + T | mean length (capped rows) | ours s/step (setting) | padded s/step | ours vs padded "
         "| TRL s/step (fastest config) | ours vs TRL | " + " | ".join(f"{k} s/step" for k in real) +
         " | useful, ours | useful, padded | recompiles |",
         "|---|---|---|---|---|---|---|---|" + "---|" * len(real) + "---|---|---|"]
    frac = lambda u: " / ".join(f"{u[p]:.2f}" for p in phases)
    for sh, r in rows.items():
        trl = (f"{r['trl_step_s']:.3f} ({r['trl_best_variant']})", f"{r['speedup_vs_trl']:.2f}x") \
            if "trl_step_s" in r else ("-", "-")
        L.append(f"| {sh} | {r['N']} x {r['G']}, {r['P']} + {r['T']} | {r['mean_length']:.1f} ({r['capped_rows']}) | "
                 f"{r['ours_step_s']:.3f} ({r['ours_setting']}) | {r['padded_step_s']:.3f} | "
                 f"{r['speedup_vs_padded']:.2f}x | {trl[0]} | {trl[1]} | "
                 + " | ".join(f"{r['setting_step_s'][k]:.3f}" for k in real) +
                 f" | {frac(r['useful_fraction'])} | {frac(r['padded_useful_fraction'])} | "
                 f"{r['compiles_after_first_step']} |")
    return "\n".join(L) + "\n"
