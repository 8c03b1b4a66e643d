"""SAGE on DeepSeek-R1-Distill-Qwen-7B (the paper's second base model), DAPO-Math-17k, branch guide.

    python -m sage_jax.main --config=configs/r1_distill_qwen.py --workdir=DIR --config.data.manual_dir=...

R1-distilled models reason inside <think> at length: longer completions and a 64-sample pass@k; the
model's own chat template opens the <think> block, and its card advises no system prompt.
Expected (paper, avg of AIME/AMC23/MATH-500): base 0.429 / 0.778 (pass@1 / pass@64), GRPO 0.449 /
0.771, GRPO + branch 0.452 / 0.774. Variant `:grpo` runs the guide-free baseline.
"""

from sage_jax.defaults import default_config


def get_config(arg=None):
    c = default_config()
    c.mode = "rl"
    c.seed = 0
    c.max_steps = 300  # RL steps
    c.checkpoint_every = 25
    c.eval_every = 50
    c.model.path = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.data.name = "dapo_math_17k"
    # The model's own chat template (BOS, <｜User｜> / <｜Assistant｜> turns, the opened <think>), the instruction
    # in the user turn after the problem, no system prompt (the model card's advice)
    c.data.template = "chat:{problem}\nPlease reason step by step, and put your final answer within \\boxed{}."
    c.data.batch_size = 32  # prompts per step (x 8 = 256 completions)
    c.data.max_prompt_tokens = 512
    c.data.max_answer_tokens = 64
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 8192
    c.rollout.temperature = 0.6
    c.rollout.top_p = 0.95
    c.rl.beta = 0.05
    c.rl.reward = "math_verify"
    c.rl.logp_chunk = 512
    c.sage.guide = "branch"
    c.optim.learning_rate = 2e-6
    c.optim.warmup_steps = 10
    c.eval.num_problems = 0
    c.eval.n = 64
    c.eval.temperature = 0.6
    c.eval.top_p = 0.95
    c.eval.max_new_tokens = 8192
    c.eval.at_start = False
    c.eval.benchmarks = "math500:test,aime2024:test,aime2025:test,amc23:test"
    c.mesh.shape = (1, -1, 1)
    if arg == "grpo":
        c.sage.guide = "none"
    elif arg:
        raise ValueError(f"configs/r1_distill_qwen.py:{arg}: unknown variant (grpo)")
    return c
