"""The package's shape (docs/architecture.md): no import cycles, counting
imports under TYPE_CHECKING and inside functions; import depth at most 8;
no module over 400 lines; no module using another module's private names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sa_jobqueue"
MAX_LINES = 400
MAX_DEPTH = 8


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports() -> tuple[dict[str, set[str]], dict[str, set[tuple[str, str]]]]:
    """Each module's imported package modules (every import: at module level,
    under TYPE_CHECKING and inside functions), and the names it imports from each."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    names: dict[str, set[tuple[str, str]]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, path, node)
                targets = [source]
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in modules:
                        targets.append(submodule)
                    else:
                        names[module].add((source, alias.name))
            else:
                continue
            for target in targets:
                if target in modules and target != module and not module.startswith(target + "."):
                    # A package's __init__ imported by its own submodule is not a cycle we mean.
                    graph[module].add(target)
    return graph, names


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles_even_under_type_checking() -> None:
    graph, _ = _imports()
    # The package's own __init__ re-exports everything: leave it out, as each
    # submodule imports its siblings, never the face.
    graph = {m: {t for t in ts if t != "sa_jobqueue"} for m, ts in graph.items() if m != "sa_jobqueue"}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_import_depth_is_at_most_8() -> None:
    """The longest chain of imports (a module -> … -> one importing nothing of
    ours) has at most 8 modules, counting imports under TYPE_CHECKING and
    inside functions: they are dependencies of the design too. A package's
    ``__init__`` importing its own submodules is a face, not a link of a chain
    (so ``sa_jobqueue.cli`` counts as one module, as ``sa_jobqueue`` does)."""
    graph, _ = _imports()
    graph = {
        m: {t for t in ts if t != "sa_jobqueue" and not t.startswith(m + ".")}
        for m, ts in graph.items() if m != "sa_jobqueue"
    }
    depth: dict[str, int] = {}

    def measure(node: str) -> int:
        if node not in depth:
            depth[node] = 1 + max((measure(t) for t in graph[node]), default=0)
        return depth[node]

    deepest = max(graph, key=measure)
    chain = [deepest]
    while graph[chain[-1]]:
        chain.append(max(graph[chain[-1]], key=measure))
    assert len(chain) <= MAX_DEPTH, " -> ".join(chain)


def test_no_module_is_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_module_uses_another_modules_private_names() -> None:
    _, names = _imports()
    private = sorted(f"{module} imports {name} from {source}" for module, pairs in names.items()
                     for source, name in pairs if name.startswith("_") and not name.startswith("__"))
    assert not private, private
    # Attribute access to private names that the module does not define
    # itself, e.g. ``worker._count`` from another module. Flask's documented
    # ``LocalProxy._get_current_object`` is public API despite its name; so are the
    # engine's JSON functions, which SQLAlchemy's ``Dialect`` interface declares (typed)
    # for every dialect and its own JSON type reads.
    allowed = {"_get_current_object", "_asdict", "_replace", "_fields", "_mapping", "_json_serializer",
               "_json_deserializer"}
    reaching = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        own = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
               and n.value.id in ("self", "cls")}
        own |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        own |= {t.id for n in ast.walk(tree) if isinstance(n, ast.AnnAssign) for t in [n.target]
                if isinstance(t, ast.Name)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and node.attr not in own and node.attr not in allowed):
                reaching.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not reaching, reaching
