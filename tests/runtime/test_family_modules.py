"""The runtime's family modules (rdnattention/families/) stand apart: their module-level imports of
one another form no circle, none calls another family's planner (which family serves a call is
route.py's choice alone), and every family that declares layout options spells them in its names."""

import ast
from pathlib import Path

import rdnattention.families as families_package
from rdnattention.families import FAMILIES

FAMILY_DIR = Path(families_package.__file__).resolve().parent
MODULES = {p.stem: ast.parse(p.read_text()) for p in sorted(FAMILY_DIR.glob("*.py")) if p.stem != "__init__"}


def _siblings(tree: ast.Module) -> set[str]:
    """The sibling modules a family module imports when it is imported (``from . import x``)."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module)
            else:
                out.update(a.name for a in node.names)
    return out & set(MODULES)


def test_family_modules_import_one_another_without_a_circle():
    graph = {m: _siblings(tree) for m, tree in MODULES.items()}
    assert graph["i8dec"] >= {"dec", "i8"}  # the checker sees the imports
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, "import circle: " + " -> ".join(path + [m, n])
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_no_family_module_calls_another_familys_planner():
    calls = []
    for m, tree in MODULES.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == "plan" and isinstance(node.value, ast.Name)
                    and node.value.id in MODULES and node.value.id not in (m, "_splitkv")):
                calls.append(f"{m}.py:{node.lineno}: {ast.unparse(node)}")
    assert not calls, calls


# What follows the layout in a kernel name, by family (the row-block families' by default).
NAME_REST = {"bwd": "_hd64_br16_bc16_nt128_w32_cvt_fma"}


def test_layout_options_are_spelled_by_the_names():
    for name, module in FAMILIES.items():
        layouts = getattr(module, "LAYOUTS", {})
        fields = {f.key: f for f in module.NAMES.fields}
        if not layouts:
            assert "options.layout" not in fields, name
            continue
        rest = NAME_REST.get(name, "_hd64_g1_br4_bc16_nt128_tm4_w32_dot2_sf16")
        for layout in layouts:
            kernel = f"{module.NAMES.prefix}{layout}{rest}"
            assert module.NAMES.parse(kernel)["options.layout"] == layout, kernel
        plain = module.NAMES.parse(f"{module.NAMES.prefix}{rest}")
        assert plain is not None and "options.layout" not in plain
