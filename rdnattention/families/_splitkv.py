"""Split-KV planning (flash-decoding), shared by the families whose kernels run it: dec (its
plain and paged kernels) over fp16 rows, i8dec over int8 rows. Each family brings its argument
struct and extra fields; the grid, the key slices and their merge are the same. A helper of this
package, not a family (discovery skips modules whose name starts with an underscore).

One launch: a workgroup per (row chunk x key slice, K/V head, batch) reads its slice of the keys
once for all the query rows of its chunk (the query heads of a GQA group times the query
positions, up to ``br`` of them). With one slice it writes the output; with several, a normalised
fp32 partial output and log2-domain LSE per slice into scratch, and counts itself done in a
counter per (row chunk, K/V head, batch); the last slice to count merges the partials into the
output and resets the counter to zero (so counters start every launch at zero: workspace.py)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import InvalidArgumentError, UnsupportedError
from ..plan import Launch, Plan
from ..table import KernelEntry, TargetTable
from . import f16

if TYPE_CHECKING:  # the generator imports the families, and with them this module, without torch
    import ctypes

    import torch


@functools.lru_cache(maxsize=None)
def units(device: torch.device) -> int:
    """Compute units (CUs, SMs) of a GPU; worker threads of the host emulator."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return os.cpu_count() or 1


def resident(table: TargetTable, entry: KernelEntry, device: torch.device) -> int:
    """Workgroups of ``entry`` one compute unit holds at once, from the device's runtime (its
    registers and LDS against the unit's; the host emulator counts a fixed number)."""
    from .. import drivers  # imports torch: the generator reads this module without it

    return drivers.for_platform(table.platform).resident_workgroups(table.code_object, entry.name, entry.threads,
                                                                    table.shared_bytes(entry), device)


# Keys a slice holds at least where the device has a workgroup per compute unit without shorter
# ones: shorter slices give the merge more partial rows than the parallel reads save
# (tuning/results/h200_decode_slices.md).
MIN_SLICE_KEYS = 128


def splits_for(workgroups: int, seq_k: int, keys_per_step: int, units: int, per_unit: int) -> int:
    """Key slices for ``workgroups`` workgroups of one slice over ``seq_k`` keys: as many as bring
    them up to one wave, ``per_unit`` on each of ``units`` compute units at once (rounding up would
    start a second, nearly empty wave: tuning/results/h200_decode.md), but no more than slices of
    MIN_SLICE_KEYS keys give, or one workgroup per compute unit where that asks for more
    (tuning/results/h200_decode_slices.md); each slice at least two steps of keys, and every slice
    then non-empty (the slice length rounds up to whole steps)."""
    return _count(seq_k, keys_per_step, 0, *_of_launch(workgroups, units, per_unit))


def _of_launch(workgroups: int, units: int, per_unit: int) -> tuple[int, int]:
    """What of splits_for's count follows from the launch alone (_count's ``wave`` and ``least``:
    slices that bring the workgroups up to one wave, and that give one workgroup per compute unit;
    Lengths keeps both, so that a replay following a growing cache computes only the rest)."""
    workgroups = max(workgroups, 1)
    return max(1, per_unit * units // workgroups), units // workgroups


def slices(seq_k: int, keys_per_step: int, splits: int) -> int:
    """The slices ``splits`` asks for once each is rounded up to whole steps (the kernel's rule)."""
    return _count(seq_k, keys_per_step, splits if splits > 1 else 1, 0, 0)


def _count(seq_k: int, per_step: int, asked: int, wave: int, least: int) -> int:
    """The slices of ``seq_k`` keys, each rounded up to whole steps of ``per_step`` keys: ``asked``
    of them, or where it is 0, as many as splits_for chooses (at least ``least``, at most ``wave`` and
    two steps a slice). In one frame: a replay following a growing cache computes it per new length
    (Lengths.splits)."""
    if not asked:
        asked = seq_k // MIN_SLICE_KEYS
        if asked < least:
            asked = least
        if asked > wave:
            asked = wave
        steps2 = -(-seq_k // (2 * per_step))
        if asked > steps2:
            asked = steps2
        if asked < 1:
            asked = 1
    if not seq_k:
        return 1
    per = -(-(-(-seq_k // asked)) // per_step) * per_step
    return -(-seq_k // per)  # at least 1: per is positive, and so is seq_k here


@dataclass(frozen=True)
class Lengths:
    """What of a split-KV plan changes with the keys' length alone, where nothing else does (K/V
    rows addressed by their strides: no cache lengths, packed offsets, pages or cache rows): the key
    slices, hence the first launch's grid and the scratch; the fields seq_k, splits and the K/V
    strides. A replay of such a plan follows calls whose keys differ only in length and strides
    (replay.relength)."""

    chunks: int         # row chunks: the first launch's grid.x is chunks x slices
    keys_per_step: int  # the tile's bc
    workgroups: int     # chunks x K/V heads x batch
    units: int
    per_unit: int
    num_splits: int     # slices asked for (0: chosen)
    rows: int           # batch x query heads x query rows: the partials per slice
    head_dim: int
    wave: int = field(init=False)   # splits_for's, of the launch alone (_of_launch)
    least: int = field(init=False)
    asked: int = field(init=False)  # _count's: num_splits as slices() takes it, or 0 where chosen

    def __post_init__(self) -> None:
        wave, least = _of_launch(self.workgroups, self.units, self.per_unit)
        object.__setattr__(self, "wave", wave)
        object.__setattr__(self, "least", least)
        n = self.num_splits
        object.__setattr__(self, "asked", (n if n > 1 else 1) if n else 0)

    def splits(self, seq_k: int) -> int:
        """The slices of ``seq_k`` keys: splits_for's count, or the count asked for, as slices() rounds it."""
        return _count(seq_k, self.keys_per_step, self.asked, self.wave, self.least)

    def scratch(self, splits: int) -> tuple[int, int]:
        """(scratch bytes, where the partial LSEs start) of ``splits`` slices: their partial outputs
        (fp32 [splits, batch, heads_q, seq_q, head_dim]), then their LSEs (fp32 [splits, batch,
        heads_q, seq_q]); none for one slice."""
        from .. import workspace  # imports torch: the generator reads this module without it

        if splits <= 1:
            return 0, 0
        lse = workspace.align(splits * self.rows * self.head_dim * 4)
        return lse + workspace.align(splits * self.rows * 4), lse


def alibi_rows(table: TargetTable) -> int:
    """The most query rows a split-KV tile of ``table``'s target applies ALiBi in (variants.yaml's
    ``decode_alibi_rows``, the build's FA2_DECODE_ALIBI_ROWS): its slope and key distances cost
    registers that four-row tiles do not have to spare on AMD and Pascal targets (a wave), so there
    ALiBi calls run tiles of at most two rows (select), in more row chunks."""
    return table.decode_alibi_rows


def select(table: TargetTable, family: str, head_dim: int, rows: int, kernel: str | None = None,
           layout: str | None = None, most_rows: int | None = None, dtype: str | None = None) -> KernelEntry:
    """The entry of ``family`` (compiled for ``layout`` and ``dtype``) for ``rows`` query rows per K/V
    head (tiles for few rows say so with ``when: {rows: ...}``); rows beyond its br take several row
    chunks. ``most_rows``: the tile may hold no more rows than that (ALiBi: alibi_rows), the entry for
    fewer rows chosen where the one for ``rows`` holds more; UnsupportedError where none does."""
    def pick(n: int) -> KernelEntry:
        return table.select(family, layout=layout, head_dim=head_dim, heads_per_kv=1, causal=False, seq_q=n,
                            rows=n, kernel=kernel, dtype=dtype)
    entry = pick(rows)
    if most_rows is None or entry.br <= most_rows:
        return entry
    for fewer in range(min(rows, most_rows), 0, -1):
        entry = pick(fewer)
        if entry.br <= most_rows:
            return entry
    raise UnsupportedError(f"ALiBi on the split-KV kernels needs a tile of at most {most_rows} query rows; the "
                           f"{family} kernel for head_dim {head_dim} on {table.target} ({entry.name}) holds {entry.br}")


def plan(table: TargetTable, call, *, family: str, args_type: type[ctypes.Structure], layout: str | None = None,
         kernel: str | None = None, extra: dict | None = None, buffers: tuple = ()) -> Plan:
    """The launches of a split-KV call (a dec.Call) on ``family``'s kernels compiled for ``layout``:
    their struct ``args_type``, ``extra`` fields beyond the shared ones and the tensors ``buffers``
    they read."""
    q, k, v = call.q, call.k, call.v
    heads_q, head_dim = q.shape[1], q.shape[3]
    heads_kv = k.shape[1]
    group = heads_q // heads_kv
    dtype = getattr(call, "dtype", None)  # an int8 call has none
    entry = select(table, family, head_dim, group * call.seq_q, kernel, layout,
                   most_rows=alibi_rows(table) if call.alibi_slopes is not None else None, dtype=dtype)
    chunks = -(-group * call.seq_q // entry.br)
    lengths = Lengths(chunks=chunks, keys_per_step=entry.bc, workgroups=chunks * heads_kv * call.batch,
                      units=units(q.device), per_unit=0 if call.num_splits else resident(table, entry, q.device),
                      num_splits=call.num_splits or 0, rows=call.batch * heads_q * call.seq_q, head_dim=head_dim)
    splits = lengths.splits(call.seq_k)
    fields = f16.common_fields(q, k, v, call.out, call.lse, call.window, call.softmax_scale, False, None,
                               call.seqused_k)
    del fields["heavy_first"]
    fields.update(batch=call.batch, seq_q=call.seq_q, seq_k=call.seq_k, splits=splits, kv_rows=k.shape[0])
    if call.cu_seqlens_q is not None:
        fields.update(cu_seqlens_q=call.cu_seqlens_q.data_ptr(), q_stride_b=0, o_stride_b=0,
                      total_q=f16.packed_rows(q))
        if call.lse is not None:  # [heads_q, total_q]
            fields.update(lse_stride_b=0, lse_stride_h=call.lse.stride(0))
    if call.seqused_q is not None:
        fields["seqused_q"] = call.seqused_q.data_ptr()
    if call.cu_seqlens_k is not None:
        fields.update(cu_seqlens_k=call.cu_seqlens_k.data_ptr(), k_stride_b=0, v_stride_b=0,
                      total_k=f16.packed_rows(k))
    if call.cache_batch_idx is not None:
        fields["cache_batch_idx"] = call.cache_batch_idx.data_ptr()
    if call.block_table is not None:
        page = k.shape[2]
        fields.update(block_table=call.block_table.data_ptr(), block_table_stride=call.block_table.stride(0),
                      page_shift=page.bit_length() - 1)
    if k.shape[0] == 0 and call.seq_k > 0 and (call.block_table is not None or call.cache_batch_idx is not None):
        what, index = ("pages", "block_table") if call.block_table is not None else ("rows", "cache_batch_idx")
        raise InvalidArgumentError(f"the cache has no {what} for {index} to pick")
    for key in ("batch", "heads_q", "heads_kv", "seq_q", "seq_k", "window_left", "window_right"):
        if not -2**31 <= fields[key] < 2**31:
            raise InvalidArgumentError(f"{key} = {fields[key]} does not fit the kernel's 32-bit field")
    fields.update(f16.score_fields(call))  # softcap, ALiBi, sinks: where the call has them
    fields.update(extra or {})
    # The launch, and with it its grid, is checked here; the scratch and the counters are allocated
    # where the plan runs (Plan.run, or a stream's workspace), never for a grid beyond the limits.
    launches = [Launch(kernel=entry, grid=(chunks * splits, heads_kv, call.batch), block=entry.threads,
                       shared_bytes=table.shared_bytes(entry), args=args_type(**fields))]
    scratch_bytes, scratch_lse = lengths.scratch(splits)
    buffers = tuple(t for t in (q, k, v, call.out, call.lse, call.seqused_k, call.cache_batch_idx, call.block_table,
                                call.cu_seqlens_q, call.cu_seqlens_k, call.seqused_q,
                                call.alibi_slopes, call.sinks, *buffers)
                    if t is not None)
    plain = all(getattr(call, name, None) is None for name in ("seqused_k", "cu_seqlens_q", "cu_seqlens_k", "seqused_q",
                                                                "cache_batch_idx", "block_table"))
    return Plan(table=table, device=q.device, launches=launches, outputs=(call.out, call.lse), buffers=buffers,
                scratch_bytes=scratch_bytes, scratch_lse=scratch_lse, counters=lengths.workgroups if splits > 1 else 0,
                lengths=lengths if plain and call.seq_k > 0 else None)
