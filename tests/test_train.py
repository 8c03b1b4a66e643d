"""Training loop end to end (subprocesses): exact resume after SIGKILL, SIGTERM, corrupted checkpoints."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from sage_jax.models.tiny import write_random_init
from sage_jax.train.metric_writer import read_metrics
from run_copies import preempted_copy
from xla_env import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "train_worker.py")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    # one layer: the loop's machinery is under test, not what it learns (a third less time per run)
    return write_random_init(str(tmp_path_factory.mktemp("init") / "tiny"), seed=0, num_layers=1)


@pytest.fixture(scope="module")
def data_dir(tiny_task_data_dir):
    return tiny_task_data_dir  # prepared once for the suite (conftest)


def _cmd(workdir, base, data_dir, steps=6, reward="slow_exact_match", extra=()):
    return [sys.executable, WORKER, f"--config={ROOT}/configs/tiny.py", f"--workdir={workdir}",
            f"--config.model.path={base}", f"--config.data.data_dir={data_dir}", f"--config.max_steps={steps}",
            "--config.checkpoint_every=3", "--config.log_every=1", f"--config.rl.reward={reward}",
            "--config.eval.at_start=False", "--config.eval.at_end=False", "--config.ckpt.async_save=False",
            "--config.logging.progress=False", "--config.logging.tensorboard=False",
            "--config.data.batch_size=4", "--config.rollout.group_size=4", "--config.rollout.max_new_tokens=16",
            *extra]


def _env(slow):
    return subprocess_env(SLOW_REWARD_S=str(slow), PYTHONUNBUFFERED="1")


def _run(cmd, slow=0.0, timeout=600, **env):
    p = subprocess.run(cmd, env=dict(_env(slow), **env), capture_output=True, text=True, timeout=timeout)
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


# A small final evaluation, so that kills around it can be tested: 4 held-out problems x 2 samples.
EVAL = ("--config.eval.at_end=True", "--config.eval.num_problems=4", "--config.eval.n=2",
        "--config.eval.batch_size=8", "--config.eval.max_new_tokens=16")


@pytest.fixture(scope="module")
def reference(base, data_dir, tmp_path_factory):
    """An uninterrupted 6-step run with its final evaluation: what every killed-and-restarted run must equal."""
    a = str(tmp_path_factory.mktemp("ref") / "a")
    summary, _ = _run(_cmd(a, base, data_dir, extra=EVAL))
    assert summary["start_step"] == 0 and summary["end_step"] == 6
    return a


def _same_run(a, b):
    """Bit-identical parameters, and every metric of `a` in `b`'s metrics.jsonl with the same value."""
    with open(os.path.join(a, "export_hf", "model.safetensors"), "rb") as fa, \
            open(os.path.join(b, "export_hf", "model.safetensors"), "rb") as fb:
        assert fa.read() == fb.read()
    assert _strip_perf(read_metrics(a)) == _strip_perf(read_metrics(b))
    assert [r["step"] for r in read_metrics(b)] == [1, 2, 3, 4, 5, 6, 6]  # the last: the final eval
    assert "eval/pass@1" in read_metrics(b)[-1]


def _kill_when(workdir, cmd, pred):
    proc = subprocess.Popen(cmd, env=_env(0.5), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(pred, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def test_exact_resume_after_sigkill(reference, base, data_dir, tmp_path):
    b = str(tmp_path / "b")
    # Killed once step 4 is logged: checkpoint 3 is complete (sync saves), 6 not.
    _kill_when(b, _cmd(b, base, data_dir, extra=EVAL), lambda: _steps_logged(b) >= 4)
    assert sorted(os.listdir(os.path.join(b, "checkpoints"))) == ["3"]
    summary_b, _ = _run(_cmd(b, base, data_dir, extra=EVAL))
    assert summary_b["start_step"] == 3 and summary_b["end_step"] == 6
    _same_run(reference, b)


def test_sigkill_right_after_a_checkpoint_loses_no_metric(reference, base, data_dir, tmp_path):
    """Step N's metrics are on disk before checkpoint N exists: the restart, which resumes after N, never
    writes them, so they must already be there."""
    b = str(tmp_path / "b")
    _kill_when(b, _cmd(b, base, data_dir, extra=EVAL), lambda: os.path.isdir(os.path.join(b, "checkpoints", "3")))
    assert 3 in [r["step"] for r in read_metrics(b)]
    summary_b, _ = _run(_cmd(b, base, data_dir, extra=EVAL))
    assert summary_b["start_step"] == 3
    _same_run(reference, b)


def test_sigkill_before_the_final_evaluation_is_logged(reference, base, data_dir, tmp_path):
    """Killed after the last checkpoint, while the final evaluation runs: the restart finds the run finished,
    evaluates (what is missing) and writes the eval row the first attempt never wrote."""
    b = str(tmp_path / "b")
    _kill_when(b, _cmd(b, base, data_dir, extra=EVAL), lambda: os.path.isdir(os.path.join(b, "checkpoints", "6")))
    assert not any("eval/pass@1" in r for r in read_metrics(b))
    summary_b, _ = _run(_cmd(b, base, data_dir, extra=EVAL))
    assert summary_b["start_step"] == 6
    _same_run(reference, b)
    again, _ = _run(_cmd(b, base, data_dir, extra=EVAL))  # a finished run rerun: nothing new, nothing lost
    _same_run(reference, b)


def test_restart_survives_a_cut_last_metrics_line(reference, base, data_dir, tmp_path):
    """A kill during a write leaves half a JSON line at the end of metrics.jsonl; the restart drops it."""
    b = str(tmp_path / "b")
    # steps 1-4, then half of step 5's line
    preempted_copy(reference, b, drop=("checkpoints/6", "export_hf"), keep_lines=4, partial_next=True)
    summary_b, _ = _run(_cmd(b, base, data_dir, extra=EVAL))
    assert summary_b["start_step"] == 3
    _same_run(reference, b)


def test_deleted_checkpoints_start_over_without_a_second_history(reference, base, data_dir, tmp_path, monkeypatch):
    from sage_jax.models import auto_tokenizer
    b = str(tmp_path / "b")
    shutil.copytree(reference, b)
    shutil.rmtree(os.path.join(b, "checkpoints"))
    summary_b, p = _run(_cmd(b, base, data_dir, extra=EVAL), SAGE_JAX_CACHE=str(tmp_path / "cache"))
    assert summary_b["start_step"] == 0
    assert "dropping" in p.stderr
    _same_run(reference, b)
    # the export was checked for outside tools (AutoTokenizer): its verdict is in this run's own, fresh cache
    monkeypatch.setenv("SAGE_JAX_CACHE", str(tmp_path / "cache"))
    assert auto_tokenizer._auto_check_key(os.path.join(b, "export_hf")) in auto_tokenizer._auto_check_cache()


def test_another_model_in_the_same_workdir_is_refused(reference, base, data_dir, tmp_path):
    from sage_jax.defaults import TINY_BASE
    b = str(tmp_path / "b")
    shutil.copytree(reference, b)
    before = sorted(os.listdir(b)), open(os.path.join(b, "metrics.jsonl")).read()
    p = subprocess.run(_cmd(b, TINY_BASE, data_dir, extra=EVAL), env=_env(0), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    err = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "model.path" in err[0] and "another --workdir" in err[0], p.stderr[-2000:]
    assert (sorted(os.listdir(b)), open(os.path.join(b, "metrics.jsonl")).read()) == before  # untouched


def test_crash_mid_training_leaves_whole_checkpoints(base, data_dir, tmp_path):
    """A crash while an asynchronous save may be under way: the save finishes (or fails) before the process
    exits, with no "Event loop is closed" spam, and the rerun resumes from an intact checkpoint."""
    w = str(tmp_path / "crash")
    cmd = _cmd(w, base, data_dir, steps=6, extra=("--config.ckpt.async_save=True", "--config.checkpoint_every=1"))
    env = dict(_env(0), CRASH_AT_BATCH="4")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode != 0 and "injected crash at batch 4" in p.stderr
    assert "Event loop is closed" not in p.stderr, p.stderr[-3000:]
    assert sorted(os.listdir(os.path.join(w, "checkpoints"))) == ["1", "2", "3"]
    summary, proc = _run(cmd)
    assert summary["start_step"] == 3 and summary["end_step"] == 6
    assert "could not be restored" not in proc.stderr


def _popen(cmd, slow, err_path):
    """The run in the background, SIGINT at its default disposition (a background job of a non-interactive shell
    would ignore it), stderr to a file the test can read while the run goes on."""
    return subprocess.Popen(cmd, env=_env(slow), stdout=subprocess.PIPE, stderr=open(err_path, "w"), text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_a_signal_saves_after_the_step_under_way_and_resumes(base, data_dir, tmp_path, sig, code):
    """SIGTERM (a preemption) or SIGINT (Ctrl-C) while step 2 waits 3 s on its reward, the main thread inside the
    step: the signal is reported at once, the save comes when that step ends (step 2, not one later), the exit is
    0 / 130, and (SIGTERM) the rerun resumes there."""
    w, err = str(tmp_path / "sig"), str(tmp_path / "err.txt")
    proc = _popen(_cmd(w, base, data_dir, steps=8), 3.0, err)
    _wait_for(lambda: _steps_logged(w) >= 1, proc)
    time.sleep(1.0)  # inside step 2's reward wait
    proc.send_signal(sig)
    sent = time.time()
    _wait_for(lambda: "received" in open(err).read(), proc, timeout=60)
    assert time.time() - sent < 2.5, "the signal was seen only when the step ended"
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == code, open(err).read()[-3000:]
    assert sorted(os.listdir(os.path.join(w, "checkpoints"))) == ["2"]
    assert [r["step"] for r in read_metrics(w)] == [1, 2]
    assert not os.path.exists(os.path.join(w, "export_hf"))  # a preempted run is not final
    if sig == signal.SIGTERM:  # the rerun (the same code path for both signals) resumes at the saved step
        assert json.loads(out.strip().splitlines()[-1])["preempted"]
        again, _ = _run(_cmd(w, base, data_dir, steps=8))
        assert again["start_step"] == 2 and again["end_step"] == 8


def test_a_second_signal_exits_at_once_without_saving(base, data_dir, tmp_path):
    w, err = str(tmp_path / "twice"), str(tmp_path / "err.txt")
    proc = _popen(_cmd(w, base, data_dir, steps=8), 6.0, err)
    _wait_for(lambda: _steps_logged(w) >= 1, proc)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _wait_for(lambda: "received" in open(err).read(), proc, timeout=60)
    proc.send_signal(signal.SIGINT)
    sent = time.time()
    proc.wait(timeout=60)
    assert time.time() - sent < 3 and proc.returncode == 130, open(err).read()[-3000:]
    assert "exiting now, without saving" in open(err).read()
    assert not os.path.exists(os.path.join(w, "checkpoints", "2"))


def test_a_loss_that_turns_non_finite_stops_the_run(base, data_dir, tmp_path):
    """A learning rate of 1e38 blows the weights up after step 1; step 2's loss is NaN. The run stops there with
    one line naming the step (exit 3), logs train/nonfinite, keeps checkpoint 1 and exports nothing (it trained to
    exit 0 and exported NaN weights before)."""
    w = str(tmp_path / "nan")
    p = subprocess.run(_cmd(w, base, data_dir, steps=4, extra=["--config.optim.learning_rate=1e38",
                                                                "--config.checkpoint_every=1"]),
                       env=_env(0), capture_output=True, text=True, timeout=300)
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 3 and len(err) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    rows = read_metrics(w)
    bad = rows[-1]["step"]
    assert f"step {bad}: the loss or a gradient is not finite" in err[0] and "optim.skip_nonfinite" in err[0]
    assert rows[-1]["train/nonfinite"] == 1 and all(r["train/nonfinite"] == 0 for r in rows[:-1])
    assert sorted(int(x) for x in os.listdir(os.path.join(w, "checkpoints"))) == list(range(1, bad))
    assert not os.path.exists(os.path.join(w, "export_hf"))


def _copy_of(reference, tmp_path, name):
    """A finished 6-step run (checkpoints 3 and 6) to damage, without training it again."""
    w = str(tmp_path / name)
    shutil.copytree(reference, w)
    return w


def test_corrupted_latest_checkpoint_is_skipped(reference, base, data_dir, tmp_path):
    w = _copy_of(reference, tmp_path, "corrupt")
    latest = os.path.join(w, "checkpoints", "6")
    # Damage every data file of the latest step's state (as a crash mid-write on a non-atomic store would).
    for root, _, files in os.walk(os.path.join(latest, "state")):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "r+b") as fh:
                fh.truncate(max(0, os.path.getsize(p) // 3))
    summary, proc = _run(_cmd(w, base, data_dir, steps=7, extra=EVAL))
    assert summary["start_step"] == 3, proc.stderr[-2000:]
    assert "could not be restored" in proc.stderr
    # moved aside, so the rerun wrote a good step 6 where the bad one was; the next run resumes at 7
    assert os.listdir(os.path.join(w, "checkpoints.corrupt")) == ["6"]
    assert {"6", "7"} <= set(os.listdir(os.path.join(w, "checkpoints")))
    summary, proc = _run(_cmd(w, base, data_dir, steps=7, extra=EVAL))
    assert summary["start_step"] == 7 and "could not be restored" not in proc.stderr
    # unreadable metadata is damage too: moved aside, and step 7 written anew
    for root, _, files in os.walk(os.path.join(w, "checkpoints", "7", "meta")):
        for f in files:
            open(os.path.join(root, f), "w").write("{not json")
    summary, proc = _run(_cmd(w, base, data_dir, steps=7, extra=EVAL))
    assert summary["start_step"] == 6 and "metadata at step 7" in proc.stderr, proc.stderr[-2000:]
    assert sorted(os.listdir(os.path.join(w, "checkpoints.corrupt"))) == ["6", "7"]
    assert "7" in os.listdir(os.path.join(w, "checkpoints"))


def test_checkpoints_that_all_fail_to_restore_are_kept_and_refused(reference, base, data_dir, tmp_path):
    """No checkpoint restores (damaged, or another config's): one line, and nothing is moved or truncated."""
    w = _copy_of(reference, tmp_path, "all_bad")
    for step in ("3", "6"):
        for root, _, files in os.walk(os.path.join(w, "checkpoints", step, "state")):
            for f in files:
                with open(os.path.join(root, f), "r+b") as fh:
                    fh.truncate(0)
    metrics = open(os.path.join(w, "metrics.jsonl")).read()
    p = subprocess.run(_cmd(w, base, data_dir, steps=7, extra=EVAL), env=_env(0), capture_output=True,
                       text=True, timeout=300)
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2 and len(err) == 1 and "none of the 2 checkpoint(s) restores" in err[0], p.stderr[-2000:]
    assert sorted(os.listdir(os.path.join(w, "checkpoints"))) == ["3", "6"]
    assert not os.path.exists(w + "/checkpoints.corrupt")
    assert open(os.path.join(w, "metrics.jsonl")).read() == metrics


def test_cli_config_error_is_one_line(base, data_dir, tmp_path):
    p = subprocess.run(_cmd(str(tmp_path / "bad"), base, data_dir, extra=["--config.sage.guide=nope"]),
                       env=_env(0), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    err = [ln for ln in p.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "sage.guide" in err[0] and "nope" in err[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not os.path.exists(os.path.join(str(tmp_path / "bad"), "checkpoints"))  # stopped before anything ran
