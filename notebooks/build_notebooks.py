"""Writes the Colab notebooks of this directory from their cell sources (`cells_*.py`), outputs cleared.

    python notebooks/build_notebooks.py           # (re)write notebooks/*.ipynb
    python notebooks/build_notebooks.py --check   # exit 1 if a committed notebook differs from its source

Edit the `cells_*.py` modules, not the .ipynb files: the notebooks are generated (deterministic cell
ids, no outputs, execution_count None) so that diffs stay readable. The GPU memory / time tables in the
markdown cells are computed here from `gpu_estimates` (arithmetic estimates, no GPU measured).
"""

from __future__ import annotations

import argparse
import os
import sys

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [HERE, ROOT]

# One place for the repository address: the Colab install cell clones it, the README badges point at it.
REPO_SLUG = "sage-jax/sage_jax"
REPO_URL = f"https://github.com/{REPO_SLUG}"
JAX_VERSION = "0.10.2"  # requirements.txt's pin
NOTEBOOKS = ("quickstart_sage", "evaluate_passk", "inspect_guides")


def colab_url(name: str) -> str:
    return f"https://colab.research.google.com/github/{REPO_SLUG}/blob/main/notebooks/{name}.ipynb"


def badge(name: str) -> str:
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab_url(name)})"


def params_header(extra: str = "") -> str:
    """The first lines of every notebook's first code cell (SMOKE, where to install from)."""
    return (
        "# Parameters (edit here). SMOKE = True swaps in the shipped tiny model, the procedural task and a few\n"
        "# steps: CPU, offline, a minute or two; tests/test_notebooks.py runs every notebook that way.\n"
        "SMOKE = False\n"
        f'REPO_URL = "{REPO_URL}"  # the Colab install cell clones this repository\n'
        f'JAX_VERSION = "{JAX_VERSION}"  # requirements.txt pin, installed as jax[cuda12] on Colab\n' + extra)


SETUP_MD = """### Install (Colab) or find the checkout

**What:** on Colab (and not `SMOKE`) clones `REPO_URL`, installs the pinned `requirements.txt` with
`jax[cuda12]==JAX_VERSION`, then the repo itself (`pip install --no-deps -e`). Anywhere else it finds the
checkout above the working directory (run from `notebooks/`) and imports `sage_jax` from it; in `SMOKE`
mode it installs nothing.
**Time:** ~2-4 min on any Colab GPU runtime (pip downloads; estimate), instant locally. If pip replaced
a package Colab had already imported, use *Runtime > Restart session* and run again from the top (the
install is skipped the second time)."""

SETUP_CODE = """import os, subprocess, sys

IN_COLAB = "google.colab" in sys.modules
CLONE = "/content/sage_jax"
if IN_COLAB and not SMOKE:
    if not os.path.isdir(CLONE):
        subprocess.run(["git", "clone", "--depth=1", REPO_URL, CLONE], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-r", f"{CLONE}/requirements.txt",
                        f"jax[cuda12]=={JAX_VERSION}"], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", CLONE], check=True)
    sys.path.insert(0, CLONE)
else:  # a local checkout: look for sage_jax/ in the working directory and its parents
    d = os.path.abspath(os.getcwd())
    while d != os.path.dirname(d) and not os.path.isfile(os.path.join(d, "sage_jax", "__init__.py")):
        d = os.path.dirname(d)
    if os.path.isfile(os.path.join(d, "sage_jax", "__init__.py")) and d not in sys.path:
        sys.path.insert(0, d)
import sage_jax  # noqa: E402  (if this fails: pip install -e the checkout, or run from inside it)

# the notebooks' helpers (gpu_estimates, notebook_utils) live beside the notebooks, outside the package
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(sage_jax.__file__))), "notebooks"))

print("sage_jax from", os.path.dirname(sage_jax.__file__))"""

DEVICES_CODE = """if not SMOKE:  # Colab ships TensorFlow: keep it (TFDS may use it for file I/O) off the GPU that JAX uses
    try:
        import tensorflow as tf
        tf.config.set_visible_devices([], "GPU")
    except ImportError:
        pass
import jax
import matplotlib

if SMOKE:
    matplotlib.use("Agg")  # headless; the plots are saved as PNG files and displayed from them
import tensorflow_datasets as tfds
from IPython.display import HTML, Image, Markdown, display

import gpu_estimates

tfds.disable_progress_bar()  # dataset preparation logs one line instead of progress bars

DEVICE = jax.devices()[0]
GPU = gpu_estimates.gpu_of(DEVICE.device_kind) if DEVICE.platform == "gpu" else None
print(f"jax {jax.__version__}: {jax.device_count()} x {DEVICE.platform} ({DEVICE.device_kind})",
      f"-> estimates for {GPU.name}" if GPU else "")
if not SMOKE and DEVICE.platform != "gpu":
    print("No GPU: on Colab use Runtime > Change runtime type > GPU (T4 / L4 / A100), or set SMOKE = True.")"""


def md(text: str, cid: str):
    return nbformat.v4.new_markdown_cell(text.strip("\n"), id=cid)


def code(text: str, cid: str):
    cell = nbformat.v4.new_code_cell(text.strip("\n"), id=cid)
    cell.outputs, cell.execution_count = [], None
    return cell


def notebook(name: str, cells: list[tuple[str, str]]):
    """cells: ("md" | "code", source) in order; ids are `<name>-<index>` (stable across rebuilds)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "accelerator": "GPU",
        "colab": {"provenance": [], "gpuType": "L4", "name": f"{name}.ipynb"},
    }
    nb.cells = [(md if kind == "md" else code)(src, f"{name}-{i:02d}") for i, (kind, src) in enumerate(cells)]
    nbformat.validate(nb)
    return nb


def minutes(seconds: float) -> str:
    return f"~{seconds / 60:.0f} min" if seconds >= 90 else f"~{seconds:.0f} s"


def build() -> dict[str, str]:
    """{path: notebook JSON text} of every notebook."""
    import cells_evaluate
    import cells_inspect
    import cells_quickstart
    mods = {"quickstart_sage": cells_quickstart, "evaluate_passk": cells_evaluate, "inspect_guides": cells_inspect}
    out = {}
    for name in NOTEBOOKS:
        nb = notebook(name, mods[name].cells(sys.modules[__name__]))
        out[os.path.join(HERE, f"{name}.ipynb")] = nbformat.writes(nb) + "\n"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the files on disk, write nothing")
    args = ap.parse_args()
    stale = []
    for path, text in build().items():
        old = open(path).read() if os.path.exists(path) else None
        if old != text:
            stale.append(os.path.relpath(path, ROOT))
            if not args.check:
                with open(path, "w") as f:
                    f.write(text)
    if args.check and stale:
        print("out of date (run python notebooks/build_notebooks.py):", ", ".join(stale))
        return 1
    print(("up to date: " if not stale else "wrote: ") + ", ".join(stale or NOTEBOOKS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
