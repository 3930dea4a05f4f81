"""The combine step of split-KV decode, runtime side: merges the partial outputs of the key slices
of a ``dec`` launch (families/dec.py) into the output and its LSE. One launch over the rows of
[batch, heads_q, seq_q], a workgroup per row."""

from __future__ import annotations

from ..abi import ArgStruct
from ..names import NameField, NameSchema
from ..plan import Launch
from ..table import TargetTable
from . import f16

NAME = "combine"
# Output dtypes beside fp16 (f16.DTYPES): the combine of the bf16 dec kernels stores bf16 rows.
DTYPES = f16.DTYPES
NAMES = NameSchema("fa2_combine", (
    f16.dtype_field(DTYPES),
    NameField("head_dim", "_hd{}", r"\d+"),
    NameField("tile.threads", "_nt{}", r"\d+"),
    NameField("wave_size", "_w{}", r"32|64"),
    NameField("tier", "_{}", r"fp32", str),  # fp32 sums only, on every target
))

ARGS = ArgStruct("Fa2CombineArgs", (
    ("part_o", "const float*"),    # fp32 [splits, batch, heads_q, seq_q, head_dim], each slice normalised
    ("part_lse", "const float*"),  # fp32 [splits, batch, heads_q, seq_q], log2 domain; -inf: no key
    ("o", "half_t*"),  # bf16 rows in the bf16 kernels (the same 16-bit words)
    ("o_stride_b", "long long"), ("o_stride_h", "long long"), ("o_stride_s", "long long"),
    *f16.LSE_FIELDS,
    ("cu_seqlens_q", "const int*"),  # packed batches: rows past a sequence's end are skipped
    ("seqused_q", "const int*"),     # likewise rows past seqused_q[b] (padded batches)
    ("batch", "int"),
    ("heads_q", "int"),
    ("seq_q", "int"),
    ("splits", "int"),
    ("total_q", "int"),  # packed batches: the rows cu_seqlens_q may address (clamped into them)
    ("sinks", "const float*"),  # fp32 [heads_q]: each row's attention sink joins here, once; null: none
))
Fa2CombineArgs = ARGS.ctype


def lds_layout(head_dim: int, threads: int) -> dict[str, int]:
    """Bytes of each LDS region: every lane group's merged values, then their (maximum, sum)."""
    groups = threads // (head_dim // 8)
    return {"acc_bytes": groups * head_dim * 4, "stat_bytes": groups * 2 * 4}


def lds_bytes(facts: dict[str, object]) -> int:
    return sum(lds_layout(facts["head_dim"], facts["tile.threads"]).values())


def launch(table: TargetTable, call, head_dim: int, splits: int, dtype: str | None = None) -> Launch:
    """The combine launch of a dec call with ``splits`` key slices, storing ``dtype`` (None: fp16);
    the caller sets its part_o and part_lse once the scratch is allocated (after the launch, and with
    it the grid, is checked)."""
    entry = table.select(NAME, head_dim=head_dim, heads_per_kv=1, causal=False, seq_q=1, dtype=dtype)
    fields = dict(o=call.out.data_ptr(), batch=call.batch, heads_q=call.q.shape[1], seq_q=call.seq_q, splits=splits)
    fields["o_stride_b"], fields["o_stride_h"], fields["o_stride_s"] = call.out.stride()[:3]
    if call.lse is not None:
        fields.update(lse=call.lse.data_ptr(), lse_stride_b=call.lse.stride(0), lse_stride_h=call.lse.stride(1))
    if call.cu_seqlens_q is not None:
        fields.update(cu_seqlens_q=call.cu_seqlens_q.data_ptr(), o_stride_b=0, total_q=f16.packed_rows(call.q))
        if call.lse is not None:
            fields.update(lse_stride_b=0, lse_stride_h=call.lse.stride(0))
    if call.seqused_q is not None:
        fields["seqused_q"] = call.seqused_q.data_ptr()
    if call.sinks is not None:
        fields["sinks"] = call.sinks.data_ptr()
    rows = call.batch * call.q.shape[1] * call.seq_q
    return Launch(kernel=entry, grid=(rows, 1, 1), block=entry.threads, shared_bytes=table.shared_bytes(entry),
                  args=Fa2CombineArgs(**fields))
