"""The append step of ``flash_attn_with_kvcache``, runtime side: one launch that writes a call's new
keys and values into the cache (k rotated by RoPE at its positions where tables are given), the
rotated queries into their own buffer, and the cache lengths after the append, in place of the
torch operations that did it (kvcache.py keeps them where no append kernel is built).

A workgroup per (row, sequence), ``rows`` = max(seq_new, seq_q where queries are rotated, 1) rows
per sequence, in one grid dimension: position p = cache_seqlens[b] + i, cache_seqlens
clamped to [0, cache_len - seq_new]; a plain cache's row cache_batch_idx[b] (or b), clamped to
the cache's rows; a paged cache's page block_table[b, p / page_size], clamped to the pool, row p
% page_size. RoPE tables are read at positions clamped to their rows, in float64, each value
rounded to float32 and then to the input dtype, as torch rounds kvcache.py's float64 rotation
(reference.rotate) into fp16 or bf16. head_dim is a launch argument (at most the kernels'
``head_dim``, 512): one kernel per dtype and RoPE mode."""

from __future__ import annotations

from ..abi import ArgStruct
from ..names import NameField, NameSchema
from ..plan import Launch
from ..table import TargetTable
from . import f16

NAME = "append"
# RoPE modes, as layout options: the plain kernels copy (no tables).
LAYOUTS = {
    "rope": "RoPE on pairs (2i, 2i + 1) of the first rotary_dim features (rotary_interleaved=True)",
    "ropehalf": "RoPE on halves (i, i + rotary_dim / 2) of the first rotary_dim features",
}
DTYPES = f16.DTYPES
# The head_dim the kernels take at most (the launch passes the call's).
HEAD_DIM_MAX = 512
NAMES = NameSchema("fa2_append", (
    NameField("options.layout", "_{}", "|".join(LAYOUTS), str, optional=True),
    f16.dtype_field(DTYPES),
    NameField("head_dim", "_upto{}", r"\d+"),
    NameField("tile.threads", "_nt{}", r"\d+"),
    NameField("wave_size", "_w{}", r"32|64"),
))

# Table dtypes (rotary_dtype): fp32, fp16, bf16.
TABLE_DTYPES = {"torch.float32": 0, "torch.float16": 1, "torch.bfloat16": 2}

# The fields the split-KV decode kernels share with these, to append in their own launch (dec.py):
# the new rows' strides, the strides of the queries to rotate and of the RoPE tables, and the
# tables' geometry.
NEW_STRIDE_FIELDS = (
    ("kn_stride_b", "long long"), ("kn_stride_s", "long long"), ("kn_stride_h", "long long"),
    ("vn_stride_b", "long long"), ("vn_stride_s", "long long"), ("vn_stride_h", "long long"),
)
QUERY_SOURCE_STRIDE_FIELDS = (("qs_stride_b", "long long"), ("qs_stride_s", "long long"), ("qs_stride_h", "long long"))
TABLE_STRIDE_FIELDS = (("cos_stride", "long long"), ("cos_stride_c", "long long"),
                       ("sin_stride", "long long"), ("sin_stride_c", "long long"))
TABLE_FIELDS = (
    ("positions", "int"),   # rows of the RoPE tables
    ("rotary_half", "int"),  # rotary_dim / 2
    ("rotary_dtype", "int"),  # TABLE_DTYPES
    ("q_local", "int"),     # 1: query row i at cache_seqlens + i; 0: every query row at cache_seqlens
)

# Pointer fields that the attention launches after it share read the same tensors by the same
# names (k, v: the caches; seqused_k: the lengths after the append; q: the rotated queries;
# cache_batch_idx, block_table), so that a replay rewrites each once.
ARGS = ArgStruct("Fa2AppendArgs", (
    ("k_new", "const half_t*"),   # [batch, seq_new, heads_kv, head_dim] (bf16 in the bf16 kernels)
    ("v_new", "const half_t*"),
    ("k", "half_t*"),             # the caches [rows or pages, positions, heads_kv, head_dim]
    ("v", "half_t*"),
    ("q_src", "const half_t*"),   # [batch, seq_q, heads_q, head_dim]; null: no query rotation
    ("q", "half_t*"),             # the rotated queries, q_src's shape
    ("cache_seqlens", "const int*"),  # int32 [batch]
    ("seqused_k", "int*"),        # int32 [batch]: cache_seqlens (clamped) + seq_new
    ("cache_batch_idx", "const int*"),  # int32 [batch]; null: row b
    ("block_table", "const int*"),      # int32 [batch, pages per sequence]; null: not paged
    ("rotary_cos", "const float*"),     # [positions, rotary_dim / 2] of rotary_dtype; null: no RoPE
    ("rotary_sin", "const float*"),
    *NEW_STRIDE_FIELDS,
    ("kc_stride_b", "long long"), ("kc_stride_s", "long long"), ("kc_stride_h", "long long"),
    ("vc_stride_b", "long long"), ("vc_stride_s", "long long"), ("vc_stride_h", "long long"),
    *QUERY_SOURCE_STRIDE_FIELDS,
    ("q_stride_b", "long long"), ("q_stride_s", "long long"), ("q_stride_h", "long long"),
    *TABLE_STRIDE_FIELDS,
    ("block_table_stride", "long long"),
    ("batch", "int"),
    ("seq_new", "int"),
    ("seq_q", "int"),
    ("rows", "int"),        # workgroups per sequence: max(seq_new, seq_q with RoPE, 1)
    ("heads_kv", "int"),
    ("heads_q", "int"),
    ("head_dim", "int"),
    ("cache_len", "int"),   # positions per sequence (paged: pages per sequence * page_size)
    ("cache_rows", "int"),  # rows of the caches (paged: pages of the pool)
    ("page_shift", "int"),  # paged: log2(page_size)
    *TABLE_FIELDS,
))
Fa2AppendArgs = ARGS.ctype


def lds_bytes(facts: dict[str, object]) -> int:
    return 0  # registers only


def rope_layout(interleaved: bool | None) -> str | None:
    """The layout option of a call's RoPE mode (None: no tables)."""
    if interleaved is None:
        return None
    return "rope" if interleaved else "ropehalf"


def select(table: TargetTable, interleaved: bool | None, dtype: str | None):
    """The append kernel for a RoPE mode and dtype (UnsupportedError where none is built)."""
    return table.select(NAME, head_dim=HEAD_DIM_MAX, heads_per_kv=1, causal=False, seq_q=1,
                        layout=rope_layout(interleaved), dtype=dtype)


def shared_fields(k_new, v_new, q, cos, sin, local: bool) -> dict[str, int]:
    """The values of the fields these kernels share with the split-KV decode's (NEW_STRIDE_FIELDS,
    and with RoPE tables the queries' source, the tables, QUERY_SOURCE_STRIDE_FIELDS,
    TABLE_STRIDE_FIELDS and TABLE_FIELDS) for a validated call."""
    fields = {"q_local": int(local)}
    fields["kn_stride_b"], fields["kn_stride_s"], fields["kn_stride_h"] = k_new.stride()[:3]
    fields["vn_stride_b"], fields["vn_stride_s"], fields["vn_stride_h"] = v_new.stride()[:3]
    if cos is not None:
        fields.update(q_src=q.data_ptr(), rotary_cos=cos.data_ptr(), rotary_sin=sin.data_ptr(),
                      cos_stride=cos.stride(0), cos_stride_c=cos.stride(1), sin_stride=sin.stride(0),
                      sin_stride_c=sin.stride(1), positions=cos.shape[0], rotary_half=cos.shape[1],
                      rotary_dtype=TABLE_DTYPES[str(cos.dtype)])
        fields["qs_stride_b"], fields["qs_stride_s"], fields["qs_stride_h"] = q.stride()[:3]
    return fields


def launch(table: TargetTable, *, k_new, v_new, k_cache, v_cache, q, q_out, cache_seqlens, used, cache_batch_idx,
           block_table, cos, sin, interleaved: bool, local: bool, dtype: str | None) -> Launch:
    """The append launch of a validated call (shapes, strides and dtypes checked by kvcache.py):
    ``q_out`` the rotated queries' buffer where tables are given (``q`` is then read), ``used``
    int32 [batch] written."""
    entry = select(table, interleaved if cos is not None else None, dtype)
    batch, seq_new, heads_kv, head_dim = k_new.shape
    seq_q, heads_q = q.shape[1], q.shape[2]
    paged = block_table is not None
    page = k_cache.shape[1]
    fields = dict(k_new=k_new.data_ptr(), v_new=v_new.data_ptr(), k=k_cache.data_ptr(), v=v_cache.data_ptr(),
                  cache_seqlens=cache_seqlens.data_ptr(), seqused_k=used.data_ptr(), batch=batch, seq_new=seq_new,
                  seq_q=seq_q, heads_kv=heads_kv, heads_q=heads_q, head_dim=head_dim,
                  cache_len=block_table.shape[1] * page if paged else page, cache_rows=k_cache.shape[0],
                  **shared_fields(k_new, v_new, q, cos, sin, local))
    for prefix, t in (("kc", k_cache), ("vc", v_cache)):
        fields[f"{prefix}_stride_b"], fields[f"{prefix}_stride_s"], fields[f"{prefix}_stride_h"] = t.stride()[:3]
    if cache_batch_idx is not None:
        fields["cache_batch_idx"] = cache_batch_idx.data_ptr()
    if paged:
        fields.update(block_table=block_table.data_ptr(), block_table_stride=block_table.stride(0),
                      page_shift=page.bit_length() - 1)
    rows = max(seq_new, 1)
    if cos is not None:
        rows = max(rows, seq_q)
        fields["q"] = q_out.data_ptr()
        fields["q_stride_b"], fields["q_stride_s"], fields["q_stride_h"] = q_out.stride()[:3]
    fields["rows"] = rows
    return Launch(kernel=entry, grid=(rows * batch, 1, 1), block=entry.threads, shared_bytes=table.shared_bytes(entry),
                  args=Fa2AppendArgs(**fields))
