"""Cells of notebooks/evaluate_passk.ipynb (built by build_notebooks.py)."""

import gpu_estimates as ge

E = dict(problems=100, n=16, new_tokens=1024, rows=128, prompt_assumed=256)
BENCHMARKS = "math500:test,amc23:test,aime2024:test,minerva_math:test"
BENCH_SIZES = {"math500": 500, "amc23": 40, "aime2024": 30, "minerva_math": 272}
COMPILE_S = 60  # per model: load + sampler compilation (estimate)


def problems() -> int:
    return sum(min(E["problems"], n) if E["problems"] else n for n in BENCH_SIZES.values())


def per_model_s(s: ge.Shape, gpu: ge.GPU) -> float:
    batches = -(-problems() * E["n"] // E["rows"])
    return COMPILE_S + batches * ge.sample_seconds(s, E["rows"], E["prompt_assumed"], E["new_tokens"], gpu)


def table(b) -> str:
    lines = ["| model | sampler GiB (estimate) | " + " | ".join(g.name for g in ge.GPUS.values()) + " |",
             "|---|---|" + "---|" * len(ge.GPUS)]
    for model, s in ge.KNOWN_SHAPES.items():
        mem = ge.sample_memory_gib(s, E["rows"], E["prompt_assumed"], E["new_tokens"])
        cells = [(b.minutes(per_model_s(s, g)) + " per model") if mem <= 0.9 * g.memory_gib else "**does not fit**"
                 for g in ge.GPUS.values()]
        lines.append(f"| `{model}` | {mem:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


PARAMS_EXTRA = r"""
# name -> an HF directory or hub id, or a run directory of this project (its latest Orbax checkpoint is
# restored onto the run's base model; a LoRA run's adapters are attached to that base)
MODELS = {
    "base": "Qwen/Qwen2.5-0.5B-Instruct",
    "sage": "runs/quickstart",  # the quickstart's run (Orbax checkpoints)
    # "sage_hf": "runs/quickstart/export_hf",  # the same policy in HF format (adapters merged; SMOKE adds it)
}
BASE_MODEL = "base"  # new / lost support below are relative to this model
BENCHMARKS = "%(benchmarks)s"
NUM_PROBLEMS = %(problems)d  # first N problems of each benchmark; 0 = all
N = %(n)d  # samples per problem: pass@1 .. pass@N
MAX_NEW_TOKENS = %(new_tokens)d
TEMPERATURE, TOP_P = 0.6, 0.95
BATCH_ROWS = %(rows)d  # rows per sampler call
EVAL_DIR = "runs/evaluate_passk"  # resumable; use a new one when you change sampling settings
DATA_DIR = "runs/tfds"
"""

SMOKE_MODELS = r"""
from sage_jax.defaults import TINY_BASE, default_config
from sage_jax.models import hf

if SMOKE:  # the shipped tiny model against the quickstart's run (or a 3-step LoRA run made here)
    from sage_jax.train import loop as train
    from sage_jax.train.eval_mode import is_run_dir

    run = "runs/quickstart"
    if not is_run_dir(run):
        run = "runs/smoke_policy"
        t = default_config()
        t.model.path, t.data.data_dir, t.max_steps, t.checkpoint_every = TINY_BASE, DATA_DIR, 3, 0
        t.model.lora.rank, t.data.batch_size, t.rollout.group_size, t.rollout.max_new_tokens = 8, 4, 4, 48
        t.optim.learning_rate, t.eval.at_start, t.eval.at_end, t.logging.progress = 1e-4, False, False, False
        train.run(t, run)
    MODELS = {"base": TINY_BASE, "sage": run}
    if os.path.isdir(os.path.join(run, "export_hf")):
        MODELS["sage_hf"] = os.path.join(run, "export_hf")
    BENCHMARKS, NUM_PROBLEMS, N, MAX_NEW_TOKENS, TEMPERATURE, TOP_P, BATCH_ROWS = (
        "procedural_arithmetic:test", 8, 4, 48, 1.0, 1.0, 32)
for name, path in list(MODELS.items()):
    if not os.path.exists(path) and not hf.is_hub_id(path):  # the one rule the package decides hub ids by
        print(f"skipping {name}: {path} does not exist (run quickstart_sage.ipynb first?)")
        del MODELS[name]
        continue
    print(f"{name:10s} {path}", "(run dir)" if os.path.isfile(os.path.join(path, "run_config.json")) else "")
"""

EVAL = r"""
import ml_collections

from sage_jax.train import eval_mode

e = default_config()
e.mode, e.seed = "eval", 0
e.model.path = next(iter(MODELS.values()))
e.model.dtype = e.model.param_dtype = "float32" if SMOKE else "bfloat16"  # HF dirs; run dirs keep their own
e.data.data_dir = DATA_DIR
e.data.template = "chat" if SMOKE else "sage"  # sage: chat template + "Please reason step by step ... \boxed{}"
e.eval.models = ml_collections.ConfigDict(dict(MODELS))
e.eval.benchmarks = BENCHMARKS
e.eval.num_problems, e.eval.n, e.eval.max_new_tokens = NUM_PROBLEMS, N, MAX_NEW_TOKENS
e.eval.temperature, e.eval.top_p, e.eval.batch_size = TEMPERATURE, TOP_P, BATCH_ROWS
e.rl.reward = "exact_match" if SMOKE else "math_verify"
e.logging.progress = not SMOKE
results = eval_mode.run(e, EVAL_DIR)  # samples, verifies, stores EVAL_DIR/eval/results.json after every batch
"""

REPORT = r"""
from sage_jax.eval import report as eval_report

summary = results["summary"]
eval_report.plot_pass_at_k(summary, "passk_comparison.png")
eval_report.plot_pass1_vs_passk(summary, "pass1_vs_passk.png")
display(Image("passk_comparison.png"), Image("pass1_vs_passk.png"))
display(Markdown("## " + open(os.path.join(EVAL_DIR, "eval", "results.md")).read().split("## ")[1]))  # overview
"""

SUPPORT = r"""
import notebook_utils as nu

rows = nu.support_stats(summary, base=BASE_MODEL)
display(Markdown(nu.support_markdown(rows)))
display(Image(nu.plot_support(rows, "new_support.png")))
"""


def cells(b):
    s05 = ge.KNOWN_SHAPES["Qwen/Qwen2.5-0.5B-Instruct"]
    params = b.params_header(PARAMS_EXTRA % dict(E, benchmarks=BENCHMARKS))
    return [
        ("md", f"""# pass@k of checkpoints on the math benchmarks

{b.badge("evaluate_passk")}

Evaluates one or more policies (Orbax run directories of this project, HF directories, hub ids) with
`mode=eval` (`sage_jax.train.eval_mode.run` -> `sage_jax.eval.evaluate.evaluate_models`): every model samples the
same prompts with the same seeds; pass@k (unbiased estimator), maj@k and bootstrap CIs per benchmark and
averaged; then draws the pass@k comparison, the pass@1-vs-pass@k scatter, and the **new-support**
statistics: the fraction of problems a model solves at k = n that the base model never solves (and the
reverse, lost support), which is how SAGE's paper reads exploration.

Defaults: {len(BENCH_SIZES)} benchmarks (`{BENCHMARKS}`), the first {E['problems']} problems of each
({problems()} problems), n = {E['n']}, <= {E['new_tokens']} new tokens, temperature 0.6, top-p 0.95.

**Memory and time per model** (estimates: weights in float32 + the KV cache of one batch of
{E['rows']} rows; decode at {ge.BANDWIDTH_EFFICIENCY:.0%} of the memory bandwidth plus ~{COMPILE_S} s of loading and
compilation; no GPU measured):

{table(b)}

Raise `BATCH_ROWS` on an A100 (faster; memory grows with it); lower `NUM_PROBLEMS` / `N` to save time."""),
        ("code", params),
        ("md", b.SETUP_MD),
        ("code", b.SETUP_CODE),
        ("md", "### Devices\n\n**What:** imports JAX and reports the accelerator. **Time:** seconds."),
        ("code", b.DEVICES_CODE),
        ("md", """### Models

**What:** lists the models to compare. In `SMOKE` mode: the shipped tiny model against the quickstart's
run when it exists in this directory, else a 3-step LoRA run trained here (plus its HF export).
**Time:** instant (`SMOKE` without the quickstart run: ~30 s to train it on 2 CPU cores)."""),
        ("code", SMOKE_MODELS),
        ("md", f"""### Evaluate

**What:** prepares the benchmarks (TFDS builders, from the hub the first time), then loads each model in
turn and samples N completions per problem, verified with math-verify. Results are saved after every batch:
a rerun skips finished work and never loads a finished model.
**Time (estimates):** per model ~{b.minutes(per_model_s(s05, ge.GPUS['L4']))} on an L4 and
~{b.minutes(per_model_s(s05, ge.GPUS['A100-40GB']))} on an A100 for the 0.5B model (table above); `SMOKE`: ~20 s on 2 CPU cores (measured)."""),
        ("code", EVAL),
        ("md", """### pass@k comparison and pass@1 vs pass@k

**What:** pass@k per benchmark (and averaged) with 95% bootstrap bands, and pass@1 against pass@n per
model: sharpening moves a model right (pass@1) and often down (pass@n); exploration keeps pass@n up.
Saved as `passk_comparison.png` and `pass1_vs_passk.png`. **Time:** seconds."""),
        ("code", REPORT),
        ("md", """### New support

**What:** per model and benchmark, the fraction of problems solved at k = n, solved *only* by the model
(new support) and solved only by the base (lost support), and the mean number of distinct correct final
answers; saved as `new_support.png`. **Time:** instant."""),
        ("code", SUPPORT),
    ]
