"""Every config file loads and validates; invalid configs fail before compilation, naming the field."""

import glob
import importlib.util
import os

import pytest

from sage_jax import config_lib
from sage_jax.config_lib import ConfigValidationError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"tiny.py": [None, "grpo", "branch", "token", "random"], "qwen_math.py": [None, "grpo", "dapo", "bnpo"],
            "r1_distill_qwen.py": [None, "grpo"], "tiny_sft.py": [None],
            "sage_official.py": [None, "grpo", "nokl", "token", "random"], "dapo.py": [None, "qwen_math"]}


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
    spec = config_lib.resolve(c, num_devices=8)
    assert (spec.mode, spec.seed, spec.max_steps) == (c.mode, c.seed, c.max_steps)
    if c.mode == "rl":  # the stop strings compile against the model's tokenizer, later (RLConfig.with_tokenizer)
        assert spec.rl.guide.name == c.sage.guide and spec.rl.loss.beta == c.rl.beta


def _docstring_commands(name):
    """The `python -m sage_jax.main ...` commands of a config file's module docstring, continuations joined."""
    import ast
    doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, "configs", name)).read()))
    text = doc.replace("\\\n", " ")
    return [ln.split("#")[0].split() for ln in text.splitlines() if "python -m sage_jax.main" in ln]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_config_docstring_command_runs_this_config(name):
    """Each config file's docstring holds the command that runs it: the command names this very file,
    and every `--config.a.b=v` it passes is a field of that config (what `main` would refuse otherwise)."""
    from sage_jax import main
    cmds = _docstring_commands(name)
    assert cmds, f"configs/{name}: the docstring gives no `python -m sage_jax.main` command"
    for argv in cmds:
        spec = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
        assert spec.partition(":")[0] == f"configs/{name}", (name, spec)
        assert any(a.startswith("--workdir=") for a in argv), argv
        cwd = os.getcwd()
        try:
            os.chdir(ROOT)
            assert main._override_error(argv) is None, (name, argv)
        finally:
            os.chdir(cwd)


def test_paper_setup_values():
    c = _load("qwen_math.py")
    assert (c.rollout.group_size, c.rl.beta, c.rl.eps_low, c.optim.learning_rate) == (8, 0.05, 0.2, 5e-6)
    assert c.sage.guide == "branch" and c.model.dtype == "bfloat16"
    assert dict(c.sage.branch) == dict(ratio=0.3, threshold=1.2, q_min=0.6, q_max=1.4, source="new")


def test_dapo_preset_is_the_published_recipe():
    """configs/dapo.py against DAPO's section 4.1 (arXiv 2503.14476) and verl's recipe/dapo script."""
    c = _load("dapo.py")
    assert (c.rl.eps_low, c.rl.eps_high, c.rl.beta, c.sage.guide) == (0.2, 0.28, 0.0, "none")
    assert (c.rollout.group_size, c.data.batch_size, c.rollout.max_new_tokens, c.data.max_prompt_tokens) == (
        16, 512, 20480, 2048)
    assert c.data.batch_size * c.rollout.group_size // c.rl.num_minibatches == 512  # completions per update
    assert (c.rl.overlong_buffer, c.rl.dynamic_sampling, c.rl.loss_type) == (4096, 3, "bnpo")
    assert c.rl.overlong_penalty == 0.5  # DAPO's factor 1 on +-1 rewards, on this verifier's 1 / 0
    assert (c.optim.learning_rate, c.optim.weight_decay, c.optim.grad_clip_norm) == (1e-6, 0.1, 1.0)
    assert c.optim.warmup_steps == 20 * c.rl.num_minibatches  # 20 rollout steps
    q = _load("dapo.py", "qwen_math")
    assert q.rl.overlong_buffer == round(q.rollout.max_new_tokens / 5) and q.rl.dynamic_sampling == 3


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
    (lambda c: setattr(c.rl, "kl_mode", "forward"), "kl_mode='forward'"),  # with the branch guide of tiny.py
    (lambda c: setattr(c.eval, "n", 0), "eval.n"),
    (lambda c: setattr(c.eval, "temperature", -1.0), "eval.temperature"),
    (lambda c: setattr(c.eval, "batch_size", 0), "eval.batch_size"),
    (lambda c: setattr(c.eval, "batch_size", 12), "eval.batch_size"),  # 12 rows over 8 devices
    (lambda c: setattr(c.data, "name", "gsm8k"), "data.name"),
    (lambda c: setattr(c.eval, "benchmarks", "math500,aime2099"), "eval.benchmarks"),
    (lambda c: setattr(c.eval, "model_list", "base"), "eval.model_list"),
    (lambda c: setattr(c.eval, "template", "nope"), "eval.template"),
    (lambda c: setattr(c.data, "template", "chatt"), "data.template"),
    (lambda c: setattr(c.data, "sft_loss_on", "prompt"), "data.sft_loss_on"),
    (lambda c: setattr(c.data, "num_epochs", 2), "data.num_epochs"),  # tiny.py is an RL run
    (lambda c: setattr(c.model.lora, "init_from", "/some/adapter"), "model.lora.init_from"),  # LoRA is off
    (lambda c: setattr(c.rl, "mis_bounds", (1.5, 2.0)), "mis_bounds"),
    (lambda c: setattr(c.rl, "mismatch_level", "batch"), "mismatch_level"),
    (lambda c: setattr(c.rl, "entropy_top_frac", 0.0), "entropy_top_frac"),
    (lambda c: setattr(c.rl, "pass_at_k", 9), "pass_at_k"),  # tiny.py: groups of 8
    (lambda c: setattr(c.sage, "form", "objective"), "sage.form"),
    (lambda c: setattr(c.rl, "score_chunks", 3), "rl.score_chunks"),  # 8 prompts
    (lambda c: setattr(c.rl, "dynamic_sampling", 0), "rl.dynamic_sampling"),
    (lambda c: setattr(c.model, "attention_chunk", -1), "model.attention_chunk"),
    (lambda c: setattr(c.rl, "overlong_buffer", 97), "rl.overlong_buffer"),  # tiny.py: 96 completion tokens
    # non-finite numbers: a range check `x < lo` is false for NaN, so each must be refused by name
    (lambda c: setattr(c.optim, "learning_rate", float("nan")), "optim.learning_rate=nan"),
    (lambda c: setattr(c.optim, "learning_rate", float("inf")), "optim.learning_rate=inf"),
    (lambda c: setattr(c.rl, "beta", float("nan")), "rl.beta=nan"),
    (lambda c: setattr(c.rollout, "temperature", float("nan")), "rollout.temperature=nan"),
    (lambda c: setattr(c.optim, "grad_clip_norm", float("nan")), "optim.grad_clip_norm=nan"),
    (lambda c: setattr(c.rl, "eps_high", float("nan")), "rl.eps_high=nan"),
    (lambda c: setattr(c.rl, "mis_bounds", (0.5, float("inf"))), "rl.mis_bounds"),
    (lambda c: setattr(c.rl, "beta", -1.0), "rl.beta must be >= 0"),  # the CLI field, not LossConfig.beta
    (lambda c: setattr(c.rl, "sampler_correction", "trl_2"), "rl.sampler_correction"),
    (lambda c: (setattr(c.rl, "sampler_correction", "trl_1.16"), setattr(c.rl, "tis_cap", 2.0)), "rl.tis_cap"),
    (lambda c: (setattr(c.rl, "pass_at_k", 2), setattr(c.rl, "overlong_buffer", 8)), "rl.overlong_buffer=8"),
    (lambda c: setattr(c.rl, "update_shuffle", "all"), "rl.update_shuffle"),
    (lambda c: setattr(c.eval, "stop_strings", ("",)), "eval.stop_strings"),
])
def test_invalid_configs_name_the_field(edit, field):
    c = _load("tiny.py")
    edit(c)
    with pytest.raises(ConfigValidationError) as e:
        config_lib.validate(c, num_devices=8)
    assert field in str(e.value) and "\n" not in str(e.value)
