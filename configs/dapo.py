"""DAPO as published (Yu et al., 2025, arXiv 2503.14476, section 4.1; verl's recipe/dapo), a baseline for SAGE.

    python -m sage_jax.main --config=configs/dapo.py --workdir=DIR --config.data.manual_dir=/data/sage_manual
    python -m sage_jax.main --config=configs/dapo.py:qwen_math --workdir=DIR ...   # at SAGE's scale

The four parts of the algorithm (`algorithm` below, also what experiments/sage_miniature's DAPO row uses):
- clip-higher: eps_low 0.2, eps_high 0.28;
- dynamic sampling: 3 x the trained prompts are sampled per step (verl's gen_prompt_bsz 1536 for 512) and
  the groups whose rewards differ are trained on first. verl resamples until the batch is full (up to 10
  generation rounds); one fixed-shape program cannot, so a shortfall is left to masked groups and logged
  (`dynamic/short_groups`; sage_jax/rl/dapo.py);
- token-level loss: each update's token sum over that update's tokens (verl's token-mean, `bnpo` here; TRL's
  `dapo` divides by the whole generation batch's tokens instead, which differs with several updates);
- overlong reward shaping: the last 4096 of 20480 tokens (a fifth of the completion budget) get a linear
  penalty down to -1. DAPO's rewards are +1 / -1; the verifier here scores 1 / 0, so the penalty factor is
  0.5: the shaped reward is then an affine map (positive scale) of DAPO's, which group-normalised
  advantages do not see.
No KL term and no reference model. The rest of the published recipe: AdamW lr 1e-6 with a 20-step linear
warm-up (constant after), weight decay 0.1, grad clip 1.0; 512 prompts x 16 completions per step, 16
updates of 32 prompts each; temperature 1, top-p 1; prompts <= 2048 tokens, completions <= 20480.

Kept from this repo's SAGE setup, so the rows compare: the prompt (SAGE's boxed-answer system prompt, not
DAPO's "Answer: $Answer" line) and the reward (math-verify on the boxed answer, not DAPO's exact match).
The published base model is Qwen2.5-32B; `:qwen_math` runs the same algorithm on configs/qwen_math.py's
model, data, batch, lengths and evaluation (Qwen2.5-Math-7B has a 4k context, so the buffer is a fifth of
its 3072 completion tokens).
"""

EPS_LOW, EPS_HIGH = 0.2, 0.28
OVERSAMPLE = 3  # verl recipe/dapo: gen_prompt_bsz = 3 x train_prompt_bsz
BUFFER_FRACTION = 4096 / 20480  # the soft-penalty buffer's share of the completion budget
PENALTY = 0.5  # 1.0 on DAPO's +-1 rewards = 0.5 on this verifier's 1 / 0 (see the docstring)


def algorithm(max_new_tokens: int, buffer: int | None = None) -> dict:
    """DAPO's algorithmic fields as dotted config overrides (no sage_jax import: experiments read it too).

    The soft-penalty buffer: `buffer` tokens at the end of a `max_new_tokens` budget; None = DAPO's share,
    a fifth. DAPO puts it past the expected longest answer (16384 of 20480); where a task's longest correct
    answer is known, pass the tokens past it."""
    buffer = max(1, round(BUFFER_FRACTION * max_new_tokens)) if buffer is None else buffer
    return {"rl.loss_type": "bnpo", "rl.eps_low": EPS_LOW, "rl.eps_high": EPS_HIGH, "rl.beta": 0.0,
            "sage.guide": "none", "rl.dynamic_sampling": OVERSAMPLE, "rl.overlong_buffer": buffer,
            "rl.overlong_penalty": PENALTY, "rl.overlong_filter": False}


def _apply(c, fields: dict):
    for dotted, value in fields.items():
        group, name = dotted.split(".")
        c[group][name] = value
    return c


def get_config(arg=None):
    from sage_jax.defaults import default_config
    if arg == "qwen_math":
        import importlib.util
        import os
        spec = importlib.util.spec_from_file_location("qwen_math", os.path.join(os.path.dirname(__file__), "qwen_math.py"))
        qm = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(qm)
        c = qm.get_config()
        return _apply(c, algorithm(c.rollout.max_new_tokens))
    if arg:
        raise ValueError(f"configs/dapo.py:{arg}: unknown variant (qwen_math)")
    c = default_config()
    c.mode = "rl"
    c.seed = 0
    c.max_steps = 500  # rollout steps (DAPO's AIME curve reaches its peak within about this many)
    c.checkpoint_every = 25
    c.log_every = 1
    c.eval_every = 50
    c.model.path = "Qwen/Qwen2.5-32B"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.remat = "full"
    c.data.name = "dapo_math_17k"
    c.data.template = "sage"
    c.data.batch_size = 512  # prompts trained on per step (x 16 completions)
    c.data.max_prompt_tokens = 2048
    c.data.max_answer_tokens = 64
    c.rollout.group_size = 16
    c.rollout.max_new_tokens = 20480
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rl.num_minibatches = 16  # 512 completions per update
    c.rl.reward = "math_verify"
    c.rl.logp_chunk = 512
    c.rl.score_chunks = 16
    c.optim.learning_rate = 1e-6
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 20 * c.rl.num_minibatches  # 20 rollout steps, counted here in optimizer updates
    c.optim.weight_decay = 0.1
    c.optim.grad_clip_norm = 1.0
    c.eval.num_problems = 0
    c.eval.n = 32  # DAPO reports avg@32 on AIME 2024
    c.eval.temperature = 1.0
    c.eval.top_p = 0.7
    c.eval.max_new_tokens = 20480
    c.eval.benchmarks = "aime2024:test"
    c.mesh.shape = (1, -1, 1)
    return _apply(c, algorithm(c.rollout.max_new_tokens))
