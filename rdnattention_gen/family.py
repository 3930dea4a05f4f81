"""What a kernel family is to the generator. A family module under families/ defines one
:class:`Family`: its axes in variants.yaml, its validation rules, its name schema, its LDS layout,
its argument struct (imported from the runtime, which owns it), its audit signature per tier, its
template, and the cases the oracle sweep runs it on. Nothing outside the module knows them."""

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
    (tests/cases.py turns it into a call of the entry point that serves the family). ``options`` are
    the call's (is_causal, window_size, softmax_scale, rope) and its layout's: ``seqused_k`` (keys
    each sequence uses), ``seqlens_q``/``seqlens_k`` (a packed batch: batch, seq_q and seq_k are
    their count and longest), ``page_size`` (a paged cache of seq_k keys per sequence),
    ``num_splits`` (key slices)."""

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    options: dict = field(default_factory=dict)


class Family:
    name: str
    template: str                     # the kernel template under templates/
    args: ArgStruct                   # the runtime's argument struct for this family
    schema: NameSchema
    rules: tuple[Rule, ...]
    signatures: dict[str, str]        # tier -> audit count that must be non-zero
    oracle_cases: dict[str, OracleCase]
    tiles_family: str | None = None   # take another family's tiles (a variant of it); None: its own
    tile_constraints: bool = True     # False: the tiles' `when:` does not apply (the kernel serves every call)

    # --- the matrix
    def axes(self, node: Node) -> dict:
        """Parses this family's entry under ``kernels:`` (and finishes the node)."""
        raise NotImplementedError

    def points(self, axes: dict) -> list[dict]:
        """Every (head_dim, gqa_group, ...) point of the axes."""
        raise NotImplementedError

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
        node.finish()
        return axes

    def points(self, axes: dict) -> list[dict]:
        return [{"head_dim": hd, "gqa_group": 1} for hd in axes["head_dims"]]
