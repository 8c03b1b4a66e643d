"""Worker for tests/test_sharding.py: runs under 8 fake CPU devices (XLA_FLAGS set by the caller).

`python tests/sharding_worker.py OUT_DIR` runs one RL step of the tiny setup unsharded (the exact
mesh=None path of `make_rl_step`) and on each mesh in MESHES from the same initial values, and writes
per run: metrics, updated params, Adam's first moment (= (1 - b1) * grad after one step), the sampled
tokens of the step's rollout, and every state leaf's sharding. The test does the comparisons.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import rl_fixtures as F  # noqa: E402
from flax import nnx  # noqa: E402

from sage_jax import sharding as shd  # noqa: E402
from sage_jax.models.decoder import Decoder  # noqa: E402
from sage_jax.models.tiny import tiny_config  # noqa: E402
from sage_jax.rewards.host import HostReward  # noqa: E402
from sage_jax.rl import losses  # noqa: E402
from sage_jax.policy import optim, state as train_state
from sage_jax.rl import step as R  # noqa: E402
from sage_jax.sampling import SamplingConfig, generate  # noqa: E402

MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]
LORA_MESHES = [(2, 2, 2), (1, 2, 4)]  # LoRA: adapters placed by their axes, the base where hf.load puts it
LR = 1e-3


def make_model():
    return Decoder(tiny_config(hidden_size=64, num_layers=1), rngs=nnx.Rngs(0))  # one layer: as rl_fixtures


def parts():
    cfg = R.RLConfig(group_size=4, sampling=SamplingConfig(max_new_tokens=16, eos_ids=(2,), pad_id=0,
                                                                   decode_segments=2),
                     loss=losses.LossConfig(beta=0.04))
    tx, lr_fn = optim.make_optimizer(optim.OptimConfig(learning_rate=LR))
    return cfg, tx, lr_fn


def flat(tree, prefix):
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            continue
        out[prefix + jax.tree_util.keystr(path)] = np.asarray(jax.device_get(x))
    return out


def spec_list(x):
    return [list(s) if isinstance(s, tuple) else s for s in x.sharding.spec] if hasattr(x.sharding, "spec") else None


def shardings(state):
    """path -> {shape, axes, spec} for every leaf of the train state."""
    out = {}
    leaves = jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
    for path, v in leaves:
        axes = v.get_metadata().get("axes") if isinstance(v, nnx.Variable) else None
        x = v.get_value() if isinstance(v, nnx.Variable) else v
        out[jax.tree_util.keystr(path)] = {"shape": list(x.shape), "axes": list(axes) if axes else None,
                                           "spec": spec_list(x)}
    return out


def rollout_tokens(graphdef, state, cfg, batch, mesh):
    """The step's rollout, reproduced: same key derivation as rl_step, sharded like the step."""
    def fn(params, rng, step, prompt, pmask):
        key = jax.random.split(jax.random.fold_in(rng, step))[0]
        G = cfg.group_size
        rep = lambda x: shd.constrain(jnp.repeat(x, G, axis=0), ("batch", None))
        with shd.activation_sharding(mesh):
            out = generate(nnx.merge(graphdef, params), rep(prompt), rep(pmask), key, cfg.sampling)
        return out.tokens_BxT, out.mask_BxT
    return jax.jit(fn)(train_state.policy_state(state), state.rng, state.step, batch["prompt"], batch["prompt_mask"])


def make_lora_model():
    from sage_jax.models import lora
    model = lora.add_lora(make_model(), lora.LoRAConfig(rank=4, alpha=8.0), seed=1)
    for _, _, _, ad in lora.iter_adapters(model):  # non-zero B: the adapters shape the rollout and the loss
        ad.b[...] = 0.05 * jax.random.normal(jax.random.key(7), ad.b.shape)
    return model


def run(mesh_shape, out_dir, report, use_lora=False):
    cfg, tx, lr_fn = parts()
    model = make_lora_model() if use_lora else make_model()
    graphdef, state = train_state.init_train_state(model, cfg, tx, 0)  # eager init, as the 1-device path
    name = ("lora_" if use_lora else "") + ("ref" if mesh_shape is None else "x".join(map(str, mesh_shape)))
    mesh = None if mesh_shape is None else shd.make_mesh(mesh_shape)
    if mesh is not None:
        state = jax.device_put(state, shd.state_shardings(state, mesh))  # into the rules' shardings
    b = F.batch()
    toks, tmask = rollout_tokens(graphdef, state, cfg, b, mesh)
    step = R.make_rl_step(graphdef, cfg, tx, lr_fn, HostReward(F.TOK, F.count_ones), mesh=mesh)
    before = shardings(state)
    state, m = step(state, b)
    arrays = {**flat(state.params, "params"), **flat(state.opt_state[1][0].mu, "mu"),
              "tokens": np.asarray(toks), "tokens_mask": np.asarray(tmask)}
    np.savez(os.path.join(out_dir, f"{name}.npz"), **arrays)
    rec = {"metrics": {k: float(v) for k, v in m.items()}}
    if mesh is not None:
        rec.update(before=before, after=shardings(state))
        state, _ = step(state, b)  # second step: must reuse the compilation and the donated layout
        rec["cache_size"] = step._cache_size()
        rec["after2"] = shardings(state)
    report[name] = rec


def born(report):
    """Born-sharded init on each mesh: the shardings, and the values against the eager init."""
    cfg, tx, _ = parts()
    _, eager = train_state.init_train_state(make_model(), cfg, tx, 0)
    ref = flat(eager.params, "")
    for ms in MESHES:
        mesh = shd.make_mesh(ms)
        _, st = train_state.init_train_state_sharded(make_model, cfg, tx, 0, mesh)
        got = flat(st.params, "")
        diff = max(float(np.max(np.abs(got[k] - ref[k]))) for k in ref)
        report["born_" + "x".join(map(str, ms))] = {"shardings": shardings(st), "max_abs_diff_vs_eager": diff}


def main(out_dir):
    assert jax.device_count() == 8, jax.devices()
    report = {}
    run(None, out_dir, report)
    for ms in MESHES:
        run(ms, out_dir, report)
    run(None, out_dir, report, use_lora=True)
    for ms in LORA_MESHES:
        run(ms, out_dir, report, use_lora=True)
    born(report)
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
