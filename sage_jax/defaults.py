"""Every field of a run config, with its default and unit (`default_config`); configs/*.py start from it.

The values are the static dataclasses' defaults (`LossConfig`, `RLConfig`, `SamplingConfig`, `OptimConfig`, the
guides' configs), so each default is written once; `sage_jax.config_lib` validates a config and resolves it.
"""

from __future__ import annotations

import dataclasses
import os

import ml_collections

from sage_jax.policy.optim import OptimConfig
from sage_jax.rl import guide_configs, losses
from sage_jax.rl.step import RLConfig
from sage_jax.sampling import SamplingConfig

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
TINY_BASE = os.path.join(PACKAGE_DIR, "assets", "tiny_base")  # shipped tiny HF checkpoint


def default_config() -> ml_collections.ConfigDict:
    """Every field a config may set, with its unit; the values of the static dataclasses' defaults (one source:
    `LossConfig`, `RLConfig`, `SamplingConfig`, `OptimConfig`, the guides' configs), which config files override."""
    loss, rl, smp, opt = losses.LossConfig(), RLConfig(), SamplingConfig(), OptimConfig()
    c = ml_collections.ConfigDict()
    c.mode = "rl"  # rl | sft | eval
    c.seed = 0  # data order, initialisation and the RL step's keys
    c.max_steps = 100  # RL steps (mode=rl; each makes rl.num_iterations x rl.num_minibatches updates) or SFT steps
    c.checkpoint_every = 50  # steps; 0 = only at the end
    c.log_every = 1  # steps
    c.eval_every = 0  # steps; 0 = only at start / end (see eval.at_start / eval.at_end)

    c.model = ml_collections.ConfigDict()
    c.model.path = TINY_BASE  # HF directory (or hub id when online)
    c.model.dtype = "float32"  # compute dtype: float32 | bfloat16
    c.model.param_dtype = "float32"  # storage dtype of parameters
    c.model.remat = "none"  # training-forward rematerialisation per block: none | full | dots
    c.model.attention_chunk = 0  # multi-token attention in query chunks of this many tokens (0 = all at once):
    #                              float32 scores of chunk x S live per row and head, not S x S; the same numbers
    c.model.lora = ml_collections.ConfigDict()
    c.model.lora.rank = 0  # LoRA rank r; 0 = off (full fine-tuning)
    c.model.lora.alpha = 16.0  # scale = alpha / rank
    c.model.lora.dropout = 0.0  # adapter-input dropout probability, training forward only
    c.model.lora.targets = "q,k,v,o,gate,up,down"  # comma-separated projections
    c.model.lora.param_dtype = ""  # storage dtype of the adapters; "" = model.param_dtype (PEFT: float32)
    c.model.lora.init_from = ""  # a PEFT adapter dir (e.g. an SFT run's export_peft) the adapters start from

    c.data = ml_collections.ConfigDict()
    c.data.name = "procedural_arithmetic"  # a sage_jax.data.builders name
    c.data.builder_config = "default"  # TFDS builder config of the procedural task (its difficulty)
    c.data.train_split = "train"  # the TFDS split trained on
    c.data.data_dir = ""  # TFDS data dir; "" = DIR/tfds
    c.data.manual_dir = ""  # where the public release files are placed (see sage_jax/data/README.md)
    c.data.template = "chat"  # chat | sage | r1 | plain | a '{problem}' string
    c.data.system_prompt = ml_collections.config_dict.placeholder(str)  # text; None = the template's own
    c.data.batch_size = 8  # prompts per RL step (global); SFT: sequences per step
    c.data.max_train_problems = 0  # use only the first N training problems (0 = all), repeated by epochs
    c.data.max_prompt_tokens = 64  # tokens; a longer prompt is an error, never truncated
    c.data.max_answer_tokens = 32  # tokens of a gold answer as the host verifier receives it
    c.data.max_sft_tokens = 128  # tokens of an SFT example (prompt + solution + EOS)
    c.data.sft_loss_on = "completion"  # SFT targets: completion (+ EOS) | all (every token, as TRL on a text field)
    c.data.sft_drop_longer = False  # SFT rows over max_sft_tokens: False = refuse, True = drop them (counted)
    c.data.num_epochs = 0  # SFT: > 0 sets max_steps = num_epochs x rows // batch_size

    c.rollout = ml_collections.ConfigDict()
    c.rollout.group_size = rl.group_size  # G completions per prompt
    c.rollout.max_new_tokens = smp.max_new_tokens  # T, tokens
    c.rollout.temperature = smp.temperature  # sampling temperature; 0 = greedy
    c.rollout.top_p = smp.top_p  # nucleus mass kept, (0, 1]
    c.rollout.top_k = smp.top_k  # tokens kept; 0 = off
    c.rollout.min_p = smp.min_p  # drop tokens with p < min_p x p_max; 0 = off
    c.rollout.stop_strings = ()  # text that ends a training completion (kept), e.g. ("</SOLUTION>",)
    c.rollout.decode_segments = smp.decode_segments  # speed only: decode loops over a growing cache

    c.rl = ml_collections.ConfigDict()
    c.rl.beta = loss.beta  # KL coefficient; 0 = no KL term (no reference pass, no reference weights)
    c.rl.estimator = loss.estimator  # k1 | k2 | k3
    c.rl.kl_mode = loss.kl_mode  # reverse (shaped anchor) | forward (exact, to pi_ref)
    c.rl.loss_type = loss.loss_type  # grpo | bnpo | dr_grpo | dapo | cispo (CISPO's weight capped at rl.eps_high)
    c.rl.dapo_normalizer = rl.dapo_normalizer  # dapo, M > 1: generation (TRL 0.23, reference) | window (TRL >= 1.x)
    c.rl.eps_low = loss.eps_low  # PPO clip below: ratio >= 1 - eps_low
    c.rl.eps_high = loss.eps_high  # PPO clip above: ratio <= 1 + eps_high (DAPO: 0.28); cispo: its weight cap
    c.rl.delta = ml_collections.config_dict.placeholder(float)  # ratio cap (two-sided clip); None = off
    c.rl.tis_cap = ml_collections.config_dict.placeholder(float)  # sampler importance weight cap (TRL: 2.0); None = off
    c.rl.mis_bounds = ()  # (lo, hi): masked IS, the sampler weight inside, 0 outside (TRL token/sequence_mask); () = off
    c.rl.rs_bounds = ()  # (lo, hi): rejection only, weight 1 inside, 0 outside (verl rollout_rs); () = off
    c.rl.mismatch_level = loss.mismatch_level  # the sampler weight of the three above: token | sequence | geometric
    # a named sampler correction in place of the four fields above: trl_0.23 (token TIS, cap 2) | trl_1.16
    # (sequence_mask, weight kept up to 3, TRL's default since 1.6); "" = the fields as set
    c.rl.sampler_correction = ""
    c.rl.opsm_threshold = ml_collections.config_dict.placeholder(float)  # off-policy sequence masking, nats; None = off
    c.rl.entropy_top_frac = loss.entropy_top_frac  # policy gradient only on this top fraction of tokens by entropy
    c.rl.entropy_coef = loss.entropy_coef  # entropy bonus: minus this times the mean token entropy (TRL); 0 = off
    c.rl.update_shuffle = rl.update_shuffle  # the minibatches' rows: none (batch order) | groups | rows (TRL 0.23)
    c.rl.importance_sampling_level = loss.importance_sampling_level  # token | sequence (GSPO)
    c.rl.scale_rewards = rl.scale_rewards  # group | batch | none
    c.rl.pass_at_k = rl.pass_at_k  # k >= 1: the analytic pass@k advantage (Chen et al., 2025); 0 = off
    c.rl.score_chunks = rl.score_chunks  # the reference (and old-logp) pass in this many row chunks; 1 = all at once
    c.rl.length_buckets = rl.length_buckets  # K > 1: passes over rows sorted by length, at K static lengths
    c.rl.pack_buckets = rl.pack_buckets  # K >= 1: each prompt's completions packed into rows behind it; 0 = off
    # DAPO's sample-level options (sage_jax/rl/dapo.py), off by default:
    c.rl.dynamic_sampling = rl.dynamic_sampling  # k > 1: sample k x data.batch_size prompts per step, train on
    #                            data.batch_size of them, groups with a signal first (1 = off)
    c.rl.overlong_buffer = rl.overlong_buffer  # tokens: soft overlong penalty over the budget's last ones (0 = off)
    c.rl.overlong_penalty = rl.overlong_penalty  # its factor: a truncated completion's reward gets -overlong_penalty
    c.rl.overlong_filter = rl.overlong_filter  # truncated completions (no EOS, no stop string) out of the loss
    c.rl.num_iterations = rl.num_iterations  # passes over each rollout (PPO epochs)
    c.rl.num_minibatches = rl.num_minibatches  # M: updates per pass, each over B / M rows
    c.rl.grad_accum_steps = rl.grad_accum_steps  # micro-batches summed into one update (memory, not math)
    c.rl.logp_chunk = rl.logp_chunk  # tokens per chunk of the log-prob pass
    c.rl.share_prompt = rl.share_prompt  # each prompt's forward once per group (prefill, reference, policy pass)
    c.rl.reward = "exact_match"  # reward spec, e.g. "math_verify" or "math_verify:1.0,format:0.1"

    c.sage = ml_collections.ConfigDict()
    c.sage.guide = "branch"  # none | branch | token | random | a registered guide
    c.sage.form = loss.sage_form  # loss (k3 against ref + log q, the code's form) | reward (KL to ref + beta sum log q)
    # each guide's fields and defaults are its config dataclass's (sage_jax/rl/guide_configs.py, with units)
    c.sage.branch = ml_collections.ConfigDict(dataclasses.asdict(guide_configs.BranchConfig()))
    c.sage.token = ml_collections.ConfigDict(dataclasses.asdict(guide_configs.TokenConfig()))
    c.sage.random = ml_collections.ConfigDict(dataclasses.asdict(guide_configs.RandomConfig()))

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = opt.learning_rate  # peak learning rate
    c.optim.schedule = opt.schedule  # constant | linear | cosine, after the warm-up
    c.optim.warmup_steps = opt.warmup_steps  # optimizer updates
    c.optim.weight_decay = opt.weight_decay  # AdamW decoupled decay
    c.optim.grad_clip_norm = opt.grad_clip_norm  # global-norm clip
    c.optim.skip_nonfinite = False  # a non-finite loss or gradient: True = skip that update, False = stop the run

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.keep = 3  # checkpoints kept
    c.ckpt.async_save = True  # save in the background while training goes on
    c.ckpt.export_hf = True  # write DIR/export_hf (HF format) at the end

    c.eval = ml_collections.ConfigDict()
    c.eval.num_problems = 64  # problems per benchmark of eval.benchmarks (0 = all), in training and mode=eval
    c.eval.n = 8  # samples per problem
    c.eval.temperature = 1.0  # sampling temperature; 0 = greedy
    c.eval.top_p = 1.0  # nucleus mass kept
    c.eval.max_new_tokens = 64  # tokens per evaluation completion
    c.eval.batch_size = 128  # rows per sampler call
    c.eval.at_start = True  # evaluate the policy before the first step
    c.eval.at_end = True  # and after the last
    # mode=eval: models to compare (name -> HF dir, hub id, or a run dir of this project) and
    # benchmarks ("dataset[:split]" list; see sage_jax/data/README.md)
    c.eval.models = ml_collections.ConfigDict()
    c.eval.model_list = ""  # the same from the command line: 'NAME=DIR,NAME=DIR' (added after eval.models)
    c.eval.benchmarks = "procedural_arithmetic:test"  # comma-separated "dataset[:split]"
    c.eval.template = ""  # the evaluation prompt's template (as data.template); "" = data.template
    c.eval.stop_strings = ()  # text that ends an evaluation completion (kept); its own list, not rollout.stop_strings

    c.mesh = ml_collections.ConfigDict()
    c.mesh.shape = (-1, 1, 1)  # (data, fsdp, tensor) devices; one entry may be -1

    c.logging = ml_collections.ConfigDict()
    c.logging.tensorboard = True  # DIR/tb event files
    c.logging.wandb = False  # off by default; needs `pip install wandb` and a login
    c.logging.wandb_project = "sage_jax"  # W&B project name
    c.logging.progress = True  # tqdm bars on the terminal
    return c
