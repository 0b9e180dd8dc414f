"""The core's layers: no import cycle among modules of ``src/craft_rag``, and the core never
imports the engine.

Every module under ``src/craft_rag`` is parsed with ``ast`` (nothing is imported). An edge
``a -> b`` is a ``craft_rag`` import in ``a`` resolved to the module that defines it:
``from craft_rag.engine import gemma`` is an edge to ``craft_rag.engine.gemma`` (a submodule),
``from craft_rag.engine import CraftEngine`` one to ``craft_rag.engine`` (its ``__init__``).
Imports are *top-level* when they run at import time (module body, not under
``if TYPE_CHECKING:``), *deferred* otherwise (inside a function, or for annotations only).

- No cycle among top-level edges: a cycle there makes the import order matter.
- No deferred cycle either (the CP-Tree's modules had one until they became the
  ``craft_rag.tree`` package, whose modules import downwards only).
- No module outside ``craft_rag.engine`` imports the engine, at any level, except those of the
  application packages in :data:`ABOVE_ENGINE` (packages, so the layer shows in the folders: no
  root module of the core imports the engine); and nothing outside the engine and those
  packages imports them (otherwise the core reaches the engine through them, as
  ``routing.simulator`` did through ``replay.percentile``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "craft_rag"
ENGINE = "craft_rag.engine"

# Packages that sit above the engine, each for a reason that moving a shared type down cannot
# remove; every module inside one may import the engine. A package that no longer imports the
# engine fails (the list only shrinks). Root modules (``craft_rag/<name>.py``) are never here.
ABOVE_ENGINE: Mapping[str, str] = {
    # The ``craft-rag`` command: registers the engine's subcommands by module name, and its
    # ``replay`` renders prompts with the embedded model's chat format, as the engine does.
    "craft_rag.cli": "dispatches to craft_rag.engine.cli_commands and ...backends.server.serve",
    # Offline replay runs the engine's own turn code (parity with a served turn is its point).
    "craft_rag.replay": "runs RagTurns/ConversationPrompts/PlannerNamespaces without a model",
    # Test helpers: a fake backend behind a real CraftEngine.
    "craft_rag.testing": "make_fake_engine builds a CraftEngine",
}


def _above_engine(module: str) -> str | None:
    """The application package ``module`` belongs to, if any."""
    for package in ABOVE_ENGINE:
        if module == package or module.startswith(package + "."):
            return package
    return None


# Deferred cycles allowed (none: a new one fails; add one here only with its reason).
KNOWN_DEFERRED_CYCLES: tuple[frozenset[str], ...] = ()


@dataclass(slots=True)
class Graph:
    """Import edges between ``craft_rag`` modules: ``top`` run at import time, ``deferred``
    inside functions or under ``TYPE_CHECKING``. Self-edges are dropped."""

    top: dict[str, set[str]] = field(default_factory=dict)
    deferred: dict[str, set[str]] = field(default_factory=dict)
    # The engine imported by name through importlib (module names in string constants).
    by_name: dict[str, set[str]] = field(default_factory=dict)

    def all_edges(self) -> dict[str, set[str]]:
        return {m: self.top[m] | self.deferred[m] for m in self.top}


def _module_names(package: Path) -> dict[str, Path]:
    names: dict[str, Path] = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it is deferred."""

    def walk(node: ast.AST, deferred: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, deferred
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from walk(child, True)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), True)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), deferred)
            else:
                yield from walk(child, deferred)

    yield from walk(tree, False)


def build_graph(package: Path = PACKAGE) -> Graph:
    """The import graph of ``package`` (a ``craft_rag`` source folder). O(source size)."""
    names = _module_names(package)

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in names:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph = Graph()
    for module, path in names.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        here = module if is_package else module.rpartition(".")[0]
        top: set[str] = set()
        deferred: set[str] = set()
        for node, is_deferred in _imports(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join([*parts, base] if base else parts)
                subs = [f"{base}.{alias.name}" for alias in node.names]
                # ``from pkg import sub`` needs pkg.sub; any other name needs pkg itself.
                targets = [s for s in subs if s in names]
                if len(targets) < len(subs):
                    targets.append(base)
            for target in targets:
                if target == "craft_rag" or target.startswith("craft_rag."):
                    resolved = owner(target)
                    if resolved is not None and resolved != module:
                        (deferred if is_deferred else top).add(resolved)
        graph.top[module] = top
        graph.deferred[module] = deferred - top
        graph.by_name[module] = {
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith(ENGINE + ".")
            and node.value in names
        }
    return graph


def cycles(edges: Mapping[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan). O(V + E)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _in_engine(module: str) -> bool:
    return module == ENGINE or module.startswith(ENGINE + ".")


def engine_importers(graph: Graph) -> dict[str, set[str]]:
    """Modules outside the engine that import it (any level, or by module name)."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.all_edges().items():
        if _in_engine(module):
            continue
        engine = {t for t in targets | graph.by_name[module] if _in_engine(t)}
        if engine:
            out[module] = engine
    return out


def test_no_top_level_import_cycle() -> None:
    graph = build_graph()
    found = cycles(graph.top)
    assert not found, f"import cycles among top-level imports: {[sorted(c) for c in found]}"


def test_no_deferred_import_cycle() -> None:
    found = cycles(graph_edges := build_graph().all_edges())
    assert graph_edges  # the walk found the package
    new = [sorted(c) for c in found if not any(c <= known for known in KNOWN_DEFERRED_CYCLES)]
    assert not new, f"new import cycles (through function or TYPE_CHECKING imports): {new}"


def test_only_the_application_packages_import_the_engine() -> None:
    importers = engine_importers(build_graph())
    unexpected = {m: sorted(t) for m, t in importers.items() if _above_engine(m) is None}
    assert not unexpected, f"core modules importing craft_rag.engine: {unexpected}"
    stale = sorted(set(ABOVE_ENGINE) - {_above_engine(m) for m in importers})
    assert not stale, f"no longer import the engine; drop them from ABOVE_ENGINE: {stale}"


def test_the_application_layer_is_packages() -> None:
    """Each entry of :data:`ABOVE_ENGINE` is a folder, so no root module sits above the engine."""
    for package in ABOVE_ENGINE:
        folder = PACKAGE.parent.joinpath(*package.split("."))
        assert (folder / "__init__.py").is_file(), f"{package} must be a package"
        assert not folder.with_suffix(".py").exists(), f"{package}.py shadows the package"
    roots = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    importing = sorted(
        m
        for m in engine_importers(build_graph())
        if m.rpartition(".")[2] in roots and m.count(".") == 1
    )
    assert importing == [], f"root modules importing craft_rag.engine: {importing}"


def test_the_core_does_not_import_the_application_packages() -> None:
    graph = build_graph()
    reaching = {
        m: sorted(a for a in t if _above_engine(a) is not None)
        for m, t in graph.all_edges().items()
        if not _in_engine(m)
        and _above_engine(m) is None
        and any(_above_engine(a) is not None for a in t)
    }
    assert not reaching, f"core modules reaching the engine through {reaching}"


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """The graph finds a top-level cycle, keeps deferred ones apart, and sees an engine import."""
    pkg = tmp_path / "craft_rag"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("from craft_rag.engine import gemma\n")
    (pkg / "engine" / "gemma.py").write_text("")
    (pkg / "a.py").write_text("from craft_rag.b import x\n")
    (pkg / "b.py").write_text("from . import a\nx = 1\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from craft_rag import d\n"
    )
    (pkg / "d.py").write_text("import craft_rag.c\ndef f():\n    from craft_rag.engine import X\n")
    graph = build_graph(pkg)
    assert cycles(graph.top) == [frozenset({"craft_rag.a", "craft_rag.b"})]
    assert frozenset({"craft_rag.c", "craft_rag.d"}) in cycles(graph.all_edges())
    # ``from craft_rag.engine import gemma`` inside the engine package is not a cycle.
    assert graph.top["craft_rag.engine"] == {"craft_rag.engine.gemma"}
    assert engine_importers(graph) == {"craft_rag.d": {"craft_rag.engine"}}


def test_moved_names_stay_importable_from_their_old_modules() -> None:
    from craft_rag import metrics, replay, types, validation
    from craft_rag.engine import planners
    from craft_rag.stores import histories, shared

    assert replay.percentile is metrics.percentile
    assert planners.CacheSalt is types.CacheSalt
    assert planners.validate_cache_salt is validation.validate_cache_salt
    assert histories.SharedPosition is shared.SharedPosition
