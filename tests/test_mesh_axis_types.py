"""`hf.load`, the sampler and the RL step accept a mesh from `jax.make_mesh` with its default (Explicit) axis types, which
used to crash the first forward with a ShardingTypeError; a mesh with other axis names is refused in one line.
Runs in a subprocess with 4 fake CPU devices (the device count is fixed when JAX starts)."""

import subprocess
import sys

from xla_env import subprocess_env

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
# training on it: the sharded train state and one fused RL step (sampling, reference, update), with DAPO's
# dynamic sampling (4 prompts sampled, all informative, 2 kept and gathered across the row shards) and its
# overlong penalty, so the one compilation covers the plain step's phases and the row gather too
import jax.numpy as jnp
from sage_jax.rl import losses
from sage_jax.policy import optim
from sage_jax.policy import state as train_state
from sage_jax.rl import step as R
from sage_jax.rewards.host import HostReward, encode_answers
from sage_jax.sampling import left_pad
cfg = R.RLConfig(group_size=2, sampling=SamplingConfig(max_new_tokens=6, eos_ids=(2,), pad_id=0),
                 loss=losses.LossConfig(beta=0.04), dynamic_sampling=2, overlong_buffer=2)
tx, lr_fn = optim.make_optimizer(optim.OptimConfig(learning_rate=1e-3))
graphdef, state = train_state.init_train_state_sharded(model, cfg, tx, 0, mesh)
vary = HostReward(tok, lambda c, a: np.arange(len(c), dtype=np.float32) % 2)  # every group informative
step = R.make_rl_step(graphdef, cfg, tx, lr_fn, vary, mesh)
p4, m4 = left_pad([tok(x, add_special_tokens=False)["input_ids"] for x in ["1+2=", "3*4=", "5-1=", "2+2="]], 0)
state, m2 = step(state, dict(prompt=jnp.asarray(p4), prompt_mask=jnp.asarray(m4),
                             answer=jnp.asarray(encode_answers(tok, ["3", "12", "4", "4"], 4))))
assert int(state.step) == 1 and np.isfinite(float(m2["train/loss"])), m2
assert int(m2["dynamic/generated_groups"]) == 4 and int(m2["dynamic/kept_groups"]) == 2, m2
try:
    hf.load(TINY_BASE, mesh=jax.make_mesh((2, 2), ("x", "y")))
    raise SystemExit("a mesh with other axis names was accepted")
except ConfigError as e:
    assert "data" in str(e) and "\n" not in str(e), str(e)
print("OK")
"""


def test_make_mesh_default_axis_types_work():
    env = subprocess_env(4)
    p = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "OK" in p.stdout, p.stderr[-3000:]
