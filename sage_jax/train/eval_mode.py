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

from sage_jax import config_lib
from sage_jax.eval.benchmarks import benchmarks_from_config, settings_from_config, strategy_fn_for
from sage_jax.eval.benchmarks import sampling_config as eval_sampling_config
from sage_jax.eval.evaluate import EvalSettings, evaluate_models
from sage_jax.models import hf
from sage_jax.sampling import TextSampler

RUN_CONFIG = "run_config.json"  # written by train.run into every run directory


def is_run_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, RUN_CONFIG)) and os.path.isdir(os.path.join(path, "checkpoints"))


def load_policy(path: str, dtype=None, mesh=None, param_dtype=None):
    """(model, tokenizer_path) from an HF dir (in `dtype` / `param_dtype`, default float32) or from a run
    dir's latest checkpoint (in the dtypes that run trained with)."""
    if not is_run_dir(path):
        return hf.load(path, dtype=dtype or jnp.float32, mesh=mesh, param_dtype=param_dtype)[0], path
    from sage_jax.rl import optim
    from sage_jax.rl.state import TrainState
    from sage_jax.train.checkpoint import Checkpointer, base_pointer, check_base_pointer

    with open(os.path.join(path, RUN_CONFIG)) as f:
        rc = ml_collections.ConfigDict(json.load(f))
    from sage_jax.models import lora as lora_lib
    from sage_jax.rl.state import policy_model

    model, _ = hf.load(rc.model.path, dtype=config_lib.model_dtypes(rc)[0], mesh=mesh,
                       param_dtype=config_lib.model_dtypes(rc)[1])
    lora_cfg = config_lib.lora_config(rc)
    if lora_cfg is not None:  # the checkpoint holds the adapters; the base is the run's model.path
        lora_lib.add_lora(model, lora_cfg, param_dtype=config_lib.lora_param_dtype(rc))
    graphdef, params, frozen = lora_lib.split_trainable(model)
    tx, _ = optim.make_optimizer(config_lib.optim_config(rc))
    template = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                          rng=jax.random.key(0), frozen_params=frozen)
    ck = Checkpointer(os.path.join(path, "checkpoints"), async_save=False)
    ckdir = ck.directory
    base = base_pointer(rc)
    restored = ck.restore_latest(template, check_meta=lambda m: check_base_pointer(m, base, ckdir))
    ck.close()
    if restored is None:
        raise config_lib.ConfigValidationError(f"eval.models: {path} has no restorable checkpoint")
    return policy_model(graphdef, restored[0]), rc.model.path


def run(c, workdir: str) -> dict:
    config_lib.validate_eval(c)
    models = config_lib.eval_models(c) or {"model": c.model.path}
    for name, path in models.items():
        if not (os.path.isdir(path) or hf.is_hub_id(path)):
            raise config_lib.ConfigValidationError(f"eval.models.{name}={path!r}: no such directory")
    first = next(iter(models.values()))
    tok_path = json.load(open(os.path.join(first, RUN_CONFIG)))["model"]["path"] if is_run_dir(first) else first
    tokenizer = hf.load_tokenizer(tok_path)
    settings = settings_from_config(c)
    from sage_jax import sharding
    from sage_jax.models.config import ModelConfig
    from sage_jax.rewards.verifiers import make_reward_fn
    mesh = sharding.make_mesh(tuple(c.mesh.shape))
    dtype, pdtype = config_lib.model_dtypes(c)

    def factory(path):
        def build(s: EvalSettings):
            model, tp = load_policy(path, dtype, mesh=mesh, param_dtype=pdtype)  # HF dirs: model.(param_)dtype
            tok = hf.load_tokenizer(tp)
            mcfg, _ = ModelConfig.from_hf_dir(hf.resolve_path(tp))
            cfg = eval_sampling_config(s, tok, mcfg, c.rollout.decode_segments)
            return TextSampler(model, tok, cfg, batch_size=c.eval.batch_size, mesh=mesh)
        return build

    benchmarks = benchmarks_from_config(c, workdir, tokenizer)
    results = evaluate_models({k: factory(v) for k, v in models.items()}, benchmarks, make_reward_fn(c.rl.reward),
                              settings, workdir, sources=models, is_writer=jax.process_index() == 0,
                              progress=c.logging.progress, strategy_fn=strategy_fn_for(benchmarks))
    print(open(os.path.join(workdir, "eval", "results.md")).read())
    return results
