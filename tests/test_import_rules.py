"""Import rules of the tree (issue 19): no import cycles in ``engines/`` or ``orchestrator/``,
counting the imports inside functions that hide them at run time; the orchestrator reaches
the engines through their torch-free API only (the engine process builds one through the
factory, inside a function); the server's front end imports without torch, and the
command-line client and the load driver without Quart, hypercorn or torch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engines", "orchestrator")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST):
    """Every import statement, at any depth, except those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if _is_type_checking(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    targets = set()
    for name in names:
        while name and name not in modules:  # a name inside a module: the module
            name = name.rpartition(".")[0]
        if name and name != module:
            targets.add(name)
    return targets


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {module: set().union(*(_targets(module, path, node, modules)
                                  for node in _imports(ast.parse(path.read_text()))))
            for module, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while component[-1:] != [v]:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 100 and "engines.tools.bench" in graph["engines.tools.profile_tick"]
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function():
    graph = import_graph()
    graph["engines.config"] = graph["engines.config"] | {"engines.runtime.factory"}  # what a lazy import would add
    assert any({"engines.config", "engines.runtime.factory"} <= set(c) for c in cycles(graph))


# What the orchestrator may import from engines/ when its modules load: no torch among them.
ENGINES_API = {"engines", "engines.config", "engines.interface", "engines.errors", "engines.audio_io", "engines.progress",
               "engines.spec",
               "engines.checkpoints", "engines.checkpoints.hub", "engines.checkpoints.random_weights",
               "engines.checkpoints.weights_format"}


def _module_level_imports(tree: ast.AST):
    """Import statements that run when the module loads (not inside a function)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or _is_type_checking(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _module_level_imports(node)


def test_the_orchestrator_loads_only_the_engines_api():
    modules = _modules()
    reached = {}
    for module, path in modules.items():
        if module.startswith("orchestrator"):
            for node in _module_level_imports(ast.parse(path.read_text())):
                for target in _targets(module, path, node, modules):
                    if target.startswith("engines"):
                        reached.setdefault(target, []).append(module)
    assert "engines.config" in reached and "engines.interface" in reached
    assert {t: m for t, m in reached.items() if t not in ENGINES_API} == {}


def _loaded_by(modules: list[str], watched: list[str]) -> list[str]:
    """Which of ``watched`` a fresh interpreter has loaded once it imported ``modules``."""
    code = (f"import sys, json; import {', '.join(modules)}; "
            f"print(json.dumps(sorted(m for m in {watched!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_server_front_end_imports_without_torch():
    assert _loaded_by(["engines.runtime.torch_engine"], ["torch", "quart"]) == ["torch"]  # the probe sees what loads
    assert _loaded_by(["orchestrator", "orchestrator.frontend.routes", "orchestrator.settings",
                       "orchestrator.engine_host.host"], ["torch", "triton", "safetensors", "sentencepiece"]) == []


def test_the_client_and_the_load_driver_import_without_the_server_stack():
    assert _loaded_by(["orchestrator.client.cli", "orchestrator.load_driver.cli", "orchestrator.load_driver.run"],
                      ["quart", "hypercorn", "torch", "triton", "sphn"]) == []


def _names_defined(tree: ast.Module) -> set[str]:
    """Names a module defines or imports at its top level (what ``from it import name`` finds)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node in tree.body:
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def unresolved_imports() -> list[str]:
    """Every ``from engines... / orchestrator... import name`` in the tree, at any depth (the
    GPU paths import lazily, inside functions CPU tests never run), whose module or name does
    not exist."""
    modules = _modules()
    trees = {module: ast.parse(path.read_text()) for module, path in modules.items()}
    defined = {module: _names_defined(tree) for module, tree in trees.items()}
    broken = []
    for module, tree in trees.items():
        path = modules[module]
        for node in _imports(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = node.module or ""
            if node.level:
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            if not base.startswith(PACKAGES):
                continue
            if base not in modules:
                broken.append(f"{module}: no module {base}")
                continue
            for alias in node.names:
                if alias.name != "*" and f"{base}.{alias.name}" not in modules and alias.name not in defined[base]:
                    broken.append(f"{module}: {base} has no {alias.name}")
    return broken


def test_every_import_in_the_tree_resolves():
    assert unresolved_imports() == []


# Front-end modules that reach past the engine port, and why.
PAST_THE_PORT = {
    "orchestrator.frontend.services": {"orchestrator.engine_host.launch"},  # starts the engine host
}


def test_the_front_end_reaches_engines_through_the_port():
    """Sessions and the rest of the front end know an engine as ``orchestrator.engine_port``
    (its messages and ``EnginePort``), not the lockstep's or the engine host's modules."""
    graph = import_graph()
    reached = {module: {t for t in targets if t.startswith(("orchestrator.lockstep", "orchestrator.engine_host"))}
               for module, targets in graph.items() if module.startswith("orchestrator.frontend")}
    assert {m: t for m, t in reached.items() if t and t != PAST_THE_PORT.get(m)} == {}
    for session_module in ("session", "native_session", "session_core", "engine_link"):
        assert "orchestrator.engine_port" in graph[f"orchestrator.frontend.{session_module}"]


# The engine's layers (docs/ARCHITECTURE.md, "Files"): the torch-free API; the compute layer
# (the model, the per-slot state it runs over, and the fast paths that replace parts of both:
# they import each other); above them checkpoints, runtime, export, tools.
ENGINE_API_LAYER = ("engines", "engines.config", "engines.errors", "engines.interface", "engines.progress",
                    "engines.audio_io", "engines.spec")
COMPUTE_LAYER = ("engines.model", "engines.state", "engines.fastpath")
# Checkpoint modules that build engines, and so reach the runtime (the demo checkpoint makes its
# voices with the engine; random weights are built into one).
CHECKPOINT_BUILDERS = {"engines.checkpoints.tiny", "engines.checkpoints.random_model"}


def _layer_violations(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    found = {}
    for module, targets in graph.items():
        if module in ENGINE_API_LAYER:
            allowed = ENGINE_API_LAYER + ("engines.checkpoints.random_weights", "engines.checkpoints.hub",
                                          "engines.checkpoints.weights_format", "engines.checkpoints")
        elif module.startswith(tuple(m + "." for m in COMPUTE_LAYER)):
            allowed = ENGINE_API_LAYER + COMPUTE_LAYER
        elif module.startswith("engines.checkpoints.") and module not in CHECKPOINT_BUILDERS:
            allowed = ENGINE_API_LAYER + COMPUTE_LAYER + ("engines.checkpoints",)
        else:
            continue
        bad = {t for t in targets if t.startswith("engines") and not any(t == a or t.startswith(a + ".")
                                                                          for a in allowed if a != "engines")
               and t != "engines"}
        if bad:
            found[module] = bad
    return found


def test_the_engines_layers_import_downwards():
    assert _layer_violations(import_graph()) == {}


def test_the_layer_check_finds_a_compute_module_reaching_up():
    graph = import_graph()
    graph["engines.model.prefill"] = graph["engines.model.prefill"] | {"engines.checkpoints.voices"}
    assert _layer_violations(graph) == {"engines.model.prefill": {"engines.checkpoints.voices"}}
