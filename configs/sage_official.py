"""The official SAGE recipe (github.com/tally0818/SAGE, configs/train_config.yaml on TRL 0.23's defaults).

    python -m sage_jax.main --config=configs/sage_official.py --workdir=DIR \
        --config.data.manual_dir=/data/sage_manual   # dapo_math_17k_en/en/train-00000-of-00001.parquet, ...

DeepSeek-R1-Distill-Qwen-7B with LoRA (r 8, alpha 16, dropout 0, all seven projections; the reference is
the base, adapters off), bf16 compute, fp32 adapters (PEFT's default). AdamW lr 5e-6 constant (HF's
"constant" ignores warmup_ratio), weight decay 0.01, grad clip 1.0, 1000 optimiser steps. GRPO loss with
beta 0.05 (k3 against the branch-guided anchor), eps 0.2 / 0.2, group std with Bessel's correction. A
generation batch is 2 prompts x 8 completions, split into 2 optimiser steps (so 500 RL steps here);
temperature 1, top-p 1, min_p 0.01, stop after "</SOLUTION>" (kept), prompts <= 2048 and completions
<= 6144 tokens; TRL's vLLM importance weight capped at 2.0. The official system prompt and the official
reward (math-verify on the whole completion, 0 on any exception). Training data: open-r1's
DAPO-Math-17k-Processed, config en. tests/test_official_recipe.py compares every field with the official
values and lists the deviations with their reasons.
Variants: `:grpo` (guide none), `:nokl` (beta 0, guide none: the README's no-KL rows), `:token`, `:random`.
Not built yet: the Qwen2.5-Math-7B variant, whose SFT stage on OpenMathReasoning-mini precedes RL.
"""

from sage_jax.config_lib import default_config
from sage_jax.data.templates import OFFICIAL_SYSTEM_PROMPT

UPDATES_PER_GENERATION = 2  # TRL: generation_batch_size 16 / per_device_train_batch_size 8


def get_config(arg=None):
    c = default_config()
    c.mode = "rl"
    c.seed = 3407  # the official trainer_seed (TRL's seed: data order and sampling)
    c.max_steps = 1000 // UPDATES_PER_GENERATION  # RL steps; optimiser steps = 1000 (TRL max_steps)
    c.checkpoint_every = 50  # RL steps (the official save_steps: 100 optimiser steps)
    c.log_every = 1
    c.eval_every = 0  # the official run has no in-training evaluation; set e.g. 50 to add one

    c.model.path = "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.remat = "full"  # the official gradient_checkpointing: true
    c.model.lora.rank = 8
    c.model.lora.alpha = 16.0  # the official default alpha = 2 x rank
    c.model.lora.dropout = 0.0
    c.model.lora.targets = "q,k,v,o,gate,up,down"
    c.model.lora.param_dtype = "float32"  # PEFT keeps adapters in fp32 on a bf16 base

    c.data.name = "dapo_math_17k_en"
    c.data.template = "chat"  # the model's own chat template: system prompt, then the problem as the user turn
    c.data.system_prompt = OFFICIAL_SYSTEM_PROMPT
    c.data.batch_size = 2  # prompts per generation batch (x 8 completions = 16)
    c.data.max_prompt_tokens = 2048
    c.data.max_answer_tokens = 64

    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 6144
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.rollout.min_p = 0.01
    c.rollout.stop_strings = ("</SOLUTION>",)

    c.rl.beta = 0.05
    c.rl.estimator = "k3"
    c.rl.kl_mode = "reverse"
    c.rl.loss_type = "grpo"
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.2
    c.rl.scale_rewards = "group"
    c.rl.num_iterations = 1
    c.rl.num_minibatches = UPDATES_PER_GENERATION
    c.rl.tis_cap = 2.0  # TRL 0.23 vllm_importance_sampling_correction with vllm_importance_sampling_cap 2.0
    c.rl.reward = "math_verify_text"
    c.rl.logp_chunk = 512

    c.sage.guide = "branch"
    c.sage.branch.ratio = 0.3
    c.sage.branch.threshold = 1.2
    c.sage.branch.q_min = 0.6
    c.sage.branch.q_max = 1.4
    c.sage.branch.source = "new"

    c.optim.learning_rate = 5e-6
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.01
    c.optim.grad_clip_norm = 1.0

    c.eval.n = 8
    c.eval.temperature = 1.0
    c.eval.max_new_tokens = 6144
    c.eval.batch_size = 64
    c.eval.at_start = False
    c.eval.at_end = False
    c.eval.benchmarks = "math500:test,aime2024:test,aime2025:test,amc23:test"
    c.mesh.shape = (1, -1, 1)

    variants = {"branch": {}, "grpo": dict(guide="none"), "nokl": dict(guide="none", beta=0.0),
                "token": dict(guide="token"), "random": dict(guide="random")}
    if arg:
        if arg not in variants:
            raise ValueError(f"configs/sage_official.py:{arg}: unknown variant; choose one of {sorted(variants)}")
        v = variants[arg]
        c.sage.guide = v.get("guide", c.sage.guide)
        c.rl.beta = v.get("beta", c.rl.beta)
    return c
