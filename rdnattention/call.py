"""What a validated call is, in the kernels' view (:class:`Attention`), and what of it decides which
family serves it (:class:`Request`: precision, K/V layout, head_dim, rows, options). The chooser
(route.py) reads the request; the split-KV planner (families/dec.py) plans the call itself."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the generator imports the families, and with them this module, without torch
    import torch


# torch dtypes (as str() spells them) whose kernels are a dtype option of the fp16 families.
DTYPE_OPTIONS = {"torch.bfloat16": "bf16"}


class Precision(Enum):
    FP16 = "fp16"
    INT8 = "int8"


class Layout(Enum):
    """How a call's keys and values are found (the value is how messages say it)."""

    STRIDED = "strided keys and values"
    SEQUSED = "strided keys and values with per-sequence key counts (seqused_k)"
    PACKED = "packed sequences (cu_seqlens)"
    PAGED = "a paged cache (block_table)"


class Option(Enum):
    """What a call may ask of a kernel beyond reading its layout (the value is how messages say it).
    The score transforms (softcap, ALiBi, sinks) are taken by the algorithms whose kernels apply them."""

    ROTARY = "RoPE in the kernel (rotary_cos, rotary_sin)"
    ROW_ORDER = "a row-block order (heavy_first)"
    CACHE_ROWS = "cache rows chosen per sequence (cache_batch_idx)"
    KEY_SLICES = "a number of key slices (num_splits)"
    QUERY_COUNTS = "per-sequence query rows (padded batches)"
    SOFTCAP = "a logit softcap (softcap)"
    ALIBI = "ALiBi (alibi_slopes)"
    SINKS = "attention sinks (sinks)"


@dataclass(frozen=True)
class Attention:
    """A validated call in the kernels' view: q and out [batch, heads_q, seq_q, head_dim] (packed:
    [1, heads_q, total_q, head_dim] with cu_seqlens_q), k and v [batch, heads_kv, seq_k, head_dim]
    (packed: [1, heads_kv, total_k, head_dim] with cu_seqlens_k; paged: [pages, heads_kv,
    page_size, head_dim] with block_table), lse [batch, heads_q, seq_q] (packed: [heads_q,
    total_q]) or None. An int8 call carries its scales (int8.py states their contract)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor | None
    window: tuple[int, int]  # (left, right) after folding is_causal in; -1: unbounded
    softmax_scale: float
    batch: int
    seq_q: int  # query rows per sequence (packed: the longest)
    seq_k: int  # keys per sequence at most (paged: pages per row x page size)
    seqused_k: torch.Tensor | None = None
    cache_batch_idx: torch.Tensor | None = None
    block_table: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    seqused_q: torch.Tensor | None = None  # int32 [batch]: query rows of each sequence (padded batches)
    rotary_cos: torch.Tensor | None = None  # fp32 [positions, rotary_dim / 2]
    rotary_sin: torch.Tensor | None = None
    rotary_interleaved: bool = False
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # int8: q_scale, k_scale, v_scale
    num_splits: int = 0  # key slices of the split-KV kernels; 0: chosen from the grid and the device
    heavy_first: bool | None = None  # the row-block order; None: the kernel's default
    kernel: str | None = None  # a kernel forced by name
    # Score transforms (options.ScoreOptions states them): the logit softcap (0.0: none), ALiBi
    # slopes fp32 [heads_q] or [batch, heads_q], attention sinks fp32 [heads_q].
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None

    @property
    def causal_like(self) -> bool:
        """Visible keys grow with the query position (no left bound, a right bound)."""
        left, right = self.window
        return left < 0 and right >= 0

    @property
    def dtype(self) -> str | None:
        """The kernels' dtype option that reads the call's tensors: ``bf16`` for bfloat16; None for
        the families' own (fp16; int8 for the int8 families)."""
        return DTYPE_OPTIONS.get(str(self.q.dtype))

    @property
    def layout(self) -> Layout:
        if self.block_table is not None:
            return Layout.PAGED
        if self.cu_seqlens_q is not None:
            return Layout.PACKED
        return Layout.SEQUSED if self.seqused_k is not None else Layout.STRIDED

    def request(self) -> Request:
        layout = self.layout
        wanted = {Option.ROTARY: self.rotary_cos is not None,
                  Option.ROW_ORDER: self.heavy_first is not None,
                  Option.CACHE_ROWS: self.cache_batch_idx is not None,
                  Option.QUERY_COUNTS: self.seqused_q is not None,
                  # A slice count asks for the split-KV kernels on a cache (flash_attn_with_kvcache's
                  # num_splits). On packed batches (varlen_attn's) it applies where they run: a long
                  # packed prefill runs row blocks, which have no slices, so their results do not
                  # depend on the batch either.
                  Option.KEY_SLICES: self.num_splits > 0 and layout is not Layout.PACKED,
                  Option.SOFTCAP: self.softcap != 0.0,
                  Option.ALIBI: self.alibi_slopes is not None,
                  Option.SINKS: self.sinks is not None}
        return Request(precision=Precision.INT8 if self.scales is not None else Precision.FP16, layout=layout,
                       head_dim=self.q.shape[3], rows=self.q.shape[1] // max(self.k.shape[1], 1) * self.seq_q,
                       options=frozenset(o for o, on in wanted.items() if on), kernel=self.kernel, seq_q=self.seq_q,
                       dtype=self.dtype if self.scales is None else None)


@dataclass(frozen=True)
class Request:
    """What decides the family of a call."""

    precision: Precision
    layout: Layout
    head_dim: int
    rows: int  # query rows per K/V head: query heads per K/V head times query rows per sequence
    options: frozenset[Option] = frozenset()
    kernel: str | None = None
    seq_q: int | None = None  # query rows per sequence; None: as many as rows (no grouped heads)
    # The dtype option of the kernels that read it (``bf16``); None: the precision's own (fp16, int8).
    dtype: str | None = None

    @property
    def what(self) -> str:
        """The inputs' dtype as messages say it: ``fp16``, ``int8``, ``bf16``."""
        return self.precision.value if self.dtype is None else self.dtype
