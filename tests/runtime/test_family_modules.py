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


def test_layout_options_are_spelled_by_the_names():
    for name, module in FAMILIES.items():
        layouts = getattr(module, "LAYOUTS", {})
        fields = {f.key: f for f in module.NAMES.fields}
        if not layouts:
            assert "options.layout" not in fields, name
            continue
        sample = {"head_dim": 64, "gqa_group": 1, "tile.br": 4, "tile.bc": 16, "tile.threads": 128, "tile.tm": 4,
                  "tile.waves": 0, "wave_size": 32, "tier": "dot2", "stage": "f16", "options.dtype": None,
                  "options.score": None, "options.stage": None}
        if name == "bwd":  # the backward's fp32-staged tier (its fp16-staged kernels spell _sf16 after it)
            sample["tier"] = "cvt_fma"
        for layout in layouts:
            kernel = module.NAMES.name(lambda key: {**sample, "options.layout": layout}[key])
            assert layout in kernel and module.NAMES.parse(kernel)["options.layout"] == layout, kernel
        plain = module.NAMES.parse(module.NAMES.name(lambda key: {**sample, "options.layout": None}[key]))
        assert plain is not None and "options.layout" not in plain
