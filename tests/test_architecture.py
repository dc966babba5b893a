"""The package's shape: imports run one way (no cycle, function-local imports counted; each part imports only
the parts in the layers below it, ``LAYERS``), no module over 600 lines, and the EAGLE-1 / EAGLE-3 difference
lives in eaglekit/heads/ and the exports' layouts (at most 3 kind comparisons outside them).

600 rather than less: fewer, fuller files that a reader does not hop between, so a decode step's code sits
in a few files (gpt-fast style), while a module still fits in one reading.

The import graph has one node per module; an edge for every ``import`` / ``from ... import`` of an
eaglekit module anywhere in a file (inside functions too), plus an edge to each package above the
imported module, whose ``__init__`` runs first (``import eaglekit.heads.config`` runs
``eaglekit/heads/__init__.py``). A module's own enclosing packages are not edges: they are being
imported already when it runs.
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "eaglekit"
MAX_LINES = 600
MAX_KIND_BRANCHES_OUTSIDE_HEADS = 3
KIND_NAMES = {"eagle1", "eagle3", "EAGLE1", "EAGLE3"}
# The parts (eaglekit's top-level modules and packages), lowest first: a part imports only parts of lower layers.
# ``cli`` is the entry point's dispatcher (commands by name, its error line), imported by the subcommands.
LAYERS = [{"fileio", "timing", "cli", "vllm_connector"}, {"assets"}, {"config", "assets_cli"},
          {"target", "engines"}, {"heads"}, {"export"}, {"decode", "data_prep"}, {"train", "bench"}, {"demo"}]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def imported(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The eaglekit modules ``path`` (module ``name``) imports anywhere in the file, with their packages."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            found |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {m for m in found if m in known and m != name and not name.startswith(m + ".")}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imported(path, name, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def part(module: str) -> str:
    """The part a module belongs to: ``eaglekit.decode.loop`` -> ``decode``."""
    return module.split(".")[1] if "." in module else module


def layer_violations(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """Each import of one part by another that is not below it (a part missing from ``layers`` is one too)."""
    rank = {p: i for i, layer in enumerate(layers) for p in layer}
    return sorted(f"{m} -> {d}" for m, ds in graph.items() for d in ds if part(m) != part(d)
                  and rank.get(part(d), len(layers)) >= rank.get(part(m), -1))


def is_kind(node) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in KIND_NAMES
    if isinstance(node, (ast.Name, ast.Attribute)):
        return (node.id if isinstance(node, ast.Name) else node.attr) in KIND_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(is_kind(e) for e in node.elts)
    return False


def kind_branches(path: Path) -> list[int]:
    """Lines comparing something with a head kind (``kind == "eagle3"``, ``x.kind != EAGLE1``, ``in (...)``)."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Compare) and any(is_kind(n) for n in [node.left, *node.comparators])]


# ---- the package ---------------------------------------------------------------------------------------
def test_eaglekit_imports_have_no_cycle():
    assert cycles(import_graph()) == []


def test_parts_import_only_lower_layers():
    graph = import_graph()
    assert {part(m) for m in graph if "." in m} <= set().union(*LAYERS), "a new part: give it a layer"
    assert layer_violations(graph, LAYERS) == []


def test_no_module_over_600_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_eagle1_eagle3_branches_live_in_heads():
    """Decoding, training and data preparation do not branch on the kind; the heads do, and the exports,
    whose layouts differ per kind by nature."""
    outside = {name: lines for name, path in modules().items()
               if not name.startswith(("eaglekit.heads", "eaglekit.export")) and (lines := kind_branches(path))}
    assert sum(map(len, outside.values())) <= MAX_KIND_BRANCHES_OUTSIDE_HEADS, outside


# ---- the checks can fail -------------------------------------------------------------------------------
@pytest.fixture
def probe(tmp_path):
    root = tmp_path / "eaglekit"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("from eaglekit.sub.low import x\n")
    (root / "sub" / "low.py").write_text("x = 1\n")
    (root / "top.py").write_text("def f():\n    from eaglekit.sub import low\n")
    return root


def test_graph_sees_function_local_imports_and_package_inits(probe):
    graph = import_graph(probe)
    assert graph["eaglekit.top"] == {"eaglekit.sub", "eaglekit.sub.low"}  # the package __init__ on the way
    assert graph["eaglekit.sub.low"] == set()  # its own package is not an edge
    assert cycles(graph) == []
    # a module the package's __init__ pulls in, importing (inside a function) a module that imports the package
    (probe / "sub" / "low.py").write_text("def g():\n    import eaglekit.top\n")
    assert cycles(import_graph(probe)) == [["eaglekit.sub", "eaglekit.sub.low", "eaglekit.top"]]


def test_layer_violations_are_found():
    graph = {"eaglekit.target": {"eaglekit.heads.base"}, "eaglekit.heads.base": {"eaglekit.target"},
             "eaglekit.decode.loop": {"eaglekit.data_prep.capture", "eaglekit.decode.cost"}}
    layers = [{"target"}, {"heads"}, {"decode", "data_prep"}]
    assert layer_violations(graph, layers) == ["eaglekit.decode.loop -> eaglekit.data_prep.capture",
                                               "eaglekit.target -> eaglekit.heads.base"]


def test_kind_branches_are_found(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('if kind == "eagle3":\n    pass\nx = cfg.kind != EAGLE1\ny = k in (None, "eagle1")\n'
                 'z = kind == "other"\n')
    assert kind_branches(f) == [1, 3, 4]
