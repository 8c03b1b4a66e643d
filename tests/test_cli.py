"""Bad input through the CLI: one `error:` line naming the field, file or row, exit 2, no traceback, and
nothing started (probe list of the newcomer issue)."""

import os
import shutil
import subprocess
import sys

import pytest

from sage_jax.defaults import TINY_BASE
from xla_env import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(workdir, *flags, config="configs/tiny.py"):
    env = subprocess_env()
    p = subprocess.run([sys.executable, "-m", "sage_jax.main", f"--config={config}", f"--workdir={workdir}",
                        "--config.logging.progress=False", "--config.logging.tensorboard=False", *flags],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert len(err) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    return err[0]


@pytest.fixture(scope="module")
def prepared(tiny_task_data_dir):
    """The embedded task's TFDS copy (configs/tiny.py's), prepared once for the suite (conftest)."""
    return tiny_task_data_dir


@pytest.mark.parametrize("flags,words", [
    (["--config.rl.betaa=0.1"], ["config.rl", "'betaa'", "config.rl.beta?"]),
    (["--config.eval.models.base=/tmp"], ["eval.models.base", "--config.eval.model_list"]),
    (["--config.rl.beta=abc"], ["--config.rl.beta=abc"]),
    (["--config.eval.n=0"], ["eval.n=0"]),
    (["--config.eval.temperature=-0.5"], ["eval.temperature"]),
    (["--config.data.name=gsm8k"], ["data.name", "gsm8k"]),
    (["--config.data.builder_config=huge"], ["no builder config 'huge'"]),
    (["--config.data.train_split=validation"], ["no split 'validation'"]),
])
def test_bad_flags_and_values(tmp_path, prepared, flags, words):
    # the split check reads the prepared task (in an empty data_dir it would prepare it first: ~13 s)
    data_dir = prepared if "--config.data.train_split=validation" in flags else tmp_path / "tfds"
    line = _cli(str(tmp_path / "w"), f"--config.data.data_dir={data_dir}", *flags)
    assert all(w in line for w in words), line
    assert not os.path.exists(tmp_path / "w" / "checkpoints")


def test_one_long_prompt_late_in_the_data_is_found_before_the_model_loads(tmp_path):
    """One row of 200, far past the first batch, is over the limit: named (row and id) before any step."""
    import json
    rows = [{"problem": ("9" * 300 if i == 150 else f"{i}+1"), "answer": str(i + 1), "unique_id": f"p{i}"}
            for i in range(200)]
    (tmp_path / "m" / "math500").mkdir(parents=True)
    (tmp_path / "m" / "math500" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = _cli(str(tmp_path / "w"), f"--config.data.data_dir={tmp_path / 'tfds'}", "--config.data.name=math500",
                "--config.data.train_split=test", f"--config.data.manual_dir={tmp_path / 'm'}",
                "--config.eval.benchmarks=math500:test", "--config.data.max_prompt_tokens=64")
    assert "1 prompt(s) of math500:test are longer, the first at row 150 (id p150" in line, line
    assert not os.path.exists(tmp_path / "w" / "checkpoints")


def test_missing_config_file(tmp_path):
    assert "no such config file" in _cli(str(tmp_path / "w"), config="configs/nope.py")


def test_workdir_that_is_a_file_or_not_writable(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert "is a file" in _cli(str(f))
    assert "cannot write there" in _cli("/proc/sage_jax_workdir")  # not writable, even for root


def test_model_dir_without_tokenizer(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(TINY_BASE, model)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        os.remove(model / f)
    line = _cli(str(tmp_path / "w"), f"--config.model.path={model}")
    assert str(model) in line and "tokenizer" in line


def test_tokenizer_larger_than_the_vocabulary(tmp_path):
    import json
    model = tmp_path / "model"
    shutil.copytree(TINY_BASE, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["vocab_size"] -= 8  # the tokenizer's last ids have no embedding row
    (model / "config.json").write_text(json.dumps(cfg))
    line = _cli(str(tmp_path / "w"), f"--config.model.path={model}")
    assert str(model) in line and "tokenizer has" in line and f"vocab_size is {cfg['vocab_size']}" in line, line


def test_a_prompt_too_long_is_found_before_the_first_step(tmp_path, prepared):
    line = _cli(str(tmp_path / "w"), f"--config.data.data_dir={prepared}", "--config.data.max_prompt_tokens=36")
    assert "data.max_prompt_tokens=36" in line and "row" in line and "procedural_arithmetic:train" in line
    assert not os.path.exists(tmp_path / "w" / "checkpoints")


def test_an_unknown_config_variant_lists_the_valid_ones(tmp_path):
    line = _cli(str(tmp_path / "w"), config="configs/sage_official.py:bogus")
    assert "unknown variant 'bogus'" in line and all(v in line for v in ("branch", "grpo", "nokl")), line


@pytest.mark.parametrize("config,flags,words", [
    # tiny.py: 48 prompt tokens on a model with 1024 positions
    ("configs/tiny.py", ["--config.rollout.max_new_tokens=1100"],
     ["data.max_prompt_tokens=48 + rollout.max_new_tokens=1100 = 1148 positions", "beyond the model's 1024"]),
    # the official preset's 2048 + 6144 on the tiny model
    ("configs/sage_official.py", [f"--config.model.path={TINY_BASE}"],
     ["rollout.max_new_tokens=6144", "beyond the model's 1024"]),
])
def test_a_context_beyond_the_model_positions_is_refused_before_compiling(tmp_path, config, flags, words):
    line = _cli(str(tmp_path / "w"), f"--config.data.data_dir={tmp_path / 'tfds'}", *flags, config=config)
    assert all(w in line for w in words), line
    assert "model.path=" in line and not os.path.exists(tmp_path / "w" / "checkpoints")


def test_an_evaluation_beyond_the_model_positions_is_refused_before_the_first_step(tmp_path, prepared):
    line = _cli(str(tmp_path / "w"), f"--config.data.data_dir={prepared}", "--config.eval.max_new_tokens=1100")
    assert "eval.max_new_tokens=1100" in line and "beyond the model's 1024" in line, line
    assert not os.path.exists(tmp_path / "w" / "checkpoints")


def test_a_training_set_smaller_than_one_batch_names_the_field(tmp_path, prepared):
    line = _cli(str(tmp_path / "w"), f"--config.data.data_dir={prepared}", "--config.data.max_train_problems=5")
    assert "5 training record(s)" in line and "data.batch_size=8" in line, line


def test_a_non_finite_learning_rate_is_refused_by_name(tmp_path):
    line = _cli(str(tmp_path / "w"), f"--config.data.data_dir={tmp_path / 'tfds'}", "--config.optim.learning_rate=nan")
    assert "optim.learning_rate=nan" in line, line
