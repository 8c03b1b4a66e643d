"""Paper-scale SAGE: Qwen2.5-Math-7B on DAPO-Math-17k, branch guide, TPU pod or GPUs.

    python -m sage_jax.main --config=configs/qwen_math.py --workdir=gs://BUCKET/sage_qwen_math \
        --config.data.manual_dir=/data/sage_manual          # where DAPO-Math-17k etc. were placed
    ./launch_tpu.sh --name=sage --zone=us-east5-a --accelerator-type=v5p-64 --config=configs/qwen_math.py --workdir=...

The SAGE paper's setup (Lee, Kang, Hwang, ICML 2026; reference code subclasses TRL's GRPOTrainer):
8 rollouts per prompt, beta 0.05 (k3 against the shaped anchor), eps 0.2, lr 5e-6, branch guide
(ratio 0.3, threshold 1.2 nats, q in [0.6, 1.4]), bf16. Expected (paper, avg of AIME/AMC23/MATH-500):
pass@1 0.284 and pass@256 0.729 for GRPO + branch, against 0.266 / 0.714 for GRPO.
Variants: `:grpo` (guide none), `:dapo` (DAPO aggregation + branch), `:bnpo`.
"""

from sage_jax.defaults import default_config


def get_config(arg=None):
    c = default_config()
    c.mode = "rl"
    c.seed = 0
    c.max_steps = 500  # RL steps
    c.checkpoint_every = 25
    c.log_every = 1
    c.eval_every = 50
    c.model.path = "Qwen/Qwen2.5-Math-7B"  # or a local HF directory
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.data.name = "dapo_math_17k"
    c.data.eval_split = "train"  # in-training eval reads eval.benchmarks; this split is unused
    c.data.template = "sage"  # chat template + "Please reason step by step, ... \\boxed{}."
    c.data.batch_size = 64  # prompts per step (x 8 rollouts = 512 completions)
    c.data.max_prompt_tokens = 512
    c.data.max_answer_tokens = 64
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 3072  # Qwen2.5-Math-7B has a 4k context
    c.rollout.temperature = 1.0
    c.rl.beta = 0.05
    c.rl.estimator = "k3"
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.2
    c.rl.loss_type = "grpo"
    c.rl.reward = "math_verify"
    c.rl.logp_chunk = 512
    c.sage.guide = "branch"
    c.optim.learning_rate = 5e-6
    c.optim.warmup_steps = 10
    c.optim.weight_decay = 0.01
    c.optim.grad_clip_norm = 1.0
    c.eval.num_problems = 0  # all problems of each benchmark
    c.eval.n = 16
    c.eval.temperature = 0.6
    c.eval.top_p = 0.95
    c.eval.max_new_tokens = 3072
    c.eval.batch_size = 512
    c.eval.at_start = False
    c.eval.benchmarks = "math500:test,aime2024:test,aime2025:test,amc23:test,minerva_math:test"
    c.mesh.shape = (1, -1, 1)  # FSDP over every device; see README "Scaling" for tensor-parallel layouts
    if arg:
        if arg == "grpo":
            c.sage.guide = "none"
        elif arg in ("dapo", "bnpo"):
            c.rl.loss_type = arg
        else:
            raise ValueError(f"configs/qwen_math.py:{arg}: unknown variant (grpo, dapo, bnpo)")
    return c
