"""The package's import graph, read from the source with `ast` (function-local imports included): no module
imports another that, directly or not, imports it back; imports only point down the layers of docs/design.md §4;
no `_private` name crosses a module boundary."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "sage_jax")


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return out


def _imports(path: str, modules) -> list[tuple[str, list[str]]]:
    """(imported sage_jax module, names taken from it) for every import statement of the file."""
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sage_jax"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((sub, []) if sub in modules else (node.module, [a.name]))
    return out


def _graph():
    mods = _modules()
    return mods, {m: {t for t, _ in _imports(p, mods) if t != m and t in mods} for m, p in mods.items()}


def test_no_import_circles():
    mods, graph = _graph()
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1 and n != "sage_jax":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import circles: {cycles}"


# docs/design.md §4: models <- sampling <- rl <- spec <- config_lib <- train <- main, with data, rewards and eval
# beside. A unit (a subpackage or a top-level module) imports only units on lower layers, never one on its own
# layer or above.
LAYERS = {
    "sharding": 0, "stop_strings": 0, "errors": 0,
    "models": 1, "rewards": 1, "distributed": 1,
    "sampling": 2, "data": 2, "policy": 2,
    "rl": 3, "eval": 3,
    "spec": 4, "defaults": 4, "losses": 4, "guides": 4, "evaluate": 4,  # the last three: aliases of §6
    "config_lib": 5,
    "train": 6,
    "main": 7,
}


def _unit(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_imports_only_point_down():
    mods, graph = _graph()
    unplaced = sorted({_unit(m) for m in mods if m != "sage_jax"} - set(LAYERS))
    assert not unplaced, f"modules on no layer (add them to LAYERS): {unplaced}"
    up = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                if m != "sage_jax" and _unit(m) != _unit(t) and LAYERS[_unit(t)] >= LAYERS[_unit(m)])
    assert not up, f"imports that do not point down: {up}"


def test_the_design_interface_names_import():
    """docs/design.md §6's names, importable where outside checks look for them and the same objects as the
    implementations'."""
    from sage_jax import evaluate, guides, losses, rewards
    from sage_jax.eval import metrics
    from sage_jax.models import hf
    from sage_jax.rewards import verifiers
    from sage_jax.rl import guide_configs, guides as rl_guides, losses as rl_losses

    assert losses.per_token_kl is rl_losses.per_token_kl
    for name in ("branch_q", "token_q", "random_q", "cosine_schedule"):
        assert getattr(guides, name) is getattr(rl_guides if name != "cosine_schedule" else guide_configs, name)
    assert evaluate.pass_at_k is metrics.pass_at_k
    assert rewards.math_verify_reward is verifiers.math_verify_reward
    assert callable(hf.load) and callable(hf.save)


def test_no_private_name_crosses_a_module():
    mods, _ = _graph()
    bad = [(m, t, n) for m, p in mods.items() for t, names in _imports(p, mods) for n in names
           if t != m and n.startswith("_") and not n.startswith("__")]
    assert not bad, f"private names imported across modules: {bad}"


def test_no_private_attribute_of_another_module():
    """`mod._name` where `mod` is another sage_jax module bound by an import (e.g. `hf._resolve`)."""
    mods, bad = _modules(), []
    for m, path in mods.items():
        tree = ast.parse(open(path).read())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sage_jax"):
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                                if f"{node.module}.{a.name}" in mods})
            elif isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in mods})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and aliases[node.value.id] != m and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append((m, f"{node.value.id}.{node.attr}"))
    assert not bad, f"private attributes of other modules: {bad}"
