"""The official SAGE recipe (github.com/tally0818/SAGE, configs/train_config.yaml on TRL 0.23's defaults).

    python -m sage_jax.main --config=configs/sage_official.py --workdir=DIR \
        --config.data.manual_dir=/data/sage_manual   # dapo_math_17k_en/en/train-00000-of-00001.parquet, ...

DeepSeek-R1-Distill-Qwen-7B with LoRA (r 8, alpha 16, dropout 0, all seven projections; the reference is
the base, adapters off), bf16 compute, fp32 adapters (PEFT's default). AdamW lr 5e-6 constant (HF's
"constant" ignores warmup_ratio), weight decay 0.01, grad clip 1.0, 1000 optimiser steps. GRPO loss with
beta 0.05 (k3 against the branch-guided anchor), eps 0.2 / 0.2, group std with Bessel's correction. A
generation batch is 2 prompts x 8 completions, split into 2 optimiser steps (so 500 RL steps here);
temperature 1, top-p 1, min_p 0.01, stop after "</SOLUTION>" (kept), prompts <= 2048 and completions
<= 6144 tokens; TRL's vLLM importance weight capped at 2.0; each update a random half of the generation
batch's rows (TRL's shuffle before the split). Evaluation generates until EOS, without the stop string. The official system prompt and the official
reward (math-verify on the whole completion, 0 on any exception). Training data: open-r1's
DAPO-Math-17k-Processed, config en. tests/test_official_recipe.py compares every field with the official
values and lists the deviations with their reasons.
Variants: `:grpo` (guide none), `:nokl` (beta 0, guide none: the README's no-KL rows), `:token`, `:random`.

Qwen2.5-Math-7B, a base model (`instruction_tuned: false` upstream), first gets the official SFT stage:
`:qwen_math_sft` trains the LoRA adapter on OpenMathReasoning-mini (split cot, numeric answers, the
official CHAT_TEMPLATE and target format, loss on every token as TRL's SFTTrainer on a text field, rows up
to 4096 tokens = max_seq_len / 2; 2 epochs, lr 2e-4, batch 1, warm-up 5, linear, weight decay 0.01), then
`:qwen_math` (combinable with a guide variant, e.g. `:qwen_math,nokl`) continues that adapter with RL
(`model.lora.init_from`); the reference stays the raw base. One command runs both stages:

    ./scripts/sage_official_qwen_math.sh DIR --config.data.manual_dir=/data/sage_manual
"""

from sage_jax.defaults import default_config
from sage_jax.data.templates import OFFICIAL_EVAL_USER, OFFICIAL_SYSTEM_PROMPT

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
    # TRL 0.23 shuffles the 16-row generation batch before splitting it into the 2 updates: each update is a
    # random 8 rows of both prompts (the training forward still computes each prompt once, for 8 rows)
    c.rl.update_shuffle = "rows"
    # TRL 0.23 vllm_importance_sampling_correction: token level, weight capped at 2.0
    c.rl.sampler_correction = "trl_0.23"
    c.rl.reward = "math_verify_text"
    c.rl.logp_chunk = 512
    c.rl.score_chunks = 2  # the reference pass one prompt group at a time (memory only; the same numbers)
    # attention in query chunks of 512 (memory only; the same numbers): without it the float32 scores of one
    # 8-row update (8 x 28 heads x 8192^2) need ~105 GiB and the recipe does not fit one 80 GB GPU; with it,
    # ~42 GiB (experiments/memory_plan_long.md, libtpu's compiler)
    c.model.attention_chunk = 512

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

    # The official evaluation (configs/eval_config.yaml, src/data/loaders.py): k = 64 samples at
    # temperature 0.3, top-p 0.95, up to 6144 tokens; the system prompt, then "Problem: ..." as the user turn.
    c.eval.n = 64
    c.eval.temperature = 0.3
    c.eval.top_p = 0.95
    c.eval.max_new_tokens = 6144
    c.eval.batch_size = 64
    c.eval.template = "chat:" + OFFICIAL_EVAL_USER
    c.eval.stop_strings = ()  # the official evaluation generates until EOS (its </SOLUTION> stop is training's)
    c.eval.at_start = False
    c.eval.at_end = False
    c.eval.num_problems = 0  # all
    c.eval.benchmarks = "math500:test,aime_2024_2025:test,amc23:test,minerva_math:test"
    c.mesh.shape = (1, -1, 1)

    variants = {"branch": {}, "grpo": dict(guide="none"), "nokl": dict(guide="none", beta=0.0),
                "token": dict(guide="token"), "random": dict(guide="random")}
    models = {"qwen_math": _qwen_math, "qwen_math_sft": _qwen_math_sft}
    for part in [p.strip() for p in (arg or "").split(",") if p.strip()]:
        if part in models:
            models[part](c)
        elif part in variants:
            v = variants[part]
            c.sage.guide = v.get("guide", c.sage.guide)
            c.rl.beta = v.get("beta", c.rl.beta)
        else:
            raise ValueError(f"configs/sage_official.py:{arg}: unknown variant {part!r}; choose from "
                             f"{sorted(variants) + sorted(models)}")
    return c


def _qwen_math(c) -> None:
    """RL on Qwen2.5-Math-7B after the SFT stage: the official base-model chat template (system prompt, EOS,
    the problem, then `<start_working_out>`), the adapter from `:qwen_math_sft` via model.lora.init_from."""
    c.model.path = "Qwen/Qwen2.5-Math-7B"
    c.data.template = "official_base"
    c.eval.template = "official_base:" + OFFICIAL_EVAL_USER
    # Qwen2.5-Math-7B has 4096 positions; the official 2048 + 6144 is the R1-Distill (default model) shape.
    c.data.max_prompt_tokens = 1024
    c.rollout.max_new_tokens = 3072
    c.eval.max_new_tokens = 3072


def _qwen_math_sft(c) -> None:
    """The official SFT stage (src/train/common.py run_sft_if_needed, configs/train_config.yaml `sft:`)."""
    _qwen_math(c)
    c.mode = "sft"
    c.seed = 42  # SFTConfig(seed=cfg["seed"]): the project seed
    c.max_steps = 1  # replaced by data.num_epochs x rows
    c.checkpoint_every = 500
    c.log_every = 5  # logging_steps
    c.data.name = "openmathreasoning_mini"
    c.data.train_split = "cot"
    c.data.batch_size = 1
    c.data.num_epochs = 2
    c.data.max_sft_tokens = 4096  # rows up to max_seq_len (8192) / 2 tokens are kept
    c.data.sft_drop_longer = True
    c.data.sft_loss_on = "all"
    c.optim.learning_rate = 2e-4
    c.optim.schedule = "linear"
    c.optim.warmup_steps = 5
    c.optim.weight_decay = 0.01
