"""`mode=eval` end to end: the shipped HF dir and a run's Orbax checkpoint, results + table + plots, resume."""

import json
import os

import ml_collections
from test_learning import tiny_config

from sage_jax.defaults import TINY_BASE
from sage_jax.train import eval_mode, loop as train


def _small(c, data_dir):
    c.data.data_dir = data_dir  # configs/tiny.py's task, prepared once for the suite (conftest)
    c.data.batch_size = 4
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 24
    c.eval.at_start = c.eval.at_end = False
    c.ckpt.export_hf = False
    c.logging.progress = c.logging.tensorboard = False
    return c


def test_eval_hf_dir_and_run_dir(tmp_path, monkeypatch, tiny_task_data_dir):
    run_dir = str(tmp_path / "run")
    c = _small(tiny_config(), tiny_task_data_dir)
    c.max_steps, c.checkpoint_every = 2, 2
    train.run(c, run_dir)
    assert eval_mode.is_run_dir(run_dir)

    e = _small(tiny_config(), tiny_task_data_dir)
    e.mode = "eval"
    e.eval.models = ml_collections.ConfigDict({"base": TINY_BASE, "run": run_dir})
    e.eval.num_problems, e.eval.n, e.eval.max_new_tokens, e.eval.batch_size = 4, 4, 32, 16
    out = str(tmp_path / "eval")
    eval_mode.run(e, out)
    for f in ("results.json", "results.md", "pass_at_k.png", "pass1_vs_passk.png"):
        assert os.path.getsize(os.path.join(out, "eval", f)) > 0, f
    res = json.load(open(os.path.join(out, "eval", "results.json")))
    assert set(res["models"]) == {"base", "run"}
    for m in ("base", "run"):
        probs = res["models"][m]["benchmarks"]["procedural_arithmetic:test"]["problems"]
        assert len(probs) == 4 and all(len(p["correct"]) == 4 for p in probs.values())
    # Identical prompts and seeds for both models: same problem ids, same per-problem seeds.
    pb = res["models"]["base"]["benchmarks"]["procedural_arithmetic:test"]["problems"]
    pr = res["models"]["run"]["benchmarks"]["procedural_arithmetic:test"]["problems"]
    assert {k: v["seed"] for k, v in pb.items()} == {k: v["seed"] for k, v in pr.items()}

    # A rerun samples nothing: no model is even loaded.
    def no_load(*a, **k):
        raise AssertionError("a finished evaluation must not load a model")
    monkeypatch.setattr(eval_mode, "load_policy", no_load)
    before = open(os.path.join(out, "eval", "results.json")).read()
    eval_mode.run(e, out)
    assert json.loads(open(os.path.join(out, "eval", "results.json")).read())["models"] == json.loads(before)["models"]


def test_hf_dirs_load_in_the_configured_dtypes(tmp_path, monkeypatch, tiny_task_data_dir):
    """mode=eval loads an HF dir in the config's model.dtype / model.param_dtype (bf16 on a GPU runtime),
    float32 when called without them; a run dir keeps the dtypes it trained with."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    param_dtypes = lambda m: {x.dtype for x in jax.tree.leaves(nnx.state(m, nnx.Param))}
    model, _ = eval_mode.load_policy(TINY_BASE)
    assert param_dtypes(model) == {jnp.dtype("float32")} and model.dtype == jnp.float32
    model, _ = eval_mode.load_policy(TINY_BASE, jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert param_dtypes(model) == {jnp.dtype("bfloat16")} and model.dtype == jnp.bfloat16

    seen = []
    real = eval_mode.load_policy

    def spy(path, dtype=None, mesh=None, param_dtype=None):
        seen.append((dtype, param_dtype))
        return real(path, dtype, mesh=mesh, param_dtype=param_dtype)

    monkeypatch.setattr(eval_mode, "load_policy", spy)
    e = _small(tiny_config(), tiny_task_data_dir)
    e.mode = "eval"
    e.model.dtype = e.model.param_dtype = "bfloat16"
    e.eval.models = ml_collections.ConfigDict({"base": TINY_BASE})
    e.eval.num_problems, e.eval.n, e.eval.max_new_tokens, e.eval.batch_size = 2, 2, 8, 4
    eval_mode.run(e, str(tmp_path / "eval"))
    assert seen == [(jnp.bfloat16, jnp.bfloat16)]
