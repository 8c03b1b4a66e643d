"""The Colab notebooks (notebooks/*.ipynb): generated from notebooks/cells_*.py, committed with outputs
cleared, linked from the README, and each executed top to bottom with SMOKE = True on CPU, offline,
in one shared working directory (quickstart first, so the other two pick up its run), with a kernel
that runs this interpreter."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
ORDER = ("quickstart_sage", "evaluate_passk", "inspect_guides")
EXPECTED = {  # files each notebook writes into its working directory in SMOKE mode
    "quickstart_sage": ("quickstart_curves.png", "quickstart_pass_at_k.png", "quickstart_pass1_vs_passk.png"),
    "evaluate_passk": ("passk_comparison.png", "pass1_vs_passk.png", "new_support.png"),
    "inspect_guides": ("inspect_heatmap_0.png", "inspect_heatmap_2.png", "inspect_scatter.png",
                       "inspect_tokens.html"),
}
SMOKE_OFF = re.compile(r"^SMOKE = False$", re.M)
KERNEL = "sage-jax-smoke"
OFFLINE_ENV = {"JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "SAGE_JAX_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_OFFLINE": "1", "MPLBACKEND": "Agg", "TF_CPP_MIN_LOG_LEVEL": "3",
               "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
               "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}


def _read(name: str):
    return nbformat.read(NB_DIR / f"{name}.ipynb", as_version=4)


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_every_notebook_is_tested():
    assert sorted(p.stem for p in NB_DIR.glob("*.ipynb")) == sorted(ORDER)


@pytest.mark.parametrize("name", ORDER)
def test_outputs_cleared_and_smoke_switch(name):
    nb = _read(name)
    nbformat.validate(nb)
    for cell in _code_cells(nb):
        assert cell.outputs == [] and cell.execution_count is None, f"{name}: a code cell has outputs"
    assert "widgets" not in nb.metadata
    first, *rest = _code_cells(nb)
    assert len(SMOKE_OFF.findall(first.source)) == 1, f"{name}: first code cell must set SMOKE = False once"
    assert not any(re.search(r"^SMOKE\s*=", c.source, re.M) for c in rest), f"{name}: SMOKE set twice"


def test_notebooks_match_their_sources():
    r = subprocess.run([sys.executable, str(NB_DIR / "build_notebooks.py"), "--check"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr


def test_readme_links_every_notebook():
    sys.path.insert(0, str(NB_DIR))
    try:
        import build_notebooks as b
    finally:
        sys.path.remove(str(NB_DIR))
    readme = (ROOT / "README.md").read_text()
    for name in ORDER:
        assert b.colab_url(name) in readme, f"README has no Colab link for {name}"
        assert f'REPO_URL = "{b.REPO_URL}"' in _code_cells(_read(name))[0].source


def test_estimates_are_consistent():
    import gpu_estimates as ge
    s = ge.KNOWN_SHAPES["Qwen/Qwen2.5-0.5B-Instruct"]
    assert abs(ge.param_count(s) - 494_032_768) < 1e6  # Qwen2.5-0.5B's published size
    r = ge.Run(rows=64, prompt_tokens=256, new_tokens=512, micro_rows=16, logp_chunk=32, lora_rank=8)
    m = ge.memory(s, r)
    assert m["peak"] == pytest.approx(m["weights"] + m["trainable_state"] + max(m["rollout"], m["reference"], m["train"]))
    assert ge.step_seconds(s, r, ge.GPUS["A100-40GB"])["step"] < ge.step_seconds(s, r, ge.GPUS["L4"])["step"]
    assert ge.gpu_of("NVIDIA L4") is ge.GPUS["L4"] and ge.gpu_of("Tesla T4") is ge.GPUS["T4"]


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory):
    """The shared working directory and a kernelspec for this interpreter, found through JUPYTER_PATH."""
    jp = tmp_path_factory.mktemp("jupyter")
    spec = jp / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "sage_jax smoke (test venv)", "language": "python", "env": OFFLINE_ENV}))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(jp) + (os.pathsep + old if old else "")
    yield tmp_path_factory.mktemp("notebooks_run")
    if old is None:
        os.environ.pop("JUPYTER_PATH")
    else:
        os.environ["JUPYTER_PATH"] = old


@pytest.mark.parametrize("name", ORDER)
def test_smoke_run(name, smoke_dir):
    nb = _read(name)
    first = _code_cells(nb)[0]
    first.source = SMOKE_OFF.sub("SMOKE = True", first.source)
    check = nbformat.v4.new_code_cell(  # the kernel must be this interpreter, offline, on CPU
        f"import os, sys\nassert sys.executable == {sys.executable!r}, sys.executable\n"
        "assert os.environ['HF_HUB_OFFLINE'] == '1' and os.environ['JAX_PLATFORMS'] == 'cpu'", id="smoke-check")
    nb.cells.insert(0, check)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name=KERNEL,
                                     resources={"metadata": {"path": str(smoke_dir)}})
    client.execute()
    for f in EXPECTED[name]:
        path = smoke_dir / f
        assert path.is_file() and path.stat().st_size > 0, f"{name} did not write {f}"
    shown = [o for c in _code_cells(nb) for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(shown) >= len([f for f in EXPECTED[name] if f.endswith(".png")]), f"{name}: plots not displayed"
