"""The run spec: a config resolved once, typed and validated, into the parts each layer reads.

`config_lib.resolve(config)` builds a `RunSpec` from an ml-collections config (and is the only place that reads
one); `train/` hands each layer only its part: the data pipeline a `DataSpec`, the evaluation an `EvalSpec`, the
RL step its `RLConfig`, the optimizer its `OptimConfig`. Every part is frozen, so a spec can be shared and passed
around without copies, and a config change touches `config_lib` and the one consumer of that field.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from sage_jax.eval.evaluate import EvalSettings
from sage_jax.models.lora import LoRAConfig
from sage_jax.policy.optim import OptimConfig
from sage_jax.rl.step import RLConfig


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    path: str  # HF directory (or hub id)
    dtype: Any  # compute dtype (jnp.float32 | jnp.bfloat16)
    param_dtype: Any  # storage dtype of the parameters
    remat: str  # training-forward rematerialisation: none | full | dots
    attention_chunk: int  # multi-token attention in query chunks of this many tokens (0 = all at once)
    lora: LoRAConfig | None  # None = full fine-tuning
    lora_param_dtype: Any  # the adapters' storage dtype
    lora_init_from: str  # a PEFT adapter dir the adapters start from ("" = fresh)


@dataclasses.dataclass(frozen=True)
class DataSpec:
    name: str  # a sage_jax.data.builders name
    builder_config: str | None  # TFDS builder config (the procedural task only)
    train_split: str
    data_dir: str  # TFDS data dir; "" = DIR/tfds
    manual_dir: str | None  # where the public release files are placed
    template: str  # prompt template of training (and of evaluation unless EvalSpec.template says otherwise)
    system_prompt: str | None
    batch_size: int  # prompts per RL step (sequences per SFT step)
    sampled_per_step: int  # prompts drawn per step: batch_size x rl.dynamic_sampling
    max_train_problems: int  # the first N training problems only (0 = all)
    max_prompt_tokens: int
    max_answer_tokens: int
    max_sft_tokens: int
    sft_loss_on: str  # completion | all
    sft_drop_longer: bool
    num_epochs: int  # SFT: > 0 sets max_steps from the data

    def tfds_dir(self, workdir: str) -> str:
        return self.data_dir or os.path.join(workdir, "tfds")


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    benchmarks: tuple[str, ...]  # "dataset[:split]"
    num_problems: int  # per benchmark; 0 = all
    settings: EvalSettings  # n, temperature, top_p, length, seed, stop strings (what results.json records)
    batch_size: int  # sampler rows per call
    template: str  # the evaluation prompt's template
    at_start: bool
    at_end: bool
    every: int  # training steps between evaluations (0 = only at start / end)
    models: tuple[tuple[str, str], ...]  # mode=eval: (name, HF dir / hub id / run dir)
    decode_segments: int  # speed only: the sampler's decode segments

    @property
    def any(self) -> bool:
        return bool(self.at_start or self.at_end or self.every)


@dataclasses.dataclass(frozen=True)
class CheckpointSpec:
    every: int  # steps; 0 = only at the end
    keep: int
    async_save: bool
    export_hf: bool


@dataclasses.dataclass(frozen=True)
class LoggingSpec:
    every: int  # steps
    tensorboard: bool
    wandb: bool
    wandb_project: str
    progress: bool


@dataclasses.dataclass(frozen=True)
class RunSpec:
    mode: str  # rl | sft | eval
    seed: int
    max_steps: int  # RL steps (rl) or SFT steps
    model: ModelSpec
    data: DataSpec
    rl: RLConfig | None  # the RL step's config (mode=rl); its sampling's stop / eos / pad ids are the tokenizer's
    stop_strings: tuple[str, ...]  # rollout.stop_strings (compiled once the tokenizer is loaded)
    optim: OptimConfig  # total_steps in optimizer updates (RL steps x updates per step)
    reward: str  # the reward spec, e.g. "math_verify" or "math_verify:1.0,format:0.1"
    logp_chunk: int  # tokens per chunk of the log-prob pass (SFT; the RL step reads its RLConfig's)
    skip_nonfinite: bool  # a non-finite loss or gradient skips that update (else the run stops)
    eval: EvalSpec
    ckpt: CheckpointSpec
    logging: LoggingSpec
    mesh_shape: tuple[int, int, int]  # (data, fsdp, tensor), one entry may be -1
    config_json: str  # the whole config, as run_config.json records it (resume checks, W&B)

    @property
    def updates_per_step(self) -> int:
        return 1 if self.rl is None else self.rl.num_iterations * self.rl.num_minibatches
