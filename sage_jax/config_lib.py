"""Run configuration: defaults, validation before any compilation, and conversion to the static
dataclasses the jitted code takes.

A config is an `ml_collections.ConfigDict` with sub-dicts `model`, `data`, `rollout`, `rl`, `sage`,
`optim`, `ckpt`, `eval`, `mesh`, `logging` and the top-level run keys `mode`, `seed`, `max_steps`,
`checkpoint_every`, `log_every`. Files in `configs/` start from `default_config()` and override.
"""

from __future__ import annotations

import os

import ml_collections

from sage_jax.rl import guide_configs, guides, losses
from sage_jax.rl.optim import OptimConfig
from sage_jax.rl.step import RLConfig
from sage_jax.sampling import SamplingConfig

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
TINY_BASE = os.path.join(PACKAGE_DIR, "assets", "tiny_base")  # shipped tiny HF checkpoint
MODES = ("rl", "sft", "eval")


class ConfigValidationError(ValueError):
    """A config that cannot run; the message names the field."""


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.mode = "rl"  # rl | sft | eval
    c.seed = 0
    c.max_steps = 100  # optimizer steps (rl: RL steps x updates per step)
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
    c.data.builder_config = "default"  # TFDS builder config (procedural difficulty)
    c.data.train_split = "train"
    c.data.eval_split = "test"
    c.data.data_dir = ""  # TFDS data dir; "" = DIR/tfds
    c.data.manual_dir = ""  # where the public release files are placed (see sage_jax/data/README.md)
    c.data.template = "chat"  # chat | sage | r1 | plain | a '{problem}' string
    c.data.system_prompt = ml_collections.config_dict.placeholder(str)
    c.data.batch_size = 8  # prompts per RL step (global); SFT: sequences per step
    c.data.max_train_problems = 0  # use only the first N training problems (0 = all), repeated by epochs
    c.data.max_prompt_tokens = 64  # prompts longer than this are an error, not truncated
    c.data.max_answer_tokens = 32
    c.data.max_sft_tokens = 128
    c.data.sft_loss_on = "completion"  # SFT targets: completion (+ EOS) | all (every token, as TRL on a text field)
    c.data.sft_drop_longer = False  # SFT rows over max_sft_tokens: False = refuse, True = drop them (counted)
    c.data.num_epochs = 0  # SFT: > 0 sets max_steps = num_epochs x rows // batch_size

    c.rollout = ml_collections.ConfigDict()
    c.rollout.group_size = 8  # G completions per prompt
    c.rollout.max_new_tokens = 64  # T, tokens
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.rollout.min_p = 0.0
    c.rollout.stop_strings = ()  # text that ends a completion (kept), e.g. ("</SOLUTION>",); also in evaluation
    c.rollout.decode_segments = 4  # speed only: decode loops over a growing cache (sampling.SamplingConfig)

    c.rl = ml_collections.ConfigDict()
    c.rl.beta = 0.05  # KL coefficient; 0 = no KL term (no reference pass, no reference weights)
    c.rl.estimator = "k3"  # k1 | k2 | k3
    c.rl.kl_mode = "reverse"  # reverse (shaped anchor) | forward (exact, to pi_ref)
    c.rl.loss_type = "grpo"  # grpo | bnpo | dr_grpo | dapo | cispo (CISPO's weight capped at rl.eps_high)
    c.rl.dapo_normalizer = "generation"  # dapo, M > 1: generation (TRL 0.23, reference) | window (TRL >= 1.x)
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.2
    c.rl.delta = ml_collections.config_dict.placeholder(float)  # ratio cap; None = off
    c.rl.tis_cap = ml_collections.config_dict.placeholder(float)  # sampler importance weight cap (TRL: 2.0); None = off
    c.rl.mis_bounds = ()  # (lo, hi): masked IS, the sampler weight inside, 0 outside (TRL token/sequence_mask); () = off
    c.rl.rs_bounds = ()  # (lo, hi): rejection only, weight 1 inside, 0 outside (verl rollout_rs); () = off
    c.rl.mismatch_level = "token"  # the sampler weight of tis_cap / mis_bounds / rs_bounds: token | sequence | geometric
    # a named sampler correction in place of the three fields above: trl_0.23 (token TIS, cap 2) | trl_1.16
    # (sequence_mask, weight kept up to 3, TRL's default since 1.6); "" = the fields as set
    c.rl.sampler_correction = ""
    c.rl.opsm_threshold = ml_collections.config_dict.placeholder(float)  # off-policy sequence masking (nats); None = off
    c.rl.entropy_top_frac = 1.0  # policy gradient only on this top fraction of tokens by entropy; 1 = all
    c.rl.entropy_coef = 0.0  # entropy bonus: minus this times the mean token entropy (TRL entropy_coef); 0 = off
    c.rl.update_shuffle = "none"  # the minibatches' rows: none (batch order) | groups | rows (TRL 0.23's shuffle)
    c.rl.importance_sampling_level = "token"  # token | sequence (GSPO)
    c.rl.scale_rewards = "group"  # group | batch | none
    c.rl.pass_at_k = 0  # k >= 1: the analytic pass@k advantage (Chen et al., 2025) replaces the group one; 0 = off
    c.rl.score_chunks = 1  # the reference (and old-logp) pass in this many row chunks; 1 = all rows at once
    # DAPO's sample-level options (sage_jax/rl/dapo.py), off by default:
    c.rl.dynamic_sampling = 1  # k > 1: sample k x data.batch_size prompts per step, train on data.batch_size
    #                            of them, groups with unequal rewards first (1 = off)
    c.rl.overlong_buffer = 0  # soft overlong penalty over the last this-many tokens of rollout.max_new_tokens (0 = off)
    c.rl.overlong_penalty = 1.0  # its factor: a truncated completion's reward gets -overlong_penalty
    c.rl.overlong_filter = False  # truncated completions (no EOS) out of the loss
    c.rl.num_iterations = 1
    c.rl.num_minibatches = 1
    c.rl.grad_accum_steps = 1  # micro-batches whose gradients are summed into one update (memory, not math)
    c.rl.logp_chunk = 256  # tokens per chunk of the log-prob pass
    c.rl.share_prompt = True  # each prompt's forward once per group (prefill, reference, policy pass)
    c.rl.reward = "exact_match"  # reward spec, e.g. "math_verify" or "math_verify:1.0,format:0.1"

    c.sage = ml_collections.ConfigDict()
    c.sage.guide = "branch"  # none | branch | token | random | a registered guide
    c.sage.form = "loss"  # loss (k3 against ref + log q, the code-level form) | reward (KL to ref + beta sum log q bonus)
    c.sage.branch = ml_collections.ConfigDict(dict(ratio=0.3, threshold=1.2, q_min=0.6, q_max=1.4, source="new"))
    c.sage.token = ml_collections.ConfigDict(dict(norm="minmax", alpha_ub=0.3, alpha_lb=0.1, sigma_ub=0.25,
                                                  sigma_lb=0.1, q_min=0.6, q_max=1.4, source="new"))
    c.sage.random = ml_collections.ConfigDict(dict(eps_ub=0.1, eps_lb=0.0, sigma_ub=0.15, sigma_lb=0.05,
                                                   q_min=0.6, q_max=1.4))

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-6
    c.optim.schedule = "constant"  # constant | linear | cosine
    c.optim.warmup_steps = 0
    c.optim.weight_decay = 0.01
    c.optim.grad_clip_norm = 1.0

    c.ckpt = ml_collections.ConfigDict()
    c.ckpt.keep = 3  # checkpoints kept
    c.ckpt.async_save = True
    c.ckpt.export_hf = True  # write DIR/export_hf (HF format) at the end

    c.eval = ml_collections.ConfigDict()
    c.eval.num_problems = 64  # problems per benchmark of eval.benchmarks (0 = all), in training and mode=eval
    c.eval.n = 8  # samples per problem
    c.eval.temperature = 1.0
    c.eval.top_p = 1.0
    c.eval.max_new_tokens = 64
    c.eval.batch_size = 128  # rows per sampler call
    c.eval.at_start = True
    c.eval.at_end = True
    # mode=eval: models to compare (name -> HF dir, hub id, or a run dir of this project) and
    # benchmarks ("dataset[:split]" list; see sage_jax/data/README.md)
    c.eval.models = ml_collections.ConfigDict()
    c.eval.model_list = ""  # the same from the command line: 'NAME=DIR,NAME=DIR' (added after eval.models)
    c.eval.benchmarks = "procedural_arithmetic:test"
    c.eval.template = ""  # the evaluation prompt's template (as data.template); "" = data.template
    c.eval.stop_strings = ()  # text that ends an evaluation completion (kept); its own list, not rollout.stop_strings

    c.mesh = ml_collections.ConfigDict()
    c.mesh.shape = (-1, 1, 1)  # (data, fsdp, tensor); one entry may be -1

    c.logging = ml_collections.ConfigDict()
    c.logging.tensorboard = True
    c.logging.wandb = False  # off by default; needs `pip install wandb` and a login
    c.logging.wandb_project = "sage_jax"
    c.logging.progress = True
    return c


def _dtype(name: str, field: str):
    import jax.numpy as jnp
    table = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    if name not in table:
        raise ConfigValidationError(f"{field}={name!r} is not one of {sorted(table)}")
    return table[name]


def model_dtypes(c):
    return _dtype(c.model.dtype, "model.dtype"), _dtype(c.model.param_dtype, "model.param_dtype")


def lora_param_dtype(c):
    """The adapters' storage dtype: model.lora.param_dtype, else model.param_dtype."""
    name = c.model.get("lora", {}).get("param_dtype", "") or c.model.param_dtype
    return _dtype(name, "model.lora.param_dtype")


def lora_config(c):
    """The LoRAConfig of `model.lora`, or None when `model.lora.rank == 0` (full fine-tuning)."""
    from sage_jax.models.lora import LoRAConfig
    lc = c.model.get("lora")
    if lc is None or not lc.rank:
        return None
    try:
        return LoRAConfig(rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout,
                          targets=tuple(t.strip() for t in lc.targets.split(",") if t.strip()))
    except ValueError as e:
        raise ConfigValidationError(f"model.lora: {e}") from None


def guide_config(c):
    name = c.sage.guide
    try:
        guides.get_guide(name)
    except ValueError as e:
        raise ConfigValidationError(f"sage.guide: {e}") from None
    fields = dict(c.sage.get(name, {}) or {})
    try:
        return guides.make_guide_config(name, **fields) if name != "none" else guide_configs.NoneGuideConfig()
    except (ValueError, TypeError) as e:
        raise ConfigValidationError(f"sage.{name}: {e}") from None


def _stop_string_list(c) -> tuple[str, ...]:
    from sage_jax.eval.benchmarks import string_list
    try:
        return string_list(c.rollout.stop_strings, "rollout.stop_strings")
    except ValueError as e:
        raise ConfigValidationError(str(e)) from None


def stop_strings(c, tokenizer, vocab_size: int):
    """rollout.stop_strings compiled for `tokenizer` (sage_jax.stop_strings), or None when there are none."""
    strings = _stop_string_list(c)
    if not strings:
        return None
    from sage_jax.stop_strings import StopStrings
    return StopStrings.for_tokenizer(strings, tokenizer, vocab_size)


def sampling_config(c, eos_ids, pad_id, stop=None, validating=False) -> SamplingConfig:
    r = c.rollout
    if _stop_string_list(c) and stop is None and not validating:
        raise ConfigValidationError("rollout.stop_strings is set but no tokenizer compiled it (config_lib.stop_strings)")
    try:
        return SamplingConfig(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, min_p=r.min_p, eos_ids=tuple(eos_ids), pad_id=pad_id, stop=stop,
                              decode_segments=r.get("decode_segments", 4))
    except ValueError as e:
        raise ConfigValidationError(f"rollout: {e}") from None


def sampler_correction_fields(c) -> dict:
    """tis_cap, mis_bounds, rs_bounds and mismatch_level: as set, or from the named `rl.sampler_correction`."""
    r = c.rl
    fields = dict(tis_cap=r.tis_cap, mis_bounds=tuple(r.mis_bounds) or None, rs_bounds=tuple(r.rs_bounds) or None,
                  mismatch_level=r.mismatch_level)
    name = r.sampler_correction
    if not name:
        return fields
    if name not in losses.SAMPLER_CORRECTIONS:
        raise ConfigValidationError(f"rl.sampler_correction={name!r} is not one of "
                                    f"{sorted(losses.SAMPLER_CORRECTIONS)} (or '' for the fields as set)")
    set_here = [k for k in ("tis_cap", "mis_bounds", "rs_bounds") if fields[k] is not None]
    if set_here:
        raise ConfigValidationError(f"rl.sampler_correction={name!r} and rl.{set_here[0]} both set: the preset "
                                    "sets the correction; use one")
    return {**fields, **losses.SAMPLER_CORRECTIONS[name]}


def loss_config(c) -> losses.LossConfig:
    r = c.rl
    try:
        return losses.LossConfig(loss_type=r.loss_type, beta=r.beta, estimator=r.estimator, kl_mode=r.kl_mode,
                                 eps_low=r.eps_low, eps_high=r.eps_high, delta=r.delta,
                                 importance_sampling_level=r.importance_sampling_level,
                                 opsm_threshold=r.opsm_threshold, entropy_top_frac=r.entropy_top_frac,
                                 entropy_coef=r.entropy_coef, sage_form=c.sage.form,
                                 max_completion_length=c.rollout.max_new_tokens, **sampler_correction_fields(c))
    except ValueError as e:
        raise ConfigValidationError(str(e)) from None


def rl_config(c, eos_ids=(), pad_id=0, stop=None, validating=False) -> RLConfig:
    """The step's static config; its rules live in `RLConfig` (and `check_batch` for the batch shape), which
    names the config field of each, and a failure here is a config error."""
    try:
        return RLConfig(group_size=c.rollout.group_size, sampling=sampling_config(c, eos_ids, pad_id, stop, validating),
                        loss=loss_config(c), guide=c.sage.guide, guide_cfg=guide_config(c),
                        scale_rewards=c.rl.scale_rewards, num_iterations=c.rl.num_iterations,
                        num_minibatches=c.rl.num_minibatches,
                        grad_accum_steps=c.rl.get("grad_accum_steps", 1),
                        max_steps=c.max_steps, logp_chunk=c.rl.logp_chunk,
                        share_prompt=c.rl.get("share_prompt", True), remat=c.model.get("remat", "none"),
                        dapo_normalizer=c.rl.get("dapo_normalizer", "generation"), pass_at_k=c.rl.pass_at_k,
                        score_chunks=c.rl.score_chunks, dynamic_sampling=c.rl.dynamic_sampling,
                        overlong_buffer=c.rl.overlong_buffer, overlong_penalty=c.rl.overlong_penalty,
                        overlong_filter=c.rl.overlong_filter, update_shuffle=c.rl.update_shuffle)
    except ValueError as e:
        raise ConfigValidationError(str(e)) from None


def optim_config(c) -> OptimConfig:
    o = c.optim
    try:
        return OptimConfig(learning_rate=o.learning_rate, schedule=o.schedule, warmup_steps=o.warmup_steps,
                           total_steps=c.max_steps, weight_decay=o.weight_decay, grad_clip_norm=o.grad_clip_norm)
    except ValueError as e:
        raise ConfigValidationError(str(e)) from None


def validate_eval(c) -> None:
    e = c.eval
    for k, lo in (("n", 1), ("batch_size", 1), ("max_new_tokens", 1), ("num_problems", 0)):
        if int(e[k]) < lo:
            raise ConfigValidationError(f"eval.{k}={e[k]} must be >= {lo}")
    if not e.temperature >= 0:
        raise ConfigValidationError(f"eval.temperature={e.temperature} must be >= 0 (0 = greedy)")
    if not 0 < e.top_p <= 1:
        raise ConfigValidationError(f"eval.top_p={e.top_p} must be in (0, 1]")
    if c.eval_every < 0:
        raise ConfigValidationError(f"eval_every={c.eval_every} must be >= 0")
    from sage_jax.eval.benchmarks import string_list
    try:
        string_list(e.stop_strings, "eval.stop_strings")
    except ValueError as err:
        raise ConfigValidationError(str(err)) from None
    from sage_jax.data.templates import format_prompt
    for field, t in (("data.template", c.data.template), ("eval.template", e.get("template"))):
        try:
            if t:
                format_prompt("x", t)
        except ValueError as err:
            raise ConfigValidationError(f"{field}: {err}") from None
    eval_models(c)


def eval_models(c) -> dict[str, str]:
    """`mode=eval`'s models: `eval.models` (a dict, in config files) and `eval.model_list`
    ('NAME=DIR,NAME=DIR', from the command line), in that order."""
    models = dict(c.eval.get("models") or {})
    for item in [x.strip() for x in (c.eval.get("model_list") or "").split(",") if x.strip()]:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigValidationError(f"eval.model_list: {item!r} is not NAME=DIR")
        if name.strip() in models:
            raise ConfigValidationError(f"eval.model_list: model {name.strip()!r} is named twice")
        models[name.strip()] = path.strip()
    return models


def validate(c, num_devices: int | None = None) -> None:
    """Every check that needs no model or data: fails fast, naming the field."""
    if c.mode not in MODES:
        raise ConfigValidationError(f"mode={c.mode!r} is not one of {MODES}")
    for k in ("max_steps", "log_every"):
        if int(c[k]) < 1:
            raise ConfigValidationError(f"{k}={c[k]} must be >= 1")
    if c.checkpoint_every < 0:
        raise ConfigValidationError(f"checkpoint_every={c.checkpoint_every} must be >= 0")
    if not c.model.path:
        raise ConfigValidationError("model.path is empty: give an HF directory (or a hub id when online)")
    path = c.model.path
    from sage_jax.models.hf import is_hub_id
    if not os.path.isdir(path) and not is_hub_id(path):
        raise ConfigValidationError(f"model.path={path!r}: no such directory (and not a hub id 'org/name')")
    model_dtypes(c)
    if c.model.attention_chunk < 0:
        raise ConfigValidationError(f"model.attention_chunk={c.model.attention_chunk} must be >= 0 (0 = off)")
    if c.data.sft_loss_on not in ("completion", "all"):
        raise ConfigValidationError(f"data.sft_loss_on={c.data.sft_loss_on!r} must be 'completion' or 'all'")
    if c.data.num_epochs < 0 or (c.data.num_epochs and c.mode != "sft"):
        raise ConfigValidationError(f"data.num_epochs={c.data.num_epochs}: >= 0, and only for mode=sft "
                                    "(RL runs count max_steps)")
    if lora_config(c) is None and c.model.lora.get("init_from"):
        raise ConfigValidationError(f"model.lora.init_from={c.model.lora.init_from!r} needs LoRA on "
                                    "(model.lora.rank > 0)")
    lora_param_dtype(c)
    if c.data.batch_size < 1:
        raise ConfigValidationError(f"data.batch_size={c.data.batch_size} must be >= 1")
    from sage_jax.data.builders import BUILDERS
    names = [c.data.name] + [b.strip().partition(":")[0] for b in c.eval.benchmarks.split(",") if b.strip()]
    fields = ["data.name"] + ["eval.benchmarks"] * (len(names) - 1)
    for field, name in zip(fields, names):
        if name not in BUILDERS:
            raise ConfigValidationError(f"{field}: unknown dataset {name!r}; known: {sorted(BUILDERS)}")
    validate_eval(c)
    if c.mode == "rl":
        try:
            rl_config(c, validating=True).check_batch(c.data.batch_size * c.rl.dynamic_sampling)
        except ValueError as e:
            raise ConfigValidationError(str(e)) from None
    optim_config(c)
    shape = tuple(c.mesh.shape)
    if len(shape) != 3 or shape.count(-1) > 1:
        raise ConfigValidationError(f"mesh.shape={shape}: three entries (data, fsdp, tensor), at most one -1")
    if num_devices is not None:
        known = 1
        for s in shape:
            known *= s if s != -1 else 1
        if num_devices % known:
            raise ConfigValidationError(f"mesh.shape={shape} does not fit {num_devices} devices")
        full = [s if s != -1 else num_devices // known for s in shape]
        batch_shards = full[0] * full[1]
        rows = c.data.batch_size * (c.rollout.group_size if c.mode == "rl" else 1)
        if rows % batch_shards:
            raise ConfigValidationError(
                f"data.batch_size={c.data.batch_size}"
                + (f" x rollout.group_size={c.rollout.group_size}" if c.mode == "rl" else "")
                + f" = {rows} rows is not divisible by the {batch_shards} batch shards of mesh.shape={shape}")
        if c.eval.batch_size % batch_shards:
            raise ConfigValidationError(f"eval.batch_size={c.eval.batch_size} sampler rows are not divisible by the "
                                        f"{batch_shards} batch shards of mesh.shape={shape}")
