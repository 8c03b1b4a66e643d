"""Every config file loads and validates; invalid configs fail before compilation, naming the field."""

import glob
import importlib.util
import os

import pytest

from sage_jax import config_lib
from sage_jax.config_lib import ConfigValidationError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"tiny.py": [None, "grpo", "branch", "token", "random"], "qwen_math.py": [None, "grpo", "dapo", "bnpo"],
            "r1_distill_qwen.py": [None, "grpo"], "tiny_sft.py": [None]}


def _load(name, arg=None):
    spec = importlib.util.spec_from_file_location(name[:-3], os.path.join(ROOT, "configs", name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


def test_every_config_file_is_covered():
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))) == sorted(VARIANTS)


@pytest.mark.parametrize("name,arg", [(n, a) for n, args in VARIANTS.items() for a in args])
def test_config_validates(name, arg, tmp_path):
    c = _load(name, arg)
    if name == "tiny_sft.py":
        c.model.path = str(tmp_path)  # made by `python -m sage_jax.models.tiny` before it runs
    config_lib.validate(c, num_devices=8)
    assert c.__doc__ if hasattr(c, "__doc__") else True
    for key in ("seed", "max_steps", "checkpoint_every", "log_every"):
        assert key in c
    if c.mode == "rl":
        rl = config_lib.rl_config(c)
        assert rl.guide == c.sage.guide and rl.loss.beta == c.rl.beta


def test_config_docstrings_give_the_command():
    for name in VARIANTS:
        src = open(os.path.join(ROOT, "configs", name)).read()
        assert "python -m sage_jax.main --config=configs/" in src, name
        assert "Expected" in src, name


def test_paper_setup_values():
    c = _load("qwen_math.py")
    assert (c.rollout.group_size, c.rl.beta, c.rl.eps_low, c.optim.learning_rate) == (8, 0.05, 0.2, 5e-6)
    assert c.sage.guide == "branch" and c.model.dtype == "bfloat16"
    assert dict(c.sage.branch) == dict(ratio=0.3, threshold=1.2, q_min=0.6, q_max=1.4, source="new")


@pytest.mark.parametrize("edit,field", [
    (lambda c: setattr(c.sage, "guide", "nope"), "sage.guide"),
    (lambda c: (setattr(c.rl, "beta", 0.0), setattr(c.sage, "guide", "branch")), "rl.beta=0"),
    (lambda c: setattr(c.rollout, "group_size", 1), "rollout.group_size"),
    (lambda c: setattr(c.rollout, "decode_segments", 0), "decode_segments"),
    (lambda c: (setattr(c.data, "batch_size", 3), setattr(c.rollout, "group_size", 3)), "batch shards"),
    (lambda c: setattr(c.model, "path", "/no/such/dir"), "model.path"),
    (lambda c: setattr(c.model, "path", ""), "model.path"),
    (lambda c: setattr(c, "mode", "train"), "mode"),
    (lambda c: setattr(c.rl, "loss_type", "ppo"), "loss_type"),
    (lambda c: setattr(c.sage.branch, "q_min", 2.0), "q_min"),
    (lambda c: setattr(c.model, "dtype", "float16"), "model.dtype"),
    (lambda c: setattr(c.mesh, "shape", (-1, -1, 1)), "mesh.shape"),
])
def test_invalid_configs_name_the_field(edit, field):
    c = _load("tiny.py")
    edit(c)
    with pytest.raises(ConfigValidationError) as e:
        config_lib.validate(c, num_devices=8)
    assert field in str(e.value) and "\n" not in str(e.value)
