"""A static cost model for the kernels' main loop, for targets with no GPU at hand.

From the disassembly, the audit takes the loop over key tiles (the outermost loop holding the
family's product instructions) and counts, per wave and per key tile: product instructions, all
VALU instructions (quarter-rate transcendentals weighted four times), LDS bytes per lane and the
waits on LDS results. Loops nested inside it (left rolled by the compiler) are weighted by the trip
count that makes the product count equal the family's own (``Family.products_per_step``), shared
equally between the nested loops that carry the products; other nested loops count once.

With the target's published rates (VALU lanes per SIMD per clock, LDS bytes per clock per
CU/WGP) and the audited occupancy W (waves per SIMD), one key tile of every resident wave costs:

    issue    W * valu * wave_size / valu_lanes                     cycles per SIMD
    lds      W * simds * lds_bytes * wave_size / lds_bytes_per_clock
    latency  valu * wave_size / valu_lanes + waits * LDS_LATENCY   (one wave's own chain)

The largest names the bound (issue splits into dot-bound when products are most of the VALU work,
VALU-bound otherwise); the share of the product peak is W * products * wave_size / valu_lanes
over it. Both sides of a branch inside the loop are counted, and broadcast LDS reads are counted
at full cost: the estimate ranks tiles of one family on one target, it does not predict time."""

from __future__ import annotations

import bisect
import re
from dataclasses import asdict, dataclass

# Cycles from an LDS read to its use when nothing else is ready (RDNA and GCN: ~64 clocks).
LDS_LATENCY = 64
# Quarter-rate VALU operations.
_TRANSCENDENTAL = re.compile(r"v_(exp|log|rcp|rsq|sqrt|sin|cos)_")
_DS = re.compile(r"ds_(?:read|write|load|store)(2st64|2)?_[biu](\d+)")
_CROSS_LANE = ("ds_bpermute_b32", "ds_permute_b32", "ds_swizzle_b32")


@dataclass(frozen=True)
class Instruction:
    address: int
    mnemonic: str
    operands: str
    target: int | None  # a branch's destination


@dataclass(frozen=True)
class LoopCounts:
    """One key tile of the main loop, per wave (per lane for LDS bytes)."""

    products: float   # the family's product instruction (v_dot2, v_dot4, v_fma_mix, ...)
    valu: float       # VALU issue slots, products included, transcendentals x4
    lds_bytes: float  # bytes each lane reads or writes in LDS (cross-lane permutes: 4)
    lds_waits: float  # s_waitcnt on lgkmcnt

    def to_json(self) -> dict:
        return {k: round(v, 2) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Estimate:
    bound: str        # dot-bound, VALU-bound, LDS-bound or latency-bound
    share: float      # fraction of the product instruction's peak rate
    issue: float      # cycles per key tile (see the module docstring)
    lds: float
    latency: float


def lds_bytes(mnemonic: str) -> int:
    if mnemonic in _CROSS_LANE:
        return 4
    m = _DS.match(mnemonic)
    if not m:
        return 0
    return int(m[2]) // 8 * (2 if m[1] else 1)


@dataclass(frozen=True)
class Isa:
    """How the counts read one instruction set's mnemonics."""

    issue_slots: object  # mnemonic -> VALU issue slots it takes (0: not a VALU instruction)
    lds_bytes: object    # mnemonic -> LDS bytes per lane
    lds_wait: object     # Instruction -> whether it waits for LDS results


AMDGCN = Isa(
    issue_slots=lambda m: (4 if _TRANSCENDENTAL.match(m) else 1) if m.startswith("v_") else 0,
    lds_bytes=lds_bytes,
    lds_wait=lambda i: i.mnemonic == "s_waitcnt" and "lgkmcnt" in i.operands,
)

_SASS_SIZE = {".128": 16, ".64": 8, ".U16": 2, ".S16": 2, ".U8": 1, ".S8": 1}


def _sass_lds_bytes(m: str) -> int:
    if not m.startswith(("LDS", "STS")) or m.startswith("LDSM"):
        return 0
    return next((size for suffix, size in _SASS_SIZE.items() if suffix in m), 4)


# NVIDIA SASS (cuobjdump -sass): every instruction but branches and barriers takes an issue slot of
# its SM sub-partition (MUFU a quarter-rate one); dependency waits are not instructions, so the
# latency term sees none.
SASS = Isa(
    issue_slots=lambda m: 0 if m.startswith(("BRA", "EXIT", "BAR", "NOP", "RET", "CALL", "WARPSYNC", "BSYNC", "BSSY"))
    else 4 if m.startswith("MUFU") else 1,
    lds_bytes=_sass_lds_bytes,
    lds_wait=lambda i: False,
)


def _loops(code: list[Instruction]) -> list[tuple[int, int]]:
    """(first, last) instruction addresses of every backward branch's span."""
    return [(i.target, i.address) for i in code if i.target is not None and i.target <= i.address]


def loop_counts(code: list[Instruction], product: str, products_per_step: float | None,
                isa: Isa = AMDGCN) -> LoopCounts | None:
    """The main loop's counts, or None when no loop holds a ``product`` instruction."""
    def inside(i: Instruction, span: tuple[int, int]) -> bool:
        return span[0] <= i.address <= span[1]

    # The loops holding a product: the first product address at or after a loop's start is within it.
    products = sorted(i.address for i in code if i.mnemonic.startswith(product))
    spans = _loops(code)
    loops = [s for s in spans if (n := bisect.bisect_left(products, s[0])) < len(products) and products[n] <= s[1]]
    if not loops:
        return None
    main = max(loops, key=lambda s: (s[1] - s[0], -s[0]))
    nested = sorted({s for s in spans if s != main and main[0] <= s[0] and s[1] <= main[1]},
                    key=lambda s: s[1] - s[0])
    body = [i for i in code if inside(i, main)]
    # Each instruction belongs to the innermost nested loop holding it (None: the main loop's own).
    owner = [next((s for s in nested if inside(i, s)), None) for i in body]
    static: dict = {}
    for i, o in zip(body, owner):
        if i.mnemonic.startswith(product):
            static[o] = static.get(o, 0) + 1
    # The products the main loop's own code does not issue are shared equally by the nested loops
    # that carry the products (for the fp16 family exact: S and P.V issue half each): those with at
    # least an eighth of the largest one's. Other nested loops (lane reductions, a few trips, with
    # a stray product or none) count once.
    largest = max((n for s, n in static.items() if s is not None), default=0)
    product_loops = [s for s, n in static.items() if s is not None and 8 * n >= largest]
    trips = {}
    if products_per_step and product_loops:
        share = max(products_per_step - static.get(None, 0), 0) / len(product_loops)
        trips = {s: max(1.0, share / static[s]) for s in product_loops}
    totals = dict(products=0.0, valu=0.0, lds_bytes=0.0, lds_waits=0.0)
    for i, o in zip(body, owner):
        w = trips.get(o, 1.0)  # a stray product in a once-counted loop is counted once too
        m = i.mnemonic
        if m.startswith(product):
            totals["products"] += w
        totals["valu"] += w * isa.issue_slots(m)
        totals["lds_bytes"] += w * isa.lds_bytes(m)
        if isa.lds_wait(i):
            totals["lds_waits"] += w
    return LoopCounts(**totals)


def estimate(counts: LoopCounts, *, waves_per_simd: int, wave_size: int, valu_lanes: int, simds: int,
             lds_bytes_per_clock: int) -> Estimate:
    per_instruction = wave_size / valu_lanes
    w = max(waves_per_simd, 1)
    issue = w * counts.valu * per_instruction
    lds = w * simds * counts.lds_bytes * wave_size / lds_bytes_per_clock
    latency = counts.valu * per_instruction + counts.lds_waits * LDS_LATENCY
    worst = max(issue, lds, latency)
    if worst == issue:
        bound = "dot-bound" if counts.products >= counts.valu / 2 else "VALU-bound"
    else:
        bound = "LDS-bound" if worst == lds else "latency-bound"
    share = w * counts.products * per_instruction / worst if worst else 0.0
    return Estimate(bound=bound, share=share, issue=issue, lds=lds, latency=latency)


def estimate_on(target, loop: LoopCounts, waves_per_simd: int) -> Estimate:
    """The estimate with ``target``'s rates (a matrix Target)."""
    return estimate(loop, waves_per_simd=waves_per_simd, wave_size=target.wave_size, valu_lanes=target.valu_lanes,
                    simds=target.simds_per_cu, lds_bytes_per_clock=target.lds_bytes_per_clock)


def audit_fields(loop: LoopCounts | None, target, waves_per_simd: int) -> dict:
    """The audit row's cost-model fields for a kernel on ``target`` (a matrix Target)."""
    if loop is None:
        return {"loop": None, "bound": None, "peak_share": None}
    e = estimate_on(target, loop, waves_per_simd)
    return {"loop": loop.to_json(), "bound": e.bound, "peak_share": round(e.share, 3)}


_SASS_LINE = re.compile(r"/\*(?P<addr>[0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?(?P<op>[A-Z][A-Z0-9_.]*)(?P<rest>[^;]*);")
_SASS_LABEL = re.compile(r"^\s*(?P<label>\.L_x_\d+):")
_SASS_FUNCTION = re.compile(r"^\s*Function\s*:\s*(?P<name>\S+)")


def parse_sass(text: str) -> dict[str, list[Instruction]]:
    """``cuobjdump -sass`` output: each function's instructions, branch targets resolved from labels."""
    out: dict[str, list[Instruction]] = {}
    pending: list[str] = []
    labels: dict[str, int] = {}
    raw: list[tuple[int, str, str]] = []
    name = None

    def flush() -> None:
        if name is not None:
            out[name] = [Instruction(a, m, r.strip(), _sass_target(r, labels) if m.startswith("BRA") else None)
                         for a, m, r in raw]

    for line in text.splitlines():
        f = _SASS_FUNCTION.match(line)
        if f:
            flush()
            name, raw, labels, pending = f["name"], [], {}, []
            continue
        lab = _SASS_LABEL.match(line)
        if lab:
            pending.append(lab["label"])
            continue
        m = _SASS_LINE.search(line)
        if m and name is not None:
            addr = int(m["addr"], 16)
            for label in pending:
                labels[label] = addr
            pending = []
            raw.append((addr, m["op"], m["rest"]))
    flush()
    return out


def _sass_target(operands: str, labels: dict[str, int]) -> int | None:
    """A branch's destination: ``BRA 0x370`` (cuobjdump) or ``BRA `(.L_x_3)`` (nvdisasm)."""
    m = re.search(r"\.L_x_\d+", operands)
    if m:
        return labels.get(m[0])
    m = re.search(r"0x([0-9a-f]+)", operands)
    return int(m[1], 16) if m else None
