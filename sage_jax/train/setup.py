"""What a training run is built from: the tokenizer, the model and its train state, the jitted step, the batches.

`build_setup` loads what needs no weights (the tokenizer, the model's config) and refuses, before any weight
loads or any program compiles, what cannot run: a tokenizer larger than the model's vocabulary, stop strings
that can never fire, prompt + completion lengths beyond the model's positions. `build_trainer` then loads the
model (LoRA adapters on it if configured) and builds the train state, born sharded, and the jitted step.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from sage_jax import config_lib, distributed, sharding
from sage_jax.models import hf, lora as lora_lib
from sage_jax.models.config import ModelConfig
from sage_jax.policy import optim
from sage_jax.policy.state import TrainState, init_train_state_sharded
from sage_jax.rewards.host import HostReward, encode_answers
from sage_jax.rewards.verifiers import make_reward_fn
from sage_jax.rl.step import make_rl_step
from sage_jax.sampling import left_pad
from sage_jax.spec import RunSpec
from sage_jax.train.sft import encode_sft, make_sft_step

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Setup:
    """What a run is built from (loaded once, shared by the loop and the evaluations)."""
    spec: RunSpec
    workdir: str
    mesh: Any
    model_cfg: ModelConfig
    tokenizer: Any
    eos_ids: tuple[int, ...]
    pad_id: int
    reward_fn: Any
    stop: Any = None  # sage_jax.stop_strings.StopStrings of rollout.stop_strings, or None


def build_setup(spec: RunSpec, workdir: str) -> Setup:
    mesh = sharding.make_mesh(spec.mesh_shape)
    tokenizer = hf.load_tokenizer(spec.model.path)
    model_cfg, _ = ModelConfig.from_hf_dir(hf.resolve_path(spec.model.path))
    if len(tokenizer) > model_cfg.vocab_size:
        raise config_lib.ConfigValidationError(
            f"model.path={spec.model.path}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{model_cfg.vocab_size}; the tokenizer files belong to another model")
    eos_ids, pad_id = hf.sampling_ids(tokenizer, model_cfg)
    check_positions(spec, model_cfg)
    stop = None
    if spec.mode == "rl":
        stop = config_lib.compile_stop_strings(spec.stop_strings, tokenizer, model_cfg.vocab_size,
                                               spec.rl.sampling.max_new_tokens, "rollout.stop_strings")
    evaluation = spec.eval.settings
    config_lib.compile_stop_strings(evaluation.sampler.get("stop_strings", ()), tokenizer, model_cfg.vocab_size,
                                    evaluation.max_tokens, "eval.stop_strings")  # refused now, not after training
    return Setup(spec, workdir, mesh, model_cfg, tokenizer, eos_ids, pad_id, make_reward_fn(spec.reward), stop)


def check_positions(spec: RunSpec, model_cfg: ModelConfig) -> None:
    """The longest sequence a training step builds fits the model's positions (RoPE scaling counted); the
    evaluation's prompts are checked once they are read (`training_eval.read_benchmarks`)."""
    try:
        if spec.mode == "rl":
            model_cfg.check_positions(spec.data.max_prompt_tokens + spec.rl.sampling.max_new_tokens,
                                      f"data.max_prompt_tokens={spec.data.max_prompt_tokens} + "
                                      f"rollout.max_new_tokens={spec.rl.sampling.max_new_tokens}")
        elif spec.mode == "sft":
            model_cfg.check_positions(spec.data.max_sft_tokens, f"data.max_sft_tokens={spec.data.max_sft_tokens}")
    except ValueError as e:
        raise config_lib.ConfigValidationError(f"model.path={spec.model.path}: {e}") from None


@dataclasses.dataclass
class Trainer:
    """The jitted step and the state it carries; `spec` with SFT's epochs turned into max_steps."""
    spec: RunSpec
    graphdef: Any
    state: TrainState
    step_fn: Callable


def build_trainer(spec: RunSpec, s: Setup, num_records: int) -> Trainer:
    """Loads the model (LoRA adapters on it if configured) straight into its shardings, and builds the train state
    and the jitted RL or SFT step. `num_records`: the training set's size (SFT epochs become max_steps)."""
    m = spec.model
    model, _ = hf.load(m.path, dtype=m.dtype, mesh=s.mesh, param_dtype=m.param_dtype)
    model.set_attention_chunk(m.attention_chunk)
    if m.lora is not None:  # adapters (B = 0) on the loaded base; only they train and are checkpointed
        lora_lib.add_lora(model, m.lora, seed=spec.seed, param_dtype=m.lora_param_dtype)
        if m.lora_init_from:  # e.g. the SFT stage's adapter, which RL continues (the reference stays the base)
            hf.load_peft_adapter(model, m.lora_init_from)
    if spec.mode == "sft" and spec.data.num_epochs:  # the schedule's length comes from the data
        steps = spec.data.num_epochs * (num_records // spec.data.batch_size)
        log.info("data.num_epochs=%d over %d rows in batches of %d: max_steps=%d", spec.data.num_epochs,
                 num_records, spec.data.batch_size, steps)
        spec = dataclasses.replace(spec, max_steps=steps, optim=dataclasses.replace(spec.optim, total_steps=steps))
    tx, lr_fn = optim.make_optimizer(spec.optim)
    if spec.mode == "rl":
        rl_cfg = spec.rl.with_tokenizer(s.eos_ids, s.pad_id, s.stop)
        # params are placed by hf.load; the optimizer state and the reference are born in their shardings
        graphdef, state = init_train_state_sharded(model, rl_cfg, tx, spec.seed, s.mesh)
        step_fn = make_rl_step(graphdef, rl_cfg, tx, lr_fn, HostReward(s.tokenizer, s.reward_fn), s.mesh)
    else:
        graphdef, params, frozen = lora_lib.split_trainable(model)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                           rng=jax.random.key(spec.seed), frozen_params=frozen)
        step_fn = make_sft_step(graphdef, tx, lr_fn, spec.logp_chunk, spec.skip_nonfinite)
    return Trainer(spec, graphdef, state, step_fn)


def encode_prompts(tokenizer, prompts, max_tokens: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompt ids and mask of one fixed width (one compilation); a longer prompt is an error."""
    rows = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    for i, r in enumerate(rows):
        if len(r) > max_tokens:
            raise ValueError(f"prompt {i} has {len(r)} tokens > data.max_prompt_tokens={max_tokens} "
                             f"({prompts[i][:60]!r}...); raise the limit (prompts are never truncated)")
    return left_pad(rows, pad_id, multiple=max_tokens)


def batch_fn(spec: RunSpec, s: Setup):
    """raw records -> the step's global batch (RL: prompts, masks and gold answers; SFT: sequences and masks)."""
    d = spec.data
    if spec.mode == "rl":
        def rl_batch(raw):
            p, m = encode_prompts(s.tokenizer, raw["prompt"], d.max_prompt_tokens, s.pad_id)
            a = encode_answers(s.tokenizer, raw["answer"], d.max_answer_tokens)
            return distributed.global_batch({"prompt": p, "prompt_mask": m, "answer": a}, s.mesh)
        return rl_batch

    def sft_batch(raw):
        b = encode_sft(s.tokenizer, raw["prompt"], raw["solution"], s.eos_ids[0] if s.eos_ids else s.pad_id,
                       d.max_sft_tokens, s.pad_id, loss_on=d.sft_loss_on)
        return distributed.global_batch(b, s.mesh)
    return sft_batch
