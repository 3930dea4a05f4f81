"""Split-KV decode (flash-decoding), runtime side: few query rows per K/V head against many keys.

Its kernels read strided caches (``cache_batch_idx``), packed variable-length batches
(``cu_seqlens_q``/``cu_seqlens_k``) and, compiled with the paged layout option, paged caches
(``block_table``). The launch (a workgroup per row chunk, key slice, K/V head and batch, the last
slice of each row chunk to finish merging the slices) is planned by _splitkv.py, which i8dec
shares. Its kernels of dtype option bf16 read bf16 rows and store bf16 outputs."""

from __future__ import annotations

from ..abi import ArgStruct
from ..call import Attention
from ..names import NameSchema
from ..plan import Plan
from ..table import TargetTable
from . import _splitkv, append, f16
# The slice rules, under dec's name as before (_splitkv.py states them for every split-KV family).
from ._splitkv import MIN_SLICE_KEYS, alibi_rows, resident, slices, splits_for  # noqa: F401

NAME = "dec"
# Strided caches, cache lengths and packed batches are read from the arguments; a paged cache by
# kernels compiled for it, so that the others hold no page state (the page lookup's scalar
# registers spilled on GCN when both lived in one kernel).
LAYOUTS = {"paged": "a paged cache (block_table)"}
# br = tm: the query rows one workgroup holds (every thread holds all of them); bc: keys per step.
# Input dtypes beside fp16 (f16.DTYPES): the same kernel over bf16 keys and values.
DTYPES = f16.DTYPES
NAMES = NameSchema("fa2_dec", (f16.layout_field(LAYOUTS), f16.dtype_field(DTYPES)) + f16.FP16_NAME_FIELDS)

# Paged caches: key i of batch b lives in page block_table[b * block_table_stride + i >> page_shift],
# row i & (2^page_shift - 1); k_stride_b and v_stride_b are then the page strides.
PAGED_FIELDS = (("block_table", "const int*"), ("block_table_stride", "long long"), ("page_shift", "int"))
# Packed batches: batch b's query rows start at row cu_seqlens_q[b] and number
# cu_seqlens_q[b + 1] - cu_seqlens_q[b] (likewise keys); null: [batch, seq, ...] tensors.
# seqused_q (int32 [batch]): batch b's query rows, where its offsets alone do not say (padding).
VARLEN_FIELDS = (("cu_seqlens_q", "const int*"), ("cu_seqlens_k", "const int*"), ("seqused_q", "const int*"))
# Key slices: with splits > 1, each writes part_o fp32 [splits, batch, heads_q, seq_q, head_dim]
# (normalised) and part_lse fp32 [splits, batch, heads_q, seq_q] (log2 domain), and counts itself
# in counters (uint32 [batch, heads_kv, row chunks], zero before the launch and after it); the
# last slice of a row chunk to count merges them.
SPLIT_FIELDS = (("splits", "int"), ("part_o", "float*"), ("part_lse", "float*"), ("counters", "unsigned*"))
# K/V rows along their batch stride (cache rows, or a pool's pages): cache_batch_idx and
# block_table values outside them read row 0 (their values are not read on a GPU), and the rows
# packed offsets may address (f16.PACKED_BOUND_FIELDS).
BOUND_FIELDS = (("kv_rows", "int"), *f16.PACKED_BOUND_FIELDS)

# The least kernel head_dim that rotates (fa2_decode.h's FA2_DECODE_ROPE_MIN_D): the head_dim 8 and
# 16 tiles are compiled without the rotation, whose float64 registers cost them waves on every AMD
# target; their calls with RoPE tables run the append kernel's launch first.
ROPE_MIN_HEAD_DIM = 24

# flash_attn_with_kvcache's append, in the launch that reads it (kvcache.py fuses them where the
# attention is one launch of these kernels): with append_rows > 0, seqused_k points at cache_seqlens
# (the lengths before the append), and sequence b's append_rows new keys and values (k_new, v_new
# [batch, append_rows, heads_kv, head_dim]) are written at positions cache_seqlens[b] (bounded to
# [0, seq_k - append_rows]) onwards. With RoPE tables (rope 1: pairs, 2: halves; 0: none), in kernels
# of head_dim ROPE_MIN_HEAD_DIM and up, k is rotated at its position and the queries are rotated from
# q_src [batch, seq_q, heads_q, head_dim] into q (at cache_seqlens, + i for row i where q_local), as
# the append kernel rotates them (append.py: the shared fields mean what they mean there).
APPEND_FIELDS = (
    ("k_new", "const half_t*"), ("v_new", "const half_t*"),
    ("q_src", "const half_t*"), ("rotary_cos", "const float*"), ("rotary_sin", "const float*"),
    *append.NEW_STRIDE_FIELDS,
    *append.QUERY_SOURCE_STRIDE_FIELDS,
    *append.TABLE_STRIDE_FIELDS,
    ("append_rows", "int"),
    ("rope", "int"),  # 0: no tables; 1: pairs; 2: halves
    *append.TABLE_FIELDS,
)

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
    *BOUND_FIELDS,
    *f16.SCORE_FIELDS,  # the sinks join where a row is written: unsplit or merged, once
    *APPEND_FIELDS,
))
Fa2DecArgs = ARGS.ctype


def lds_layout(head_dim: int, threads: int, rows: int, wave_size: int) -> dict[str, int]:
    """Bytes of each LDS region: every wave's output rows (its lane groups merged by shuffles),
    then their (max, sum) pairs."""
    waves = threads // wave_size
    return {"o_bytes": waves * rows * head_dim * 4, "stat_bytes": waves * rows * 2 * 4}


def lds_bytes(facts: dict[str, object]) -> int:
    return sum(lds_layout(facts["head_dim"], facts["tile.threads"], facts["tile.br"], facts["wave_size"]).values())


# A decode call is the call description every entry point builds (call.py): the planner reads its
# tensors, lengths, layout fields and num_splits.
Call = Attention


def layout_of(call: Call) -> str | None:
    """The kernels' layout option that reads ``call``: paged with a block table, else the plain ones."""
    return "paged" if call.block_table is not None else None


def plan(table: TargetTable, call: Call, *, kernel: str | None = None) -> Plan:
    """The launches of a decode call on the kernels compiled for its layout (layout_of)."""
    return _splitkv.plan(table, call, family=NAME, layout=layout_of(call), args_type=Fa2DecArgs, kernel=kernel)
