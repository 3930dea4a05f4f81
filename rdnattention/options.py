"""A call's options, validated into the kernel's terms: the mask (is_causal folded into the window),
the softmax scale, RoPE tables, per-sequence key counts, the log-sum-exp, the score transforms
(softcap, ALiBi, sinks). Everything here reads
shapes, strides, dtypes and devices only, never values, so it runs on fake tensors too."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import checks
from .errors import InvalidArgumentError, UnsupportedError

INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class ScoreOptions:
    """The score transforms of a call (docs/api.md: score transforms), each applied once to every
    visible score in the kernels' score step: the logit softcap (flash-attn's ``softcap``: a score
    s, softmax scale applied, becomes softcap * tanh(s / softcap); 0.0: none), ALiBi slopes
    (flash-attn's ``alibi_slopes``, fp32 [heads_q] or [batch, heads_q]: -slope * |i + seqlen_k -
    seqlen_q - j| added to the scaled score of query i and key j) and attention sinks (``sinks``,
    fp32 [heads_q]: one logit per query head that joins each row's softmax denominator and adds
    no value)."""

    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    sinks: torch.Tensor | None = None

    @property
    def tensors(self) -> tuple:
        return (self.alibi_slopes, self.sinks)


NO_SCORE_OPTIONS = ScoreOptions()


def replayed_score(softcap, alibi_slopes, sinks) -> ScoreOptions:
    """The score transforms of a replayed call, which validation accepted when its key was planned
    (the key holds the softcap's value and the slopes' and sinks' shapes, dtypes and devices):
    NO_SCORE_OPTIONS for a call without any, built for no call."""
    if alibi_slopes is None and sinks is None and type(softcap) is float and not softcap:
        return NO_SCORE_OPTIONS
    return ScoreOptions(softcap=float(softcap), alibi_slopes=alibi_slopes, sinks=sinks)


@dataclass(frozen=True)
class Options:
    """A validated call's options, in the kernel's terms."""

    window_left: int
    window_right: int
    softmax_scale: float
    rotary_cos: torch.Tensor | None
    rotary_sin: torch.Tensor | None
    rotary_interleaved: bool
    return_lse: bool
    seqused_k: torch.Tensor | None  # int32 [batch]: keys each batch uses (a preallocated cache)
    # softcap, ALiBi, sinks. No default: torch.compile cannot trace a dataclass field whose default
    # is an object (torch 2.11's dynamo refuses to wrap it), so every caller passes one.
    score: ScoreOptions
    # The backward's passes: every gradient summed in one order (True), or dQ added by atomics where
    # the device has those kernels (ops.backward; torch.use_deterministic_algorithms forces True).
    deterministic: bool = False


def replayable_types(window_size: object, scale: object, softcap: object) -> bool:
    """Whether a call's window, scale and softcap are of the types the replay keys take as they are
    (a tuple of two ints, a float or None, a float or int): what an entry point checks before it
    compares them with the options its express function was made under (replay.LastExpress)."""
    return (type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int
            and type(window_size[1]) is int and (scale is None or type(scale) is float)
            and (type(softcap) is float or type(softcap) is int))


def as_window(window_size: object) -> object:
    """flash-attn's ``window_size`` as its callers pass it, made a tuple of two Python ints: a tuple
    or list of two ints, a pair in a CPU tensor or two 0-d CPU tensors of an integer dtype (as
    flash-attn's tests pass it), read without a device synchronisation. A pair on a GPU is refused
    (UnsupportedError): its values choose the mask the kernels apply, and reading them would
    synchronise with the device on every call. Anything else is returned as it is, for
    check_window to name."""
    if type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is type(window_size[1]) is int:
        return window_size  # the common form, as it is (every call of an eager loop passes one)

    def integer(t: torch.Tensor) -> bool:
        return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)

    def on_cpu(t: torch.Tensor) -> None:
        if t.device.type != "cpu":
            raise UnsupportedError(f"window_size is a tensor on {t.device}: its values choose the mask, and reading "
                                   "them would synchronise with the device on every call; pass a tuple of two ints "
                                   "(or a CPU tensor)")

    if isinstance(window_size, torch.Tensor):
        if tuple(window_size.shape) != (2,) or not integer(window_size):
            return window_size
        on_cpu(window_size)
        return tuple(int(w) for w in window_size.tolist())
    if isinstance(window_size, (tuple, list)) and len(window_size) == 2:
        pair = []
        for w in window_size:
            if isinstance(w, torch.Tensor) and w.dim() == 0 and integer(w):
                on_cpu(w)
                w = int(w.item())
            pair.append(w)
        return tuple(pair)
    return window_size


def check_window(window_size: object) -> tuple[int, int]:
    """flash-attn's ``window_size``: a pair of ints (left, right), each -1 (unbounded) or more, in
    any of the forms as_window takes."""
    window_size = as_window(window_size)
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise InvalidArgumentError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if left < -1 or right < -1:
        raise InvalidArgumentError(f"window_size values must be >= -1 (-1: unbounded), got {tuple(window_size)}")
    return left, right


def check_scale(scale: object, head_dim: int, name: str = "softmax_scale") -> float:
    """The softmax scale (None: 1/sqrt(head_dim)): a finite number whose product with log2(e), the
    factor the kernels scale scores by in float32, is within float32's range."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise InvalidArgumentError(f"{name} must be a finite number, got {scale!r}")
    if abs(float(scale)) * LOG2E > FLOAT32_MAX:
        raise InvalidArgumentError(f"{name} {scale!r} times log2(e) is beyond float32's range; the kernel scales "
                                   "scores in float32")
    return float(scale)


def check_rotary(cos: object, sin: object, interleaved: object, q: torch.Tensor, seq_k: int) -> bool:
    """Validates the RoPE tables (float32 or q's dtype); returns whether RoPE is on."""
    if cos is None and sin is None:
        return False
    if cos is None or sin is None:
        raise InvalidArgumentError("rotary_cos and rotary_sin must be given together")
    if not isinstance(interleaved, bool):
        raise InvalidArgumentError(f"rotary_interleaved must be a bool, got {interleaved!r}")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.float32, q.dtype):
            raise InvalidArgumentError(f"{name} must be float32 or q's dtype ({q.dtype}), got {t.dtype}")
        if t.dim() != 2 or t.shape[1] == 0:
            raise InvalidArgumentError(f"{name} must be 2-D [positions, rotary_dim/2], got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise InvalidArgumentError(f"{name} is on {t.device}, q on {q.device}")
        if t.stride(1) != 1:
            raise InvalidArgumentError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if cos.shape != sin.shape or cos.stride() != sin.stride() or cos.dtype != sin.dtype:
        raise InvalidArgumentError(f"rotary_cos {tuple(cos.shape)} {cos.dtype} and rotary_sin {tuple(sin.shape)} "
                                   f"{sin.dtype} must have the same shape, strides and dtype")
    rotary_dim = 2 * cos.shape[1]
    if rotary_dim > q.shape[3]:
        raise InvalidArgumentError(f"rotary_dim {rotary_dim} (2 * table width) exceeds head_dim {q.shape[3]}")
    if q.shape[2] > seq_k:
        raise InvalidArgumentError(f"with RoPE, seq_q ({q.shape[2]}) must not exceed seq_k ({seq_k}): query i sits at "
                                   "position i + seq_k - seq_q, which must be a row of the tables")
    if cos.shape[0] < seq_k:
        raise InvalidArgumentError(f"rotary tables have {cos.shape[0]} positions; keys need {seq_k} "
                                   "(positions 0..seq_k-1, queries at the last seq_q of them)")
    return True


def check_seqused(seqused_k: object, q: torch.Tensor, name: str = "seqused_k") -> torch.Tensor | None:
    """Cache lengths: int32 [batch] on q's device (their values are checked when planned)."""
    if seqused_k is None:
        return None
    if not isinstance(seqused_k, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor or None, got {type(seqused_k).__name__}")
    if seqused_k.dtype != torch.int32 or tuple(seqused_k.shape) != (q.shape[0],):
        raise InvalidArgumentError(f"{name} must be int32 [batch] = ({q.shape[0]},), got {seqused_k.dtype} "
                                   f"{tuple(seqused_k.shape)}")
    if seqused_k.device != q.device:
        raise InvalidArgumentError(f"{name} is on {seqused_k.device}, q on {q.device}")
    if seqused_k.numel() > 1 and seqused_k.stride(0) != 1:
        raise InvalidArgumentError(f"{name} must be contiguous, got stride {seqused_k.stride()}")
    return seqused_k


def validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: object, window_size: object,
             softmax_scale: object, rotary_cos: object, rotary_sin: object, rotary_interleaved: object,
             return_lse: object, seqused_k: object = None, softcap: object = 0.0, alibi_slopes: object = None,
             sinks: object = None) -> Options:
    """Everything but the data pointers, so it runs on fake tensors too. q, k, v: the kernel's view."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_rows(name, t)
    if not isinstance(is_causal, bool):
        raise InvalidArgumentError(f"is_causal must be a bool, got {is_causal!r}")
    left, right = check_window(window_size)
    if is_causal:
        right = 0 if right < 0 else min(right, 0)
    batch, heads_q, seq_q, head_dim = q.shape
    _, heads_kv, seq_k, _ = k.shape
    if k.shape[0] != batch or k.shape[3] != head_dim:
        raise InvalidArgumentError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} "
                                   "in batch or head_dim")
    if v.shape != k.shape:
        raise InvalidArgumentError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    if heads_kv == 0 or heads_q % heads_kv:
        raise InvalidArgumentError(f"q heads ({heads_q}) must be a multiple of k/v heads ({heads_kv})")
    if q.device != k.device or q.device != v.device:
        raise InvalidArgumentError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    checks.check_same_dtype(("q", q), ("k", k), ("v", v))
    if max(seq_q, seq_k) > INT32_MAX:
        raise InvalidArgumentError(f"sequence lengths must be below 2^31, got {seq_q} and {seq_k}")
    softmax_scale = check_scale(softmax_scale, head_dim)
    # Windows at least as long as the sequences change nothing: clamp them so any int packs into
    # the kernel's 32-bit fields (INT_MAX or 2**40 for "unbounded" behave like -1).
    if left >= seq_k:
        left = -1
    if right >= seq_q:
        right = seq_q
    if not isinstance(return_lse, bool):
        raise InvalidArgumentError(f"return_lse must be a bool, got {return_lse!r}")
    rope = check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, seq_k)
    # Gradients: the backward kernels (ops.flash_attn_bwd) take the mask, the scale, GQA, the softcap,
    # ALiBi and seqused_k; sinks need nothing of them (the log-sum-exp holds the sink) and get their
    # gradient in ops._backward; RoPE is applied by torch operations before the kernels (ops.rotated).
    return Options(window_left=left, window_right=right, softmax_scale=softmax_scale,
                   rotary_cos=rotary_cos if rope else None, rotary_sin=rotary_sin if rope else None,
                   rotary_interleaved=bool(rotary_interleaved) if rope else False, return_lse=return_lse,
                   seqused_k=check_seqused(seqused_k, q),
                   score=check_score_options(softcap, alibi_slopes, sinks, batch=batch, heads_q=heads_q, sinks_grad=True,
                                             device=q.device))


def refuse_missing_features(dropout_p: object) -> None:
    """flash-attn's options this library does not have: UnsupportedError naming each."""
    if dropout_p != 0.0:
        raise UnsupportedError(f"dropout_p={dropout_p!r}: the kernels have no attention dropout; pass 0.0")


# The least softcap whose 1 / (softcap * log2(e)), which the kernels multiply by, is a float32.
_SOFTCAP_MIN = 1.0 / (FLOAT32_MAX / 2) / LOG2E


def check_softcap(softcap: object) -> float:
    """flash-attn's ``softcap``: a finite number, 0.0 (none) or positive, whose product with
    log2(e) and its reciprocal are float32 numbers (the kernels' terms)."""
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not math.isfinite(softcap):
        raise InvalidArgumentError(f"softcap must be a finite number (0.0: no cap), got {softcap!r}")
    if softcap < 0:
        raise InvalidArgumentError(f"softcap must be 0.0 (no cap) or positive, got {softcap!r}")
    if softcap and not _SOFTCAP_MIN <= softcap <= FLOAT32_MAX / LOG2E:
        raise InvalidArgumentError(f"softcap {softcap!r} is outside float32's range for the kernels' terms "
                                   f"(softcap * log2(e) and its reciprocal); use a value in [{_SOFTCAP_MIN:.3g}, "
                                   f"{FLOAT32_MAX / LOG2E:.3g}]")
    return float(softcap)


def _check_fp32(name: str, t: object, shapes: tuple[tuple[int, ...], ...], what: str,
                device: torch.device, grad: bool = False) -> torch.Tensor:
    """A float32 tensor of one of ``shapes`` on ``device``, its last dimension contiguous; one that
    requires grad only where the caller's backward gives it a gradient (``grad``)."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if t.dtype != torch.float32 or tuple(t.shape) not in shapes:
        raise InvalidArgumentError(f"{name} must be float32 {what}, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise InvalidArgumentError(f"{name} is on {t.device}, q on {device}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise InvalidArgumentError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if not grad and torch.is_grad_enabled() and t.requires_grad:
        raise UnsupportedError(f"{name} requires grad, and the backward pass gives no gradient for it: run it "
                               "under torch.no_grad() or torch.inference_mode(), or pass a detached tensor")
    return t


def check_score_options(softcap: object = 0.0, alibi_slopes: object = None, sinks: object = None, *, batch: int,
                        heads_q: int, device: torch.device, sinks_grad: bool = False) -> ScoreOptions:
    """Validates a call's score transforms (shapes, dtypes and devices only: their values are
    checked where the call is planned, check_score_values). ``sinks_grad``: the caller's backward
    gives sinks a gradient (the flash_attn family's), so sinks may require grad."""
    softcap = check_softcap(softcap)
    if alibi_slopes is not None:
        alibi_slopes = _check_fp32("alibi_slopes", alibi_slopes, ((heads_q,), (batch, heads_q)),
                                   f"[heads_q] = ({heads_q},) or [batch, heads_q] = ({batch}, {heads_q})", device)
    if sinks is not None:
        sinks = _check_fp32("sinks", sinks, ((heads_q,),), f"[heads_q] = ({heads_q},)", device, grad=sinks_grad)
    return ScoreOptions(softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)


def check_score_values(values: checks.Values, score: ScoreOptions) -> checks.Values:
    """Adds the checks of the slopes' and sinks' values to ``values`` (finite, where they are read:
    checks.reads), after their memory's."""
    for name, t in (("alibi_slopes", score.alibi_slopes), ("sinks", score.sinks)):
        if t is not None:
            checks.check_memory(name, t)
            values.finite(name, t)
    return values
