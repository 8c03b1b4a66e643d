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

from sage_jax import config_lib, optim, sharding
from sage_jax.checkpoint import Checkpointer
from sage_jax.metric_writer import MetricWriter
from sage_jax.models import hf
from sage_jax.models import lora as lora_lib
from sage_jax.reward_host import HostReward, encode_answers
from sage_jax.rl_step import TrainState, init_train_state_sharded, make_rl_step, policy_model, policy_state
from sage_jax.sampling import SamplingConfig, TextSampler, left_pad

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


def _stop_ids(tokenizer, model_cfg) -> tuple[int, ...]:
    ids = set(model_cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    if im_end is not None:
        ids.add(int(im_end))  # chat models end a turn with <|im_end|> even where config.json names <|endoftext|>
    return tuple(sorted(ids))


def data_source(c, workdir: str, split: str):
    from sage_jax.data import builders
    data_dir = c.data.data_dir or os.path.join(workdir, "tfds")
    return builders.load_split(c.data.name, split, data_dir=data_dir, manual_dir=c.data.manual_dir or None,
                               config=c.data.builder_config if c.data.name == "procedural_arithmetic" else None)


def prompt_iterator(c, s: Setup, split: str, seed: int):
    from sage_jax.data.pipeline import make_prompt_iterator
    n_proc = jax.process_count()
    if c.data.batch_size % n_proc:
        raise config_lib.ConfigValidationError(
            f"data.batch_size={c.data.batch_size} is not divisible by the {n_proc} processes")
    source = data_source(c, s.workdir, split)
    if c.data.max_train_problems:
        source = _Head(source, c.data.max_train_problems)
    return make_prompt_iterator(source, batch_size=c.data.batch_size // n_proc, seed=seed,
                                template=c.data.template, tokenizer=s.tokenizer, system_prompt=c.data.system_prompt)


class _Head:
    """The first n records of a random-access source (a smaller training pool)."""

    def __init__(self, source, n: int):
        if n > len(source):
            raise config_lib.ConfigValidationError(
                f"data.max_train_problems={n} exceeds the {len(source)} training problems")
        self.source, self.n = source, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.source[i]


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


def _global(mesh, x: np.ndarray):
    """Host-local rows -> one global array sharded over the batch axes (multi-host safe)."""
    return jax.make_array_from_process_local_data(sharding.batch_sharding(mesh, x.ndim), x)


# ------------------------------------------------------------------------------------------ eval
def quick_eval(s: Setup, sampler: TextSampler, state: TrainState, problems: list[dict], n: int,
               seed: int) -> dict[str, float]:
    """pass@k (unbiased) for k = 1, 2, 4, ..., n on `problems` with the policy of `state` (read afresh
    each call: the step donates the state it is given)."""
    from sage_jax.evaluate import pass_at_k
    sampler.state = policy_state(state)
    outs = sampler.generate([p["prompt"] for p in problems], n=n, seed=seed)
    comps = [c.text for group in outs for c in group]
    answers = [p["answer"] for p in problems for _ in range(n)]
    correct = np.asarray(s.reward_fn(comps, answers)).reshape(len(problems), n) > 0.5
    c = correct.sum(1)
    out = {}
    k = 1
    while k <= n:
        out[f"eval/pass@{k}"] = float(np.mean(pass_at_k(n, c, k)))
        k *= 2
    out["eval/mean_length"] = float(np.mean([x.num_tokens for g in outs for x in g]))
    return out


def eval_problems(c, s: Setup) -> list[dict]:
    from sage_jax.data.sources import decode_record
    from sage_jax.data.templates import format_prompt
    src = data_source(c, s.workdir, c.data.eval_split)
    n = min(c.eval.num_problems, len(src))
    recs = [decode_record(src[i]) for i in range(n)]
    for r in recs:
        r["prompt"] = format_prompt(r["problem"], c.data.template, s.tokenizer, c.data.system_prompt)
    return recs


def make_eval_sampler(c, s: Setup, graphdef, state: TrainState) -> TextSampler:
    cfg = SamplingConfig(max_new_tokens=c.eval.max_new_tokens, temperature=c.eval.temperature, top_p=c.eval.top_p,
                         eos_ids=s.eos_ids, pad_id=s.pad_id, decode_segments=c.rollout.get("decode_segments", 4))
    return TextSampler(policy_model(graphdef, state), s.tokenizer, cfg, batch_size=c.eval.batch_size, mesh=s.mesh)


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
    model_cfg, _ = ModelConfig.from_hf_dir(hf._resolve(c.model.path))
    from sage_jax.rewards import make_reward_fn
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (model_cfg.pad_token_id or 0)
    return Setup(c, workdir, mesh, model_cfg, tokenizer, _stop_ids(tokenizer, model_cfg), int(pad),
                 make_reward_fn(c.rl.reward))


def run(c, workdir: str) -> dict[str, Any]:
    """Trains per `c.mode` ('rl' or 'sft') in `workdir`, resuming from its checkpoints. Returns a summary."""
    os.makedirs(workdir, exist_ok=True)
    s = build_setup(c, workdir)
    is_main = jax.process_index() == 0
    dtype, pdtype = config_lib.model_dtypes(c)
    model, _ = hf.load(c.model.path, dtype=dtype, mesh=s.mesh, param_dtype=pdtype)
    lora_cfg = config_lib.lora_config(c)
    if lora_cfg is not None:  # adapters (B = 0) on the loaded base; only they train and are checkpointed
        lora_lib.add_lora(model, lora_cfg, seed=c.seed, param_dtype=pdtype)

    if c.mode == "rl":
        rl_cfg = config_lib.rl_config(c, s.eos_ids, s.pad_id)
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
        from sage_jax.sft import make_sft_step
        graphdef, params, frozen = lora_lib.split_trainable(model)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                           rng=jax.random.key(c.seed), frozen_params=frozen)
        step_fn = make_sft_step(graphdef, tx, lr_fn, c.rl.logp_chunk)
    del model

    it = prompt_iterator(c, s, c.data.train_split, c.seed)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=c.ckpt.keep, async_save=c.ckpt.async_save)
    writer = MetricWriter(workdir, enabled=is_main, tensorboard=c.logging.tensorboard,
                          wandb_cfg={"project": c.logging.wandb_project, "config": c.to_dict()} if c.logging.wandb else None)
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

    problems = eval_problems(c, s) if (c.eval.at_start or c.eval.at_end or c.eval_every) else []
    sampler = make_eval_sampler(c, s, graphdef, state) if problems else None
    summary: dict[str, Any] = {"start_step": start}
    if problems and c.eval.at_start and start == 0:
        summary["before"] = quick_eval(s, sampler, state, problems, c.eval.n, c.seed)
        writer.write(0, summary["before"])
    elif start > 0 and is_main and os.path.exists(writer.path):  # report the first run's numbers again
        from sage_jax.metric_writer import read_metrics
        first = [r for r in read_metrics(workdir) if r["step"] == 0 and any("pass@" in k for k in r)]
        if first:
            summary["before"] = {k: v for k, v in first[0].items() if k.startswith("eval/")}

    def next_batch():
        raw = next(it)
        if c.mode == "rl":
            p, m = encode_prompts(s, raw["prompt"], c.data.max_prompt_tokens)
            a = encode_answers(s.tokenizer, raw["answer"], c.data.max_answer_tokens)
            return {"prompt": _global(s.mesh, p), "prompt_mask": _global(s.mesh, m), "answer": _global(s.mesh, a)}
        from sage_jax.sft import encode_sft
        b = encode_sft(s.tokenizer, raw["prompt"], raw["solution"], s.eos_ids[0] if s.eos_ids else s.pad_id,
                       c.data.max_sft_tokens, s.pad_id)
        return {k: _global(s.mesh, v) for k, v in b.items()}

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
            if c.eval_every and step % c.eval_every == 0 and problems and step < c.max_steps:
                writer.write(step, quick_eval(s, sampler, state, problems, c.eval.n, c.seed + step))
            if (c.checkpoint_every and step % c.checkpoint_every == 0) or pre.requested:
                ckpt.save(state, {"data": it.get_state(), "step": step, **base})
        if pending is not None:
            _log(writer, progress, *pending, c)
        ckpt.save(state, {"data": it.get_state(), "step": step, **base})
        ckpt.wait()
    finally:
        pre.restore()
        progress.close()
    summary["end_step"] = step
    summary["preempted"] = pre.requested
    if not pre.requested and step >= c.max_steps:
        if problems and c.eval.at_end:
            summary["after"] = quick_eval(s, sampler, state, problems, c.eval.n, c.seed)
            if start < c.max_steps:  # a rerun of a finished run reports again but logs nothing new
                writer.write(step, summary["after"])
        if c.ckpt.export_hf:
            summary.update(export(c, s, graphdef, state, workdir, is_main))
    ckpt.close()
    writer.close()
    return summary


def base_pointer(c) -> dict:
    """What a checkpoint records about the weights it does not hold: under LoRA it holds only the adapters
    (and their optimizer state), so it names the base they were trained on."""
    lora_cfg = config_lib.lora_config(c)
    if lora_cfg is None:
        return {}
    return {"base_model": c.model.path, "lora": dataclasses.asdict(lora_cfg)}


def check_base_pointer(meta: dict, base: dict, directory: str) -> None:
    saved = {k: meta.get(k) for k in ("base_model", "lora")}
    saved["lora"] = saved["lora"] and {**saved["lora"], "targets": tuple(saved["lora"]["targets"])}
    want = {k: base.get(k) for k in ("base_model", "lora")}
    if saved != want:
        raise config_lib.ConfigValidationError(
            f"checkpoints in {directory} were written with base_model={saved['base_model']!r}, "
            f"lora={saved['lora']} but the config has model.path={want['base_model'] or '(full fine-tuning)'!r}, "
            f"lora={want['lora']}; use another --workdir or the original model.path / model.lora")


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
