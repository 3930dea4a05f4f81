"""The INT8 FlashAttention-2 forward family, runtime side: its argument struct and its launches.

Both products in int8: S = Q.K^T from int8 Q and K with per-token fp32 scales, P quantized in the
kernel to int8 (0..127) for P.V against int8 V with a per-channel fp32 scale; the online softmax
in fp32, the output fp16. One launch, the same grid as the fp16 family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..abi import ArgStruct
from ..names import NameField, NameSchema
from ..plan import Plan
from ..table import TargetTable
from . import f16

if TYPE_CHECKING:
    import torch

NAME = "i8"

NAMES = NameSchema("fa2_i8", f16.TILE_NAME_FIELDS + (NameField("tier", "_{}", r"sdot4|sudot4|dp4a|exact", str),))

# Per-token scales [batch, heads, seq] (Q: heads_q, seq_q; K: heads_kv, seq_k) and the per-channel V
# scale [batch, heads_kv, head_dim], fp32: strides of batch and head, the last contiguous. Every
# int8 family's (i8dec too).
SCALE_FIELDS = tuple(field for t in "qkv" for field in ((f"{t}_scale", "const float*"),
                                                      (f"{t}_scale_stride_b", "long long"),
                                                      (f"{t}_scale_stride_h", "long long")))

# Strides are in elements; the last dimension is contiguous.
ARGS = ArgStruct("Fa2I8Args", (
    ("q", "const signed char*"),
    ("k", "const signed char*"),
    ("v", "const signed char*"),
    ("o", "half_t*"),
    *f16.STRIDE_FIELDS,
    *SCALE_FIELDS,
    *f16.SHAPE_FIELDS,
    *f16.LSE_FIELDS,
    ("heavy_first", "int"),
))
Fa2I8Args = ARGS.ctype

# P is quantized to 0..P_LEVELS in the kernel (signed int8, so it feeds the signed dot4 of every target).
P_LEVELS = 127


def lds_layout(head_dim: int, br: int, bc: int) -> dict[str, int]:
    """Bytes of each LDS region: Q transposed as quads of int8 along head_dim, the K tile the same
    way then the V tile as quads of four keys, P as quads of four keys, and the K tile's scales."""
    pad = 4  # quads: rows stay 16-byte aligned and off one bank
    return {
        "q_bytes": (head_dim // 4) * (br + pad) * 4,
        "kv_bytes": max((head_dim // 4) * (bc + pad), (bc // 4) * head_dim) * 4,
        "p_bytes": (bc // 4) * (br + pad) * 4,
        "k_scale_bytes": bc * 4,
    }


def lds_bytes(facts: dict[str, object]) -> int:
    return sum(lds_layout(facts["head_dim"], facts["tile.br"], facts["tile.bc"]).values())


@dataclass(frozen=True)
class Call:
    """A validated call: int8 tensors [batch, heads, seq, head_dim], scales fp32, output allocated."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor | None
    window: tuple[int, int]
    softmax_scale: float

    @property
    def causal_like(self) -> bool:
        left, right = self.window
        return left < 0 and right >= 0


def scale_fields(call: Call) -> dict:
    """The SCALE_FIELDS of a call: each scale's pointer and its batch and head strides."""
    fields = {}
    for prefix, t in (("q_scale", call.q_scale), ("k_scale", call.k_scale), ("v_scale", call.v_scale)):
        fields[prefix] = t.data_ptr()
        fields[f"{prefix}_stride_b"], fields[f"{prefix}_stride_h"] = t.stride()[:2]
    return fields


def plan(table: TargetTable, call: Call, *, heavy_first: bool | None = None, kernel: str | None = None) -> Plan:
    q, k = call.q, call.k
    entry = table.select(NAME, head_dim=q.shape[3], heads_per_kv=q.shape[1] // k.shape[1], causal=call.causal_like,
                         seq_q=q.shape[2], kernel=kernel)
    fields = f16.common_fields(q, k, call.v, call.out, call.lse, call.window, call.softmax_scale, call.causal_like,
                               heavy_first)
    fields.update(scale_fields(call))
    launch = f16.row_block_launch(table, entry, Fa2I8Args, fields)
    buffers = tuple(t for t in (q, k, call.v, call.q_scale, call.k_scale, call.v_scale, call.out, call.lse)
                    if t is not None)
    return Plan(table=table, device=q.device, launches=[launch], outputs=(call.out, call.lse), buffers=buffers)
