"""The layout and its conventions: the README's layout section lists exactly the package's modules, each module
is short enough to read (docs/design.md §5.1), and every shape-suffix letter has one meaning (§5.4)."""

import os
import re
import sys

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


MAX_FUNCTION_LINES = 80
LONG_BY_DESIGN = {("sage_jax/defaults.py", "default_config")}  # declarative: one line per config field


def _functions(path):
    import ast
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_is_longer_than_the_limit():
    long = {f"{p}:{f.name}": f.end_lineno - f.lineno + 1 for p in _tree() for f in _functions(p)
            if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES and (p, f.name) not in LONG_BY_DESIGN}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (name their blocks): {long}"


# The run's ConfigDict is read by config_lib (into spec.RunSpec), by defaults (which writes it) and by the entry
# points above the spec: main, and train/'s run functions. Every other module gets typed parts.
CONFIG_READERS = ("sage_jax/config_lib.py", "sage_jax/defaults.py", "sage_jax/main.py", "sage_jax/train/")
CONFIG_SECTIONS = {"model", "data", "rollout", "rl", "sage", "optim", "ckpt", "eval", "mesh", "logging", "lora"}


def _config_reads(path):
    """(function, parameter) pairs where a function reads a top-level config section (`x.rl`, `x.data`, ...)
    off a parameter, or the module imports ml_collections / config_lib / defaults."""
    import ast
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ml_collections" for a in node.names):
            found.append(("import", "ml_collections"))
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module.split(".")[0] == "ml_collections"
                or any(f"{node.module}.{a.name}" in ("sage_jax.config_lib", "sage_jax.defaults") for a in node.names)
                or node.module in ("sage_jax.config_lib", "sage_jax.defaults")):
            found.append(("import", node.module))
    for f in _functions(path):
        params = {a.arg for a in f.args.args + f.args.kwonlyargs} - {"self", "cls"}
        for n in ast.walk(f):
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in params
                    and n.attr in CONFIG_SECTIONS and isinstance(n.ctx, ast.Load)
                    and _reads_a_field(f, n.value.id, n.attr)):
                found.append((f.name, f"{n.value.id}.{n.attr}"))
    return sorted(set(found))


def _reads_a_field(f, name, section):
    """`name.section.<field>` somewhere in f: a ConfigDict section read, not a typed object's attribute that
    happens to share a section's name (`spec.data` is a DataSpec: its fields are read too, so typed parts are
    told apart by their module, see the test)."""
    import ast
    for n in ast.walk(f):
        if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == section
                and isinstance(n.value.value, ast.Name) and n.value.value.id == name):
            return True
    return False


def test_no_module_below_train_reads_the_raw_config():
    below = [p for p in _tree() if not p.startswith(CONFIG_READERS)]
    reads = {p: r for p in below if (r := _config_reads(p))}
    assert not reads, f"modules below train/ that read the run's ConfigDict (hand them a spec part): {reads}"


def test_the_config_boundary_check_sees_a_config_read(tmp_path, monkeypatch):
    """The check above is not vacuous: a function that reads `c.rl.beta` off its argument is found."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    (tmp_path / "m.py").write_text("def f(c):\n    return c.rl.beta\n\n\ndef g(spec):\n    return spec.rl\n")
    assert _config_reads("m.py") == [("f", "c.rl")]
    (tmp_path / "n.py").write_text("import ml_collections\n")
    assert _config_reads("n.py") == [("import", "ml_collections")]
