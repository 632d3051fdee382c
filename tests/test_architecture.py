"""The package's import structure: layers that only import downwards, and no import cycle.

Imports are read from the source with ``ast`` (module level, inside functions and under
``if TYPE_CHECKING:`` alike), so an import hidden in a function body to dodge a cycle at load
time still counts. The layers and the reasons for them are in docs/architecture.md."""
from __future__ import annotations

import ast
import fnmatch
import pathlib

import pytest

PACKAGE = "functional_pp"
ROOT = pathlib.Path(__file__).resolve().parents[1] / PACKAGE

# bottom to top; a module may import its own layer (without a cycle) and the layers below
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("context", ("mesh", "layout", "order", "runtime", "comm", "observers", "torch_private", "in_flight", "kernel_order", "buffer_reuse", "tree", "seeds", "recompute", "barrier", "layer_compile")),
    ("collectives", ("raw_collectives", "transposes", "collectives", "buckets", "backends", "backends.*", "launch", "process_watch", "shard_map")),
    ("named", ("named", "reshard", "sharding", "init", "fsdp_units", "fsdp_order")),
    ("ops", ("ops", "ops.*", "remat")),
    ("models", ("models", "models.*")),
    ("training", ("train", "step_buffers", "step_io", "step_update", "nonfinite", "known_finite", "deferred_metrics", "compiler", "compile_gate", "overlap", "reinplace", "grads", "optim", "optim.*", "checkpoint", "checkpoint.*", "plan", "plan.*", "plan_*",
                  "data", "data.*")),
    ("application", ("cli", "cli.*", "config", "config.*", "app", "app.*", "moved_modules", "__main__")),
]
UNLISTED_LAYER = "application"   # a module not listed above may import anything below it

# Known upward edges, each owned by an open issue. Remove the entry when the issue moves it.
ALLOWED_UPWARD: dict = {}


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)          # "" is the package itself


def _exists(name: str) -> bool:
    base = ROOT.joinpath(*name.split(".")) if name else ROOT
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: pathlib.Path, tree: ast.AST | None = None) -> set[str]:
    """Package modules imported anywhere in ``path`` (names relative to the package)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = tree or ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()

    def add(absolute: str, names: list[str]) -> None:
        if absolute != PACKAGE and not absolute.startswith(PACKAGE + "."):
            return
        rel = absolute[len(PACKAGE) + 1:]
        for n in names:                      # ``from . import optim`` imports a module
            sub = f"{rel}.{n}" if rel else n
            found.add(sub if _exists(sub) else rel)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name[len(PACKAGE) + 1:])
                elif alias.name == PACKAGE:
                    found.add("")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                absolute = ".".join([PACKAGE] + base + ([node.module] if node.module else []))
            else:
                absolute = node.module or ""
            add(absolute, [a.name for a in node.names])
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(ROOT.rglob("*.py"))}


def layer_of(module: str) -> int:
    for i, (_, patterns) in enumerate(LAYERS):
        if any(fnmatch.fnmatchcase(module, pat) for pat in patterns):
            return i
    return [n for n, _ in LAYERS].index(UNLISTED_LAYER)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        if mod == "":                        # the package facade re-exports everything
            continue
        for dep in sorted(deps):
            if dep == "":
                bad.append(f"{PACKAGE}.{mod} imports the package facade `{PACKAGE}`; import the module "
                           f"that defines the name instead")
            elif layer_of(dep) > layer_of(mod) and (mod, dep) not in ALLOWED_UPWARD:
                bad.append(f"{PACKAGE}.{mod} (layer {LAYERS[layer_of(mod)][0]!r}) imports {PACKAGE}.{dep} "
                           f"(layer {LAYERS[layer_of(dep)][0]!r}, above it): pass what it needs as an "
                           f"argument, subscribe from above (functional_pp.observers), or move the shared "
                           f"piece down; if the module belongs to another layer, list it in LAYERS")
    return bad


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), facade excluded."""
    graph = {m: {d for d in deps if d in graph and d != ""} for m, deps in graph.items() if m != ""}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


# ---------------------------------------------------------------------------------- tests
def test_no_import_cycle_in_the_package():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles (counting imports inside functions):\n" + "\n".join(
        " <-> ".join(f"{PACKAGE}.{m}" for m in c) for c in cycles)


def test_layers_import_only_downwards():
    bad = upward_imports(import_graph())
    assert not bad, "\n".join(bad)


def test_allowed_upward_edges_still_exist():
    """An exception that is no longer needed is removed, so it cannot hide a new edge."""
    graph = import_graph()
    stale = [edge for edge in ALLOWED_UPWARD if edge[1] not in graph.get(edge[0], set())]
    assert not stale, f"remove these entries from ALLOWED_UPWARD: {stale}"


def test_every_layer_pattern_matches_a_module():
    modules = set(import_graph())
    for name, patterns in LAYERS:
        for pat in patterns:
            if pat.endswith("*"):
                continue                     # a place for modules that may come
            assert pat in modules, f"layer {name!r} lists {pat!r}, which is not a module of {PACKAGE}"


# ---------------------------------------------------- the checker itself catches what it must
def _graph_of(sources: dict[str, str]) -> dict[str, set[str]]:
    graph = {}
    for name, src in sources.items():
        path = ROOT.joinpath(*name.split(".")).with_suffix(".py")
        graph[name] = imports_of(path, ast.parse(src))
    return graph


def test_checker_sees_lazy_relative_imports_and_cycles():
    graph = _graph_of({
        "named": "from . import collectives as C\n",
        "collectives": "def f():\n    from .named import options\n    return options\n",
    })
    assert graph["collectives"] == {"named"}
    assert import_cycles(graph) == [["collectives", "named"]]
    bad = upward_imports(graph)
    assert len(bad) == 1 and "functional_pp.collectives (layer 'collectives') imports functional_pp.named" in bad[0]


def test_checker_resolves_parent_relative_and_absolute_imports():
    graph = _graph_of({
        "ops.regather": "def pack(t):\n    from ..plan import count_saved\n",
        "ops.einsum": "import functional_pp.named\nfrom functional_pp.ops import regather\n",
        "train": "from . import optim\nfrom .ops import sum as nsum\n",
    })
    assert graph["ops.regather"] == {"plan"}
    assert graph["ops.einsum"] == {"named", "ops.regather"}
    assert graph["train"] == {"optim", "ops"}
    assert any("functional_pp.ops.regather" in b and "functional_pp.plan" in b for b in upward_imports(graph))


@pytest.mark.parametrize("module,layer", [("named", "named"), ("ops.einsum", "ops"), ("plan", "training"),
                                          ("plan_search", "training"), ("some_new_module", "application")])
def test_layer_lookup(module, layer):
    assert LAYERS[layer_of(module)][0] == layer
