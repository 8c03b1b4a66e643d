"""Training loop end to end (subprocesses): exact resume after SIGKILL, SIGTERM, corrupted checkpoints."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from sage_jax.metric_writer import read_metrics
from sage_jax.models.tiny import write_random_init

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "train_worker.py")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_random_init(str(tmp_path_factory.mktemp("init") / "tiny"), seed=0)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def _cmd(workdir, base, data_dir, steps=6, reward="slow_exact_match", extra=()):
    return [sys.executable, WORKER, f"--config={ROOT}/configs/tiny.py", f"--workdir={workdir}",
            f"--config.model.path={base}", f"--config.data.data_dir={data_dir}", f"--config.max_steps={steps}",
            "--config.checkpoint_every=3", "--config.log_every=1", f"--config.rl.reward={reward}",
            "--config.eval.at_start=False", "--config.eval.at_end=False", "--config.ckpt.async_save=False",
            "--config.logging.progress=False", "--config.logging.tensorboard=False",
            "--config.data.batch_size=4", "--config.rollout.group_size=4", "--config.rollout.max_new_tokens=16",
            *extra]


def _env(slow):
    env = dict(os.environ, SLOW_REWARD_S=str(slow), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    return env


def _run(cmd, slow=0.0, timeout=600):
    p = subprocess.run(cmd, env=_env(slow), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), p


def _wait_for(pred, proc, timeout=300):
    t = time.time()
    while not pred():
        assert proc.poll() is None, f"process ended early: {proc.stderr.read()[-3000:] if proc.stderr else ''}"
        assert time.time() - t < timeout, "timed out"
        time.sleep(0.05)


def _steps_logged(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    try:
        return max([r["step"] for r in read_metrics(workdir)] or [0])
    except json.JSONDecodeError:  # a line being written
        return 0


def _strip_perf(rows):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_exact_resume_after_sigkill(base, data_dir, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    summary_a, _ = _run(_cmd(a, base, data_dir))
    assert summary_a["start_step"] == 0 and summary_a["end_step"] == 6

    # Kill the second run with SIGKILL once step 4 is logged: checkpoint 3 is complete (sync saves), 6 not.
    proc = subprocess.Popen(_cmd(b, base, data_dir), env=_env(0.5), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    _wait_for(lambda: _steps_logged(b) >= 4, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert sorted(os.listdir(os.path.join(b, "checkpoints"))) == ["3"]

    summary_b, _ = _run(_cmd(b, base, data_dir))
    assert summary_b["start_step"] == 3 and summary_b["end_step"] == 6
    # Identical parameters, bit for bit, and identical per-step metrics.
    with open(os.path.join(a, "export_hf", "model.safetensors"), "rb") as fa, \
            open(os.path.join(b, "export_hf", "model.safetensors"), "rb") as fb:
        assert fa.read() == fb.read()
    assert _strip_perf(read_metrics(a)) == _strip_perf(read_metrics(b))
    assert [r["step"] for r in read_metrics(b)] == [1, 2, 3, 4, 5, 6]


def test_sigterm_saves_and_resumes(base, data_dir, tmp_path):
    w = str(tmp_path / "term")
    proc = subprocess.Popen(_cmd(w, base, data_dir, steps=8), env=_env(0.5), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: _steps_logged(w) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["preempted"] and summary["end_step"] < 8
    stopped = summary["end_step"]
    assert str(stopped) in os.listdir(os.path.join(w, "checkpoints"))
    assert not os.path.exists(os.path.join(w, "export_hf"))  # a preempted run is not final
    again, _ = _run(_cmd(w, base, data_dir, steps=8))
    assert again["start_step"] == stopped and again["end_step"] == 8


def test_corrupted_latest_checkpoint_is_skipped(base, data_dir, tmp_path):
    w = str(tmp_path / "corrupt")
    _run(_cmd(w, base, data_dir, steps=6, reward="exact_match"))
    latest = os.path.join(w, "checkpoints", "6")
    # Damage every data file of the latest step's state (as a crash mid-write on a non-atomic store would).
    for root, _, files in os.walk(os.path.join(latest, "state")):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "r+b") as fh:
                fh.truncate(max(0, os.path.getsize(p) // 3))
    summary, proc = _run(_cmd(w, base, data_dir, steps=7, reward="exact_match"))
    assert summary["start_step"] == 3, proc.stderr[-2000:]
    assert "could not be restored" in proc.stderr


def test_cli_config_error_is_one_line(base, data_dir, tmp_path):
    p = subprocess.run(_cmd(str(tmp_path / "bad"), base, data_dir, extra=["--config.sage.guide=nope"]),
                       env=_env(0), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    err = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "sage.guide" in err[0] and "nope" in err[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not os.path.exists(os.path.join(str(tmp_path / "bad"), "checkpoints"))  # stopped before anything ran
