"""The generator's modules import one another in layers: no module imports the package inside a
function (the way an import circle is kept open), the module-level imports form no circle, and
every module imports on its own."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import rdnattention_gen

PACKAGE = Path(rdnattention_gen.__file__).resolve().parent
ROOT = PACKAGE.name


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The package's modules ``node`` (in ``module``) names; empty for imports from elsewhere."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in MODULES]
    if node.level:
        base = module.split(".")
        if not _is_package(module):
            base = base[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source not in MODULES:
        return []
    # `from pkg import name`: the submodule pkg.name where there is one, else pkg itself
    return sorted({f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names})


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str) -> tuple[list[ast.AST], list[ast.AST]]:
    """(imports run when the module is imported, imports inside functions); imports under a
    module-level ``if TYPE_CHECKING:`` are neither."""
    top: list[ast.AST] = []
    local: list[ast.AST] = []

    def visit(nodes: list[ast.AST], in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                (local if in_function else top).append(node)
            elif isinstance(node, ast.If) and not in_function and _type_checking(node):
                visit(node.orelse, False)
            else:
                visit(list(ast.iter_child_nodes(node)),
                      in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(MODULES[module].read_text(), str(MODULES[module])).body, False)
    return top, local


def _discovers(module: str) -> bool:
    """A package whose __init__ imports every module in it (rdnattention.discovery.modules)."""
    return _is_package(module) and "modules(__name__, __path__)" in MODULES[module].read_text()


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules importing it imports first: what its module-level imports
    name, their enclosing packages (other than its own), and for a discovering package its modules."""
    graph = {}
    for module in MODULES:
        edges: set[str] = set()
        for node in _imports(module)[0]:
            for target in _imported(module, node):
                edges.add(target)
                edges.update(a for a in _ancestors(target) if a not in _ancestors(module))
        if _discovers(module):
            edges.update(m for m in MODULES if m.rpartition(".")[0] == module)
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_checker_sees_relative_and_absolute_imports():
    f = ast.parse("from ..matrix import Target\nfrom . import audit, TEMPLATES\nimport rdnattention_gen.spec\n"
                  "from .families import family\nfrom rdnattention.table import Constraints").body
    assert _imported("rdnattention_gen.platforms.amdgcn", f[0]) == ["rdnattention_gen.matrix"]
    assert _imported("rdnattention_gen.render", f[1]) == ["rdnattention_gen", "rdnattention_gen.audit"]
    assert _imported("rdnattention_gen.families", f[2]) == ["rdnattention_gen.spec"]
    assert _imported("rdnattention_gen", f[3]) == ["rdnattention_gen.families"]
    assert _imported("rdnattention_gen.render", f[4]) == []
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_module_imports_the_package_inside_a_function():
    found = []
    for module, path in MODULES.items():
        for node in _imports(module)[1]:
            if (isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == ROOT)) or \
                    (isinstance(node, ast.Import) and any(a.name.split(".")[0] == ROOT for a in node.names)):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "imports of the generator inside functions (import at module level, in layers):\n  " + \
        "\n  ".join(found)


def test_module_imports_form_no_circle():
    graph = import_graph()
    assert set(graph) == set(MODULES) and graph["rdnattention_gen.matrix"]  # the checker sees the modules
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_every_module_imports_on_its_own():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
    runs = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], cwd=PACKAGE.parent, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for m in sorted(MODULES)}
    output = {m: p.communicate()[0] for m, p in runs.items()}
    failed = {m: output[m].strip().splitlines()[-1:] for m, p in runs.items() if p.returncode != 0}
    assert not failed, failed
