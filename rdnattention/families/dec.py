"""Split-KV decode (flash-decoding), runtime side: few query rows per K/V head against many keys.

Launch 1 (this family): a workgroup per (row chunk x key slice, K/V head, batch) reads its slice of
the keys once for all the query rows of its chunk (the query heads of a GQA group times the query
positions, up to ``br`` of them). With one slice it writes the output; with several, a normalised
fp32 partial output and log2-domain LSE per slice into scratch, and launch 2 (the combine family)
merges them. The same kernel reads strided caches (``cache_batch_idx``), packed variable-length
batches (``cu_seqlens_q``/``cu_seqlens_k``) and paged caches (``block_table``)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..abi import ArgStruct
from ..dispatch import KernelEntry, TargetTable
from ..errors import InvalidArgumentError
from ..names import NameSchema
from ..plan import Launch, Plan
from . import f16

if TYPE_CHECKING:
    import torch

NAME = "dec"
# br = tm: the query rows one workgroup holds (every thread holds all of them); bc: keys per step.
NAMES = NameSchema("fa2_dec", f16.NAMES.fields)

# Paged caches: key i of batch b lives in page block_table[b * block_table_stride + i >> page_shift],
# row i & (2^page_shift - 1); k_stride_b and v_stride_b are then the page strides.
PAGED_FIELDS = (("block_table", "const int*"), ("block_table_stride", "long long"), ("page_shift", "int"))
# Packed batches: batch b's query rows start at row cu_seqlens_q[b] and number
# cu_seqlens_q[b + 1] - cu_seqlens_q[b] (likewise keys); null: [batch, seq, ...] tensors.
# seqused_q (int32 [batch]): batch b's query rows, where its offsets alone do not say (padding).
VARLEN_FIELDS = (("cu_seqlens_q", "const int*"), ("cu_seqlens_k", "const int*"), ("seqused_q", "const int*"))
# Key slices: with splits > 1, each writes part_o fp32 [splits, batch, heads_q, seq_q, head_dim]
# (normalised) and part_lse fp32 [splits, batch, heads_q, seq_q] (log2 domain) for the combine.
SPLIT_FIELDS = (("splits", "int"), ("part_o", "float*"), ("part_lse", "float*"))

ARGS = ArgStruct("Fa2DecArgs", (
    ("q", "const half_t*"),
    ("k", "const half_t*"),
    ("v", "const half_t*"),
    ("o", "half_t*"),
    *f16.STRIDE_FIELDS,
    *f16.SHAPE_FIELDS,
    *f16.LSE_FIELDS,
    *f16.SEQUSED_FIELDS,
    ("cache_batch_idx", "const int*"),  # K/V batch row of each batch; null: b
    *PAGED_FIELDS,
    *VARLEN_FIELDS,
    *SPLIT_FIELDS,
))
Fa2DecArgs = ARGS.ctype


def lds_layout(head_dim: int, threads: int, rows: int, wave_size: int) -> dict[str, int]:
    """Bytes of each LDS region: every wave's output rows (its lane groups merged by shuffles),
    then their (max, sum) pairs."""
    waves = threads // wave_size
    return {"o_bytes": waves * rows * head_dim * 4, "stat_bytes": waves * rows * 2 * 4}


def lds_bytes(facts: dict[str, object]) -> int:
    return sum(lds_layout(facts["head_dim"], facts["tile.threads"], facts["tile.br"], facts["wave_size"]).values())


@dataclass(frozen=True)
class Call:
    """A validated decode call in the kernel's view: q and out [batch, heads_q, seq_q, head_dim]
    (packed: [1, heads_q, total_q, head_dim] with cu_seqlens_q), k and v [batch, heads_kv, seq_k,
    head_dim] (packed: [1, heads_kv, total_k, head_dim] with cu_seqlens_k; paged: [num_pages,
    heads_kv, page_size, head_dim] with block_table), lse [batch, heads_q, seq_q] (packed:
    [heads_q, total_q])."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor | None
    window: tuple[int, int]
    softmax_scale: float
    batch: int
    seq_q: int   # query rows per batch (packed: the longest)
    seq_k: int   # keys per batch at most (paged: pages per row x page size)
    seqused_k: torch.Tensor | None = None
    cache_batch_idx: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    seqused_q: torch.Tensor | None = None  # int32 [batch]: query rows of each batch (padded batches)
    num_splits: int = 0  # 0: chosen from the grid and the device


@functools.lru_cache(maxsize=None)
def _units(device: torch.device) -> int:
    """Compute units (CUs, SMs) of a GPU; worker threads of the host emulator."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1


# Query rows per K/V head up to which flash_attn runs these kernels rather than the row-block ones
# (which read K/V once per 64-128 rows but fill the device only with many rows). Measured up to 4
# rows on the H200 (tuning/results/h200_decode.md); 8 is the untuned bound.
MAX_ROWS = 8


def takes(table: TargetTable, names: NameSchema, family: str, head_dim: int, rows: int, kernel: str | None,
          heavy_first: bool | None) -> bool:
    """Whether a call runs the decode family ``family`` (dec, i8dec; kernel names ``names``) rather
    than the row-block kernels: a kernel of it forced by name, or few query rows per K/V head
    (MAX_ROWS), no row-block kernel or row order asked for, and kernels of it built for head_dim."""
    if kernel is not None:
        return kernel.startswith(names.prefix + "_")
    return heavy_first is None and rows <= MAX_ROWS and bool(table.entries(family, head_dim))


def select(table: TargetTable, head_dim: int, rows: int, kernel: str | None = None,
           family: str = NAME) -> KernelEntry:
    """The entry of ``family`` (dec, decpaged or i8dec) for ``rows`` query rows per K/V head (tiles
    for few rows say so with ``when: {rows: ...}``); rows beyond its br take several row chunks."""
    return table.select(family, head_dim=head_dim, heads_per_kv=1, causal=False, seq_q=rows, rows=rows,
                        kernel=kernel)


def resident(table: TargetTable, entry: KernelEntry, device: torch.device) -> int:
    """Workgroups of ``entry`` one compute unit holds at once, from the device's runtime (its
    registers and LDS against the unit's; the host emulator counts a fixed number)."""
    from .. import drivers

    return drivers.for_platform(table.platform).resident_workgroups(table.code_object, entry.name, entry.threads,
                                                                    table.shared_bytes(entry), device)


def splits_for(workgroups: int, seq_k: int, keys_per_step: int, units: int, per_unit: int) -> int:
    """Key slices that bring ``workgroups`` up to at most one wave of workgroups, ``per_unit`` on
    each of ``units`` compute units at once (rounding up would start a second, nearly empty wave:
    tuning/results/h200_decode.md), each slice at least two steps of keys; every slice then
    non-empty (the slice length rounds up to whole steps)."""
    want = max(1, per_unit * units // max(workgroups, 1))
    return slices(seq_k, keys_per_step, min(want, -(-seq_k // (2 * keys_per_step))))


def slices(seq_k: int, keys_per_step: int, splits: int) -> int:
    """The slices ``splits`` asks for once each is rounded up to whole steps (the kernel's rule)."""
    splits = max(1, splits)
    per = -(-(-(-seq_k // splits)) // keys_per_step) * keys_per_step
    return max(1, -(-seq_k // per)) if seq_k else 1


def plan(table: TargetTable, call: Call, *, kernel: str | None = None, family: str | None = None,
         args=None, extra: dict | None = None, buffers: tuple = ()) -> Plan:
    """The launches of a decode call. ``family``, ``args``, ``extra`` and ``buffers``: another
    family's kernel over the same grid (i8dec: its struct, its scale fields and tensors)."""
    import torch

    q, k, v = call.q, call.k, call.v
    heads_q, head_dim = q.shape[1], q.shape[3]
    heads_kv = k.shape[1]
    group = heads_q // heads_kv
    family = family or ("decpaged" if call.block_table is not None else NAME)
    entry = select(table, head_dim, group * call.seq_q, kernel, family=family)
    chunks = -(-group * call.seq_q // entry.br)
    if call.num_splits:
        splits = slices(call.seq_k, entry.bc, call.num_splits)
    else:
        splits = splits_for(chunks * heads_kv * call.batch, call.seq_k, entry.bc, _units(q.device),
                            resident(table, entry, q.device))
    fields = f16.common_fields(q, k, v, call.out, call.lse, call.window, call.softmax_scale, False, None,
                               call.seqused_k)
    del fields["heavy_first"]
    fields.update(batch=call.batch, seq_q=call.seq_q, seq_k=call.seq_k, splits=splits)
    if call.cu_seqlens_q is not None:
        fields.update(cu_seqlens_q=call.cu_seqlens_q.data_ptr(), q_stride_b=0, o_stride_b=0)
        if call.lse is not None:  # [heads_q, total_q]
            fields.update(lse_stride_b=0, lse_stride_h=call.lse.stride(0))
    if call.seqused_q is not None:
        fields["seqused_q"] = call.seqused_q.data_ptr()
    if call.cu_seqlens_k is not None:
        fields.update(cu_seqlens_k=call.cu_seqlens_k.data_ptr(), k_stride_b=0, v_stride_b=0)
    if call.cache_batch_idx is not None:
        fields["cache_batch_idx"] = call.cache_batch_idx.data_ptr()
    if call.block_table is not None:
        page = k.shape[2]
        fields.update(block_table=call.block_table.data_ptr(), block_table_stride=call.block_table.stride(0),
                      page_shift=page.bit_length() - 1)
    for key in ("batch", "heads_q", "heads_kv", "seq_q", "seq_k", "window_left", "window_right"):
        if not -2**31 <= fields[key] < 2**31:
            raise InvalidArgumentError(f"{key} = {fields[key]} does not fit the kernel's 32-bit field")
    fields.update(extra or {})
    # The launches, and with them their grids, are checked before the scratch is allocated: a grid
    # beyond the limits would otherwise first ask for partials of every one of its workgroups.
    launches = [Launch(kernel=entry, grid=(chunks * splits, heads_kv, call.batch), block=entry.threads,
                       shared_bytes=table.shared_bytes(entry), args=(args or Fa2DecArgs)(**fields))]
    scratch: tuple = ()
    if splits > 1:
        from . import combine
        launches.append(combine.launch(table, call, head_dim, splits))
        scratch = (torch.empty((splits, call.batch, heads_q, call.seq_q, head_dim), dtype=torch.float32,
                               device=q.device),
                   torch.empty((splits, call.batch, heads_q, call.seq_q), dtype=torch.float32, device=q.device))
        for launch in launches:  # the slices write the partials, the combine reads them
            launch.args.part_o, launch.args.part_lse = (t.data_ptr() for t in scratch)
    buffers = tuple(t for t in (q, k, v, call.out, call.lse, call.seqused_k, call.cache_batch_idx, call.block_table,
                                call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_q, *buffers, *scratch)
                    if t is not None)
    return Plan(table=table, device=q.device, launches=launches, outputs=(call.out, call.lse), buffers=buffers)

