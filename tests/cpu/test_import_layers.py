"""The package's imports run one way (docs/design.md, "Layout"): no import circle among tileweave's
modules, none hidden by an import inside a function (the imports inside functions, moved to the top,
would close no circle: the CLI's are there only to start fast), each layer imports only the layers
below it, ops/compute/ imports no op nor the op skeleton, testing/ (and the tests' support/) use no
private name of bench/, and nothing in the library imports a test helper. Read from the source with
``ast``; nothing is imported."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "tileweave"

# What each layer may import from tileweave (besides itself). bench/ and testing/ sit above these and
# use each other (the benchmark runs on emulated ranks; the block's test checks the benchmark's variants).
ALLOWED = {
    "runtime": set(),
    "kernels": set(),
    "tune": {"runtime"},
    "ops": {"runtime", "kernels", "tune"},
    "nn": {"runtime", "kernels", "tune", "ops"},
    "models": {"nn"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module a dotted tileweave name stands for (a name imported from a module resolves to it)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, tree: ast.Module, *, top_level: bool):
    """``(line, target module)`` of the tileweave imports of ``tree``: its top-level statements (with
    ``top_level``) or those inside functions."""
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    nodes = tree.body if top_level else [n for f in functions for n in ast.walk(f)]
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}:{node.lineno}: the package imports absolutely"
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "tileweave":
                target = _resolve(name)
                if target is not None and target != module:
                    yield node.lineno, target


def _graph(*, with_function_imports: bool = False) -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        found = list(_imports(module, tree, top_level=True))
        if with_function_imports:
            found += list(_imports(module, tree, top_level=False))
        # Importing a.b.c runs the packages a.b and a.b.c first, except those the importer is inside
        # (already running); the root package is left out (it only re-exports, every module is below it).
        inside = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        targets = set()
        for _, target in found:
            parts = target.split(".")
            targets |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} - inside
        graph[module] = targets - {module, "tileweave"}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_circle_hidden_inside_a_function():
    assert _cycles(_graph(with_function_imports=True)) == []


SUPPORT = Path(__file__).resolve().parents[1] / "support"


def test_testing_uses_no_private_name_of_bench():
    support = {".".join(p.relative_to(SUPPORT.parent).with_suffix("").parts): p for p in SUPPORT.rglob("*.py")}
    assert support, "tests/support not found"
    found = []
    for module, path in {**MODULES, **support}.items():
        if module.startswith(("tileweave.testing", "support")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tileweave.bench"):
                    found += [f"{module} imports {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
                if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                    if isinstance(node.value, ast.Name) and node.value.id in _bench_aliases(path):
                        found.append(f"{module} reads {node.value.id}.{node.attr}")
    assert found == []


def test_the_library_imports_no_test_helper():
    """What only the tests use lives in tests/support (``import support``); nothing under src/ imports it."""
    found = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{module} imports {n}" for n in names if n.split(".")[0] in ("support", "tests")]
    assert found == []


def _bench_aliases(path: Path) -> set[str]:
    """The names a module binds to bench modules (``from tileweave.bench import block as B``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tileweave.bench"):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("tileweave.bench")}
    return names


def test_compute_launchers_stand_apart_from_the_op_skeleton():
    """ops/compute/ (the compute-only launchers) imports of the ops only ``ops.common`` and itself: the
    skeleton and the ops build on it, never the other way round."""
    found = []
    for module, targets in _graph(with_function_imports=True).items():
        if module.startswith("tileweave.ops.compute"):
            found += [f"{module} imports {t}" for t in targets if t.startswith("tileweave.ops")
                      and not t.startswith("tileweave.ops.compute") and t not in ("tileweave.ops", "tileweave.ops.common")]
    assert found == []


def test_each_layer_imports_only_those_below_it():
    found = []
    for module, targets in _graph().items():
        layer = module.split(".")[1] if module.count(".") else None
        if layer not in ALLOWED:
            continue
        for target in targets:
            other = target.split(".")[1]
            if other != layer and other not in ALLOWED[layer]:
                found.append(f"{module} imports {target}")
    assert sorted(found) == []


ENVIRONMENT_WRITERS = {"tileweave.runtime.settings", "tileweave.testing.emulated"}
"""The modules that may write the process environment: the settings' one home (``settings.export``, for
other libraries' variables) and the emulated ranks' launcher (its ranks' own variables)."""


def _environ_writes(tree: ast.Module):
    """Lines that write ``os.environ``: item assignment or deletion, or a mutating method."""
    def is_environ(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ"
                and isinstance(node.value, ast.Name) and node.value.id == "os")

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        if any(isinstance(t, ast.Subscript) and is_environ(t.value) for t in targets):
            yield node.lineno
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_environ(node.func.value)
                and node.func.attr in ("update", "pop", "popitem", "setdefault", "clear", "__setitem__")):
            yield node.lineno
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "putenv"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "os"):
            yield node.lineno


def test_only_the_settings_and_the_rank_launcher_write_the_environment():
    # The library never configures itself through os.environ: settings are read in runtime/settings.py,
    # entry points pass arguments (settings.override); other libraries' variables go through
    # settings.export.
    found = [f"{module}:{line}" for module, path in MODULES.items() if module not in ENVIRONMENT_WRITERS
             for line in _environ_writes(ast.parse(path.read_text()))]
    assert not found, found


def test_the_environment_write_check_sees_writes():
    tree = ast.parse("import os\nos.environ['A'] = '1'\nos.environ.update(B='2')\nx = os.environ.get('C')\n")
    assert list(_environ_writes(tree)) == [2, 3]
