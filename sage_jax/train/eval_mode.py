"""`mode = eval`: pass@k of one or several policies on the configured benchmarks, into DIR/eval/.

`config.eval.models` maps a name to an HF directory (or hub id) or to a run directory of this project
(its latest Orbax checkpoint is restored onto the run's base model; under LoRA the checkpoint holds
the adapters and they are attached to that base). Every model is sampled with the
same prompts, sampling settings and seeds; results are resumable (see `sage_jax.eval.evaluate`).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_collections

from sage_jax import config_lib, defaults, sharding
from sage_jax.eval.benchmarks import benchmark_problems, sampling_config, strategy_fn_for
from sage_jax.eval.evaluate import EvalSettings, evaluate_models
from sage_jax.models import hf, lora as lora_lib
from sage_jax.models.config import ModelConfig
from sage_jax.policy import optim
from sage_jax.policy.state import TrainState, policy_model
from sage_jax.rewards.verifiers import make_reward_fn
from sage_jax.sampling import TextSampler
from sage_jax.train.checkpoint import RUN_CONFIG, Checkpointer, base_pointer, check_base_pointer
from sage_jax.train.training_eval import check_prompt_positions


def is_run_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, RUN_CONFIG)) and os.path.isdir(os.path.join(path, "checkpoints"))


def run_config(path: str) -> ml_collections.ConfigDict:
    """A run dir's config, over today's defaults: a run written before a field existed reads it as its default,
    and a field since removed is ignored."""
    c = defaults.default_config()
    known = set(_flatten(c.to_dict()))
    with open(os.path.join(path, RUN_CONFIG)) as f:
        stored = _flatten(json.load(f))
    c.update_from_flattened_dict({k: v for k, v in stored.items() if k in known})
    return c


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = tuple(v) if isinstance(v, list) else v
    return out


def load_policy(path: str, dtype=None, mesh=None, param_dtype=None):
    """(model, tokenizer_path) from an HF dir (in `dtype` / `param_dtype`, default float32) or from a run
    dir's latest checkpoint (in the dtypes that run trained with)."""
    if not is_run_dir(path):
        return hf.load(path, dtype=dtype or jnp.float32, mesh=mesh, param_dtype=param_dtype)[0], path
    rc = config_lib.resolve(run_config(path))
    m = rc.model
    model, _ = hf.load(m.path, dtype=m.dtype, mesh=mesh, param_dtype=m.param_dtype)
    if m.lora is not None:  # the checkpoint holds the adapters; the base is the run's model.path
        lora_lib.add_lora(model, m.lora, param_dtype=m.lora_param_dtype)
    graphdef, params, frozen = lora_lib.split_trainable(model)
    tx, _ = optim.make_optimizer(rc.optim)
    template = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                          rng=jax.random.key(0), frozen_params=frozen)
    ck = Checkpointer(os.path.join(path, "checkpoints"), async_save=False)
    base = base_pointer(m)
    restored = ck.restore_latest(template, check_meta=lambda meta: check_base_pointer(meta, base, ck.directory))
    ck.close()
    if restored is None:
        raise config_lib.ConfigValidationError(f"eval.models: {path} has no restorable checkpoint")
    return policy_model(graphdef, restored[0]), m.path


def run(c, workdir: str) -> dict:
    spec = config_lib.resolve(c, jax.device_count())
    models = dict(spec.eval.models) or {"model": spec.model.path}
    for name, path in models.items():
        if not (os.path.isdir(path) or hf.is_hub_id(path)):
            raise config_lib.ConfigValidationError(f"eval.models.{name}={path!r}: no such directory")
    first = next(iter(models.values()))
    tokenizer = hf.load_tokenizer(run_config(first).model.path if is_run_dir(first) else first)
    mesh = sharding.make_mesh(spec.mesh_shape)
    ev = spec.eval
    benchmarks = benchmark_problems(ev, spec.data, workdir, tokenizer)

    def factory(name, path):
        def build(settings: EvalSettings):
            model, tp = load_policy(path, spec.model.dtype, mesh=mesh, param_dtype=spec.model.param_dtype)
            tok = hf.load_tokenizer(tp)
            mcfg, _ = ModelConfig.from_hf_dir(hf.resolve_path(tp))
            check_prompt_positions(benchmarks, tok, mcfg, settings.max_tokens, f"eval.models.{name}={path}")
            return TextSampler(model, tok, sampling_config(settings, tok, mcfg, ev.decode_segments),
                               batch_size=ev.batch_size, mesh=mesh)
        return build

    results = evaluate_models({k: factory(k, v) for k, v in models.items()}, benchmarks, make_reward_fn(spec.reward),
                              ev.settings, workdir, sources=models, is_writer=jax.process_index() == 0,
                              progress=spec.logging.progress, strategy_fn=strategy_fn_for(benchmarks))
    print(open(os.path.join(workdir, "eval", "results.md")).read())
    return results
