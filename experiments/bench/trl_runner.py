"""TRL side of the RL-step benchmark, seen from bench.py: its virtual environment and its runs (a subprocess
of `trl_side.py` per configuration, one shape at a time)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TRL_PINS = os.path.join(HERE, "trl_requirements.txt")
TRL_VENV = os.path.join(HERE, ".venv-trl")
TORCH_WHEEL_PIN = "torch==2.13.0"


def ensure_trl_venv():
    py = os.path.join(TRL_VENV, "bin", "python")
    if os.path.exists(py):
        return py
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.check_call([base, "-m", "venv", TRL_VENV])
    pip = [py, "-m", "pip", "install", "-q"]
    subprocess.check_call(pip + [TORCH_WHEEL_PIN])  # torch first and pinned: never a resolver-chosen build
    subprocess.check_call(pip + ["-r", TRL_PINS])
    return py


# name -> (trl_side --variant, torch threads; 0 = torch's default, all cores). Under a loaded machine torch's
# OpenMP pool with 2 threads slows down several-fold (threads wait on descheduled peers), so on CPU TRL is also
# timed on one thread and the comparison takes TRL's fastest configuration. `bf16` is autocast without
# gradient checkpointing (the like of ours in bfloat16); `defaults` adds TRL's gradient checkpointing.
TRL_VARIANTS = {"fp32": ("fp32", 0), "fp32_1thread": ("fp32", 1), "bf16": ("bf16", 0), "defaults": ("defaults", 0)}


def default_trl_variants(shape, dtype, accel):
    if accel:  # threads do not matter on an accelerator; compare within the compute dtype
        return ("fp32",) if dtype == "float32" else ("bf16", "defaults")
    return ("fp32", "fp32_1thread", "defaults") if shape == "tiny" else ("fp32_1thread", "fp32")


def run_trl(py, ckpt, prompts_file, T, G, steps, warmup, out, variant, device, lr, beta, timeout_s=900,
            lengths_file=None, steps_per_generation=1):
    """One TRL configuration's run (`steps` generations, the first `warmup` untimed); `lengths_file` forces each
    row's completion length (the varlen workload), else every completion has T tokens."""
    mode, threads = TRL_VARIANTS[variant]
    cmd = [py, os.path.join(HERE, "trl_side.py"), "--model", ckpt, "--prompts", prompts_file,
           "--completion-len", str(T), "--group", str(G), "--steps", str(steps), "--warmup", str(warmup),
           "--lr", str(lr), "--beta", str(beta), "--out", out, "--variant", mode, "--threads", str(threads),
           "--device", device, "--steps-per-generation", str(steps_per_generation)]
    if lengths_file:
        cmd += ["--lengths", lengths_file]
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    if os.path.exists(out):
        os.remove(out)
    log = out + ".log"
    try:
        with open(log, "w") as f:
            subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        res = json.load(open(out))
    except subprocess.TimeoutExpired:  # keep the steps done so far (trl_side writes after each step)
        res = json.load(open(out)) if os.path.exists(out) else dict(step_s=[])
        res["timed_out_after_s"] = timeout_s
        timed = res["step_s"][warmup:] or res["step_s"][-1:]
        res["median_step_s"] = statistics.median(timed) if timed else float("nan")
    except subprocess.CalledProcessError as e:  # say why, from its log, and go on with the other runs
        tail = open(log).read()[-2000:]
        print(f"TRL {variant} failed (exit {e.returncode}); end of {log}:\n{tail}", flush=True)
        return dict(step_s=[], median_step_s=float("nan"), failed=tail, threads_arg=threads)
    res["threads_arg"] = threads
    return res
