"""The FlashAttention-2 backward pass, runtime side: its argument struct and its three launches.

Three passes, each a kernel of its own (the family's layout option: ``pre``, none for dK/dV,
``dq``; one kernel of all three held too many arguments in scalar registers on RDNA2), compiled
per (head_dim, tile, dtype) from one body, each a launch of its own grid:
  0. preprocess, a workgroup per (row block, query head, batch): delta = rowsum(dO * O) in fp32
     (less the LSE's gradient, where the call's LSE is used), into an fp32 scratch
     [batch, heads_q, seq_q];
  1. dK and dV, a workgroup per (key block, K/V head, batch): the K and V tile stays in LDS while the
     workgroup walks the query blocks of every query head of its GQA group that see its keys,
     recomputing S and P from Q, K and the forward's log-sum-exp; dV += P^T dO and dK += dS^T Q
     accumulate in fp32 registers and are stored once, so the group's sum is taken in one order;
  2. dQ, a workgroup per (row block, query head, batch): walks the key blocks its rows see and
     accumulates dQ += dS K in fp32 registers.
No pass adds into memory another workgroup writes (no atomics): every gradient is computed in one
fixed order, so the backward pass is deterministic, run to run and whatever the launch order.

The atomic passes compute dQ in the dK/dV pass instead, without the dQ pass's second recomputation
of S and dP (5 head_dim-long products per visible score, not 7):
  0. preprocess, as above, zeroing an fp32 sum of dQ [batch, heads_q, seq_q, head_dim] too;
  3. atomic: the dK/dV pass, each step also adding its rows' dS K into that sum by atomics;
  4. dqcast, a workgroup per (row block, query head, batch): dQ = scale * the sum, in the input dtype.
The order in which the key blocks' shares of a dQ row are added varies from run to run, so dQ may
differ in its last bits between runs (dK and dV do not); ``plan(deterministic=True)`` takes the
three passes above."""

from __future__ import annotations

from ..abi import ArgStruct
from ..errors import InvalidArgumentError
from ..names import NameField, NameSchema
from ..plan import Launch, Plan
from ..table import TargetTable
from . import f16

NAME = "bwd"
# The passes besides dK/dV (the plain kernels): option value -> what its kernels compute.
LAYOUTS = {"pre": "the preprocess pass, delta = rowsum(dO * O)", "dq": "the dQ pass",
           "atomic": "the dK/dV pass adding dQ by atomics", "dqcast": "dQ from the atomic pass's fp32 sum"}
# Each kernel's pass as its body numbers it (fa2_backward.h PASS).
PASSES = {"pre": 0, None: 1, "dq": 2, "atomic": 3, "dqcast": 4}
# The passes of a call, in order: deterministic (every sum in one order), and with dQ by atomics.
DETERMINISTIC = ("pre", None, "dq")
ATOMIC = ("pre", "atomic", "dqcast")
# bf16 q, k, v, out, dout and gradients (f16.DTYPES): the same kernel over bf16 staging.
DTYPES = f16.DTYPES
NAMES = NameSchema("fa2_bwd", (
    f16.layout_field(LAYOUTS),
    f16.dtype_field(DTYPES),
    NameField("head_dim", "_hd{}", r"\d+"),
    NameField("tile.br", "_br{}", r"\d+"),
    NameField("tile.bc", "_bc{}", r"\d+"),
    NameField("tile.threads", "_nt{}", r"\d+"),
    NameField("tile.waves", "_wv{}", r"\d+", optional=True),
    NameField("wave_size", "_w{}", r"32|64"),
    # fp16: converted to fp32 once, when staged (cvt_fma), or staged as loaded (_sf16) and multiplied
    # by the target's fp16 tier (dot2, fma_mix; the host's cvt_fma); bf16: widened by a shift when
    # staged (shift_fma), or staged as loaded (_sbf16) and multiplied by the target's bf16 dot
    # (bf16_dot2; the host's shift_fma); the preprocess pass: fp32 sums (fp32).
    NameField("tier", "_{}", r"dot2|fma_mix|cvt_fma|bf16_dot2|shift_fma|fp32", str),
    NameField("options.stage", "_s{}", r"f16|bf16", str, optional=True),
))

_TENSORS = ("q", "k", "v", "o", "dout", "dq", "dk", "dv")
ARGS = ArgStruct("Fa2BwdArgs", (
    # 16-bit rows (fp16, or bf16 in the bf16 kernels), [batch, heads, seq, head_dim] with element
    # strides, the last dimension contiguous: the forward's inputs and output, the output's
    # gradient, and the gradients written.
    ("q", "const half_t*"),
    ("k", "const half_t*"),
    ("v", "const half_t*"),
    ("o", "const half_t*"),
    ("dout", "const half_t*"),
    ("dq", "half_t*"),
    ("dk", "half_t*"),
    ("dv", "half_t*"),
    *((f"{t}_stride_{d}", "long long") for t in _TENSORS for d in "bhs"),
    # The forward's log-sum-exp (natural log), fp32 [batch, heads_q, seq_q] by its strides, and the
    # gradient it got (null: none), by the same strides.
    ("lse", "const float*"),
    ("lse_stride_b", "long long"),
    ("lse_stride_h", "long long"),
    ("dlse", "const float*"),
    ("dlse_stride_b", "long long"),
    ("dlse_stride_h", "long long"),
    # fp32 scratch [batch, heads_q, seq_q] by its strides (the last 1): the preprocess pass's
    ("delta", "float*"),
    ("delta_stride_b", "long long"),
    ("delta_stride_h", "long long"),
    # fp32 scratch [batch, heads_q, seq_q, head_dim], element (b, h, s, d) at (delta's offset of (b, h,
    # s)) * head_dim + d: the atomic pass's dQ sum (null: the deterministic passes)
    ("dq_accum", "float*"),
    # Packed batches (null: dense): int32 [batch + 1] offsets of each sequence's rows and keys along
    # the tensors' sequence dimension (and the LSE's, delta's); seq_q and seq_k are then the longest.
    ("cu_seqlens_q", "const int*"),
    ("cu_seqlens_k", "const int*"),
    ("total_q", "int"),  # the rows the offsets may address (q's, k's), which the kernels clamp them into
    ("total_k", "int"),
    # ALiBi (null: none): fp32 slopes, batch b's query head h at [b * alibi_stride_b + h], as the
    # forward's (f16.SCORE_FIELDS)
    ("alibi_slopes", "const float*"),
    ("alibi_stride_b", "long long"),
    # Keys each sequence uses (null: all): int32 [batch], the first seqused_k[b] of its keys (clamped
    # into them), as the forward's; the others get zero gradients (the caller's zeroed dK and dV rows).
    ("seqused_k", "const int*"),
    ("batch", "int"),
    ("heads_q", "int"),
    ("heads_kv", "int"),
    ("seq_q", "int"),
    ("seq_k", "int"),
    ("window_left", "int"),   # as the forward's (f16.SHAPE_FIELDS)
    ("window_right", "int"),
    ("scale_log2", "float"),  # softmax scale times log2(e)
    ("softmax_scale", "float"),
    ("softcap_log2", "float"),  # as the forward's (f16.SCORE_FIELDS); 0: no cap
    ("softcap_inv", "float"),
))
Fa2BwdArgs = ARGS.ctype


def lds_layout(head_dim: int, br: int, bc: int, threads: int, layout: str | None,
               stage: str | None = None) -> dict[str, int]:
    """Bytes of each LDS region. The dK/dV and dQ passes: the Q and dO tiles [br][head_dim + pad],
    the K and V tiles [bc][head_dim + pad] (fp32 rows, or 16-bit with ``stage`` "f16" or "bf16"; padded by 16
    bytes, so that lanes reading 16 bytes of consecutive rows meet no bank twice), P and dS [br][bc]
    fp32, and each row's LSE and delta [br]. The preprocess pass: a partial sum per thread; dqcast:
    none."""
    if layout == "pre":
        return {"partial_bytes": threads * 4}
    if layout == "dqcast":
        return {}
    row = (head_dim + 8) * 2 if stage in ("f16", "bf16") else (head_dim + 4) * 4
    return {"q_do_bytes": 2 * br * row, "k_v_bytes": 2 * bc * row, "p_ds_bytes": 2 * br * bc * 4,
            "row_bytes": 2 * br * 4}


def lds_bytes(facts: dict[str, object]) -> int:
    return sum(lds_layout(facts["head_dim"], facts["tile.br"], facts["tile.bc"], facts["tile.threads"],
                          facts.get("options.layout"), facts.get("options.stage")).values())


_LOG2E = 1.4426950408889634
_INT32_MAX = 2**31 - 1


def served(table: TargetTable, head_dim: int, dtype: str | None, passes: tuple = DETERMINISTIC) -> bool:
    """Whether ``table``'s target has backward kernels for ``head_dim`` in ``dtype`` (None: fp16), the
    deterministic passes (or ``passes``)."""
    return all(table.entries(NAME, head_dim, layout, dtype) for layout in passes)


def plan(table: TargetTable, *, dout, q, k, v, out, lse, dlse, delta, dq, dk, dv, window: tuple[int, int],
         softmax_scale: float, softcap: float, dtype: str | None, dq_accum=None, alibi_slopes=None,
         packed: tuple | None = None, seqused_k=None,
         kernels: tuple[str | None, str | None, str | None] = (None, None, None)) -> Plan:
    """The three launches of a backward call: tensors [batch, heads, seq, head_dim] (lse, dlse and
    the scratch delta [batch, heads_q, seq_q], dlse None where the LSE got no gradient). With
    ``dq_accum`` (fp32 scratch [batch, heads_q, seq_q, head_dim], contiguous) the atomic passes,
    else the deterministic ones. ``alibi_slopes``: fp32 [heads_q] or [batch, heads_q], or None.
    ``packed`` = (cu_seqlens_q, cu_seqlens_k, max_q, max_k): the tensors are [1, heads, total,
    head_dim] views of packed sequences (lse, dlse, delta [1, heads_q, total_q], dq_accum [1,
    heads_q, total_q, head_dim]), sequence b at the rows and keys the int32 offsets give.
    ``seqused_k`` (int32 [batch], or None): the keys each sequence uses, as the forward's; the rows
    of dk and dv past them are not written (the caller zeroes them). ``kernels`` forces each pass's entry by name (None: the table's choice), alternates included."""
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    if packed is not None:
        cu_q, cu_k, seq_q, seq_k = packed
        batch = cu_q.shape[0] - 1
    passes = DETERMINISTIC if dq_accum is None else ATOMIC
    pre, dkdv, dq_pass = (table.select(NAME, head_dim=head_dim, heads_per_kv=1, causal=False, seq_q=seq_q,
                                       layout=layout, dtype=dtype, kernel=kernel)
                          for layout, kernel in zip(passes, kernels))
    for name, value in (("batch", batch), ("heads_q", heads_q), ("seq_q", seq_q), ("seq_k", seq_k),
                        ("total_q", q.shape[2]), ("total_k", k.shape[2])):
        if value > _INT32_MAX:
            raise InvalidArgumentError(f"{name} = {value} does not fit the kernel's 32-bit field")
    fields = dict(batch=batch, heads_q=heads_q, heads_kv=heads_kv, seq_q=seq_q, seq_k=seq_k,
                  window_left=window[0], window_right=window[1], scale_log2=softmax_scale * _LOG2E,
                  softmax_scale=softmax_scale, lse=lse.data_ptr(), lse_stride_b=lse.stride(0),
                  lse_stride_h=lse.stride(1), delta=delta.data_ptr(), delta_stride_b=delta.stride(0),
                  delta_stride_h=delta.stride(1))
    if packed is not None:
        fields.update(cu_seqlens_q=cu_q.data_ptr(), cu_seqlens_k=cu_k.data_ptr(), total_q=q.shape[2],
                      total_k=k.shape[2])
    if alibi_slopes is not None:
        fields.update(alibi_slopes=alibi_slopes.data_ptr(),
                      alibi_stride_b=alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0)
    if seqused_k is not None:
        fields.update(seqused_k=seqused_k.data_ptr())
    if softcap:
        fields.update(softcap_log2=softcap * _LOG2E, softcap_inv=1.0 / (softcap * _LOG2E))
    if dlse is not None:
        fields.update(dlse=dlse.data_ptr(), dlse_stride_b=dlse.stride(0), dlse_stride_h=dlse.stride(1))
    if dq_accum is not None:
        fields.update(dq_accum=dq_accum.data_ptr())
    for name, t in zip(_TENSORS, (q, k, v, out, dout, dq, dk, dv)):
        fields[name] = t.data_ptr()
        fields[f"{name}_stride_b"], fields[f"{name}_stride_h"], fields[f"{name}_stride_s"] = t.stride()[:3]
    args = Fa2BwdArgs(**fields)
    launches = [Launch(kernel=e, grid=grid, block=e.threads, shared_bytes=table.shared_bytes(e), args=args)
                for e, grid in ((pre, (-(-seq_q // pre.br), heads_q, batch)),
                                (dkdv, (-(-seq_k // dkdv.bc), heads_kv, batch)),
                                (dq_pass, (-(-seq_q // dq_pass.br), heads_q, batch)))]
    buffers = tuple(t for t in (dout, q, k, v, out, lse, dlse, delta, dq_accum, dq, dk, dv, alibi_slopes, seqused_k,
                                *(packed[:2] if packed is not None else ())) if t is not None)
    return Plan(table=table, device=q.device, launches=launches, outputs=(dq, dk, dv), buffers=buffers)
