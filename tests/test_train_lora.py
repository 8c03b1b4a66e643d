"""LoRA through `python -m sage_jax.main` end to end (subprocesses): adapters-only checkpoints, exact resume,
the base pointer refusing another LoRA shape, PEFT and merged exports that agree, eval of the run dir."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from run_copies import preempted_copy
from test_train import (ROOT, WORKER, _cmd, _env, _run,  # noqa: F401  (base, data_dir: the module-scoped fixtures)
                        _strip_perf, base, data_dir)

from sage_jax.train.metric_writer import read_metrics

LORA = ["--config.model.lora.rank=4", "--config.model.lora.alpha=8.0", "--config.model.lora.targets=q,v,up",
        "--config.optim.learning_rate=3e-3", "--config.ckpt.export_hf=True"]


def _state_leaf_paths(step_dir):
    """Every array path saved under `<step>/state`, from Orbax's tree metadata."""
    import orbax.checkpoint as ocp

    meta = ocp.StandardCheckpointer().metadata(os.path.join(step_dir, "state"))
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    paths = []

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, prefix + (str(k),))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, prefix + (str(i),))
        elif node is not None:
            paths.append(prefix[:-1] if prefix[-1] == "value" else prefix)  # nnx.Variable's own level

    walk(dict(tree), ())
    return paths


@pytest.fixture(scope="module")
def lora_runs(base, data_dir, tmp_path_factory):  # noqa: F811
    """Run `a` uninterrupted for 6 steps; `b` a copy of it as a SIGKILL after step 4 leaves it (the adapters-only
    checkpoint 3, metrics of steps 1-4, no export: what tests/test_train.py's kills leave), then restarted."""
    root = tmp_path_factory.mktemp("lora_runs")
    a, b = str(root / "a"), str(root / "b")
    cmd = lambda w: _cmd(w, base, data_dir, steps=6, extra=["--config.checkpoint_every=3", *LORA])
    summary_a, _ = _run(cmd(a))
    preempted_copy(a, b, drop=("checkpoints/6", "export_hf", "export_peft"), keep_lines=4)
    left = sorted(d for d in os.listdir(os.path.join(b, "checkpoints")) if d.isdigit())
    summary_b, _ = _run(cmd(b))
    return dict(a=a, b=b, base=base, summary_a=summary_a, summary_b=summary_b, left=left)


def test_checkpoint_holds_only_adapters_and_the_base_pointer(lora_runs):
    a = lora_runs["a"]
    step_dir = os.path.join(a, "checkpoints", "6")
    paths = _state_leaf_paths(step_dir)
    params = [p for p in paths if p[0] == "params"]
    assert params and all(p[-1] in ("a", "b") for p in params), params[:5]
    # q, v, up on each layer, an A and a B each; nothing of the base (embeddings, norms, kernels).
    with open(os.path.join(lora_runs["base"], "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    assert len(params) == layers * 3 * 2, params
    assert not any("embed" in "/".join(p) or "norm" in "/".join(p) for p in paths)
    # Adam's two moments mirror the adapters, nothing more.
    opt_arrays = [p for p in paths if p[0] == "opt_state" and p[-1] in ("a", "b")]
    assert len(opt_arrays) == 2 * len(params)
    with open(os.path.join(step_dir, "meta", "metadata")) as f:
        meta = json.load(f)
    assert meta["base_model"] == lora_runs["base"]
    assert meta["lora"]["rank"] == 4 and tuple(meta["lora"]["targets"]) == ("q", "v", "up")


def test_resume_from_a_mid_run_checkpoint_is_exact(lora_runs):
    a, b = lora_runs["a"], lora_runs["b"]
    assert lora_runs["left"] == ["3"]
    assert lora_runs["summary_b"]["start_step"] == 3 and lora_runs["summary_b"]["end_step"] == 6
    for name in ("export_hf/model.safetensors", "export_peft/adapter_model.safetensors"):
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name
    assert _strip_perf(read_metrics(a)) == _strip_perf(read_metrics(b))


def test_resume_with_another_rank_is_refused(lora_runs, data_dir):  # noqa: F811
    a = lora_runs["a"]
    with open(os.path.join(a, "run_config.json")) as f:
        run_config = f.read()
    extra = ["--config.checkpoint_every=3", *LORA, "--config.model.lora.rank=8"]
    p = subprocess.run(_cmd(a, lora_runs["base"], data_dir, steps=8, extra=extra), env=_env(0),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr[-2000:]
    err = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "model.lora.rank=4 there, 8 now" in err[0], p.stderr[-2000:]
    assert sorted(os.listdir(os.path.join(a, "checkpoints"))) == ["3", "6"]  # nothing was overwritten
    with open(os.path.join(a, "run_config.json")) as f:
        assert f.read() == run_config  # what eval of this run dir reads still describes its checkpoints


def _tokens(vocab):
    return np.random.default_rng(0).integers(1, vocab, size=(2, 13))


def test_peft_export_on_the_base_equals_the_merged_export(lora_runs):
    peft = pytest.importorskip("peft")
    import torch
    import transformers
    from hf_fixtures import hf_logits

    a, base_dir = lora_runs["a"], lora_runs["base"]
    merged = os.path.join(a, "export_hf")
    tokens = _tokens(transformers.AutoConfig.from_pretrained(base_dir).vocab_size)
    theirs_merged = hf_logits(merged, tokens)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                              attn_implementation="eager")
    pm = peft.PeftModel.from_pretrained(model, os.path.join(a, "export_peft"))
    pm.eval()
    with torch.no_grad():
        theirs_peft = pm(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
    np.testing.assert_allclose(theirs_peft, theirs_merged, atol=1e-4, rtol=0)
    # Training moved the adapters: the adapted model is not the base.
    assert np.abs(hf_logits(base_dir, tokens) - theirs_merged).max() > 1e-3


def test_eval_mode_loads_the_lora_run_dir(lora_runs):
    import jax.numpy as jnp
    from flax import nnx

    from sage_jax.models import hf, lora
    from sage_jax.train import eval_mode

    a = lora_runs["a"]
    policy, tok_path = eval_mode.load_policy(a)
    assert tok_path == lora_runs["base"] and lora.has_lora(policy)
    exported, mcfg = hf.load(os.path.join(a, "export_hf"))
    tokens = jnp.asarray(_tokens(mcfg.vocab_size))
    fwd = nnx.jit(lambda m, t: m(t))
    np.testing.assert_allclose(np.asarray(fwd(policy, tokens)), np.asarray(fwd(exported, tokens)), atol=1e-4, rtol=0)


def test_sft_with_lora_trains_and_saves_only_adapters(base, data_dir, tmp_path):  # noqa: F811
    w = str(tmp_path / "sft")
    cmd = [sys.executable, WORKER, f"--config={ROOT}/configs/tiny_sft.py", f"--workdir={w}",
           f"--config.model.path={base}", f"--config.data.data_dir={data_dir}", "--config.max_steps=3",
           "--config.checkpoint_every=3", "--config.log_every=1", "--config.data.batch_size=8",
           "--config.optim.warmup_steps=1", "--config.eval.at_end=False", "--config.ckpt.async_save=False",
           "--config.logging.progress=False", "--config.logging.tensorboard=False", *LORA]
    summary, _ = _run(cmd)
    assert summary["end_step"] == 3 and os.path.isdir(summary["export_peft"])
    params = [p for p in _state_leaf_paths(os.path.join(w, "checkpoints", "3")) if p[0] == "params"]
    assert params and all(p[-1] in ("a", "b") and p[-2].startswith("lora_") for p in params), params[:4]
    losses = [r["train/loss"] for r in read_metrics(w) if "train/loss" in r]
    assert len(losses) == 3 and all(np.isfinite(losses))
    # The merged export moved exactly the targeted projections; every other base tensor is bit-identical.
    from safetensors.numpy import load_file
    before = load_file(os.path.join(base, "model.safetensors"))
    after = load_file(os.path.join(w, "export_hf", "model.safetensors"))
    assert before.keys() == after.keys()
    for k in before:
        targeted = any(f"{t}_proj.weight" in k for t in ("q", "v", "up"))
        assert np.array_equal(before[k], after[k]) != targeted, k
