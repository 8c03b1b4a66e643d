"""The layout and its conventions: the README's layout section lists exactly the package's modules, each module
is short enough to read (docs/design.md §5.1), and every shape-suffix letter has one meaning (§5.4)."""

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


def _design_letters() -> set[str]:
    design = open(os.path.join(ROOT, "docs", "design.md")).read()
    table = design.split("One\n   meaning per letter across the package:", 1)[1].split("\n\n", 2)[1]
    letters = set()
    for row in table.splitlines()[2:]:
        letters.update(re.findall(r"`(\w+)`", row.split("|")[1]))
    return letters


def test_every_shape_suffix_letter_is_in_the_design_key():
    letters = _design_letters()
    assert {"B", "N", "G", "P", "T", "K", "Dh"} <= letters, letters
    unknown = {}
    for path in _tree():
        for name, suffix in re.findall(r"\b(\w+?)_((?:Dh|[A-Z])(?:x(?:Dh|[A-Z0-9]|[a-z]))*)\b", open(os.path.join(ROOT, path)).read()):
            for part in suffix.split("x"):
                if part[0].isupper() and part not in letters:
                    unknown.setdefault(part, []).append(f"{path}: {name}_{suffix}")
    assert not unknown, f"shape letters not in docs/design.md §5.4's key: {unknown}"
