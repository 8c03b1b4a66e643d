"""The training loop for `mode = rl | sft`: build -> restore -> train -> finish.

`run(config, workdir)` resolves the config once (`config_lib.resolve`) and hands each part of the `RunSpec` to
what reads it. While step N runs on the device, the host prepares batch N + 1; then it waits for step N, writes
its metrics (before any checkpoint of step N), and saves, evaluates or stops as the step's end says. Everything a
resume needs (params, optimizer state, step, RNG, data-iterator position) is in the checkpoint, so a run killed at
any point and restarted continues exactly. SIGTERM and SIGINT save at the end of the step under way and exit
(`train.signals`); a loss or gradient that turns non-finite stops the run, naming the step, with the last good
checkpoint kept and nothing exported (unless `optim.skip_nonfinite` skips such updates).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sage_jax import config_lib
from sage_jax.errors import UserError
from sage_jax.eval import report as eval_report
from sage_jax.models import auto_tokenizer, hf, lora as lora_lib
from sage_jax.policy.state import TrainState, policy_state
from sage_jax.spec import RunSpec
from sage_jax.train import data as train_data
from sage_jax.train.checkpoint import (Checkpointer, base_pointer, check_base_pointer, check_resume_config,
                                       write_run_config)
from sage_jax.train.metric_writer import MetricWriter
from sage_jax.train.setup import Setup, batch_fn, build_setup, build_trainer
from sage_jax.train.signals import Preemption
from sage_jax.train.training_eval import TrainingEval, eval_metrics, read_benchmarks

log = logging.getLogger(__name__)


class NonFiniteError(UserError, RuntimeError):
    """The loss or a gradient turned NaN / inf: the run stopped at that step (see `optim.skip_nonfinite`)."""
    exit_code = 3


@dataclasses.dataclass
class _Run:
    """One training run's parts, built once (`_build`), then carried through restore, the steps and finish."""
    spec: RunSpec
    s: Setup
    graphdef: Any
    state: TrainState
    step_fn: Any
    it: Any  # the checkpointable prompt / sequence iterator
    next_batch: Any  # raw records -> the step's global batch
    ckpt: Checkpointer
    writer: MetricWriter
    evaluator: TrainingEval | None
    is_main: bool
    logged_evals: set = dataclasses.field(default_factory=set)
    summary: dict = dataclasses.field(default_factory=dict)

    def evaluate(self, at: int) -> None:
        """Evaluates step `at` (resuming a partial evaluation) and logs it unless metrics.jsonl has it."""
        self.summary["eval"] = self.evaluator(at, self.state)
        if at not in self.logged_evals:
            self.writer.write(at, eval_metrics(self.summary["eval"], at))
            self.logged_evals.add(at)

    def save(self, step: int, data_state) -> None:
        self.ckpt.save(self.state, {"data": data_state, "step": step, **base_pointer(self.spec.model)})


def run(c, workdir: str) -> dict[str, Any]:
    """Trains per `c.mode` ('rl' or 'sft') in `workdir`, resuming from its checkpoints. Returns a summary."""
    spec = config_lib.resolve(c, jax.device_count())
    os.makedirs(workdir, exist_ok=True)
    r = _build(spec, workdir)
    start = _restore(r)
    pre = Preemption()
    try:
        step = _train(r, start, pre)
    except BaseException:
        r.ckpt.close()  # a save under way finishes (or fails) here, not half-written at interpreter exit
        raise
    finally:
        pre.restore()
    summary = _finish(r, start, step, pre)
    if pre.requested and pre.exit_code:  # SIGINT: saved; end as a shell expects of Ctrl-C
        sys.exit(pre.exit_code)
    return summary


def _build(spec: RunSpec, workdir: str) -> _Run:
    s = build_setup(spec, workdir)
    # bad data stops the run before the model loads
    source = train_data.train_source(spec.data, spec.mode, s.tokenizer, workdir)
    benchmarks = read_benchmarks(s) if spec.eval.any else None
    t = build_trainer(spec, s, len(source))
    spec = t.spec
    is_main = jax.process_index() == 0
    lg = spec.logging
    writer = MetricWriter(workdir, enabled=is_main, tensorboard=lg.tensorboard,
                          wandb_cfg={"project": lg.wandb_project, "config": json.loads(spec.config_json)}
                          if lg.wandb else None)
    return _Run(spec=spec, s=s, graphdef=t.graphdef, state=t.state, step_fn=t.step_fn,
                it=train_data.prompt_iterator(spec.data, s.tokenizer, source, spec.seed),
                next_batch=batch_fn(spec, s),
                ckpt=Checkpointer(os.path.join(workdir, "checkpoints"), keep=spec.ckpt.keep,
                                  async_save=spec.ckpt.async_save),
                writer=writer, evaluator=TrainingEval(s, benchmarks, t.graphdef) if benchmarks is not None else None,
                is_main=is_main)


def _restore(r: _Run) -> int:
    """Restores the newest checkpoint that fits this config (refusing another run config's), writes
    run_config.json, and returns the step to start from; evaluates step 0 on a fresh start."""
    workdir = r.s.workdir
    if r.ckpt.all_steps():
        check_resume_config(workdir, r.spec.config_json)
    base = base_pointer(r.spec.model)
    restored = r.ckpt.restore_latest(r.state, check_meta=lambda m: check_base_pointer(m, base, r.ckpt.directory))
    if r.is_main:
        write_run_config(workdir, r.spec.config_json)
    start = 0
    if restored is not None:
        r.state, meta = restored
        r.it.set_state(meta["data"])
        start = int(meta["step"])
        r.writer.truncate_after(start)
        log.info("resumed from %s at step %d", r.ckpt.directory, start)
    else:  # no checkpoint: whatever an earlier attempt logged or evaluated after step 0 is history that restarts
        r.writer.truncate_after(None)
        if r.evaluator is not None:
            r.evaluator.forget_after(0)
    r.summary["start_step"] = start
    r.logged_evals = {row["step"] for row in r.writer.rows() if any(k.startswith("eval/") for k in row)}
    if r.evaluator is not None and r.spec.eval.at_start and start == 0:
        r.evaluate(0)
    return start


def _train(r: _Run, start: int, pre: Preemption) -> int:
    """Steps from `start` to max_steps (or a signal); returns the last step done. Step N+1 is dispatched only once
    step N has ended, so a signal's save starts right after the step under way (signals.py)."""
    spec, max_steps = r.spec, r.spec.max_steps
    progress = _progress(spec, start, r.is_main)
    step, t_last = start, time.perf_counter()
    draw = lambda: (r.next_batch(next(r.it)), r.it.get_state())  # a batch, and the position after it
    batch, position = draw() if step < max_steps else (None, None)
    try:
        while step < max_steps and not pre.requested:
            r.state, metrics = r.step_fn(r.state, batch)  # dispatched; runs while the host draws the next batch
            step += 1
            data_state, data_error = position, None
            if step < max_steps:
                try:
                    batch, position = draw()
                except Exception as e:  # noqa: BLE001 - raised once the step under way is logged and saved
                    data_error = e
            host = jax.device_get(metrics)  # waits for the step
            now = time.perf_counter()
            host["perf/step_s"], t_last = now - t_last, now
            _log(r.writer, progress, step, host, spec)  # on disk before checkpoint `step`: no metric is lost
            if float(host.get("train/nonfinite", 0)) > 0 and not spec.skip_nonfinite:
                kept = r.ckpt.all_steps()
                raise NonFiniteError(
                    f"step {step}: the loss or a gradient is not finite (train/nonfinite in metrics.jsonl; loss "
                    f"{host.get('train/loss')}, grad_norm {host.get('train/grad_norm')}); the run stopped, nothing "
                    f"was exported, the last checkpoint is {'step ' + str(kept[-1]) if kept else 'none'}. Lower "
                    "optim.learning_rate, or set optim.skip_nonfinite=True to skip such updates")
            if r.evaluator is not None and spec.eval.every and step % spec.eval.every == 0 and step < max_steps:
                r.evaluate(step)
            if (spec.ckpt.every and step % spec.ckpt.every == 0) or pre.requested or data_error is not None:
                r.save(step, data_state)
            if data_error is not None:  # the save may still be under way: run()'s cleanup finishes it
                raise data_error
        if step > start or not r.ckpt.all_steps():
            r.save(step, data_state if step > start else r.it.get_state())
        r.ckpt.wait()
    finally:
        progress.close()
    return step


def _finish(r: _Run, start: int, step: int, pre: Preemption) -> dict[str, Any]:
    """The last evaluation (after its checkpoint), the export, the run plot; the summary `main` prints."""
    spec, summary = r.spec, r.summary
    summary.update(end_step=step, preempted=pre.requested)
    if not pre.requested and step >= spec.max_steps:
        # the last step is evaluated here, after its checkpoint: at_end, or when eval_every falls on it
        if r.evaluator is not None and (spec.eval.at_end or (spec.eval.every and step % spec.eval.every == 0)):
            r.evaluate(step)  # a restart of a finished run samples nothing new and logs only what is missing
        if spec.ckpt.export_hf:
            summary.update(export(spec, r.s, r.graphdef, r.state, r.s.workdir, r.is_main))
    if "eval" in summary:
        steps = sorted(int(m[len("step_"):]) for m in summary["eval"]["models"])
        if 0 in steps:
            summary["before"] = eval_metrics(summary["eval"], 0)
        if step in steps and step > 0:
            summary["after"] = eval_metrics(summary["eval"], step)
    if r.is_main and spec.mode == "rl" and not pre.requested:
        summary["plot"] = os.path.join(r.s.workdir, eval_report.RUN_PLOT)
        eval_report.plot_run(r.writer.rows(), summary.get("eval"), summary["plot"])
    r.ckpt.close()
    r.writer.close()
    return summary


def export(spec: RunSpec, s: Setup, graphdef, state: TrainState, workdir: str, is_main: bool) -> dict[str, str]:
    """The final policy in HF format (`export_hf`, adapters merged into the weights) and, under LoRA, the
    adapters alone as a PEFT adapter (`export_peft`, onto the base at `model.path`)."""
    full = policy_state(state)
    if jax.process_count() > 1:  # collective (every process): host copies of arrays spanning hosts
        from jax.experimental import multihost_utils
        full = jax.tree.map(jnp.asarray, multihost_utils.process_allgather(full, tiled=True))
    model = nnx.merge(graphdef, full)
    out = {"export": os.path.join(workdir, "export_hf")}
    if lora_lib.has_lora(model):
        out["export_peft"] = os.path.join(workdir, "export_peft")
    if is_main:
        hf.save(model, s.model_cfg, out["export"], tokenizer=s.tokenizer)
        auto_tokenizer.check_auto_tokenizer(out["export"])  # outside tools read it as we do, or one warning
        if "export_peft" in out:
            hf.save_peft_adapter(model, out["export_peft"], base_path=spec.model.path)
    return out


def _progress(spec: RunSpec, start: int, is_main: bool):
    from tqdm.auto import tqdm
    return tqdm(total=spec.max_steps, initial=start, disable=not (is_main and spec.logging.progress), unit="step",
                dynamic_ncols=True, desc=spec.mode)


def _log(writer, progress, step: int, host: dict, spec: RunSpec) -> None:
    progress.update(step - progress.n)
    key = "reward/reward_mean" if "reward/reward_mean" in host else "train/loss"
    progress.set_postfix({key.split("/")[-1]: f"{float(host[key]):.3f}"}, refresh=False)
    if step % spec.logging.every == 0 or step == spec.max_steps or float(host.get("train/nonfinite", 0)) > 0:
        writer.write(step, host)
