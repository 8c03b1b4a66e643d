"""Orbax checkpoints: one tree per step holding everything a resume needs.

Layout under `DIR/checkpoints/<step>/`, `<step>` the training step (an RL step or an SFT step): `state` (params,
optimizer state, the optimizer-update count that drives the lr and guide schedules, RNG key data) and `meta`
(JSON: the training step, data-iterator state, the LoRA base). An update skipped for want of a loss token does
not count, so the training step is the checkpoint's key and the resume position, not the update count.
`DIR/run_config.json` records the run's config: a rerun must share `RESUME_KEYS` with it. The frozen reference is not saved: it is the model at `config.model.path` and is reloaded.
Under LoRA `params` are the adapters only (the base is frozen and never saved); `meta` then names the
base (`base_model`, `lora`), and the loop refuses to resume onto a different one.

Restore walks the steps newest first; a checkpoint that fails to restore (corrupted, half-written by a
killed process that bypassed Orbax's atomic rename) is skipped with a warning, moved to
`DIR/checkpoints.corrupt/<step>`, and the previous one is used. Saves are asynchronous; `close()` waits
for them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from sage_jax import config_lib
from sage_jax.errors import UserError

log = logging.getLogger(__name__)
RUN_CONFIG = "run_config.json"  # the config of the run whose checkpoints a run dir holds


def _to_saveable(state) -> dict[str, Any]:
    tree = {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "rng": jax.random.key_data(state.rng)}
    return tree


class RestoreError(UserError, RuntimeError):
    """Checkpoints exist but none restores: damaged, or written by another config."""


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        opts = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                            create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=opts)

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, state, meta: dict, force: bool = True) -> None:
        """Saves `state` as checkpoint `meta["step"]` (the training step; a step saved already is skipped)."""
        step = int(meta["step"])
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_to_saveable(state)),
                                                        meta=ocp.args.JsonSave(meta)), force=force)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def restore_latest(self, template_state, check_meta=None) -> tuple[Any, dict] | None:
        """(state, meta) of the newest restorable checkpoint, into the shardings of `template_state`.

        `check_meta(meta)` runs on the newest readable meta before any state is read; what it raises
        propagates (a checkpoint of another model is an error, not a corrupt file to skip)."""
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                              _to_saveable(template_state))
        bad: list[tuple[int, str]] = []  # (step, why) of the newer steps that did not restore
        for step in reversed(self.all_steps()):
            try:
                meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            except Exception as e:
                log.warning("checkpoint metadata at step %d in %s could not be read (%s); trying the previous one",
                            step, self.directory, type(e).__name__)
                bad.append((step, f"metadata unreadable ({type(e).__name__})"))
                continue
            if check_meta is not None:
                check_meta(dict(meta))
            try:
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
            except Exception as e:  # corrupted or incomplete: fall back to an older one
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                log.warning("checkpoint at step %d in %s could not be restored (%s); trying the previous one",
                            step, self.directory, why)
                bad.append((step, why))
                continue
            # An older step restored, so the config fits these checkpoints and the newer ones are damaged:
            # move them aside, so that the run writes good ones where they were.
            for b, _ in bad:
                self._quarantine(b)
            tree = out["state"]
            key = jax.random.wrap_key_data(tree["rng"], impl=jax.random.key_impl(template_state.rng))
            state = template_state.replace(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"],
                                           rng=key)
            return state, dict(out["meta"])
        if bad:  # nothing restores: damage or another config, no telling which; never discard them silently
            step, why = bad[0]
            raise RestoreError(
                f"{self.directory}: none of the {len(bad)} checkpoint(s) restores into this config's state (newest, "
                f"step {step}: {why}); if they are damaged move the directory aside to start over, if they are "
                "another run's use another --workdir")
        return None

    def _quarantine(self, step: int) -> None:
        """Moves an unrestorable step out of the way (to DIR/checkpoints.corrupt/) so that the run, once it
        reaches that step again, writes a good one there instead of finding the step taken. Single-process
        only: with several processes every host reads the directory, and the file stays where it is."""
        if jax.process_count() > 1:
            return
        src = os.path.join(self.directory, str(step))
        if not os.path.isdir(src):
            return
        dst_root = self.directory.rstrip(os.sep) + ".corrupt"
        os.makedirs(dst_root, exist_ok=True)
        dst = os.path.join(dst_root, str(step))
        k = 1
        while os.path.exists(dst):
            dst, k = os.path.join(dst_root, f"{step}.{k}"), k + 1
        os.rename(src, dst)
        log.warning("moved the unrestorable checkpoint of step %d to %s", step, dst)
        self.manager.reload()

    def close(self) -> None:
        """Waits for saves under way, then closes; a second call does nothing."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        try:
            self.manager.wait_until_finished()
        finally:
            self.manager.close()


def base_pointer(model) -> dict:
    """What a checkpoint records about the weights it does not hold (`model`: the run's `ModelSpec`): under LoRA
    it holds only the adapters (and their optimizer state), so it names the base they were trained on."""
    if model.lora is None:
        return {}
    return {"base_model": model.path, "lora": dataclasses.asdict(model.lora)}


def check_base_pointer(meta: dict, base: dict, directory: str) -> None:
    saved = {k: meta.get(k) for k in ("base_model", "lora")}
    saved["lora"] = saved["lora"] and {**saved["lora"], "targets": tuple(saved["lora"]["targets"])}
    want = {k: base.get(k) for k in ("base_model", "lora")}
    if saved != want:
        raise config_lib.ConfigValidationError(
            f"checkpoints in {directory} were written with base_model={saved['base_model']!r}, "
            f"lora={saved['lora']} but the config has model.path={want['base_model'] or '(full fine-tuning)'!r}, "
            f"lora={want['lora']}; use another --workdir or the original model.path / model.lora")


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


def check_resume_config(workdir: str, config_json: str) -> None:
    """Refuses to resume checkpoints written under another run config (RESUME_KEYS), naming the fields:
    a changed model, task or recipe in the same workdir would otherwise mix two histories. A field one of the
    two configs lacks (added or removed since) is not compared."""
    path = os.path.join(workdir, RUN_CONFIG)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        old = _flat(json.load(f))
    new = _flat(json.loads(config_json))
    diffs = [k for k in sorted(set(old) & set(new))
             if any(k == p or k.startswith(p + ".") for p in RESUME_KEYS)
             and not any(k == p or k.startswith(p + ".") for p in RESUME_FREE) and old[k] != new[k]]
    if diffs:
        shown = "; ".join(f"{k}={old[k]!r} there, {new[k]!r} now" for k in diffs[:3])
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        raise config_lib.ConfigValidationError(
            f"{workdir} holds checkpoints of another run config: {shown}{more}; use another --workdir, or the "
            "original values to resume")


def write_run_config(workdir: str, config_json: str) -> None:
    """What `mode=eval` needs to rebuild this run's model from its checkpoints (written once the checkpoints are
    known to belong to this config: a refused resume leaves the run dir as it was)."""
    with open(os.path.join(workdir, RUN_CONFIG), "w") as f:
        f.write(config_json)
