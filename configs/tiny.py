"""The embedded default: GRPO + the SAGE branch guide on the embedded testbed (procedures of arithmetic).

Runs on a laptop CPU with no network (`make demo` runs exactly this):

    python -m sage_jax.main --config=configs/tiny.py --workdir=/tmp/sage_jax_demo

Starts from `sage_jax/assets/tiny_base` (a 0.8M-parameter char-level Qwen2 SFT'd on a corpus mixing two
correct and two wrong procedures, experiments/tiny_base/), samples 8 completions for each of 8 fresh
problems per step (3-6 operands), rewards exact matches of the final \\boxed{} answer, and trains 200 steps
with GRPO + the branch guide (beta 0.05). It evaluates every held-out problem (32 samples) before and after
and prints the gain with paired 95% CIs; DIR/run.png plots the reward and pass@k curves.
Expected: held-out pass@1 0.347 -> 0.466 (gain 0.119 [0.102, 0.135]), from experiments/demo/results.json.
Variants: `:grpo` (guide none), `:branch`, `:token`, `:random`.
"""

from sage_jax.defaults import TINY_BASE, default_config


def get_config(arg=None):
    c = default_config()
    c.mode = "rl"
    c.seed = 0
    c.max_steps = 200  # RL steps
    c.checkpoint_every = 50
    c.log_every = 5
    c.model.path = TINY_BASE
    c.data.name = "procedural_arithmetic"
    c.data.builder_config = "strategies"  # sage_jax.data.builders.STRATEGIES_TASK
    c.data.template = "chat"
    c.data.batch_size = 8  # prompts per step, fresh ones every step (50k training problems)
    c.data.max_prompt_tokens = 48  # characters (char-level tokenizer)
    c.data.max_answer_tokens = 8
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 96  # the longest worked solution (6 operands) is 89 characters + EOS
    c.rollout.decode_segments = 1  # at T <= 96 segments save little and cost compile time (bench README, 9)
    c.rollout.temperature = 1.0
    c.rl.beta = 0.05
    c.rl.loss_type = "grpo"
    c.rl.reward = "exact_match"
    c.sage.guide = "branch"  # reference defaults: ratio 0.3, threshold 1.2 nats, q in [0.6, 1.4]
    c.optim.learning_rate = 1e-4
    c.optim.warmup_steps = 10
    c.optim.grad_clip_norm = 1.0
    c.eval.num_problems = 0  # every held-out problem
    c.eval.n = 32
    c.eval.max_new_tokens = 96
    c.eval.batch_size = 512
    if arg:  # e.g. configs/tiny.py:grpo for the plain GRPO-with-KL baseline
        presets = {"grpo": dict(guide="none"), "branch": dict(guide="branch"), "token": dict(guide="token"),
                   "random": dict(guide="random")}
        if arg not in presets:
            raise ValueError(f"configs/tiny.py:{arg}: unknown preset; choose one of {sorted(presets)}")
        c.sage.guide = presets[arg]["guide"]
    return c
