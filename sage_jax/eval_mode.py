"""`mode = eval`: pass@k of one or several policies on the configured benchmarks, into DIR/eval/.

`config.eval.models` maps a name to an HF directory (or hub id) or to a run directory of this project
(its latest Orbax checkpoint is restored onto the run's base model; under LoRA the checkpoint holds
the adapters and they are attached to that base). Every model is sampled with the
same prompts, sampling settings and seeds; results are resumable (see `sage_jax.evaluate`).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import ml_collections

from sage_jax import config_lib
from sage_jax.evaluate import EvalSettings, Problem, evaluate_models
from sage_jax.models import hf
from sage_jax.sampling import SamplingConfig, TextSampler

RUN_CONFIG = "run_config.json"  # written by train.run into every run directory


def is_run_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, RUN_CONFIG)) and os.path.isdir(os.path.join(path, "checkpoints"))


def load_policy(path: str, dtype=None, mesh=None, param_dtype=None):
    """(model, tokenizer_path) from an HF dir (in `dtype` / `param_dtype`, default float32) or from a run
    dir's latest checkpoint (in the dtypes that run trained with)."""
    if not is_run_dir(path):
        return hf.load(path, dtype=dtype or jnp.float32, mesh=mesh, param_dtype=param_dtype)[0], path
    from sage_jax import optim
    from sage_jax.checkpoint import Checkpointer
    from sage_jax.rl_step import TrainState

    with open(os.path.join(path, RUN_CONFIG)) as f:
        rc = ml_collections.ConfigDict(json.load(f))
    from sage_jax.models import lora as lora_lib
    from sage_jax.rl_step import policy_model

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
    base = config_lib.base_pointer(rc)
    restored = ck.restore_latest(template, check_meta=lambda m: config_lib.check_base_pointer(m, base, ckdir))
    ck.close()
    if restored is None:
        raise config_lib.ConfigValidationError(f"eval.models: {path} has no restorable checkpoint")
    return policy_model(graphdef, restored[0]), rc.model.path


def eval_template(c) -> str:
    """The evaluation prompt's template: eval.template, else the training one (data.template)."""
    return c.eval.get("template") or c.data.template


def benchmarks_from_config(c, workdir: str, tokenizer) -> dict[str, list[Problem]]:
    from sage_jax.data import builders
    from sage_jax.data.sources import decode_record
    from sage_jax.data.templates import format_prompt

    out = {}
    data_dir = c.data.data_dir or os.path.join(workdir, "tfds")
    for spec in [b.strip() for b in c.eval.benchmarks.split(",") if b.strip()]:
        name, _, split = spec.partition(":")
        cfg = c.data.builder_config if name == "procedural_arithmetic" else None
        src = builders.load_split(name, split or "test", data_dir=data_dir, manual_dir=c.data.manual_dir or None,
                                  config=cfg)
        n = len(src) if c.eval.num_problems <= 0 else min(c.eval.num_problems, len(src))
        template = eval_template(c)
        probs = []
        for i in range(n):
            r = decode_record(src[i])
            probs.append(Problem(r["id"], format_prompt(r["problem"], template, tokenizer, c.data.system_prompt),
                                 r["answer"]))
        out[spec] = probs
    return out


def strategy_fn_for(benchmarks) -> "StrategyFn | None":
    """The procedure labeller of the procedural task (`strategies.strategy_of`) when a benchmark is that task,
    so evaluations count distinct correct procedures; None for other benchmarks."""
    if any(b.partition(":")[0] == "procedural_arithmetic" for b in benchmarks):
        from sage_jax.data.strategies import strategy_of
        return strategy_of
    return None


def run(c, workdir: str) -> dict:
    config_lib.validate_eval(c)
    models = config_lib.eval_models(c) or {"model": c.model.path}
    for name, path in models.items():
        if not (os.path.isdir(path) or path.count("/") == 1):
            raise config_lib.ConfigValidationError(f"eval.models.{name}={path!r}: no such directory")
    first = next(iter(models.values()))
    tok_path = json.load(open(os.path.join(first, RUN_CONFIG)))["model"]["path"] if is_run_dir(first) else first
    tokenizer = hf.load_tokenizer(tok_path)
    settings = EvalSettings(n=c.eval.n, temperature=c.eval.temperature, top_p=c.eval.top_p,
                            max_tokens=c.eval.max_new_tokens, seed=c.seed,
                            problems_per_batch=max(1, c.eval.batch_size // c.eval.n))
    from sage_jax.rewards import make_reward_fn
    from sage_jax.models.config import ModelConfig

    from sage_jax import sharding
    mesh = sharding.make_mesh(tuple(c.mesh.shape))
    dtype, pdtype = config_lib.model_dtypes(c)

    def factory(path):
        def build(s: EvalSettings):
            model, tp = load_policy(path, dtype, mesh=mesh, param_dtype=pdtype)  # HF dirs: model.(param_)dtype
            tok = hf.load_tokenizer(tp)
            mcfg, _ = ModelConfig.from_hf_dir(hf.resolve_path(tp))
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            cfg = SamplingConfig(max_new_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                 eos_ids=hf.stop_ids(tok, mcfg), pad_id=int(pad),
                                 stop=config_lib.stop_strings(c, tok, mcfg.vocab_size), **dict(s.sampler))
            return TextSampler(model, tok, cfg, batch_size=c.eval.batch_size, mesh=mesh)
        return build

    benchmarks = benchmarks_from_config(c, workdir, tokenizer)
    results = evaluate_models({k: factory(v) for k, v in models.items()}, benchmarks, make_reward_fn(c.rl.reward),
                              settings, workdir, sources=models, is_writer=jax.process_index() == 0,
                              progress=c.logging.progress, strategy_fn=strategy_fn_for(benchmarks))
    print(open(os.path.join(workdir, "eval", "results.md")).read())
    return results
