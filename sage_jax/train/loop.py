"""The training loop for `mode = rl | sft`: restore -> loop (step, log, checkpoint, eval) -> final save.

The host never waits on the step it just dispatched: it fetches and writes the metrics of step N-1
while step N runs. Everything a resume needs (params, optimizer state, step, RNG, data-iterator
position) is in the checkpoint, so a run killed at any point and restarted continues exactly; SIGTERM
(preemption) finishes the current step, saves, and exits cleanly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sage_jax import config_lib, distributed, sharding
from sage_jax.models import hf, lora as lora_lib
from sage_jax.rewards.host import HostReward, encode_answers
from sage_jax.rl import optim
from sage_jax.rl.state import TrainState, init_train_state_sharded, policy_model, policy_state
from sage_jax.rl.step import make_rl_step
from sage_jax.sampling import TextSampler, left_pad
from sage_jax.train import data as train_data
from sage_jax.train.checkpoint import Checkpointer, base_pointer, check_base_pointer
from sage_jax.train.metric_writer import MetricWriter

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ setup
@dataclasses.dataclass
class Setup:
    """What a run is built from (loaded once, shared by the loop and the evaluations)."""
    cfg: Any
    workdir: str
    mesh: Any
    model_cfg: Any
    tokenizer: Any
    eos_ids: tuple[int, ...]
    pad_id: int
    reward_fn: Any
    stop: Any = None  # sage_jax.stop_strings.StopStrings of rollout.stop_strings, or None


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompts(s: Setup, prompts, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    rows = [_ids(s.tokenizer, p) for p in prompts]
    for i, r in enumerate(rows):
        if len(r) > max_tokens:
            raise ValueError(f"prompt {i} has {len(r)} tokens > data.max_prompt_tokens={max_tokens} "
                             f"({prompts[i][:60]!r}...); raise the limit (prompts are never truncated)")
    toks, mask = left_pad(rows, s.pad_id, multiple=max_tokens)  # one fixed shape: one compilation
    return toks, mask


# ------------------------------------------------------------------------------------------ eval
class TrainingEval:
    """The policy at a training step, evaluated on `eval.benchmarks` through `evaluate.evaluate_models`
    (the path `mode=eval` takes) as the model `step_<N>` of DIR/eval/results.json.

    Every evaluated step stays in that file: a rerun (resume, or a restart of a finished run) samples
    nothing already there, and the summary compares every step with the first one, paired over problems.
    """

    def __init__(self, c, s: Setup, graphdef):
        from sage_jax.eval.benchmarks import benchmarks_from_config, settings_from_config, strategy_fn_for
        self.c, self.s, self.graphdef = c, s, graphdef
        self.benchmarks = benchmarks_from_config(c, s.workdir, s.tokenizer)
        self.strategy_fn = strategy_fn_for(self.benchmarks)
        self.settings = settings_from_config(c)
        self._sampler: TextSampler | None = None

    def _generator(self, state: TrainState) -> TextSampler:
        if self._sampler is None:
            from sage_jax.eval.benchmarks import sampling_config
            cfg = sampling_config(self.settings, self.s.tokenizer, self.s.model_cfg, self.c.rollout.decode_segments)
            self._sampler = TextSampler(policy_model(self.graphdef, state), self.s.tokenizer, cfg,
                                        batch_size=self.c.eval.batch_size, mesh=self.s.mesh)
        self._sampler.state = policy_state(state)  # read afresh: the step donates the state it is given
        return self._sampler

    def evaluated_steps(self) -> list[int]:
        from sage_jax.eval.evaluate import load_results
        results = load_results(self.s.workdir) or {"models": {}}
        return sorted(int(m[len("step_"):]) for m in results["models"] if m.startswith("step_"))

    def forget_after(self, step: int) -> None:
        """Drops the stored evaluations of steps after `step` (policies of a history that restarts)."""
        from sage_jax.eval.evaluate import load_results, save_results
        results = load_results(self.s.workdir)
        if results is None or jax.process_index() != 0:
            return
        drop = [m for m in results["models"] if m.startswith("step_") and int(m[len("step_"):]) > step]
        if drop:
            log.warning("dropping the stored evaluations of %s (no checkpoint of that history)", ", ".join(drop))
            for m in drop:
                del results["models"][m]
            results["summary"] = None
            save_results(results, self.s.workdir)

    def __call__(self, step: int, state: TrainState) -> dict[str, Any]:
        """Evaluates (or finishes evaluating) step `step`; returns the summary of every evaluated step."""
        from sage_jax.eval.evaluate import evaluate_models

        def stored(_settings):  # a step evaluated earlier is complete, so this is never called
            raise RuntimeError("an earlier step's evaluation is incomplete; evaluate into a fresh workdir")

        steps = sorted(set(self.evaluated_steps()) | {step})
        models = {f"step_{t}": (lambda _settings: self._generator(state)) if t == step else stored for t in steps}
        results = evaluate_models(models, self.benchmarks, self.s.reward_fn, self.settings, self.s.workdir,
                                  sources={f"step_{step}": f"training step {step}"},
                                  strategy_fn=self.strategy_fn, is_writer=jax.process_index() == 0,
                                  progress=self.c.logging.progress and jax.process_index() == 0)
        return results["summary"]


def eval_metrics(summary: dict, step: int) -> dict[str, float]:
    """The metrics.jsonl row of one evaluated step: `eval/<metric>` (the mean over benchmarks when there
    are several, each benchmark also as `eval/<benchmark>/<metric>`)."""
    per_bench = summary["models"][f"step_{step}"]
    benches = list(summary["benchmarks"])
    out = {}
    if len(benches) > 1 and "average" in per_bench:
        out.update({f"eval/{k}": v["mean"] for k, v in per_bench["average"].items()})
    for b in benches:
        prefix = "eval/" if len(benches) == 1 else f"eval/{b}/"
        out.update({f"{prefix}{k}": v["mean"] for k, v in per_bench[b].items()})
    return {k: v for k, v in out.items() if v is not None}


# ------------------------------------------------------------------------------------------ loop
class _Preemption:
    """SIGTERM sets a flag; the loop saves at the next step boundary and exits."""

    def __init__(self):
        self.requested = False
        self._old = signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame):
        log.warning("SIGTERM received: saving a checkpoint at the end of this step, then exiting")
        self.requested = True

    def restore(self):
        signal.signal(signal.SIGTERM, self._old)


def build_setup(c, workdir: str) -> Setup:
    config_lib.validate(c, jax.device_count())
    mesh = sharding.make_mesh(tuple(c.mesh.shape))
    tokenizer = hf.load_tokenizer(c.model.path)
    from sage_jax.models.config import ModelConfig
    model_cfg, _ = ModelConfig.from_hf_dir(hf.resolve_path(c.model.path))
    from sage_jax.rewards.verifiers import make_reward_fn
    if len(tokenizer) > model_cfg.vocab_size:
        raise config_lib.ConfigValidationError(
            f"model.path={c.model.path}: the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{model_cfg.vocab_size}; the tokenizer files belong to another model")
    eos_ids, pad = hf.sampling_ids(tokenizer, model_cfg)
    return Setup(c, workdir, mesh, model_cfg, tokenizer, eos_ids, pad,
                 make_reward_fn(c.rl.reward), config_lib.stop_strings(c, tokenizer, model_cfg.vocab_size))


def run(c, workdir: str) -> dict[str, Any]:
    """Trains per `c.mode` ('rl' or 'sft') in `workdir`, resuming from its checkpoints. Returns a summary."""
    os.makedirs(workdir, exist_ok=True)
    s = build_setup(c, workdir)
    source = train_data.train_source(c, s, c.data.train_split)  # bad data stops the run before the model loads
    is_main = jax.process_index() == 0
    dtype, pdtype = config_lib.model_dtypes(c)
    model, _ = hf.load(c.model.path, dtype=dtype, mesh=s.mesh, param_dtype=pdtype)
    model.set_attention_chunk(c.model.attention_chunk)
    lora_cfg = config_lib.lora_config(c)
    if lora_cfg is not None:  # adapters (B = 0) on the loaded base; only they train and are checkpointed
        lora_lib.add_lora(model, lora_cfg, seed=c.seed, param_dtype=config_lib.lora_param_dtype(c))
        if c.model.lora.init_from:  # e.g. the SFT stage's adapter, which RL continues (the reference stays the base)
            hf.load_peft_adapter(model, c.model.lora.init_from)

    if c.mode == "sft" and c.data.num_epochs:  # the schedule's length comes from the data
        c.max_steps = c.data.num_epochs * (len(source) // c.data.batch_size)
        log.info("data.num_epochs=%d over %d rows in batches of %d: max_steps=%d", c.data.num_epochs,
                 len(source), c.data.batch_size, c.max_steps)
    if c.mode == "rl":
        rl_cfg = config_lib.rl_config(c, s.eos_ids, s.pad_id, stop=s.stop)
        per_step = rl_cfg.num_iterations * rl_cfg.num_minibatches
        rl_cfg = dataclasses.replace(rl_cfg, max_steps=c.max_steps * per_step)
    else:
        rl_cfg, per_step = None, 1
    ocfg = dataclasses.replace(config_lib.optim_config(c), total_steps=c.max_steps * per_step)
    tx, lr_fn = optim.make_optimizer(ocfg)
    if c.mode == "rl":
        # params are placed by hf.load; the optimizer state and the reference are born in their shardings
        graphdef, state = init_train_state_sharded(model, rl_cfg, tx, c.seed, s.mesh)
        step_fn = make_rl_step(graphdef, rl_cfg, tx, lr_fn, HostReward(s.tokenizer, s.reward_fn), s.mesh)
    else:
        from sage_jax.train.sft import make_sft_step
        graphdef, params, frozen = lora_lib.split_trainable(model)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                           rng=jax.random.key(c.seed), frozen_params=frozen)
        step_fn = make_sft_step(graphdef, tx, lr_fn, c.rl.logp_chunk)
    del model

    it = train_data.prompt_iterator(c, s, source, c.seed)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=c.ckpt.keep, async_save=c.ckpt.async_save)
    writer = MetricWriter(workdir, enabled=is_main, tensorboard=c.logging.tensorboard,
                          wandb_cfg={"project": c.logging.wandb_project, "config": c.to_dict()} if c.logging.wandb else None)
    if ckpt.all_steps():
        check_resume_config(workdir, c)
    base = base_pointer(c)
    restored = ckpt.restore_latest(state, check_meta=lambda m: check_base_pointer(m, base, ckpt.directory))
    # What `mode=eval` needs to rebuild this run's model from its checkpoints; written only once the
    # checkpoints are known to belong to this config (a refused resume leaves the run dir as it was).
    if is_main:
        with open(os.path.join(workdir, "run_config.json"), "w") as f:
            f.write(c.to_json_best_effort(indent=2))
    start = 0
    if restored is not None:
        state, meta = restored
        it.set_state(meta["data"])
        start = int(jax.device_get(state.step)) // per_step
        writer.truncate_after(start)
        log.info("resumed from %s at step %d", ckpt.directory, start)
    else:  # no checkpoint: whatever an earlier attempt logged or evaluated after step 0 is history that restarts
        writer.truncate_after(None)

    evaluator = TrainingEval(c, s, graphdef) if (c.eval.at_start or c.eval.at_end or c.eval_every) else None
    if evaluator is not None and restored is None:
        evaluator.forget_after(0)
    summary: dict[str, Any] = {"start_step": start}
    logged_evals = {r["step"] for r in writer.rows() if any(k.startswith("eval/") for k in r)}

    def evaluate(at: int) -> None:
        """Evaluates step `at` (resuming a partial evaluation) and logs it unless metrics.jsonl has it."""
        summary["eval"] = evaluator(at, state)
        if at not in logged_evals:
            writer.write(at, eval_metrics(summary["eval"], at))
            logged_evals.add(at)

    if evaluator is not None and c.eval.at_start and start == 0:
        evaluate(0)

    def next_batch():
        raw = next(it)
        if c.mode == "rl":
            p, m = encode_prompts(s, raw["prompt"], c.data.max_prompt_tokens)
            a = encode_answers(s.tokenizer, raw["answer"], c.data.max_answer_tokens)
            return distributed.global_batch({"prompt": p, "prompt_mask": m, "answer": a}, s.mesh)
        from sage_jax.train.sft import encode_sft
        b = encode_sft(s.tokenizer, raw["prompt"], raw["solution"], s.eos_ids[0] if s.eos_ids else s.pad_id,
                       c.data.max_sft_tokens, s.pad_id, loss_on=c.data.sft_loss_on)
        return distributed.global_batch(b, s.mesh)

    pre = _Preemption()
    pending = None  # (step, metrics on device) of the step before the one running now
    progress = _progress(c, start, is_main)
    t_last = time.perf_counter()
    step = start
    try:
        while step < c.max_steps and not pre.requested:
            batch = next_batch()
            state, metrics = step_fn(state, batch)  # dispatched; runs while the host logs the previous step
            step += 1
            if pending is not None:
                _log(writer, progress, *pending, c)
            now = time.perf_counter()
            metrics["perf/step_s"] = now - t_last
            t_last = now
            pending = (step, metrics)
            save_now = (c.checkpoint_every and step % c.checkpoint_every == 0) or pre.requested
            eval_now = evaluator is not None and c.eval_every and step % c.eval_every == 0 and step < c.max_steps
            if save_now or eval_now:  # step N's metrics are on disk before checkpoint N: a restart resumes after it
                _log(writer, progress, *pending, c)
                pending = None
            if eval_now:
                evaluate(step)
            if save_now:
                ckpt.save(state, {"data": it.get_state(), "step": step, **base})
        if pending is not None:
            _log(writer, progress, *pending, c)
        ckpt.save(state, {"data": it.get_state(), "step": step, **base})
        ckpt.wait()
    except BaseException:
        ckpt.close()  # a save under way finishes (or fails) here, not half-written at interpreter exit
        raise
    finally:
        pre.restore()
        progress.close()
    summary["end_step"] = step
    summary["preempted"] = pre.requested
    if not pre.requested and step >= c.max_steps:
        # the last step is evaluated here, after its checkpoint: at_end, or when eval_every falls on it
        if evaluator is not None and (c.eval.at_end or (c.eval_every and step % c.eval_every == 0)):
            evaluate(step)  # a restart of a finished run samples nothing new and logs only what is missing
        if c.ckpt.export_hf:
            summary.update(export(c, s, graphdef, state, workdir, is_main))
    if "eval" in summary:
        steps = sorted(int(m[len("step_"):]) for m in summary["eval"]["models"])
        if 0 in steps:
            summary["before"] = eval_metrics(summary["eval"], 0)
        if step in steps and step > 0:
            summary["after"] = eval_metrics(summary["eval"], step)
    if is_main and c.mode == "rl" and not pre.requested:
        from sage_jax.eval import report as eval_report
        summary["plot"] = os.path.join(workdir, eval_report.RUN_PLOT)
        eval_report.plot_run(writer.rows(), summary.get("eval"), summary["plot"])
    ckpt.close()
    writer.close()
    return summary


# What a resume must share with the run that wrote the checkpoints. Everything else may change between
# attempts: max_steps, logging, checkpointing, evaluation, the mesh, and knobs of speed and memory alone.
RESUME_KEYS = ("mode", "seed", "model.path", "model.dtype", "model.param_dtype", "model.lora", "data.name",
               "data.builder_config", "data.train_split", "data.template", "data.system_prompt", "data.batch_size",
               "data.max_train_problems", "rollout", "rl", "sage", "optim")
RESUME_FREE = ("rollout.decode_segments", "rl.grad_accum_steps", "rl.logp_chunk", "rl.share_prompt")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def check_resume_config(workdir: str, c) -> None:
    """Refuses to resume checkpoints written under another run config (RESUME_KEYS), naming the fields:
    a changed model, task or recipe in the same workdir would otherwise mix two histories."""
    import json
    path = os.path.join(workdir, "run_config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        old = _flat(json.load(f))
    new = _flat(json.loads(c.to_json_best_effort()))
    diffs = [k for k in sorted(set(old) & set(new))
             if any(k == p or k.startswith(p + ".") for p in RESUME_KEYS)
             and not any(k == p or k.startswith(p + ".") for p in RESUME_FREE) and old[k] != new[k]]
    if diffs:
        shown = "; ".join(f"{k}={old[k]!r} there, {new[k]!r} now" for k in diffs[:3])
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise config_lib.ConfigValidationError(
            f"{workdir} holds checkpoints of another run config: {shown}{more}; use another --workdir, or the "
            "original values to resume")


def export(c, s: Setup, graphdef, state: TrainState, workdir: str, is_main: bool) -> dict[str, str]:
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
        if "export_peft" in out:
            hf.save_peft_adapter(model, out["export_peft"], base_path=c.model.path)
    return out


def _progress(c, start, is_main):
    from tqdm.auto import tqdm
    return tqdm(total=c.max_steps, initial=start, disable=not (is_main and c.logging.progress), unit="step",
                dynamic_ncols=True, desc=c.mode)


def _log(writer, progress, step, metrics, c):
    host = jax.device_get(metrics)
    progress.update(step - progress.n)
    key = "reward/reward_mean" if "reward/reward_mean" in host else "train/loss"
    progress.set_postfix({key.split("/")[-1]: f"{float(host[key]):.3f}"}, refresh=False)
    if step % c.log_every == 0 or step == c.max_steps:
        writer.write(step, host)
