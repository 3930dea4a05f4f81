"""The fp16 FlashAttention-2 forward family, runtime side: its argument struct and its launches.

One launch: a workgroup per (row block, GQA head group, batch), BR rows of the block spread over
the G query heads that share a K/V head."""

from __future__ import annotations

from ..abi import ArgStruct
from ..call import Attention, Option
from ..errors import InvalidArgumentError
from ..names import NameField, NameSchema
from ..plan import Launch, Plan
from ..table import TargetTable

NAME = "f16"

# How a kernel's name spells its facts: the generator names kernels with it, and every dispatch
# table entry is checked against the name it carries. TILE_NAME_FIELDS are every fa2 family's.
TILE_NAME_FIELDS = (
    NameField("head_dim", "_hd{}", r"\d+"),
    NameField("gqa_group", "_g{}", r"\d+"),
    NameField("tile.br", "_br{}", r"\d+"),
    NameField("tile.bc", "_bc{}", r"\d+"),
    NameField("tile.threads", "_nt{}", r"\d+"),
    NameField("tile.tm", "_tm{}", r"\d+"),
    NameField("tile.waves", "_wv{}", r"\d+", optional=True),  # a register budget: waves per SIMD
    NameField("wave_size", "_w{}", r"32|64"),
)
# tier: the pair product's lowering (fp16: dot2, fma_mix, mad_mix, cvt_fma; bf16: shift_fma, each
# value widened to fp32 by a shift, then fp32 FMAs, or bf16_dot2, gfx11+'s v_dot2_f32_bf16); stage: what LDS holds (f16 or bf16 pairs as
# loaded, or f32 pairs converted once when staged).
FP16_NAME_FIELDS = TILE_NAME_FIELDS + (
    NameField("tier", "_{}", r"dot2|fma_mix|mad_mix|cvt_fma|shift_fma|bf16_dot2", str),
    NameField("stage", "_s{}", r"f16|bf16|f32", str),
)


def layout_field(layouts: dict[str, str]) -> NameField:
    """A family's compile-time layout option (``options.layout``), spelled right after its prefix
    (``fa2_f16len_...``) and absent for the kernels that read plain strided tensors."""
    return NameField("options.layout", "{}", "|".join(layouts), str, optional=True)


def dtype_field(dtypes: dict[str, str]) -> NameField:
    """A family's compile-time input dtype option (``options.dtype``), spelled after its layout
    (``fa2_f16len_bf16_...``) and absent for the family's own dtype (fp16), so that its names are
    unchanged."""
    return NameField("options.dtype", "_{}", "|".join(dtypes), str, optional=True)


def score_field(scores: dict[str, str]) -> NameField:
    """A family's compile-time score-transform option (``options.score``), spelled after its dtype
    (``fa2_f16len_bf16_alibi_...``) and absent for the kernels without it, so that their names are
    unchanged."""
    return NameField("options.score", "_{}", "|".join(scores), str, optional=True)


# The input dtypes the kernels are also compiled for, beside fp16: option value -> what they read.
# The same kernel body and tiles over another element policy (templates/include/pairs.h): bf16 Q, K
# and V (and output), widened to fp32 by a shift where they are multiplied (or once, when staged,
# where LDS holds fp32 pairs), the same fp32 softmax and accumulation.
DTYPES = {"bf16": "bfloat16 q, k, v and output"}


# The kernels compiled for another way of finding the keys, beside the plain ones (which read
# strided [batch, heads, seq, head_dim] tensors): option value -> what it reads. Each is the same
# kernel body and tiles with a compile-time switch, so the plain kernels hold no state for it (a
# per-batch key count held in registers cost 5% at head_dim 64 on the H200).
LAYOUTS = {
    "len": "per-sequence key counts (seqused_k)",
    "varlen": "packed sequences (cu_seqlens_q, cu_seqlens_k)",
}
# The score transforms the kernels are compiled with: option value -> what they apply. The plain
# kernels apply none, so their registers and code are those of a kernel without transforms: carried
# at run time, the softcap's and sinks' branches spilled the tightest tiles of RDNA1 and GCN (and
# ALiBi's per-row slope cost RDNA2 a wave). xf: a logit softcap and attention sinks, read from the
# arguments (either may be absent); alibi: ALiBi slopes besides them. Each is built at the head_dims
# variants.yaml lists (the models that use them); other calls with them run the split-KV kernels.
SCORES = {"xf": "a logit softcap (softcap) or attention sinks (sinks)",
          "alibi": "ALiBi slopes (alibi_slopes), besides softcap and sinks"}
NAMES = NameSchema("fa2_f16", (layout_field(LAYOUTS), dtype_field(DTYPES), score_field(SCORES)) + FP16_NAME_FIELDS)

# Argument fields every fa2 family shares. Strides are in elements; the last dimension is contiguous.
STRIDE_FIELDS = tuple((f"{t}_stride_{d}", "long long") for t in "qkvo" for d in "bhs")
SHAPE_FIELDS = (
    ("batch", "int"),
    ("heads_q", "int"),
    ("heads_kv", "int"),
    ("seq_q", "int"),
    ("seq_k", "int"),
    ("window_left", "int"),   # keys visible before the query's diagonal; -1: unbounded
    ("window_right", "int"),  # keys visible after it; -1: unbounded, 0: causal
    ("scale_log2", "float"),  # softmax scale times log2(e)
)
# Log-sum-exp per query row (natural log), fp32 [batch, heads_q, seq_q]; null: not written.
LSE_FIELDS = (("lse", "float*"), ("lse_stride_b", "long long"), ("lse_stride_h", "long long"))
# Cache lengths, int32 [batch]: batch b uses its first seqused_k[b] keys; null: all seq_k.
SEQUSED_FIELDS = (("seqused_k", "const int*"),)
# Packed batches (the varlen layout): batch b's rows start at cu_seqlens_q[b] / cu_seqlens_k[b]
# (int32 [batch + 1]; zero batch strides), as many as the next offset says; null: not packed.
VARLEN_FIELDS = (("cu_seqlens_q", "const int*"), ("cu_seqlens_k", "const int*"))
# The rows packed offsets may address: q's (and the output's and LSE's) and k's and v's. The
# kernels clamp the offsets into them (fa2_policies.h), since their values are not read on a GPU.
PACKED_BOUND_FIELDS = (("total_q", "int"), ("total_k", "int"))

# Score transforms (fa2_policies.h), each off at its zero: the logit softcap as C = softcap * log2(e)
# and 1 / C (0, 0: no cap); ALiBi slopes fp32, element [b * alibi_stride_b + query head] (a stride
# of 0: one slope per head); attention sinks fp32 [heads_q] (natural log). Null: none.
SCORE_FIELDS = (
    ("softcap_log2", "float"),
    ("softcap_inv", "float"),
    ("alibi_slopes", "const float*"),
    ("alibi_stride_b", "long long"),
    ("sinks", "const float*"),
)


# q, k, v, o: fp16 rows, or bf16 rows in the bf16 kernels (16-bit words either way: the element
# policy says what they are).
ARGS = ArgStruct("Fa2Args", (
    ("q", "const half_t*"),
    ("k", "const half_t*"),
    ("v", "const half_t*"),
    ("o", "half_t*"),
    *STRIDE_FIELDS,
    *SHAPE_FIELDS,
    *LSE_FIELDS,
    *SEQUSED_FIELDS,
    *VARLEN_FIELDS,
    # RoPE tables [positions, rotary_dim/2] in fp32; rotary_dim 0: no rotation.
    ("rotary_cos", "const float*"),
    ("rotary_sin", "const float*"),
    ("rotary_stride", "long long"),
    ("rotary_dim", "int"),
    ("rotary_interleaved", "int"),  # 1: rotate pairs (2i, 2i+1); 0: rotate halves (i, i + rotary_dim/2)
    ("heavy_first", "int"),  # 1: workgroups take row blocks longest first (causal-like masks)
    *PACKED_BOUND_FIELDS,
    *SCORE_FIELDS,
))
Fa2Args = ARGS.ctype


def padded_head_dim(head_dim: int, br: int, threads: int, tm: int) -> int:
    """The head_dim a kernel's tiles hold: ``head_dim`` padded with zero columns up to a multiple of
    twice the threads that share a query row (threads * tm / br: each takes whole pairs of the output
    columns), which the kernel neither loads nor stores. Equal to ``head_dim`` where it divides."""
    rows = br // tm if tm else 0
    step = 2 * max(1, threads // rows if rows else 1)
    return -(-head_dim // step) * step


def lds_layout(head_dim: int, br: int, bc: int, stage: str) -> dict[str, int]:
    """Bytes of each LDS region of a kernel whose tiles hold ``head_dim`` columns (padded_head_dim):
    the Q tile, the K/V tile, the P tile. The generator sizes kernels with it and the runtime checks
    dispatch entries against it (on cuda the launch requests exactly this much)."""
    pair = 8 if stage == "f32" else 4  # f16 and bf16 pairs: one 32-bit word
    pad = 4  # pairs (pairs.h CHUNK): rows stay 16-byte aligned, f32 tiles' planes included
    p_row = (br + pad) * pair
    p_row_pair_gap = 16 if stage == "f32" else 0  # pipeline.h P_ROW_PAIR_GAP
    return {
        "q_bytes": (head_dim // 2) * (br + pad) * pair,
        "kv_bytes": max((head_dim // 2) * (bc + pad), (bc // 2) * head_dim) * pair,
        # bc / 2 rows, two by two, each two p_row_pair_gap bytes apart
        "p_bytes": (bc // 4) * (2 * p_row + p_row_pair_gap) + (bc // 2 % 2) * p_row,
    }


def lds_bytes(facts: dict[str, object]) -> int:
    """LDS of the kernel whose name encodes ``facts`` (NAMES.parse)."""
    padded = padded_head_dim(facts["head_dim"], facts["tile.br"], facts["tile.threads"], facts["tile.tm"])
    return sum(lds_layout(padded, facts["tile.br"], facts["tile.bc"], facts["stage"]).values())

_LOG2E = 1.4426950408889634
_INT32 = (-2**31, 2**31 - 1)


# A call is the description every entry point builds (call.py): the planner reads its tensors, the
# options and, for a packed batch (cu_seqlens_q), batch and the longest sequences.
Call = Attention


def common_fields(q, k, v, out, lse, window: tuple[int, int], softmax_scale: float, causal_like: bool,
                  heavy_first: bool | None, seqused_k=None) -> dict:
    """The argument fields every fa2 family fills the same way: pointers, shape, mask, scale,
    strides, LSE and the row-block order."""
    batch, heads_q, seq_q, _ = q.shape
    left, right = window
    fields = dict(
        q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), o=out.data_ptr(),
        batch=batch, heads_q=heads_q, heads_kv=k.shape[1], seq_q=seq_q, seq_k=k.shape[2],
        window_left=left, window_right=right, scale_log2=float(softmax_scale) * _LOG2E,
        # Under a causal-like mask row blocks differ in length; longest first leaves almost no tail.
        heavy_first=int(causal_like if heavy_first is None else heavy_first))
    for prefix, t in (("q", q), ("k", k), ("v", v), ("o", out)):
        fields[f"{prefix}_stride_b"], fields[f"{prefix}_stride_h"], fields[f"{prefix}_stride_s"] = t.stride()[:3]
    if lse is not None:
        fields.update(lse=lse.data_ptr(), lse_stride_b=lse.stride(0), lse_stride_h=lse.stride(1))
    if seqused_k is not None:
        fields["seqused_k"] = seqused_k.data_ptr()
    return fields


def score_fields(call) -> dict:
    """The score-transform fields of ``call`` (an Attention): only those it sets, so a struct without
    them (the int8 families') is filled as before."""
    fields = {}
    if call.softcap:
        fields.update(softcap_log2=call.softcap * _LOG2E, softcap_inv=1.0 / (call.softcap * _LOG2E))
    if call.alibi_slopes is not None:
        slopes = call.alibi_slopes
        fields.update(alibi_slopes=slopes.data_ptr(), alibi_stride_b=slopes.stride(0) if slopes.dim() == 2 else 0)
    if call.sinks is not None:
        fields["sinks"] = call.sinks.data_ptr()
    return fields


def packed_rows(t) -> int:
    """The rows of ``t`` [batch, heads, rows, head_dim] that packed offsets (zero batch stride) may
    address: its rows, and those of the batches before the last where its batch stride is a whole
    number of rows (padded batches addressed through offsets); at most 2^31 - 1, the offsets' range."""
    batch, _, rows, _ = t.shape
    step, stride_b = t.stride(2), t.stride(0)
    before = (batch - 1) * (stride_b // step) if batch > 1 and step > 0 and stride_b % step == 0 else 0
    return min(before + rows, _INT32[1])


def row_block_launch(table: TargetTable, entry, args_type, fields: dict) -> Launch:
    """One launch of a workgroup per (row block, GQA head group, batch), its 32-bit fields checked."""
    for key in ("batch", "heads_q", "heads_kv", "seq_q", "seq_k", "window_left", "window_right"):
        if not _INT32[0] <= fields[key] <= _INT32[1]:
            raise InvalidArgumentError(f"{key} = {fields[key]} does not fit the kernel's 32-bit field")
    rows_per_head = entry.br // entry.gqa_group
    grid = (-(-fields["seq_q"] // rows_per_head), fields["heads_q"] // entry.gqa_group, fields["batch"])
    return Launch(kernel=entry, grid=grid, block=entry.threads, shared_bytes=table.shared_bytes(entry),
                  args=args_type(**fields))


# The score option whose kernels apply each transform; a call needing several runs the first's
# (route.FP16_ROW_BLOCKS.scores is this table).
SCORE_OPTIONS = {Option.ALIBI: "alibi", Option.SOFTCAP: "xf", Option.SINKS: "xf"}


def score_of(call: Call) -> str | None:
    """The kernels' score option that serves ``call`` (SCORE_OPTIONS): alibi with ALiBi slopes, xf
    with a softcap or sinks, None (the kernels without one) otherwise."""
    needs = {Option.ALIBI: call.alibi_slopes is not None, Option.SOFTCAP: call.softcap != 0.0,
             Option.SINKS: call.sinks is not None}
    return next((score for option, score in SCORE_OPTIONS.items() if needs[option]), None)


def layout_of(call: Call) -> str | None:
    """The kernels' layout option that reads ``call``: varlen for packed calls, len with cache
    lengths, None (the plain kernels) otherwise."""
    return "varlen" if call.cu_seqlens_q is not None else None if call.seqused_k is None else "len"


def plan(table: TargetTable, call: Call) -> Plan:
    """The launches of one call on the kernels compiled for its layout (layout_of). The call's
    ``heavy_first`` (default: on under causal-like masks) makes the workgroups take row blocks
    longest first; its ``kernel`` forces a dispatch entry by name."""
    q, k = call.q, call.k
    packed = call.cu_seqlens_q is not None
    entry = table.select(NAME, layout=layout_of(call), head_dim=q.shape[3], heads_per_kv=q.shape[1] // k.shape[1],
                         causal=call.causal_like, seq_q=call.seq_q if packed else q.shape[2], kernel=call.kernel,
                         dtype=call.dtype, score=score_of(call))
    fields = common_fields(q, k, call.v, call.out, call.lse, call.window, call.softmax_scale, call.causal_like,
                           call.heavy_first, call.seqused_k)
    if packed:
        fields.update(batch=call.batch, seq_q=call.seq_q, seq_k=call.seq_k,
                      cu_seqlens_q=call.cu_seqlens_q.data_ptr(), cu_seqlens_k=call.cu_seqlens_k.data_ptr(),
                      total_q=packed_rows(q), total_k=packed_rows(k), q_stride_b=0, k_stride_b=0, v_stride_b=0,
                      o_stride_b=0)
        if call.lse is not None:  # [heads_q, total_q]
            fields.update(lse_stride_b=0, lse_stride_h=call.lse.stride(0))
    if call.rotary_cos is not None:
        fields.update(rotary_cos=call.rotary_cos.data_ptr(), rotary_sin=call.rotary_sin.data_ptr(),
                      rotary_stride=call.rotary_cos.stride(0), rotary_dim=2 * call.rotary_cos.shape[1],
                      rotary_interleaved=int(call.rotary_interleaved))
    fields.update(score_fields(call))
    launch = row_block_launch(table, entry, Fa2Args, fields)
    buffers = tuple(t for t in (q, k, call.v, call.out, call.lse, call.rotary_cos, call.rotary_sin, call.seqused_k,
                                call.cu_seqlens_q, call.cu_seqlens_k, call.alibi_slopes, call.sinks) if t is not None)
    return Plan(table=table, device=q.device, launches=[launch], outputs=(call.out, call.lse), buffers=buffers)
