"""Run configuration: validation before any compilation, and the one resolution of a config into the typed
`RunSpec` (sage_jax/spec.py) and the static dataclasses the jitted code takes.

A config is an `ml_collections.ConfigDict` (its fields, defaults and units: `sage_jax.defaults.default_config`),
which files in `configs/` start from and override. This module is the only one that reads it: `resolve(c)`
validates it (every check that needs no model or data, each error naming the field) and builds the spec whose
parts `train/` hands down.
"""

from __future__ import annotations

import math
import os

from sage_jax import sharding
from sage_jax.data.builders import BUILDERS
from sage_jax.data.templates import format_prompt
from sage_jax.errors import ConfigValidationError
from sage_jax.eval.benchmarks import string_list
from sage_jax.eval.evaluate import EvalSettings
from sage_jax.models.hf import is_hub_id
from sage_jax.models.lora import LoRAConfig
from sage_jax.policy.optim import OptimConfig
from sage_jax.rl import guides, losses
from sage_jax.rl.step import RLConfig
from sage_jax.sampling import SamplingConfig
from sage_jax.spec import CheckpointSpec, DataSpec, EvalSpec, LoggingSpec, ModelSpec, RunSpec
from sage_jax.stop_strings import StopStrings

MODES = ("rl", "sft", "eval")


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
    return _dtype(c.model.lora.param_dtype or c.model.param_dtype, "model.lora.param_dtype")


def lora_config(c):
    """The LoRAConfig of `model.lora`, or None when `model.lora.rank == 0` (full fine-tuning)."""
    lc = c.model.lora
    if not lc.rank:
        return None
    try:
        return LoRAConfig(rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout,
                          targets=tuple(t.strip() for t in lc.targets.split(",") if t.strip()))
    except ValueError as e:
        raise ConfigValidationError(f"model.lora: {e}") from None


def guide(c) -> guides.Guide:
    """`sage.guide` with its config (`sage.<name>`), as the one object the step carries."""
    name = c.sage.guide
    try:
        guides.get_guide(name)
    except ValueError as e:
        raise ConfigValidationError(f"sage.guide: {e}") from None
    fields = dict(c.sage.get(name, {}) or {})
    try:
        return guides.make_guide(name, **fields)
    except (ValueError, TypeError) as e:
        raise ConfigValidationError(f"sage.{name}: {e}") from None


def guide_config(c):
    """The config dataclass of `sage.guide` (`guide(c).cfg`)."""
    return guide(c).cfg


def _stop_string_list(c) -> tuple[str, ...]:
    try:
        return string_list(c.rollout.stop_strings, "rollout.stop_strings")
    except ValueError as e:
        raise ConfigValidationError(str(e)) from None


def stop_strings(c, tokenizer, vocab_size: int):
    """rollout.stop_strings compiled for `tokenizer` (sage_jax.stop_strings), or None when there are none; a
    string that can never fire (not writable by the tokenizer, or longer than the budget) is refused."""
    return compile_stop_strings(_stop_string_list(c), tokenizer, vocab_size, c.rollout.max_new_tokens,
                                "rollout.stop_strings")


def compile_stop_strings(strings, tokenizer, vocab_size: int, max_new_tokens: int, field: str):
    """`strings` compiled for `tokenizer`, or None when there are none; refused (naming `field`) when one can
    never fire."""
    if not strings:
        return None
    stop = StopStrings.for_tokenizer(tuple(strings), tokenizer, vocab_size)
    try:
        stop.check_reachable(max_new_tokens, field)
    except ValueError as e:
        raise ConfigValidationError(str(e)) from None
    return stop


def sampling_config(c, eos_ids=(), pad_id=0, stop=None) -> SamplingConfig:
    """The rollout's `SamplingConfig`; the stop strings (`stop`) and ids come with the tokenizer
    (`RLConfig.with_tokenizer`), so a config is checked before any model or tokenizer loads."""
    r = c.rollout
    try:
        return SamplingConfig(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, min_p=r.min_p, eos_ids=tuple(eos_ids), pad_id=pad_id, stop=stop,
                              decode_segments=r.decode_segments)
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


def rl_config(c) -> RLConfig:
    """The step's static config, its sampling without the tokenizer's ids and stop strings (`with_tokenizer`);
    its rules live in `RLConfig` (and `check_batch` for the batch shape), which names the config field of each,
    and a failure here is a config error. `max_steps` counts optimizer updates (the guide schedules' clock)."""
    r = c.rl
    try:
        return RLConfig(group_size=c.rollout.group_size, sampling=sampling_config(c), loss=loss_config(c),
                        guide=guide(c), scale_rewards=r.scale_rewards, num_iterations=r.num_iterations,
                        num_minibatches=r.num_minibatches, grad_accum_steps=r.grad_accum_steps,
                        max_steps=c.max_steps * r.num_iterations * r.num_minibatches, logp_chunk=r.logp_chunk,
                        share_prompt=r.share_prompt, remat=c.model.remat, dapo_normalizer=r.dapo_normalizer,
                        pass_at_k=r.pass_at_k, score_chunks=r.score_chunks, length_buckets=r.length_buckets,
                        pack_buckets=r.pack_buckets, dynamic_sampling=r.dynamic_sampling,
                        overlong_buffer=r.overlong_buffer, overlong_penalty=r.overlong_penalty,
                        overlong_filter=r.overlong_filter, update_shuffle=r.update_shuffle,
                        skip_nonfinite=c.optim.skip_nonfinite)
    except ValueError as e:
        raise ConfigValidationError(str(e)) from None


def optim_config(c) -> OptimConfig:
    """The optimizer's config; `total_steps` counts optimizer updates (RL steps x updates per step)."""
    o = c.optim
    per_step = c.rl.num_iterations * c.rl.num_minibatches if c.mode == "rl" else 1
    try:
        return OptimConfig(learning_rate=o.learning_rate, schedule=o.schedule, warmup_steps=o.warmup_steps,
                           total_steps=c.max_steps * per_step, weight_decay=o.weight_decay,
                           grad_clip_norm=o.grad_clip_norm)
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
    try:
        string_list(e.stop_strings, "eval.stop_strings")
    except ValueError as err:
        raise ConfigValidationError(str(err)) from None
    for field, t in (("data.template", c.data.template), ("eval.template", e.template)):
        try:
            if t:
                format_prompt("x", t)
        except ValueError as err:
            raise ConfigValidationError(f"{field}: {err}") from None
    eval_models(c)


def eval_models(c) -> dict[str, str]:
    """`mode=eval`'s models: `eval.models` (a dict, in config files) and `eval.model_list`
    ('NAME=DIR,NAME=DIR', from the command line), in that order."""
    models = dict(c.eval.models or {})
    for item in [x.strip() for x in (c.eval.model_list or "").split(",") if x.strip()]:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigValidationError(f"eval.model_list: {item!r} is not NAME=DIR")
        if name.strip() in models:
            raise ConfigValidationError(f"eval.model_list: model {name.strip()!r} is named twice")
        models[name.strip()] = path.strip()
    return models


def eval_settings(c):
    """The sampling settings of `eval.*`, the same for in-training evaluation and `mode=eval`. `eval.stop_strings`
    (its own list: the official evaluation generates until EOS where its training stops at `</SOLUTION>`) is
    stored with them, so results sampled under other stop strings are never mixed."""
    e = c.eval
    stops = list(string_list(e.stop_strings, "eval.stop_strings"))
    return EvalSettings(n=e.n, temperature=e.temperature, top_p=e.top_p, max_tokens=e.max_new_tokens, seed=c.seed,
                        problems_per_batch=max(1, e.batch_size // e.n),
                        sampler={"stop_strings": stops} if stops else {})


def non_finite_fields(c, prefix: str = "") -> list[str]:
    """Every `field=value` of the config (nested dicts, tuples and lists included) whose float is NaN or inf."""
    out = []
    for k, v in c.items():
        name = f"{prefix}{k}"
        if hasattr(v, "items"):
            out += non_finite_fields(v, name + ".")
        elif isinstance(v, float) and not math.isfinite(v):
            out.append(f"{name}={v}")
        elif isinstance(v, (tuple, list)) and any(isinstance(x, float) and not math.isfinite(x) for x in v):
            out.append(f"{name}={tuple(v)}")
    return out


def validate(c, num_devices: int | None = None) -> None:
    """Every check that needs no model or data: fails fast, naming the field."""
    bad = non_finite_fields(c)
    if bad:  # a range check written `x < lo` is false for NaN: refuse them all here, by name
        raise ConfigValidationError(f"{bad[0]} must be a finite number" + (f" (also {', '.join(bad[1:])})"
                                                                             if len(bad) > 1 else ""))
    if c.mode not in MODES:
        raise ConfigValidationError(f"mode={c.mode!r} is not one of {MODES}")
    for k in ("max_steps", "log_every"):
        if int(c[k]) < 1:
            raise ConfigValidationError(f"{k}={c[k]} must be >= 1")
    if c.checkpoint_every < 0:
        raise ConfigValidationError(f"checkpoint_every={c.checkpoint_every} must be >= 0")
    if not c.model.path:
        raise ConfigValidationError("model.path is empty: give an HF directory (or a hub id when online)")
    if not os.path.isdir(c.model.path) and not is_hub_id(c.model.path):
        raise ConfigValidationError(f"model.path={c.model.path!r}: no such directory (and not a hub id 'org/name')")
    model_dtypes(c)
    if c.model.attention_chunk < 0:
        raise ConfigValidationError(f"model.attention_chunk={c.model.attention_chunk} must be >= 0 (0 = off)")
    if c.data.sft_loss_on not in ("completion", "all"):
        raise ConfigValidationError(f"data.sft_loss_on={c.data.sft_loss_on!r} must be 'completion' or 'all'")
    if c.data.num_epochs < 0 or (c.data.num_epochs and c.mode != "sft"):
        raise ConfigValidationError(f"data.num_epochs={c.data.num_epochs}: >= 0, and only for mode=sft "
                                    "(RL runs count max_steps)")
    if lora_config(c) is None and c.model.lora.init_from:
        raise ConfigValidationError(f"model.lora.init_from={c.model.lora.init_from!r} needs LoRA on "
                                    "(model.lora.rank > 0)")
    lora_param_dtype(c)
    if c.data.batch_size < 1:
        raise ConfigValidationError(f"data.batch_size={c.data.batch_size} must be >= 1")
    names = [c.data.name] + [b.strip().partition(":")[0] for b in c.eval.benchmarks.split(",") if b.strip()]
    fields = ["data.name"] + ["eval.benchmarks"] * (len(names) - 1)
    for field, name in zip(fields, names):
        if name not in BUILDERS:
            raise ConfigValidationError(f"{field}: unknown dataset {name!r}; known: {sorted(BUILDERS)}")
    validate_eval(c)
    if c.mode == "rl":
        try:
            rl_config(c).check_batch(c.data.batch_size * c.rl.dynamic_sampling)
        except ValueError as e:
            raise ConfigValidationError(str(e)) from None
    optim_config(c)
    _validate_mesh(c, num_devices)


def _validate_mesh(c, num_devices: int | None) -> None:
    """mesh.shape fits the devices (`sharding.resolve_shape`), and the step's and the sampler's rows divide over
    its batch shards (`sharding.check_rows`)."""
    shape = tuple(c.mesh.shape)
    try:
        resolved = sharding.resolve_shape(shape, num_devices if num_devices is not None else _known_devices(shape))
    except ValueError as e:
        raise ConfigValidationError(f"mesh.shape={shape}: {e}") from None
    if num_devices is None:
        return
    shards = resolved[0] * resolved[1]
    rows = c.data.batch_size * (c.rollout.group_size if c.mode == "rl" else 1)
    what = f"data.batch_size={c.data.batch_size}" + (f" x rollout.group_size={c.rollout.group_size}"
                                                      if c.mode == "rl" else "")
    for n, name in ((rows, what), (c.eval.batch_size, f"eval.batch_size={c.eval.batch_size}")):
        if n % shards:
            raise ConfigValidationError(f"{name} = {n} rows is not divisible by the {shards} batch shards of "
                                        f"mesh.shape={shape}")


def _known_devices(shape) -> int:
    """A device count that fits `shape` when the real one is not known yet (the -1 entry then stands for 1)."""
    n = 1
    for s in shape:
        n *= s if s > 0 else 1
    return n


def resolve(c, num_devices: int | None = None) -> RunSpec:
    """The config, validated (`validate`), as the typed `RunSpec` that train/ hands down part by part: the
    one place a ConfigDict is read."""
    validate(c, num_devices)
    d, e = c.data, c.eval
    model = ModelSpec(path=c.model.path, dtype=model_dtypes(c)[0], param_dtype=model_dtypes(c)[1],
                      remat=c.model.remat, attention_chunk=c.model.attention_chunk, lora=lora_config(c),
                      lora_param_dtype=lora_param_dtype(c), lora_init_from=c.model.lora.init_from)
    data = DataSpec(name=d.name, builder_config=d.builder_config if d.name == "procedural_arithmetic" else None,
                    train_split=d.train_split, data_dir=d.data_dir, manual_dir=d.manual_dir or None,
                    template=d.template, system_prompt=d.system_prompt, batch_size=d.batch_size,
                    sampled_per_step=d.batch_size * (c.rl.dynamic_sampling if c.mode == "rl" else 1),
                    max_train_problems=d.max_train_problems, max_prompt_tokens=d.max_prompt_tokens,
                    max_answer_tokens=d.max_answer_tokens, max_sft_tokens=d.max_sft_tokens,
                    sft_loss_on=d.sft_loss_on, sft_drop_longer=d.sft_drop_longer, num_epochs=d.num_epochs)
    evaluation = EvalSpec(benchmarks=tuple(b.strip() for b in e.benchmarks.split(",") if b.strip()),
                          num_problems=e.num_problems, settings=eval_settings(c), batch_size=e.batch_size,
                          template=e.template or d.template, at_start=e.at_start, at_end=e.at_end,
                          every=c.eval_every, models=tuple(eval_models(c).items()),
                          decode_segments=c.rollout.decode_segments)
    return RunSpec(mode=c.mode, seed=c.seed, max_steps=c.max_steps, model=model, data=data,
                   rl=rl_config(c) if c.mode == "rl" else None, stop_strings=_stop_string_list(c),
                   optim=optim_config(c), reward=c.rl.reward, logp_chunk=c.rl.logp_chunk,
                   skip_nonfinite=c.optim.skip_nonfinite, eval=evaluation,
                   ckpt=CheckpointSpec(every=c.checkpoint_every, keep=c.ckpt.keep, async_save=c.ckpt.async_save,
                                       export_hf=c.ckpt.export_hf),
                   logging=LoggingSpec(every=c.log_every, tensorboard=c.logging.tensorboard, wandb=c.logging.wandb,
                                       wandb_project=c.logging.wandb_project, progress=c.logging.progress),
                   mesh_shape=tuple(c.mesh.shape), config_json=c.to_json_best_effort(indent=2))
