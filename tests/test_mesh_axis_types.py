"""`hf.load`, the sampler and the RL step accept a mesh from `jax.make_mesh` with its default (Explicit) axis types, which
used to crash the first forward with a ShardingTypeError; a mesh with other axis names is refused in one line.
Runs in a subprocess with 4 fake CPU devices (the device count is fixed when JAX starts)."""

import os
import subprocess
import sys

CODE = r"""
import jax, numpy as np
from sage_jax.defaults import TINY_BASE
from sage_jax.models import hf
from sage_jax.models.config import ConfigError
from sage_jax.sampling import SamplingConfig, TextSampler
mesh = jax.make_mesh((1, 2, 2), ("data", "fsdp", "tensor"))
assert any(str(t).endswith("Explicit") for t in mesh.axis_types), mesh.axis_types  # the default we must accept
toks = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]], np.int32)
ref = np.asarray(hf.load(TINY_BASE)[0](toks))
model, _ = hf.load(TINY_BASE, mesh=mesh)
got = np.asarray(model(toks))
assert np.abs(got - ref).max() < 1e-4, np.abs(got - ref).max()
tok = hf.load_tokenizer(TINY_BASE)
s = TextSampler(model, tok, SamplingConfig(max_new_tokens=8, temperature=0.0, eos_ids=(2,), pad_id=0), batch_size=4, mesh=mesh)
assert len(s.generate(["Compute 1+2."], n=4, seed=0)[0]) == 4
# training on it: the sharded train state and one fused RL step (sampling, reference, update)
import jax.numpy as jnp
from sage_jax.rl import losses
from sage_jax.policy import optim
from sage_jax.policy import state as train_state
from sage_jax.rl import step as R
from sage_jax.rewards.host import HostReward, encode_answers
from sage_jax.sampling import left_pad
cfg = R.RLConfig(group_size=2, sampling=SamplingConfig(max_new_tokens=6, eos_ids=(2,), pad_id=0),
                 loss=losses.LossConfig(beta=0.04))
tx, lr_fn = optim.make_optimizer(optim.OptimConfig(learning_rate=1e-3))
graphdef, state = train_state.init_train_state_sharded(model, cfg, tx, 0, mesh)
step = R.make_rl_step(graphdef, cfg, tx, lr_fn, HostReward(tok, lambda c, a: np.ones(len(c), np.float32)), mesh)
p, m = left_pad([tok(x, add_special_tokens=False)["input_ids"] for x in ["1+2=", "3*4="]], 0)
state, metrics = step(state, dict(prompt=jnp.asarray(p), prompt_mask=jnp.asarray(m),
                                  answer=jnp.asarray(encode_answers(tok, ["3", "12"], 4))))
assert int(state.step) == 1 and np.isfinite(float(metrics["train/loss"])), metrics
# DAPO's dynamic sampling on the mesh: 4 prompts sampled, the 2 kept groups gathered across the row shards
import dataclasses
cfg2 = dataclasses.replace(cfg, dynamic_sampling=2, overlong_buffer=2)
model2, _ = hf.load(TINY_BASE, mesh=mesh)
graphdef2, state2 = train_state.init_train_state_sharded(model2, cfg2, tx, 0, mesh)
vary = HostReward(tok, lambda c, a: np.array([len(x) % 2 for x in c], np.float32))
step2 = R.make_rl_step(graphdef2, cfg2, tx, lr_fn, vary, mesh)
p4, m4 = left_pad([tok(x, add_special_tokens=False)["input_ids"] for x in ["1+2=", "3*4=", "5-1=", "2+2="]], 0)
state2, m2 = step2(state2, dict(prompt=jnp.asarray(p4), prompt_mask=jnp.asarray(m4),
                                answer=jnp.asarray(encode_answers(tok, ["3", "12", "4", "4"], 4))))
assert int(m2["dynamic/generated_groups"]) == 4 and int(m2["dynamic/kept_groups"]) + int(m2["dynamic/short_groups"]) == 2, m2
assert np.isfinite(float(m2["train/loss"])), m2
try:
    hf.load(TINY_BASE, mesh=jax.make_mesh((2, 2), ("x", "y")))
    raise SystemExit("a mesh with other axis names was accepted")
except ConfigError as e:
    assert "data" in str(e) and "\n" not in str(e), str(e)
print("OK")
"""


def test_make_mesh_default_axis_types_work():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-3000:]
