"""The README's layout section lists exactly the package's modules, and each module is short enough to read
(docs/design.md §5.1)."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 400


def _tree() -> set[str]:
    out = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "sage_jax")):
        for f in files:
            if f.endswith(".py") and f != "__init__.py":
                out.add(os.path.relpath(os.path.join(dirpath, f), ROOT).replace(os.sep, "/"))
    return out


def _readme_layout() -> set[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    listed, package = set(), None
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if not m:
            continue
        depth, name = len(m.group(1)) // 2, m.group(2)
        if depth == 0:
            package = name.rstrip("/") if name == "sage_jax/" else None
        elif package and depth == 1 and name.endswith("/"):
            package = "sage_jax/" + name.rstrip("/")
        elif package and depth == 1:
            package = "sage_jax"
            listed.add(f"sage_jax/{name}")
        elif package and depth == 2 and name.endswith(".py"):
            listed.add(f"{package}/{name}")
    return listed


def test_readme_layout_lists_every_module_and_nothing_else():
    tree, listed = _tree(), _readme_layout()
    assert listed, "no layout block parsed from README.md"
    assert not tree - listed, f"modules missing from README's layout: {sorted(tree - listed)}"
    assert not listed - tree, f"README's layout lists modules that do not exist: {sorted(listed - tree)}"


def test_no_module_is_longer_than_the_limit():
    long = {p: n for p in _tree() if (n := len(open(os.path.join(ROOT, p)).read().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"
