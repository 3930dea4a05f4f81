"""Which kernel family serves a call: the one chooser every entry point goes through.

An entry point validates its arguments and describes the call as an :class:`Attention` (the
tensors in the kernels' view and the options). The chooser reads only what decides the family
(:class:`Request`: precision, how the keys and values are laid out, head_dim, query rows per K/V
head, the kernel options the call needs, a kernel forced by name) against :data:`ALGORITHMS`,
which states every algorithm: its kernel family, the layout option its kernels are compiled with
for each way a call's keys are laid out, and the options its kernels take. :func:`choose` returns
the family and layout that serve the call, or the typed error that says why none does; it is also
the "is this supported" check (the transformers integration falls back on its error).
:func:`plan` hands the call to the chosen algorithm's planner, which picks the entry within the
family (tile, GQA group, constraints: TargetTable.select)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from . import dispatch, drivers
from .call import Attention, Layout, Option, Precision, Request
from .errors import KernelsNotBuiltError, UnsupportedError
from .families import dec, f16, i8, i8dec
from .plan import Plan
from .table import TargetTable, kind


# (device, drivers.environment_token()) -> (table, table_for's generation)
_by_device: dict[tuple, tuple[TargetTable, int]] = {}


def device_table(device: torch.device) -> TargetTable:
    """The dispatch table of the target whose kernels run tensors on ``device`` (kept per device
    and environment, until dispatch.table_for's cache is cleared)."""
    key = (device, drivers.environment_token())
    hit = _by_device.get(key)
    generation = dispatch.table_for.generation
    if hit is not None and hit[1] == generation:
        return hit[0]
    table = _device_table(device)
    _by_device[key] = (table, generation)
    return table


def _device_table(device: torch.device) -> TargetTable:
    driver = drivers.for_device(device)
    target = drivers.target_of(device, driver)
    named = drivers.platform_named(target)
    if named is not None and named != driver.PLATFORM:  # refused before its kernels are looked for
        _refuse_platform(device, driver, target, named)
    try:
        table = dispatch.table_for(target)
    except KernelsNotBuiltError:
        if device.type != "cuda":
            raise
        table = dispatch.table_for(target, torch.cuda.get_device_name(device))
    if table.platform != driver.PLATFORM:
        _refuse_platform(device, driver, target, table.platform)
    return table


def _refuse_platform(device: torch.device, driver, target: str, platform: str) -> None:
    """A forced target of another platform: its kernels cannot read tensors on ``device``."""
    env = drivers.env_naming_target(device)
    chosen = f"{env}={target}" if env else f"target {target}"
    raise UnsupportedError(f"{chosen} names a target of platform {platform}, but tensors on {device} run on "
                           f"{driver.PLATFORM} targets; unset {env or 'it'} or name a {driver.PLATFORM} target")


def _int8_call(a: Attention) -> i8.Call:
    q_scale, k_scale, v_scale = a.scales
    return i8.Call(q=a.q, k=a.k, v=a.v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=a.out, lse=a.lse,
                   window=a.window, softmax_scale=a.softmax_scale)


def _fp16_row_blocks(table: TargetTable, a: Attention) -> Plan:
    return f16.plan(table, a)  # on the kernels of its layout


def _fp16_split_kv(table: TargetTable, a: Attention) -> Plan:
    return dec.plan(table, a, kernel=a.kernel)  # dec plans the call as it is


def _int8_row_blocks(table: TargetTable, a: Attention) -> Plan:
    return i8.plan(table, _int8_call(a), heavy_first=a.heavy_first, kernel=a.kernel)


def _int8_split_kv(table: TargetTable, a: Attention) -> Plan:
    return i8dec.plan(table, _int8_call(a), kernel=a.kernel, num_splits=a.num_splits)


@dataclass(frozen=True, eq=False)
class Algorithm:
    """One way of computing attention, and what it serves: a precision, its kernel family, the
    layouts it reads (each with the family's layout option its kernels are compiled with for it,
    None for the plain kernels), the options its kernels take, and its planner."""

    name: str
    precision: Precision
    split_kv: bool  # key slices for few query rows (flash-decoding), or blocks of query rows
    family: str
    layouts: Mapping[Layout, str | None]
    options: frozenset[Option]
    planner: Callable[[TargetTable, Attention], Plan]
    # The options whose calls run the family's kernels of a score option (f16's ALiBi: alibi), where
    # those are built for the call's head_dim, layout and dtype; the family's other kernels never
    # take such a call.
    scores: Mapping[Option, str] = field(default_factory=dict)

    def score(self, options: frozenset[Option]) -> str | None:
        """The family's score option whose kernels serve a call needing ``options``; None: the kernels
        without one."""
        return next((s for o, s in self.scores.items() if o in options), None)

    def kind(self, layout: Layout, dtype: str | None = None, score: str | None = None) -> str:
        """The kernels that read ``layout`` (in ``dtype``: the family's dtype option, None for its
        own; with ``score``: its score option), as messages say them: ``f16 len``, ``dec paged bf16``,
        ``f16 alibi``."""
        return kind(self.family, self.layouts[layout], dtype, score)


# The score transforms, applied in the score step of the fp16 kernels (fa2_policies.h); the int8
# kernels have none, so a call asking for one is refused there naming it. The row-block kernels
# apply them only where compiled with them (score options xf: softcap and sinks; alibi: ALiBi besides
# them; at the head_dims variants.yaml lists): carried by every kernel, they cost the tightest AMD
# tiles registers they do not have (spills on RDNA1 and GCN, a wave on RDNA2), so the plain kernels
# have none. Calls with them of few rows (split_kv_preferred), and those at head_dims without such
# kernels, run the split-KV kernels, which read them from the arguments (ALiBi in tiles of at most
# _splitkv.alibi_rows rows, the target's decode_alibi_rows; any number of rows in chunks).
SCORE_TRANSFORMS = (Option.SOFTCAP, Option.ALIBI, Option.SINKS)

FP16_ROW_BLOCKS = Algorithm(
    "fp16 row-block", Precision.FP16, split_kv=False, family=f16.NAME,
    layouts={Layout.STRIDED: None, Layout.SEQUSED: "len", Layout.PACKED: "varlen"},
    options=frozenset({Option.ROTARY, Option.ROW_ORDER, *SCORE_TRANSFORMS}), planner=_fp16_row_blocks,
    scores=f16.SCORE_OPTIONS)  # the first the call needs
FP16_SPLIT_KV = Algorithm(
    "fp16 split-KV", Precision.FP16, split_kv=True, family=dec.NAME,
    layouts={Layout.STRIDED: None, Layout.SEQUSED: None, Layout.PACKED: None, Layout.PAGED: "paged"},
    options=frozenset({Option.CACHE_ROWS, Option.KEY_SLICES, Option.QUERY_COUNTS, *SCORE_TRANSFORMS}),
    planner=_fp16_split_kv)
INT8_ROW_BLOCKS = Algorithm(
    "int8 row-block", Precision.INT8, split_kv=False, family=i8.NAME, layouts={Layout.STRIDED: None},
    options=frozenset({Option.ROW_ORDER}), planner=_int8_row_blocks)
INT8_SPLIT_KV = Algorithm(
    "int8 split-KV", Precision.INT8, split_kv=True, family=i8dec.NAME, layouts={Layout.STRIDED: None},
    options=frozenset({Option.KEY_SLICES}), planner=_int8_split_kv)
ALGORITHMS = (FP16_ROW_BLOCKS, FP16_SPLIT_KV, INT8_ROW_BLOCKS, INT8_SPLIT_KV)

# Query rows per K/V head up to which the split-KV kernels are preferred to the row-block ones
# (which read K/V once per 64-128 rows but fill the device only with many rows). Measured up to 4
# rows on the H200 (tuning/results/h200_decode.md); 8 is the untuned bound.
SPLIT_KV_MAX_ROWS = 8
# Query rows per sequence up to which the split-KV kernels are preferred however many query heads
# share a K/V head: a row block of 128 rows then holds a few real rows of each grouped head and the
# grid only batch x heads_kv blocks, each walking every key (GQA 32/8 with 4 query rows and 8192
# keys: 1.62 ms in row blocks, 0.035 ms split; 16 rows at batch 8 still favour the split).
# Measured on the H200 with tuning/split_rows.py (tuning/results/h200_split_rows.md).
SPLIT_KV_MAX_SEQ_Q = 16


def split_kv_preferred(rows: int, seq_q: int | None) -> bool:
    """Whether a call of ``rows`` query rows per K/V head (``seq_q`` per sequence) prefers the
    split-KV kernels to the row-block ones (tuning/split_rows.py measures the crossover)."""
    return rows <= SPLIT_KV_MAX_ROWS or (seq_q is not None and seq_q <= SPLIT_KV_MAX_SEQ_Q)


@dataclass(frozen=True)
class Route:
    """What serves a call: an algorithm, its kernel family and the layout, dtype and score options of
    the kernels that read the call's layout and dtype and apply its score transforms (None: the
    plain kernels, the family's dtype, no score option)."""

    algorithm: Algorithm
    family: str
    layout: str | None = None
    dtype: str | None = None  # the family's dtype option (bf16); None: its own
    score: str | None = None  # the family's score option (alibi); None: none


def choose(table: TargetTable, request: Request) -> Route:
    """The algorithm, its kernel family and layout option, that serve ``request`` on ``table``'s target.

    The algorithms of the call's precision compiled for its layout whose kernels take every option
    it needs serve it, on their kernels of the call's dtype (bf16 is a dtype option of the fp16
    families) and of the score option its transforms need (Algorithm.scores: ALiBi's alibi). A
    kernel forced by name runs if its family is one of them. Otherwise few query rows per K/V head
    (split_kv_preferred) prefer the split-KV algorithm and more rows the row-block one, and the first
    whose family is built for the head_dim (in those options) runs. UnsupportedError otherwise,
    naming what is missing."""
    if request.precision is Precision.INT8 and not any(e.family == INT8_ROW_BLOCKS.family for e in table.kernels):
        # INT8 is built on the targets with an int8 dot; its split-KV kernels only beside the row-block ones.
        raise UnsupportedError(f"target {table.target} has no int8 kernels (it has no int8 dot instruction, or they "
                               "were not built); use flash_attn, the fp16 kernel")
    serving = [a for a in ALGORITHMS if a.precision is request.precision and request.layout in a.layouts]
    if not serving:
        raise UnsupportedError(f"no {request.what} kernels read {request.layout.value}")
    if request.kernel is not None:
        return _forced(table, request, serving)
    able = [a for a in serving if request.options <= a.options]
    if not able:
        lacking = "; ".join(f"the {a.name} kernels ({a.kind(request.layout, request.dtype)}) take no "
                            f"{', '.join(sorted(o.value for o in request.options - a.options))}" for a in serving)
        raise UnsupportedError(f"no kernel family serves this {request.what} call with "
                               f"{request.layout.value}: {lacking}")
    split_first = split_kv_preferred(request.rows, request.seq_q)
    preferred = sorted(able, key=lambda a: a.split_kv != split_first)
    for a in preferred:
        layout, score = a.layouts[request.layout], a.score(request.options)
        if table.entries(a.family, request.head_dim, layout, request.dtype, score):
            return Route(algorithm=a, family=a.family, layout=layout, dtype=request.dtype, score=score)
    missing = []
    for a in preferred:
        score = a.score(request.options)
        dims = table.head_dims(a.family, a.layouts[request.layout], request.dtype, score)
        what = a.kind(request.layout, request.dtype, score)
        missing.append(f"no {what} kernel for head_dim {request.head_dim} on {table.target}; built head_dims: "
                       f"{dims}" if not missing else f"nor a {what} kernel (built head_dims: {dims})")
    raise UnsupportedError("; ".join(missing))


def _forced(table: TargetTable, request: Request, serving: list[Algorithm]) -> Route:
    """The route of a call that names its kernel: that kernel's family and layout, where they serve the call."""
    entry = table.named(request.kernel)
    kinds = ", ".join(dict.fromkeys(a.kind(request.layout, request.dtype, a.score(request.options))
                                    for a in serving))
    why = "no kernel of that name is built"
    if entry is not None:
        why = (f"it is a {entry.kind} kernel; this {request.what} call with "
               f"{request.layout.value} runs the {kinds} kernels")
    for a in serving:
        if entry is not None and ((a.family, a.layouts[request.layout], request.dtype, a.score(request.options))
                                  == (entry.family, entry.layout, entry.dtype, entry.score)):
            lacking = request.options - a.options
            if not lacking:
                return Route(algorithm=a, family=entry.family, layout=entry.layout, dtype=entry.dtype,
                             score=entry.score)
            why = f"the {entry.kind} kernels take no {', '.join(sorted(o.value for o in lacking))}"
    raise UnsupportedError(f"kernel {request.kernel!r} does not serve this call on {table.target}: {why}")


def plan(table: TargetTable, call: Attention) -> Plan:
    """The launches of ``call``: its route chosen, then planned by the algorithm's planner."""
    return choose(table, call.request()).algorithm.planner(table, call)
