"""Split-KV decode over int8 Q, K, V (the INT8 family's decode), runtime side: the dec family's
kernel with int8 rows (16 values a lane, dot4 products) and the INT8 scale contract (int8.py):
per-token Q and K scales, a per-channel V scale."""

from __future__ import annotations

from ..abi import ArgStruct
from ..names import NameSchema
from ..plan import Plan
from ..table import TargetTable
from . import _splitkv, dec, f16, i8

NAME = "i8dec"
NAMES = NameSchema("fa2_i8dec", i8.NAMES.fields)

ARGS = ArgStruct("Fa2I8DecArgs", (
    ("q", "const signed char*"),
    ("k", "const signed char*"),
    ("v", "const signed char*"),
    ("o", "half_t*"),
    *f16.STRIDE_FIELDS,
    *i8.SCALE_FIELDS,
    *f16.SHAPE_FIELDS,
    *f16.LSE_FIELDS,
    *f16.SEQUSED_FIELDS,
    ("cache_batch_idx", "const int*"),  # unused by this family (always null); the shared kernel reads it
    *dec.PAGED_FIELDS,
    *dec.VARLEN_FIELDS,
    *dec.SPLIT_FIELDS,
    *dec.BOUND_FIELDS,
))
Fa2I8DecArgs = ARGS.ctype
LANE_VALUES = 16  # int8 values per lane per key (16 bytes)


lds_layout = dec.lds_layout  # the same LDS regions: one per wave
lds_bytes = dec.lds_bytes


def plan(table: TargetTable, call: i8.Call, *, kernel: str | None = None, num_splits: int = 0) -> Plan:
    """An INT8 call with few query rows per K/V head (i8.Call: [batch, heads, seq, head_dim]);
    ``num_splits`` as in dec.Call (0: automatic). The split-KV launches of dec's kernel
    (_splitkv.py), with this family's struct and the scales."""
    q, k = call.q, call.k
    decode = dec.Call(q=q, k=k, v=call.v, out=call.out, lse=call.lse, window=call.window,
                      softmax_scale=call.softmax_scale, batch=q.shape[0], seq_q=q.shape[2], seq_k=k.shape[2],
                      num_splits=num_splits)
    return _splitkv.plan(table, decode, family=NAME, args_type=Fa2I8DecArgs, kernel=kernel,
                         extra=i8.scale_fields(call), buffers=(call.q_scale, call.k_scale, call.v_scale))
