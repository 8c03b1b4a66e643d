"""launch_tpu.sh: `--dry-run` prints the exact gcloud commands; the script passes bash -n and shellcheck."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "launch_tpu.sh")


def _run(*args):
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=30, cwd=ROOT)


def _jax_version():
    for line in open(os.path.join(ROOT, "requirements.txt")):
        if line.startswith("jax=="):
            return line.strip().split("==")[1]


def test_dry_run_prints_every_command():
    p = _run("--name=sage", "--zone=us-east5-a", "--accelerator-type=v5p-64", "--project=my-proj",
             "--config=configs/qwen_math.py", "--workdir=gs://bucket/run", "--dry-run", "--",
             "--config.rl.beta=0.02", "--config.max_steps=10")
    assert p.returncode == 0, p.stderr
    where = "--zone=us-east5-a --project=my-proj"
    install = ("set -e; mkdir -p ~/sage_jax && tar xzf ~/sage_jax_src.tgz -C ~/sage_jax && cd ~/sage_jax"
               " && (command -v python3.11 >/dev/null || (sudo apt-get update -qq && sudo apt-get install -y -qq"
               " python3.11 python3.11-venv)) && python3.11 -m venv .venv && .venv/bin/pip install -q --upgrade pip"
               f" && .venv/bin/pip install -q -r requirements.txt '\\''jax[tpu]=={_jax_version()}'\\''"
               " && .venv/bin/pip install -q --no-deps -e .")
    assert p.stdout.splitlines() == [
        f"gcloud compute tpus tpu-vm describe sage {where} '--format=value(state)'",
        "# only if describe fails (no such TPU):",
        f"gcloud compute tpus tpu-vm create sage {where} --accelerator-type=v5p-64 --version=v2-alpha-tpuv5",
        f"tar czf /tmp/sage_jax_src.tgz -C {ROOT} --exclude=.git --exclude=.venv --exclude=__pycache__ "
        "--exclude=.pytest_cache .",
        f"gcloud compute tpus tpu-vm scp /tmp/sage_jax_src.tgz 'sage:~/' {where} --worker=all",
        f"gcloud compute tpus tpu-vm ssh sage {where} --worker=all '--command={install}'",
        f"gcloud compute tpus tpu-vm ssh sage {where} --worker=all '--command=cd ~/sage_jax && "
        "SAGE_JAX_DISTRIBUTED=auto .venv/bin/python -m sage_jax.main --config=configs/qwen_math.py "
        "--workdir=gs://bucket/run --config.rl.beta=0.02 --config.max_steps=10'",
    ]


def test_dry_run_reuse_spot_and_defaults():
    # Space-separated flag values, --spot, --skip-install, the v6e software version, an override with a space.
    p = _run("--name", "t", "--zone", "europe-west4-a", "--accelerator-type", "v6e-8", "--workdir", "/tmp/w",
             "--config", "configs/tiny.py", "--spot", "--skip-install", "--dry-run", "--", "--config.data.template=a b")
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "gcloud compute tpus tpu-vm describe t --zone=europe-west4-a '--format=value(state)'",
        "# only if describe fails (no such TPU):",
        "gcloud compute tpus tpu-vm create t --zone=europe-west4-a --accelerator-type=v6e-8 "
        "--version=v2-alpha-tpuv6e --spot",
        "gcloud compute tpus tpu-vm ssh t --zone=europe-west4-a --worker=all '--command=cd ~/sage_jax && "
        "SAGE_JAX_DISTRIBUTED=auto .venv/bin/python -m sage_jax.main --config=configs/tiny.py --workdir=/tmp/w "
        "--config.data.template=a\\ b'",
    ]


@pytest.mark.parametrize("args,msg", [
    (["--zone=z", "--workdir=w"], "--name is required"),
    (["--name=n", "--workdir=w"], "--zone is required"),
    (["--name=n", "--zone=z"], "--workdir is required"),
    (["--name=n", "--zone=z", "--workdir=w", "--config=configs/nope.py"], "configs/nope.py not found"),
    (["--name=n", "--zone=z", "--workdir=w", "--config.rl.beta=1"], "unknown argument '--config.rl.beta=1'"),
    (["--name"], "--name needs a value"),
])
def test_errors(args, msg):
    p = _run(*args, "--dry-run")
    assert p.returncode == 2 and msg in p.stderr and not p.stdout


def test_bash_syntax():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed (apt-get install -y shellcheck)")
def test_shellcheck():
    p = subprocess.run(["shellcheck", SCRIPT], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout
