"""The ``when:`` key of tile tables and tuned overlays: which calls an entry serves, parsed into
the runtime's Constraints."""

from __future__ import annotations

from rdnattention.table import Constraints

from .strict_yaml import Node


def _range(node: Node, key: str) -> tuple[int, int | None] | None:
    value = node.take(key, list, None)
    if value is None:
        return None
    ok = (len(value) == 2 and isinstance(value[0], int) and not isinstance(value[0], bool) and value[0] >= 0
          and (value[1] is None or (isinstance(value[1], int) and not isinstance(value[1], bool)
                                    and value[1] >= value[0])))
    if not ok:
        raise node.fail(key, f"expected [min, max] with 0 <= min <= max (max null: open), got {value!r}")
    return (value[0], value[1])


def constraints(node: Node) -> Constraints:
    """``when: {causal: bool, seq_q: [min, max or null], rows: [min, max or null]}``; rows: query
    rows per K/V head (query heads per K/V head times seq_q)."""
    causal = node.take("causal", bool, None)
    seq_q, rows = _range(node, "seq_q"), _range(node, "rows")
    node.finish()
    return Constraints(causal=causal, seq_q=seq_q, rows=rows)
