"""Every runtime import is pinned: requirements.txt (what CI's demo venv is built from) and pyproject.toml's
dependencies cover each third-party package that sage_jax imports, plus the ones it needs without
importing them (jinja2: transformers' apply_chat_template)."""

import ast
import importlib.metadata as md
import os
import re
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONAL = {"wandb": "logging.wandb=True only; imported inside the writer with an install hint"}
NOT_IMPORTED = {"jinja2": "transformers' apply_chat_template renders with it"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_top_levels() -> set[str]:
    mods = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "sage_jax")):
        for f in files:
            if f.endswith(".py"):
                tree = ast.parse(open(os.path.join(dirpath, f), encoding="utf-8").read())
                for n in ast.walk(tree):
                    if isinstance(n, ast.Import):
                        mods |= {a.name.split(".")[0] for a in n.names}
                    elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                        mods.add(n.module.split(".")[0])
    return {m for m in mods if m not in sys.stdlib_module_names and m != "sage_jax"}


def _distributions() -> set[str]:
    dists = md.packages_distributions()
    out = set()
    for m in _imported_top_levels() - set(OPTIONAL):
        assert m in dists, f"sage_jax imports {m!r}, which no installed distribution provides"
        out |= {_norm(d) for d in dists[m]}
    return out | set(NOT_IMPORTED)


def test_requirements_txt_pins_every_runtime_package():
    pins = {}
    for line in open(os.path.join(ROOT, "requirements.txt")):
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"requirements.txt: {line!r} is not pinned with =="
            pins[_norm(name)] = version
    missing = sorted(_distributions() - set(pins))
    assert not missing, f"requirements.txt lacks {missing}"


def test_pyproject_lists_every_runtime_package():
    deps = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]["dependencies"]
    names = {_norm(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0]) for d in deps}
    missing = sorted(_distributions() - names)
    assert not missing, f"pyproject.toml [project] dependencies lack {missing}"
