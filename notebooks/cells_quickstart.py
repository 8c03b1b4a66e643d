"""Cells of notebooks/quickstart_sage.ipynb (built by build_notebooks.py)."""

import gpu_estimates as ge

# The GPU run (SMOKE off). The config cell and the estimate tables both read these values.
Q = dict(prompts=8, group=8, new_tokens=512, accum=4, chunk=32, lr=2e-5, pool=1024, steps=60, steps_15b=25,
         eval_problems=100, eval_n=8, eval_rows=128, prompt_assumed=256)
COMPILE_S = 240  # first RL step: XLA compilation of the fused step (estimate, not measured)
EVAL_COMPILE_S = 60  # per model: load + sampler compilation (estimate)
SETUP_S = 3 * 60 + 2 * 60  # pip install, model download, dataset preparation (estimates)


def run_shape(model: str) -> ge.Run:
    rows = Q["prompts"] * Q["group"]
    return ge.Run(rows=rows, prompt_tokens=Q["prompt_assumed"], new_tokens=Q["new_tokens"],
                  micro_rows=rows // Q["accum"], logp_chunk=Q["chunk"], lora_rank=8, param_bytes=4,
                  compute_bytes=2, remat="full")


def eval_seconds(s: ge.Shape, gpu: ge.GPU) -> float:
    batches = -(-Q["eval_problems"] * Q["eval_n"] // Q["eval_rows"])
    return EVAL_COMPILE_S + batches * ge.sample_seconds(s, Q["eval_rows"], Q["prompt_assumed"], Q["new_tokens"], gpu)


def tables(b) -> str:
    head = "| model | RL peak GiB (estimate) | " + " | ".join(
        f"{g.name} ({g.memory_gib:.1f} GiB)" for g in ge.GPUS.values()) + " |"
    lines = [head, "|---|---|" + "---|" * len(ge.GPUS)]
    for model, s in ge.KNOWN_SHAPES.items():
        r = run_shape(model)
        m = ge.memory(s, r)
        cells = []
        for g in ge.GPUS.values():
            t = ge.step_seconds(s, r, g)["step"]
            fit = "fits" if m["peak"] <= 0.9 * g.memory_gib else "**does not fit**"
            cells.append(f"{fit}; ~{t:.0f} s/step, eval {b.minutes(eval_seconds(s, g))}/model")
        lines.append(f"| `{model}` | {m['peak']:.1f} (weights {m['weights']:.1f}, largest phase "
                     f"{max(m['rollout'], m['reference'], m['train']):.1f}) | " + " | ".join(cells) + " |")
    s05 = ge.KNOWN_SHAPES["Qwen/Qwen2.5-0.5B-Instruct"]
    l4 = ge.GPUS["L4"]
    rl = COMPILE_S + Q["steps"] * ge.step_seconds(s05, run_shape(""), l4)["step"]
    total = SETUP_S + rl + 2 * eval_seconds(s05, l4)
    l4t, t4, a100 = (ge.step_seconds(s05, run_shape(""), g)["step"] for g in (l4, ge.GPUS["T4"], ge.GPUS["A100-40GB"]))
    return "\n".join(lines) + f"""

Whole notebook, 0.5B on an L4: {b.minutes(total)} (setup {b.minutes(SETUP_S)}, RL {b.minutes(rl)} for
{Q['steps']} steps including {b.minutes(COMPILE_S)} of compilation, evaluation {b.minutes(2 * eval_seconds(s05, l4))}).
With `Qwen/Qwen2.5-Math-1.5B` set `MAX_STEPS = {Q['steps_15b']}` for the same budget. A T4 is
~{t4 / l4t:.0f}x slower per step than an L4 (divide `MAX_STEPS` accordingly); an A100 runs the
{Q['steps']} steps in {b.minutes(COMPILE_S + Q['steps'] * a100)}.

**How these numbers were derived** (no GPU was available to measure them): `notebooks/gpu_estimates.py`
counts, from the model shapes, the buffers of each phase of the fused RL step ({Q['prompts']} prompts x
G={Q['group']} = {Q['prompts'] * Q['group']} rows, prompts padded to P={Q['prompt_assumed']} tokens (the notebook
sets P from the data and prints the estimate again), T={Q['new_tokens']} new tokens, LoRA rank 8 on all
projections, float32 weights with bf16 compute, `remat=full`, {Q['accum']} gradient micro-batches,
log-prob chunks of {Q['chunk']} tokens): weights + LoRA/Adam state + the largest of rollout (KV cache),
reference pass (float32 attention scores, logits chunks) and update (saved block inputs + one recomputed
layer). Time: decode at {ge.BANDWIDTH_EFFICIENCY:.0%} of the memory bandwidth, matmuls at
{ge.MATMUL_EFFICIENCY:.0%} of the bf16 peak (T4: fp32 peak, it has no bf16 tensor cores), spec-sheet
numbers; compilation and setup times are guesses. Treat memory as +-30% and time as within ~2x."""


CONFIG = r"""
from sage_jax.defaults import TINY_BASE, default_config

c = default_config()
c.mode, c.seed = "rl", 0
c.model.path = TINY_BASE if SMOKE else MODEL
c.model.dtype = "float32" if SMOKE else "bfloat16"  # compute dtype; log-softmax, KL and loss stay float32
c.model.param_dtype = "float32"  # storage: float32 so that LoRA's small updates are not rounded away
c.model.remat = "none" if SMOKE else "full"  # recompute each block in the backward pass (activation memory)
c.model.lora.rank, c.model.lora.alpha = 8, 16.0  # adapters on q,k,v,o,gate,up,down; the base stays frozen
c.data.name = "procedural_arithmetic" if SMOKE else "dapo_math_17k"
c.data.data_dir = DATA_DIR
c.data.template = "chat" if SMOKE else "sage"  # sage: chat template + "Please reason step by step ... \boxed{}"
c.data.batch_size = 4 if SMOKE else %(prompts)d  # prompts per RL step
c.data.max_train_problems = 64 if SMOKE else %(pool)d  # train on the first N problems (their prompt lengths are checked below)
c.data.max_answer_tokens = 16 if SMOKE else 64
c.rollout.group_size = 4 if SMOKE else %(group)d  # completions per prompt (G)
c.rollout.max_new_tokens = 48 if SMOKE else %(new_tokens)d
c.rollout.temperature = 1.0
c.rl.beta = 0.05  # KL coefficient, against the shaped anchor q * pi_ref
c.rl.reward = "exact_match" if SMOKE else "math_verify"
c.rl.grad_accum_steps = 1 if SMOKE else %(accum)d  # gradient micro-batches per update (memory, not math)
c.rl.logp_chunk = %(chunk)d  # tokens per log-prob chunk (bounds the float32 logits)
c.sage.guide = "branch"  # q = clip(1 + 0.3 relu(H - 1.2 nats), 0.6, 1.4) per token
c.optim.learning_rate = 1e-4 if SMOKE else %(lr)g
c.optim.warmup_steps = 0 if SMOKE else 5
c.max_steps = 3 if SMOKE else MAX_STEPS
c.checkpoint_every = 0 if SMOKE else 20  # 0: only at the end
c.log_every = 1
c.eval.at_start = c.eval.at_end = False  # pass@k of the base and the trained policy below, with mode=eval
c.logging.tensorboard = not SMOKE
print(c.model, c.sage.branch, sep="\n")
"""

DATA = r"""
from sage_jax.data import builders
from sage_jax.data.sources import decode_record
from sage_jax.data.templates import format_prompt
from sage_jax.models import hf

BENCH = "procedural_arithmetic" if SMOKE else "math500"
builder_config = lambda name: c.data.builder_config if name == "procedural_arithmetic" else None
train_src = builders.load_split(c.data.name, "train", data_dir=DATA_DIR, config=builder_config(c.data.name))
test_src = builders.load_split(BENCH, "test", data_dir=DATA_DIR, config=builder_config(BENCH))
tokenizer = hf.load_tokenizer(c.model.path)

pool = [decode_record(train_src[i]) for i in range(min(c.data.max_train_problems, len(train_src)))]
prompt = lambda r: format_prompt(r["problem"], c.data.template, tokenizer)
lengths = [len(tokenizer(prompt(r), add_special_tokens=False)["input_ids"]) for r in pool]
# Prompts are never truncated and all are left-padded to max_prompt_tokens: fit it to the pool.
c.data.max_prompt_tokens = -(-max(lengths) // 64) * 64
print(f"{c.data.name}: {len(train_src)} problems, training pool {len(pool)}, prompts {min(lengths)}-{max(lengths)} "
      f"tokens -> data.max_prompt_tokens = {c.data.max_prompt_tokens}")
print(f"{BENCH}: {len(test_src)} test problems")
print("--- example prompt ---\n" + prompt(pool[0]) + "\n--- gold answer: " + pool[0]["answer"])
"""

ESTIMATE = r"""
SHAPE = gpu_estimates.shape_of_path(c.model.path)
print(gpu_estimates.describe(SHAPE, gpu_estimates.Run.of_config(c), GPU))
"""

TRAIN = r"""
from sage_jax.train import loop as train

summary = train.run(c, WORKDIR)  # rerunning resumes from WORKDIR's newest checkpoint
print(summary)
"""

CURVES = r"""
import notebook_utils as nu

display(Image(nu.plot_training_curves(WORKDIR, "quickstart_curves.png")))
"""

EVAL = r"""
import shutil

import ml_collections

from sage_jax.train import eval_mode

e = default_config()
e.mode, e.seed = "eval", 0
e.model.path = c.model.path
e.data.data_dir, e.data.template = DATA_DIR, c.data.template
# the base (HF dir / hub id) against this run's latest checkpoint (LoRA adapters on that base)
e.eval.models = ml_collections.ConfigDict({"base": c.model.path, "sage": WORKDIR})
e.eval.benchmarks = f"{BENCH}:test"
e.eval.num_problems = 8 if SMOKE else %(eval_problems)d  # the first N problems (0 = all 500)
e.eval.n = 4 if SMOKE else %(eval_n)d  # samples per problem: pass@1 .. pass@n
e.eval.max_new_tokens = 48 if SMOKE else %(new_tokens)d
e.eval.temperature, e.eval.top_p = (1.0, 1.0) if SMOKE else (0.6, 0.95)
e.eval.batch_size = 32 if SMOKE else %(eval_rows)d  # rows per sampler call
e.rl.reward = c.rl.reward
e.logging.progress = not SMOKE
results = eval_mode.run(e, EVAL_DIR)  # EVAL_DIR/eval: results.json, results.md and the two plots; resumable
for name in ("pass_at_k", "pass1_vs_passk"):
    shutil.copy(os.path.join(EVAL_DIR, "eval", f"{name}.png"), f"quickstart_{name}.png")
"""

PLOTS = r"""
display(Image("quickstart_pass_at_k.png"), Image("quickstart_pass1_vs_passk.png"))
overview = open(os.path.join(EVAL_DIR, "eval", "results.md")).read().split("## ")[1]
display(Markdown("## " + overview))
"""


def cells(b):
    s05, l4 = ge.KNOWN_SHAPES["Qwen/Qwen2.5-0.5B-Instruct"], ge.GPUS["L4"]
    t = ge.step_seconds(s05, run_shape(""), l4)["step"]
    params = b.params_header(
        '\nMODEL = "Qwen/Qwen2.5-0.5B-Instruct"  # or "Qwen/Qwen2.5-Math-1.5B" (then MAX_STEPS = %d)\n'
        'MAX_STEPS = %d  # RL steps: the whole notebook takes ~30 min on an L4 with the 0.5B model (estimate)\n'
        'WORKDIR = "runs/quickstart"  # checkpoints, metrics.jsonl, export_hf/ and export_peft/; a rerun resumes\n'
        'EVAL_DIR = "runs/quickstart_eval"  # pass@k results and plots\n'
        'DATA_DIR = "runs/tfds"  # prepared TFDS datasets (shared by the three notebooks)'
        % (Q["steps_15b"], Q["steps"]))
    return [
        ("md", f"""# SAGE quickstart: RL with a shaped KL anchor, LoRA, bf16, one GPU

{b.badge("quickstart_sage")}

Trains a small instruct model with **SAGE** (GRPO whose reverse-KL anchor is `q * pi_ref`, here the
*branch* guide: `q > 1` on high-entropy tokens) through the project's own entry point
`sage_jax.train.loop.run(config, workdir)`, with LoRA adapters (rank 8) and bf16 compute: DAPO-Math-17k for
training and MATH-500 for pass@k, both prepared by the project's TFDS builders from the hub. It then
plots the reward / KL / entropy / q curves and pass@k of the base against the trained model.

Colab: *Runtime > Change runtime type > GPU* (L4 recommended), then *Run all*. Locally: run it from
`notebooks/` in a checkout with `jax[cuda12]` installed. `SMOKE = True` (first code cell) runs
everything on CPU with the shipped tiny model and the procedural arithmetic task in ~1 min (2 CPU cores).

**Memory and time per GPU type** (estimates, default settings: `{Q['steps']}` steps, see below):

{tables(b)}"""),
        ("code", params),
        ("md", b.SETUP_MD),
        ("code", b.SETUP_CODE),
        ("md", """### Devices

**What:** imports JAX, reports the accelerator and picks its row of the estimates.
**Time:** seconds (~20 s for the first CUDA initialisation on Colab)."""),
        ("code", b.DEVICES_CODE),
        ("md", """### Config

**What:** builds the run config from `sage_jax.defaults.default_config()` (the same keys as
`configs/*.py` and `--config.x.y=` on the command line): model, LoRA, data, rollout, KL, guide, optimizer.
**Time:** instant."""),
        ("code", CONFIG % Q),
        ("md", """### Data

**What:** prepares the training set and MATH-500 with the project's TFDS builders (downloaded from the
hub, written as array_record under `DATA_DIR`; `SMOKE`: the procedural arithmetic task, generated
offline), loads the tokenizer, and fits `data.max_prompt_tokens` to the longest prompt of the pool.
**Time:** ~1-2 min on Colab the first time (DAPO-Math-17k parquet + preparation; estimate), seconds after
(prepared data is reused); `SMOKE`: ~5 s."""),
        ("code", DATA),
        ("md", """### Memory and time estimate for this config

**What:** prints the arithmetic estimate (`notebooks/gpu_estimates.py`) for the config as it now is (with
the real prompt length) on this GPU, or on every listed GPU when none is detected. **Time:** instant."""),
        ("code", ESTIMATE),
        ("md", f"""### Train: SAGE (branch guide) with LoRA

**What:** `sage_jax.train.loop.run`: per step, {Q['prompts']} prompts x {Q['group']} sampled completions, math-verify
rewards, group advantages, the PPO-clip loss plus beta x KL to the branch-shaped anchor; only the LoRA
adapters train. Writes `WORKDIR/metrics.jsonl`, Orbax checkpoints (every 20 steps: a disconnected
runtime resumes by running the notebook again), and at the end `WORKDIR/export_hf` (adapters merged,
loads in `transformers`) and `WORKDIR/export_peft` (the adapters alone, PEFT format).
**Time (estimates):** L4 ~{t:.0f} s per step -> {b.minutes(COMPILE_S + Q['steps'] * t)} for {Q['steps']} steps
including ~{COMPILE_S // 60} min of compilation; A100 ~4 s per step; T4 ~6x slower than an L4; 1.5B ~3x the
0.5B time. `SMOKE`: ~20 s on 2 CPU cores (measured), mostly compilation."""),
        ("code", TRAIN),
        ("md", """### Training curves

**What:** reward, KL to the shaped anchor, token entropy and the guide's q (mean with its min-max band)
per step, from `WORKDIR/metrics.jsonl`; saved as `quickstart_curves.png`. **Time:** ~1 s."""),
        ("code", CURVES),
        ("md", f"""### pass@k: base vs trained

**What:** `mode=eval` (`sage_jax.train.eval_mode.run`): both models sample the same {Q['eval_problems']} MATH-500 problems
with the same seeds, n = {Q['eval_n']} samples each; pass@k (unbiased) with bootstrap CIs, written to
`EVAL_DIR/eval/` (resumable; change `EVAL_DIR` when you change sampling settings).
**Time (estimates):** L4 ~{b.minutes(eval_seconds(s05, l4))} per model (load + compile ~1 min, sampling
{Q['eval_problems'] * Q['eval_n']} completions of <= {Q['new_tokens']} tokens), A100 ~1-2 min, T4 ~{b.minutes(eval_seconds(s05, ge.GPUS['T4']))}; `SMOKE`: ~10 s on 2 CPU cores (measured)."""),
        ("code", EVAL % Q),
        ("md", """### Plots

**What:** pass@k of both models (with 95% bootstrap CIs) and pass@1 against pass@n, saved as
`quickstart_pass_at_k.png` and `quickstart_pass1_vs_passk.png`, and the overview table. **Time:** instant."""),
        ("code", PLOTS),
        ("md", """### Next

* `evaluate_passk.ipynb`: more checkpoints (this run's `WORKDIR`, `WORKDIR/export_hf`, any HF model) on
  all math benchmarks, with the new-support statistics.
* `inspect_guides.ipynb`: per-token entropy, q of each guide and per-token KL of this policy.
* The same run from the command line: `python -m sage_jax.main --config=configs/qwen_math.py
  --workdir=DIR --config.model.path=Qwen/Qwen2.5-0.5B-Instruct --config.model.lora.rank=8 ...`."""),
    ]
