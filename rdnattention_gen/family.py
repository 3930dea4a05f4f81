"""What a kernel family is to the generator. A family module under families/ defines one
:class:`Family`: its axes in variants.yaml, its validation rules, its name schema, its LDS layout,
its argument struct (imported from the runtime, which owns it), its audit signature per tier, its
template, the layout options its kernels are also compiled with, and the cases the oracle sweep
runs it on. Which family serves a call is the runtime chooser's (rdnattention/route.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from rdnattention.abi import ArgStruct

from .spec import KernelSpec, NameSchema, Tile
from .strict_yaml import Node
from .target import Target


@dataclass(frozen=True)
class Rule:
    """One named validation rule: ``ok`` says whether a spec satisfies it on a target, ``message``
    why not. ``stop``: later rules assume this one holds, so they are not evaluated after it fails."""

    name: str
    ok: Callable[[KernelSpec, Target], bool]
    message: Callable[[KernelSpec, Target], str]
    stop: bool = False


@dataclass(frozen=True)
class OracleCase:
    """A shape and options the test sweep runs every kernel of the family on, against the oracle
    (tests/cases.py turns it into a call of the entry point that serves the family). ``layout``: the
    family's layout option whose kernels the case runs (None: the plain ones). ``options`` are
    the call's (is_causal, window_size, softmax_scale, rope) and its layout's: ``seqused_k`` (keys
    each sequence uses), ``seqlens_q``/``seqlens_k`` (a packed batch: batch, seq_q and seq_k are
    their count and longest), ``page_size`` (a paged cache of seq_k keys per sequence),
    ``num_splits`` (key slices); and the score transforms: ``softcap``, ``alibi`` (slopes per
    ``heads`` or per ``batch`` and head) and ``sinks`` (True), the tensors made by the test.
    ``score``: the family's score option whose kernels the case runs (None: the kernels without one)."""

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    options: dict = field(default_factory=dict)
    layout: str | None = None
    score: str | None = None


class Family:
    name: str
    template: str                     # the kernel template under templates/
    args: ArgStruct                   # the runtime's argument struct for this family
    schema: NameSchema
    rules: tuple[Rule, ...]
    signatures: dict[str, str]        # tier -> audit count that must be non-zero
    oracle_cases: dict[str, OracleCase]
    # The layout options the kernels are also compiled with (the runtime module's LAYOUTS: option ->
    # what those kernels read), each at the head_dims `layouts:` lists under the family in
    # variants.yaml; the same template and tiles, the option a compile-time switch.
    layouts: dict[str, str] = {}
    # The input dtypes the kernels are also compiled for beside fp16 (the runtime module's DTYPES:
    # option -> what those kernels read), each at the head_dims `dtypes:` lists under the family in
    # variants.yaml, for the plain kernels and every layout option built there; the same template
    # and tiles over another element policy.
    dtypes: dict[str, str] = {}
    # The score-transform options the kernels are also compiled with (the runtime module's SCORES:
    # option -> what those kernels apply), each at the head_dims `scores:` lists under the family in
    # variants.yaml, for every layout and dtype built there; the same template with a compile-time
    # switch, at the family's tiles but where a table lists `<family>_<score>` tiles.
    scores: dict[str, str] = {}
    tile_constraints: bool = True     # False: the tiles' `when:` does not apply (the kernel serves every call)
    tune_layouts: bool = False        # True: the tuner builds the layout kernels too (the passes of one call)
    # True: the kernels take the head_dim at launch, built once at the most they take (the append,
    # the quantization); a build narrowed to some head_dims (Matrix.narrowed) keeps them whole.
    head_dim_at_launch: bool = False

    # --- the matrix
    def axes(self, node: Node) -> dict:
        """Parses this family's entry under ``kernels:`` (and finishes the node)."""
        raise NotImplementedError

    def points(self, axes: dict) -> list[dict]:
        """Every (head_dim, gqa_group, ...) point of the axes, and the layout points: the same at the
        head_dims each layout option lists (``layout``: the option; absent for the plain kernels)."""
        plain = self.plain_points(axes)
        points = plain + [{**p, "layout": layout} for layout, dims in axes.get("layouts", {}).items()
                          for p in plain if p["head_dim"] in dims]
        points += [{**p, "dtype": dtype} for dtype, dims in axes.get("dtypes", {}).items()
                   for p in points if p["head_dim"] in dims]
        return points + [{**p, "score": score} for score, dims in axes.get("scores", {}).items()
                         for p in points if p["head_dim"] in dims]

    def plain_points(self, axes: dict) -> list[dict]:
        raise NotImplementedError

    def builds_point(self, target: Target, point: dict) -> bool:
        """Whether ``target`` builds the kernels of ``point`` (one of ``points``): all by default."""
        return True

    def layout_axes(self, node: Node, head_dims: tuple[int, ...]) -> dict:
        """``layouts: {<option>: [head_dims]}`` under the family (optional): each a layout of the
        family's and a subset of its head_dims."""
        if "layouts" not in node:
            return {}
        layouts = node.child("layouts")
        out = {}
        for key in sorted(layouts, key=lambda k: layouts.key_lines.get(k, 0)):
            if key not in self.layouts:
                raise layouts.fail(key, f"not a layout of {self.name} (its layouts: "
                                        f"{', '.join(sorted(self.layouts)) or 'none'})")
            dims = layouts.int_list(key)
            extra = [d for d in dims if d not in head_dims]
            layouts.check(key, not extra, f"head_dims {extra} are not {self.name}'s head_dims {list(head_dims)}")
            out[key] = dims
        layouts.finish()
        return {"layouts": out} if out else {}

    def dtype_axes(self, node: Node, head_dims: tuple[int, ...]) -> dict:
        """``dtypes: {<dtype>: [head_dims]}`` under the family (optional): each an input dtype of the
        family's besides fp16 and a subset of its head_dims."""
        return self._option_axes(node, "dtypes", self.dtypes, "dtype", "dtypes besides fp16", head_dims)

    def score_axes(self, node: Node, head_dims: tuple[int, ...]) -> dict:
        """``scores: {<score>: [head_dims]}`` under the family (optional): each a score-transform
        option of the family's and a subset of its head_dims."""
        return self._option_axes(node, "scores", self.scores, "score option", "score options", head_dims)

    def _option_axes(self, node: Node, key: str, known: dict[str, str], what: str, whats: str,
                     head_dims: tuple[int, ...]) -> dict:
        if key not in node:
            return {}
        options = node.child(key)
        out = {}
        for name in sorted(options, key=lambda k: options.key_lines.get(k, 0)):
            if name not in known:
                raise options.fail(name, f"not a {what} of {self.name} (its {whats}: "
                                         f"{', '.join(sorted(known)) or 'none'})")
            dims = options.int_list(name)
            extra = [d for d in dims if d not in head_dims]
            options.check(name, not extra, f"head_dims {extra} are not {self.name}'s head_dims {list(head_dims)}")
            out[name] = dims
        options.finish()
        return {key: out} if out else {}

    @staticmethod
    def options(point: dict) -> tuple[tuple[str, object], ...]:
        """A spec's options for ``point``: its layout, its dtype and its score option, where it has them."""
        return tuple((key, point[key]) for key in ("layout", "dtype", "score") if point.get(key))

    def tier(self, target: Target) -> str | None:
        """This family's lowering on ``target``, or None when it has no kernels there."""
        raise NotImplementedError

    def spec(self, target: Target, point: dict, tile: Tile) -> KernelSpec:
        raise NotImplementedError

    def lds_layout(self, spec: KernelSpec) -> dict[str, int]:
        """Byte sizes of the kernel's LDS regions, in the order the kernel carves them."""
        raise NotImplementedError

    def lds_bytes(self, spec: KernelSpec) -> int:
        return sum(self.lds_layout(spec).values())

    def from_name(self, name: str) -> KernelSpec | None:
        raise NotImplementedError

    def problems(self, spec: KernelSpec, target: Target) -> list[str]:
        out = []
        for rule in self.rules:
            if not rule.ok(spec, target):
                out.append(rule.message(spec, target))
                if rule.stop:
                    break
        return out

    def tile_space(self, target: Target, head_dim: int) -> dict[str, tuple[int, ...]] | None:
        """Values of each tile field (br, bc, threads, tm) the tuner tries; None: not tuned. Register
        budgets (waves) come from the target (target.register_budgets)."""
        return None

    def products_per_step(self, spec: KernelSpec) -> float | None:
        """Product instructions (the tier's signature) one thread issues per key tile, for the cost
        model's trip counts (cost.py); None: not stated, nested loops count once."""
        return None

    # --- rendering
    def context(self, spec: KernelSpec) -> dict:
        """Template variables beyond ``spec`` and ``family``."""
        return {}


class HeadDimAxis:
    """A family whose only axis is ``head_dims`` (no compile-time GQA group): mixed in before Family."""

    def axes(self, node: Node) -> dict:
        axes = {"head_dims": node.int_list("head_dims")}
        axes.update(self.layout_axes(node, axes["head_dims"]))
        axes.update(self.dtype_axes(node, axes["head_dims"]))
        node.finish()
        return axes

    def plain_points(self, axes: dict) -> list[dict]:
        return [{"head_dim": hd, "gqa_group": 1} for hd in axes["head_dims"]]
