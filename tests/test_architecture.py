"""The package's shape, as docs/architecture.md draws it: no import cycles between modules, the
decode core importing nothing above it, family code only in drafters/ and targets/, small modules."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "omlx_mtp"
MAX_LINES = 500


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Modules of this package that ``path`` imports: everywhere, or only in statements that run
    when it is imported (a deferred import inside a function can't form an import cycle)."""
    module = _module(path)
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    tree = ast.parse(path.read_text())
    nodes = _run_at_import(tree.body) if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("omlx_mtp")}
        elif isinstance(node, ast.ImportFrom):
            prefix = base[: len(base) - node.level + 1] if node.level else []
            target = ".".join(prefix + ([node.module] if node.module else []))
            if target.startswith("omlx_mtp"):
                found |= {target, *(f"{target}.{a.name}" for a in node.names)}
    return found


def _run_at_import(body: list) -> list:
    """The statements of a module body, those inside its ``if`` blocks (``TYPE_CHECKING`` included:
    a typing-only import still ties two modules together) and ``try`` blocks too."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If):
            out += _run_at_import(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            out += _run_at_import(node.body + node.orelse + node.finalbody
                                  + [n for h in node.handlers for n in h.body])
    return out


def graph(top_level_only: bool = False) -> dict[str, set[str]]:
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    return {name: {m for m in _imports(path, top_level_only) if m in modules and m != name}
            for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(graph(top_level_only=True))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_decode_imports_nothing_above_it():
    """decode/ is the core: targets, drafters, hosts and tools depend on it, never the reverse."""
    allowed = ("omlx_mtp.decode", "omlx_mtp.errors")
    for name, deps in graph().items():
        if name.startswith("omlx_mtp.decode"):
            outside = sorted(d for d in deps if not d.startswith(allowed) and d != "omlx_mtp")
            assert not outside, f"{name} imports {outside}"


def test_layers_point_down():
    """checkpoint/'s readers know nothing outside checkpoint/ (its quantizer and inspector sit above
    the drafters); drafters/ and targets/ know no host or tool; hosts/ know no tool."""
    readers = ("files", "loading", "mtp_tensors", "gemma4_config", "shards")
    rules = {**{f"omlx_mtp.checkpoint.{name}": ("omlx_mtp.decode", "omlx_mtp.drafters", "omlx_mtp.targets",
                                                 "omlx_mtp.hosts", "omlx_mtp.tools") for name in readers},
             "omlx_mtp.checkpoint": ("omlx_mtp.hosts", "omlx_mtp.tools"),
             "omlx_mtp.drafters": ("omlx_mtp.hosts", "omlx_mtp.tools"),
             "omlx_mtp.targets": ("omlx_mtp.hosts", "omlx_mtp.tools", "omlx_mtp.drafters"),
             "omlx_mtp.hosts": ("omlx_mtp.tools",)}
    for name, deps in graph().items():
        for package, forbidden in rules.items():
            if name.startswith(package):
                bad = sorted(d for d in deps if d.startswith(forbidden))
                assert not bad, f"{name} imports {bad}"


def _private_names(tree) -> set[str]:
    """Private functions, methods and classes a module defines (``_name``, not dunders)."""
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.name.startswith("_") and not n.name.startswith("__")}


def private_reaches(sources: dict[str, str] | None = None) -> list[str]:
    """Where a module imports another module's private name, or calls one on an object other than
    ``self``, ``cls`` or ``super()`` (a private name of this package that the module itself doesn't
    define: the seam runs through another module's insides).  ``sources``: name -> code (default:
    the package's modules)."""
    if sources is None:
        sources = {str(p.relative_to(ROOT)): p.read_text() for p in ROOT.rglob("*.py")}
    trees = {name: ast.parse(code) for name, code in sources.items()}
    everywhere = set().union(*(_private_names(t) for t in trees.values()))
    found = []
    for where, tree in trees.items():
        own = _private_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("omlx_mtp")):
                found += [f"{where}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name, owner = node.func.attr, node.func.value
                if name not in everywhere or name in own:
                    continue
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
                    continue
                found.append(f"{where}:{node.lineno} calls {ast.unparse(node.func)}")
    return found


def test_no_calls_into_another_modules_private_names():
    """Modules meet through public names: the batch through the decoder's round API, the hosts
    through the decoder's and generator's public methods."""
    reaches = private_reaches()
    assert not reaches, reaches


def test_modules_stay_small():
    big = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_the_checks_can_fail():
    """The graph finds the loop's imports (relative, from a package and deferred ones), and a
    planted cycle is found."""
    edges = graph()
    assert "omlx_mtp.decode.batch" in edges["omlx_mtp.decode.loop"]
    assert "omlx_mtp.decode.requests" in edges["omlx_mtp.decode.batch"]
    assert "omlx_mtp.checkpoint.quantize" in edges["omlx_mtp.tools.cli"]  # imported inside a function
    typing_only = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .loop import Decoder\n")
    assert any(isinstance(n, ast.ImportFrom) and n.module == "loop" for n in _run_at_import(typing_only.body))
    planted_calls = {"a.py": "class A:\n    def _inside(self):\n        pass\n",
                     "b.py": "from .a import _helper\n\ndef use(a):\n    return a._inside()\n"}
    assert private_reaches(planted_calls) == ["b.py:1 imports _helper", "b.py:4 calls a._inside"]
    planted = {**graph(top_level_only=True)}
    planted["omlx_mtp.decode.requests"] = planted["omlx_mtp.decode.requests"] | {"omlx_mtp.decode.loop"}
    assert find_cycle(planted) is not None
