"""torch.nn.functional.scaled_dot_product_attention, served by rdnattention's kernels where they can.

    import rdnattention
    rdnattention.patch_sdpa()           # or: with rdnattention.sdpa_patched(): ...
    ...                                 # diffusers, ComfyUI, transformers' "sdpa", nn.MultiheadAttention
    rdnattention.stats()                # {'served': ..., 'fallback': ..., 'fallbacks': {reason: count}, ...}

:func:`patch_sdpa` replaces the ``scaled_dot_product_attention`` attribute of
``torch.nn.functional`` (which is what ``F.scaled_dot_product_attention(...)``,
``torch.nn.functional.scaled_dot_product_attention(...)`` and ``nn.MultiheadAttention`` look up at
each call) with :func:`sdpa`. For each call, :func:`sdpa` decides from the arguments alone (dtypes,
shapes, devices, flags, and the values of a mask) whether the kernels serve it, asking the chooser
(route.choose) with the call's Request as every entry point does; only then does it launch them.
Every other call goes to the function that was replaced, with its arguments unchanged, and is
counted by reason (:func:`stats`); the first of each reason logs one line (logger
``rdnattention.integrations.sdpa``, level WARNING).

Masks are read, not assumed. A boolean mask (True: the key takes part) or an additive one (0:
visible; -inf or at most -10000: hidden) is served when, per sequence of the batch and identically
for every head, the keys each query sees are a band: keys ``[k0, k1)`` of the sequence, and for
query ``i`` keys ``i + lo .. i + hi`` of them, either bound possibly absent. That covers all-visible
masks, causal masks (either alignment), sliding windows, key padding (per-sequence key lengths:
one call with ``seqused_k`` where a kernel of that layout is built, else one call per sequence) and
their combinations. Reading a mask needs its values: a CPU mask is read directly; a GPU mask costs
one device synchronisation, once per mask tensor while it is unmodified (``device_masks=False``
sends those calls to torch instead). Calls captured into a CUDA graph run torch's function.

Inputs that require grad are served where the target has backward kernels for the dtype at the
head_dim or above it (rdnattention's backward, through autograd: ops.flash_attn_fwd; a head_dim
without its own runs the next one's on padded copies, ops.backward_head_dim), key padding
included (the backward takes the per-sequence key counts); above every built head_dim, and for a
mask that requires grad, torch's function runs (reason ``requires grad``)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.utils._python_dispatch

from .. import ops, replay, route, workspace
from ..call import DTYPE_OPTIONS, Layout, Precision, Request
from ..checks import FLOAT_DTYPES as SERVED_DTYPES  # float16, bfloat16
from ..errors import InvalidArgumentError, KernelsNotBuiltError, UnsupportedError
from ..options import FLOAT32_MAX, LOG2E, validate
from ..tally import Tally

log = logging.getLogger(__name__)

ENV = "RDNATTENTION_PATCH_SDPA"
DEVICE_TYPES = ("cuda", "cpu")  # torch's device types the kernels serve: ROCm and CUDA GPUs, the host emulator
DEFAULT_DEVICES = ("cuda",)
# An additive mask entry at or below this hides its key: exp(score + entry - row max) underflows to
# exactly 0 in float32 once the scores of a row lie less than 9900 apart.
HIDDEN = -1.0e4
# torch >= 2.5 returns zeros for a query row whose every key is masked with -inf (or False), as the
# kernels do; older versions return NaN there, so such masks are served only from 2.5 on.
_ZERO_EMPTY_ROWS = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 5)
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_POSITIONAL = 6  # torch's scale and enable_gqa are keyword-only


@dataclass(frozen=True)
class _Config:
    devices: frozenset[str]
    device_masks: bool
    strict: bool


_lock = threading.Lock()
_config: _Config | None = None  # None: not patched; sdpa passes every call on, uncounted
_original = None  # the function patch_sdpa replaced, restored by unpatch_sdpa
_tally = Tally()  # hits: the calls the kernels served; by reason, the ones passed to torch
_no_kernels: dict[torch.device, str] = {}  # devices found without kernels since patch_sdpa(), and why


def patch_sdpa(*, devices: str | Iterable[str] = DEFAULT_DEVICES, device_masks: bool = True,
               strict: bool = False) -> None:
    """Replaces ``torch.nn.functional.scaled_dot_product_attention`` with :func:`sdpa`.

    ``devices``: the torch device types whose tensors the kernels serve, ``"cuda"`` (GPUs of ROCm
    and CUDA builds of torch; the default) and/or ``"cpu"`` (the host emulator, a correctness tool
    far slower than torch's own CPU attention; the tests use it). ``device_masks``: read masks that
    live on a GPU (one synchronisation per mask tensor); False sends calls with such masks to torch.
    ``strict``: an error raised while deciding or running a call propagates instead of being logged
    and the call run by torch (for tests). Patching again only updates these
    settings; :func:`unpatch_sdpa` restores the original object."""
    global _config, _original
    config = _Config(devices=_check_devices(devices), device_masks=_check_bool("device_masks", device_masks),
                     strict=_check_bool("strict", strict))
    with _lock:
        _no_kernels.clear()
        current = torch.nn.functional.scaled_dot_product_attention
        if current is not sdpa:
            _original = current
            torch.nn.functional.scaled_dot_product_attention = sdpa
        _config = config


def unpatch_sdpa() -> None:
    """Puts back the object :func:`patch_sdpa` replaced; does nothing when not patched. Where
    something else has replaced the attribute since, it is left in place, and :func:`sdpa` (which
    that may still call) passes every call on to the original from now on."""
    global _config
    with _lock:
        if _config is None:
            return
        if torch.nn.functional.scaled_dot_product_attention is sdpa:
            torch.nn.functional.scaled_dot_product_attention = _original
        else:
            log.warning("torch.nn.functional.scaled_dot_product_attention was replaced again after "
                        "rdnattention.patch_sdpa(); leaving that in place (rdnattention's function now passes "
                        "every call on to torch's)")
        _config = None


def is_patched() -> bool:
    """Whether :func:`patch_sdpa` is in effect."""
    return _config is not None


@contextlib.contextmanager
def sdpa_patched(*, devices: str | Iterable[str] = DEFAULT_DEVICES, device_masks: bool = True,
                 strict: bool = False) -> Iterator[None]:
    """:func:`patch_sdpa` for the ``with`` block (same arguments); on leaving it, the state before
    it (unpatched, or patched with other settings) is back."""
    before = _config
    patch_sdpa(devices=devices, device_masks=device_masks, strict=strict)
    try:
        yield
    finally:
        if before is None:
            unpatch_sdpa()
        else:
            patch_sdpa(devices=before.devices, device_masks=before.device_masks, strict=before.strict)


def stats(*, reset: bool = False) -> dict:
    """What the patched function did: ``{"patched": bool, "served": calls run by the kernels,
    "fallback": calls passed to torch's function, "fallbacks": {reason: calls}, "transformers":
    {...}, "kvcache": {...}}`` (a copy); "transformers" holds the same three counts of the
    transformers integration (integrations/transformers.py: register()'s attention function), zeros
    where it was never imported; "kvcache" the appends of flash_attn_with_kvcache (kvcache.counts:
    run by the append kernel, or by torch operations where none is built, by reason); "int8" the
    quantizations of the INT8 entry points (int8.counts: likewise, by the quant kernel); "backward" the
    backward calls run padded to a larger head_dim's kernels (ops.backward_counts). With
    ``reset=True`` the counts start again from zero, and each reason logs its line again."""
    _check_bool("reset", reset)
    served, fallbacks = _tally.read(reset=reset)
    out = {"patched": _config is not None, "served": served, "fallback": sum(fallbacks.values()),
           "fallbacks": fallbacks}
    integration = sys.modules.get("rdnattention.integrations.transformers")
    out["transformers"] = (integration.counts(reset=reset) if integration is not None
                           else {"served": 0, "fallback": 0, "fallbacks": {}})
    from .. import kvcache  # flash_attn_with_kvcache's appends: kernel or torch operations

    out["kvcache"] = kvcache.counts(reset=reset)
    from .. import int8  # the INT8 entry points' quantizations: kernel or torch operations

    out["int8"] = int8.counts(reset=reset)
    out["backward"] = ops.backward_counts(reset=reset)  # backward calls padded to a larger head_dim
    return out


def patch_from_env(value: str | None = None) -> bool:
    """Patches as ``$RDNATTENTION_PATCH_SDPA`` says (read when rdnattention is imported): ``1``,
    ``true``, ``yes`` or ``on`` patch with the defaults; a comma-separated list of device types
    (``cuda``, ``cpu``) patches for those; empty, ``0``, ``false``, ``no`` or ``off`` do nothing.
    Returns whether it patched."""
    value = os.environ.get(ENV, "") if value is None else value
    word = value.strip().lower()
    if word in ("", "0", "false", "no", "off"):
        return False
    if word in ("1", "true", "yes", "on"):
        patch_sdpa()
        return True
    devices = [d.strip() for d in word.split(",") if d.strip()]
    if not devices or any(d not in DEVICE_TYPES for d in devices):
        raise InvalidArgumentError(f"{ENV}={value!r}: expected 1 (patch for GPUs), 0, or a comma-separated list of "
                                   f"device types from {', '.join(DEVICE_TYPES)}")
    patch_sdpa(devices=devices)
    return True


def _check_devices(devices: object) -> frozenset[str]:
    items = [devices] if isinstance(devices, str) else devices
    try:
        items = list(items)
    except TypeError:
        items = None
    if not items or any(not isinstance(d, str) or d not in DEVICE_TYPES for d in items):
        raise InvalidArgumentError(f"devices must be a device type or a collection of them from "
                                   f"{', '.join(DEVICE_TYPES)}, got {devices!r}")
    return frozenset(items)


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{name} must be a bool, got {value!r}")
    return value


# --- the patched function -----------------------------------------------------------------------


def sdpa(*args, **kwargs):
    """torch.nn.functional.scaled_dot_product_attention as patched: the kernels where they serve
    the call, else the original function with the arguments as given."""
    config = _config
    if config is None or torch.compiler.is_compiling():  # traced: torch's op goes into the graph
        return _original_fn()(*args, **kwargs)
    out = _replayed(config, args, kwargs)
    if out is not None:
        _tally.hit()
        return out
    bound = _bind(args, kwargs)
    if bound is None:
        return _fall_back("arguments", "arguments that do not bind to torch's signature", args, kwargs)
    tensors = tuple(t for t in (bound["query"], bound["key"], bound["value"], bound["attn_mask"])
                    if isinstance(t, torch.Tensor))
    if (len(tensors) >= 3 and all(type(t) is torch.Tensor for t in tensors)
            and torch.overrides.has_torch_function(tensors)):
        # Plain tensors under a TorchFunctionMode: the mode sees this function (the attribute its
        # code may compare against) and, calling it, runs it with the mode off.
        return torch.overrides.handle_torch_function(sdpa, tensors, *args, **kwargs)
    try:
        decision = _decide(config, **bound)
        out = None if isinstance(decision, tuple) else decision.run()
    except Exception as e:  # a drop-in never breaks the program over its own error: torch runs the call
        if config.strict:
            raise
        return _fall_back(f"error: {type(e).__name__}", str(e), args, kwargs)
    if out is None:
        return _fall_back(*decision, args, kwargs)
    _tally.hit()
    return out


_REPLAYED_KEYWORDS = frozenset(_NAMES[3:])


def _replayed(config: _Config, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A call without a mask, of 4-D query, key and value given by position, whose geometry was
    served before: replayed before _decide's checks (None where it was not, or where a check would
    read more than the replay key holds). The key (_launch's, ops.key) holds the tensors' shapes,
    strides, dtypes and devices, the window and the scale, and only calls that passed every check
    are kept under it; what it does not hold is checked here as _decide checks it: the keyword
    arguments' types and values, the patched device types, torch function and dispatch modes,
    tracing, nested, sparse and torch.func's tensors, graph capture and autocast. Gradients and
    tensor subclasses give no key. The express function of the geometry served last is tried first,
    after the checks of the arguments, modes and tracing, for a call with the options it was made
    under: its guard holds what the checks after it read (the tensors' dispatch keys, dimensions,
    shapes, devices; so the slice and the key too). (CPU, launch stubbed: a GQA decode step through
    the express costs about 9 us, replayed by its key 11 to 15, decided in full 36 to 60.)"""
    if len(args) != 3 or not _REPLAYED_KEYWORDS.issuperset(kwargs):
        return None
    q, k, v = args
    get = kwargs.get
    dropout, causal, scale, gqa = get("dropout_p", 0.0), get("is_causal", False), get("scale"), get("enable_gqa", False)
    if (get("attn_mask") is not None or type(q) is not torch.Tensor or type(k) is not torch.Tensor
            or type(v) is not torch.Tensor or (type(dropout) is not float and type(dropout) is not int) or dropout
            or type(causal) is not bool or type(gqa) is not bool or (scale is not None and type(scale) is not float)
            or replay.autocast_on() or torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack()
            or replay.tracing()):
        return None
    options = (config, causal, scale, gqa)
    if not (q.is_cuda and workspace.capturing()):
        # The express's guard holds every shape, stride, dtype, device and dispatch key (so the
        # checks below, the slice and the key are those of the call it was made for): first.
        out = _express.run(options, q, k, v)
        if out is not None:
            return out.transpose(1, 2)
    # tensors like those of a kept call (its dispatch keys) are none of these
    if not replay.recognised("flash_attn", (q, k, v, None, None, None, None, None)):
        for t in (q, k, v):  # before any size is read: nested and sparse tensors have none to give
            if (t.is_nested or t.layout is not torch.strided or torch._C._functorch.is_functorch_wrapped_tensor(t)
                    or torch._is_functional_tensor(t)):
                return None
    if (q.dim() != 4 or (not gqa and q.shape[1] != k.shape[1]) or q.device.type not in config.devices
            or (q.is_cuda and workspace.capturing())):
        return None
    seq_q, seq_k = q.shape[2], k.shape[2]
    s = _mask_free_slice(seq_q, seq_k, causal)
    if s is None or s.rows != seq_q:
        return None
    whole = not s.k0 and s.k1 == seq_k
    if not whole:
        k, v = k[:, :, s.k0:s.k1], v[:, :, s.k0:s.k1]
    key = ops.key(q, k, v, is_causal=False, window_size=s.window, softmax_scale=scale, return_lse=False,
                  token_major=True, views=True)
    hit = ops.replayed(key, q, k, v, return_lse=False, token_major=True, views=True)
    if hit is not None and whole:  # (whole K and V: no slice of them made per call)
        _express.remember(options, key, q.device)  # the next calls of this key take it
    return None if hit is None else hit[0].transpose(1, 2)


# The express function of the geometry last replayed by its guard, made under the call's options
# (config, is_causal, scale, enable_gqa).
_express = replay.LastExpress()


_slices: dict[tuple[int, int, bool], _Slice | None] = {}


def _mask_free_slice(seq_q: int, seq_k: int, causal: bool) -> _Slice | None:
    """_decide's slice of a call without a mask (torch's is_causal is top-left: query i sees keys
    0..i), kept per (seq_q, seq_k, causal)."""
    at = (seq_q, seq_k, causal)
    s = _slices.get(at, False)
    if s is False:
        if len(_slices) >= 4096:
            _slices.clear()
        s = _slices[at] = _slice((0, seq_k, -seq_q, 0 if causal else seq_k), seq_q)
    return s


def _original_fn():
    return _original if _original is not None else torch.nn.functional.scaled_dot_product_attention


def _bind(args: tuple, kwargs: dict) -> dict | None:
    if len(args) > _POSITIONAL:
        return None
    bound = dict(zip(_NAMES, args))
    for name, value in kwargs.items():
        if name not in _NAMES or name in bound:
            return None
        bound[name] = value
    if not all(n in bound for n in _NAMES[:3]):
        return None
    for name, default in zip(_NAMES[3:], (None, 0.0, False, None, False)):
        bound.setdefault(name, default)
    return bound


def _fall_back(reason: str, detail: str, args: tuple, kwargs: dict):
    if _tally.add(reason):
        log.warning("rdnattention.patch_sdpa: %s (%s); these calls run torch's scaled_dot_product_attention",
                    reason, detail)
    return _original_fn()(*args, **kwargs)


# --- deciding ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Slice:
    """The keys ``[k0, k1)`` of a sequence that its first ``rows`` queries may see (later ones see
    none), and the kernel's window over them."""

    k0: int
    k1: int
    rows: int
    window: tuple[int, int]


@dataclass
class _Run:
    """A call found servable: q, k, v as [batch, heads, seq, head_dim] fp16 or bf16, and how to launch."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float | None
    slices: list[_Slice | None]  # one per sequence, or one for all; None: the sequence sees no key
    seqused: bool  # one call with per-sequence key counts (the slices share k0 and the window)
    unbatched: int | None  # 3-D input: the dimension added to make it 4-D

    def run(self) -> torch.Tensor:
        q, k, v = self.q, self.k, self.v
        if len(self.slices) == 1:
            out = self._one(q, k, v, self.slices[0])
        elif self.seqused:
            s = next(s for s in self.slices if s is not None)
            used = _lengths(tuple(0 if t is None else t.k1 - s.k0 for t in self.slices), q.device)
            k1 = max(t.k1 for t in self.slices if t is not None)
            out = _launch(q, k[:, :, s.k0:k1], v[:, :, s.k0:k1], s.window, self.scale, used)
        else:
            out = torch.cat([self._one(q[b:b + 1], k[b:b + 1], v[b:b + 1], s) for b, s in enumerate(self.slices)])
        return out if self.unbatched is None else out.squeeze(self.unbatched)

    def _one(self, q, k, v, s: _Slice | None) -> torch.Tensor:
        if s is None:
            return _NoKey.apply(q, k, v) if _grad(q, k, v) else q.new_zeros(q.shape)
        if s.rows == q.shape[2]:
            return _launch(q, k[:, :, s.k0:s.k1], v[:, :, s.k0:s.k1], s.window, self.scale, None)
        out = q.new_zeros(q.shape)
        out[:, :, :s.rows] = _launch(q[:, :, :s.rows], k[:, :, s.k0:s.k1], v[:, :, s.k0:s.k1], s.window, self.scale,
                                     None)
        return out


class _NoKey(torch.autograd.Function):
    """The output of queries that see no key, zero, as torch's function gives it, recorded by autograd
    so that a loss of it alone backpropagates (to zero gradients) as torch's does."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in (q, k, v)]
        return q.new_zeros(q.shape)

    @staticmethod
    def backward(ctx, dout):
        return tuple(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs)


def _grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


_lengths_cache: dict[tuple, torch.Tensor] = {}
def _lengths(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 key counts on ``device``, made once per distinct list (the kernels only read them)."""
    t = _lengths_cache.get((values, device))
    if t is None:
        if len(_lengths_cache) >= 64:
            _lengths_cache.clear()
        t = _lengths_cache[values, device] = torch.tensor(values, dtype=torch.int32, device=device)
    return t


def _launch(q, k, v, window: tuple[int, int], scale: float | None, seqused: torch.Tensor | None) -> torch.Tensor:
    """The kernels' output [batch, heads, seq_q, head_dim] as a view of a token-major buffer, as
    torch's flash and cuDNN attention return theirs: transformers' ``transpose(1, 2).contiguous()``
    and diffusers' ``transpose(1, 2).reshape(...)`` after the call then copy nothing."""
    q, k, v = _rows(q), _rows(k), _rows(v)
    key = ops.key(q, k, v, is_causal=False, window_size=window, softmax_scale=scale, return_lse=False,
                  token_major=True, seqused_k=seqused, views=True)
    hit = ops.replayed(key, q, k, v, return_lse=False, token_major=True, seqused_k=seqused, views=True)
    if hit is not None:
        return hit[0].transpose(1, 2)
    o = validate(q, k, v, is_causal=False, window_size=window, softmax_scale=scale, rotary_cos=None,
                 rotary_sin=None, rotary_interleaved=False, return_lse=False, seqused_k=seqused)
    return ops.forward(q, k, v, o, token_major=True, key=key)[0]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` where the kernels can read it (rows contiguous, strides of 8 elements, 16-byte aligned), else a copy."""
    if t.is_neg() or t.is_conj():
        t = t.resolve_neg().resolve_conj()
    s = t.stride()
    if (s[3] == 1 or t.shape[3] == 1) and not (s[0] % 8 or s[1] % 8 or s[2] % 8 or t.data_ptr() % 16):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _decide(config: _Config, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """A :class:`_Run` where the kernels serve the call, else ``(reason, detail)``."""
    q, k, v, mask = query, key, value, attn_mask
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not (mask is None or isinstance(mask, torch.Tensor)):
        return "arguments", "query, key, value or attn_mask is not a tensor"
    tensors = (q, k, v) if mask is None else (q, k, v, mask)
    if any(type(t) is not torch.Tensor for t in tensors):
        return "tensor subclass", f"a {type(next(t for t in tensors if type(t) is not torch.Tensor)).__name__}"
    if any(t.is_nested for t in tensors):
        return "nested tensors", "nested (ragged) tensors"
    if torch.utils._python_dispatch._get_current_dispatch_mode() is not None:
        return "dispatch mode", f"a {type(torch.utils._python_dispatch._get_current_dispatch_mode()).__name__} is active"
    if torch.jit.is_tracing():
        return "jit tracing", "torch.jit.trace records torch's operator"
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) or torch._is_functional_tensor(t) for t in tensors):
        return "torch.func transform", "tensors of a torch.func transform (vmap, grad, functionalization)"
    device = q.device
    if device.type not in config.devices:
        return f"device {device.type}", f"tensors on {device}; patch_sdpa(devices=...) serves " \
            f"{', '.join(sorted(config.devices))}"
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "CUDA graph capture", ("a CUDA graph is being captured: a first launch would load a code object and "
                                      "a mask cannot be read")
    if any(t.device != device for t in tensors) or any(t.layout != torch.strided for t in tensors):
        return "arguments", "tensors on different devices, or not strided"
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if grad and mask is not None and mask.requires_grad:
        return "requires grad", "an attn_mask that requires grad: the kernels give no gradient for a mask"
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or dropout_p != 0:
        return "dropout", f"dropout_p={dropout_p!r}: the kernels have no dropout"
    if (not isinstance(is_causal, bool) or not isinstance(enable_gqa, bool)
            or not (scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool)))):
        return "arguments", f"is_causal={is_causal!r}, enable_gqa={enable_gqa!r}, scale={scale!r}"
    if scale is not None and (not math.isfinite(scale) or abs(float(scale)) * LOG2E > FLOAT32_MAX):
        return "scale", f"scale={scale!r}: the kernels scale scores in float32"
    if is_causal and mask is not None:
        return "arguments", "both attn_mask and is_causal"
    q, k, v, mask, why = _autocast(q, k, v, mask)
    if why:
        return why
    if mask is not None and mask.dtype not in (torch.bool, torch.float32, q.dtype):
        return "arguments", f"attn_mask of {mask.dtype} for query of {q.dtype}: torch takes bool, float32 or q's dtype"
    if not (q.dtype == k.dtype == v.dtype and q.dtype in SERVED_DTYPES):
        return f"dtype {q.dtype}" if q.dtype == k.dtype == v.dtype else "arguments", \
            f"query, key, value of {q.dtype}, {k.dtype}, {v.dtype}: the kernels take float16 or bfloat16, all alike"
    rank = q.dim()
    if rank not in (3, 4) or k.dim() != rank or v.dim() != rank:
        return "rank", f"query, key, value of {q.dim()}, {k.dim()}, {v.dim()} dimensions: served are 3 or 4"
    unbatched = None
    if rank == 3:  # [batch, seq, dim], or [heads, seq, dim] with enable_gqa and fewer key heads
        unbatched = 1 if q.shape[0] == k.shape[0] else 0
        q, k, v = q.unsqueeze(unbatched), k.unsqueeze(unbatched), v.unsqueeze(unbatched)
        if mask is not None:
            if mask.dim() > 3:
                return "arguments", f"attn_mask of shape {tuple(mask.shape)} for 3-D inputs"
            mask = mask.reshape((1,) * (3 - mask.dim()) + tuple(mask.shape)).unsqueeze(unbatched)
    batch, heads, seq_q, head_dim = q.shape
    _, heads_kv, seq_k, _ = k.shape
    if v.shape[3] != head_dim:
        return "value head_dim", f"value's head_dim {v.shape[3]} differs from query's {head_dim}"
    if k.shape[0] != batch or v.shape[:3] != k.shape[:3] or k.shape[3] != head_dim:
        return "shapes", f"query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}"
    if heads != heads_kv and not (enable_gqa and heads_kv and heads % heads_kv == 0):
        return "shapes", f"{heads} query heads and {heads_kv} key heads (enable_gqa={enable_gqa})"
    if not (batch and heads and seq_q and seq_k and head_dim):
        return "empty", f"empty tensors: query {tuple(q.shape)}, key {tuple(k.shape)}"
    if mask is not None and (mask.dim() > 4 or any(m not in (1, n) for m, n in zip(
            reversed(mask.shape), (seq_k, seq_q, heads, batch)))):
        return "arguments", f"attn_mask of shape {tuple(mask.shape)} for scores {(batch, heads, seq_q, seq_k)}"
    table = _no_kernels.get(device)
    if table is None:
        try:
            table = route.device_table(device)
        except (KernelsNotBuiltError, UnsupportedError) as e:
            table = _no_kernels[device] = str(e)  # looked up again only after the next patch_sdpa()
    if isinstance(table, str):
        return f"no kernels for {device.type}", table
    rows = heads // heads_kv * seq_q
    dtype = DTYPE_OPTIONS.get(str(q.dtype))  # the kernels' dtype option (bf16); None: fp16
    why = _choose(table, Request(precision=Precision.FP16, layout=Layout.STRIDED, head_dim=head_dim, rows=rows,
                                 seq_q=seq_q, dtype=dtype))
    if why:
        return f"head_dim {head_dim}", why
    missing = ops.backward_missing(table, q) if grad else None
    if missing:
        return "requires grad", f"inputs that require grad, and {missing}"
    if mask is None:
        slices = [_mask_free_slice(seq_q, seq_k, is_causal)]
    else:
        bands = _bands(config, mask, batch, heads, seq_q, seq_k)
        if isinstance(bands, tuple):
            return bands
        slices = [_slice(b, seq_q) for b in bands]
    run = _Run(q=q, k=k, v=v, scale=scale, slices=slices, seqused=False, unbatched=unbatched)
    live = [s for s in slices if s is not None]
    if len(set(slices)) == 1:  # one slice and window for every sequence (or none sees a key)
        run.slices = slices[:1]
    elif all(s.k0 == live[0].k0 and s.window == live[0].window and s.rows == seq_q for s in live):
        # One call with per-sequence key counts where kernels of that layout are built (its backward
        # takes the counts too), else one call per sequence on the plain kernels.
        run.seqused = not _choose(table, Request(precision=Precision.FP16, layout=Layout.SEQUSED, head_dim=head_dim,
                                                 rows=rows, seq_q=seq_q, dtype=dtype))
    return run


_routes: dict[tuple, tuple] = {}


def _choose(table, request: Request) -> str | None:
    """None where a kernel family serves ``request`` on ``table`` (route.choose), else why not;
    remembered per table and request."""
    hit = _routes.get((id(table), request))
    if hit is None or hit[0] is not table:
        try:
            route.choose(table, request)
            hit = (table, None)
        except UnsupportedError as e:
            hit = (table, str(e))
        if len(_routes) >= 256:
            _routes.clear()
        _routes[id(table), request] = hit
    return hit[1]


def _autocast(q, k, v, mask):
    """The tensors as torch's autocast would give them to the operator (it casts its floating
    inputs to the autocast dtype), and a fallback reason where that is neither float16 nor bfloat16."""
    kind = q.device.type
    if not torch.is_autocast_enabled(kind):
        return q, k, v, mask, None
    dtype = torch.get_autocast_dtype(kind)
    if dtype not in SERVED_DTYPES:
        return q, k, v, mask, (f"dtype {dtype}", f"autocast to {dtype}: the kernels take float16 or bfloat16")
    cast = (torch.float32, torch.bfloat16, torch.float16)
    if any(t.dtype not in cast for t in (q, k, v)):
        return q, k, v, mask, ("arguments", "inputs autocast does not cast")
    if mask is not None and mask.dtype in cast:
        mask = mask.to(dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype), mask, None


def _slice(band: tuple | None, seq_q: int) -> _Slice | None:
    """The keys, query rows and window of a sequence whose query i sees keys ``i + lo .. i + hi``
    of keys ``[k0, n)``; None where it sees none."""
    if band is None:
        return None
    k0, n, lo, hi = band
    rows = min(seq_q, n - lo)  # later rows see no key: zeros, not launched
    if rows <= 0:
        return None
    k0 = max(k0, lo)
    binds_left = rows - 1 + lo > k0  # some row's first key is past k0
    binds_right = hi < n - 1  # some row's last key is before n - 1
    k1 = min(n, rows + hi) if binds_right else n
    if k1 <= k0:
        return None
    # The kernel puts query i at key i + (k1 - k0) - rows of the slice and sees `left` keys before
    # it and `right` after (-1: unbounded): keys i + lo - k0 .. i + hi - k0 of the slice. Both are
    # >= 0 (hi >= lo where a row sees a key; k1 <= rows + hi; rows <= n - lo).
    right = hi - k1 + rows if binds_right else -1
    left = k1 - rows - lo if binds_left else -1
    return _Slice(k0=k0, k1=k1, rows=rows, window=(left, right))


# --- reading masks ------------------------------------------------------------------------------

_mask_cache: dict[int, tuple] = {}
_MASK_CACHE_LIMIT = 64


def _bands(config: _Config, mask: torch.Tensor, batch: int, heads: int, seq_q: int, seq_k: int):
    """Per sequence (one for all where the mask has one), (k0, n, lo, hi) where query i sees keys
    ``max(k0, i + lo) .. min(n - 1, i + hi)``, or None where the sequence sees no key at all; else
    ``(reason, detail)``."""
    if mask.dtype != torch.bool and not mask.is_floating_point():
        return "arguments", f"attn_mask of {mask.dtype}: torch takes bool or floating masks"
    if mask.device.type != "cpu":
        if not config.device_masks:
            return "attn_mask on the device", "reading a GPU mask needs a device synchronisation (device_masks=False)"
    key = None
    if not mask.is_inference():  # inference tensors have no version counter
        key = (mask.data_ptr(), mask.storage_offset(), tuple(mask.shape), mask.stride(), mask.dtype, mask._version,
               batch, heads, seq_q, seq_k)
        hit = _mask_cache.get(id(mask))
        if hit is not None and hit[0]() is mask and hit[1] == key:
            return hit[2]
    result = _read(mask, batch, heads, seq_q, seq_k)
    if key is not None:
        if len(_mask_cache) >= _MASK_CACHE_LIMIT:
            _mask_cache.clear()
        _mask_cache[id(mask)] = (weakref.ref(mask), key, result)
    return result


def _read(mask: torch.Tensor, batch: int, heads: int, seq_q: int, seq_k: int):
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if m.dtype == torch.bool:
        visible, hard = m, torch.ones((), dtype=torch.bool, device=m.device)
        values_ok = hard
    else:
        visible = m == 0
        hidden = m <= HIDDEN  # -inf included, NaN not
        values_ok = (visible | hidden).all()
        hard = (visible | torch.isneginf(m)).all()  # every hidden entry -inf: rows that see nothing are zero
    mb, mh = m.shape[0], m.shape[1]
    v = visible.expand(mb, mh, seq_q, seq_k)
    w = v[:, 0]  # [mb, seq_q, seq_k]
    same_heads = (v == w[:, None]).all() if mh > 1 else torch.ones((), dtype=torch.bool, device=m.device)
    dev = m.device
    i = torch.arange(seq_q, device=dev)
    j = torch.arange(seq_k, device=dev)
    rows = w.any(-1)  # [mb, seq_q]: the row sees some key
    cols = w.any(-2)  # [mb, seq_k]: some row sees the key
    wi = w.to(torch.int8)
    first = wi.argmax(-1)
    last = seq_k - 1 - wi.flip(-1).argmax(-1)
    some = cols.any(-1)  # [mb]
    k0 = cols.to(torch.int8).argmax(-1)
    n = torch.where(some, seq_k - cols.to(torch.int8).flip(-1).argmax(-1), 0)
    big = seq_q + seq_k + 1
    lo = torch.where(rows, first - i, big).min(-1).values  # over the rows that see a key
    hi = torch.where(rows, last - i, -big).max(-1).values
    d = j[None, :] - i[:, None]  # [seq_q, seq_k]
    expected = ((j >= k0[:, None, None]) & (j < n[:, None, None])
                & (d >= lo[:, None, None]) & (d <= hi[:, None, None]))
    matches = (expected == w).all()
    every_row = rows.all()
    flags = torch.stack([values_ok, same_heads, matches, every_row, hard]).long()
    facts = torch.cat([flags, some.long(), k0, n, lo, hi]).tolist()  # one read
    values_ok, same_heads, matches, every_row, hard = facts[:5]
    if not values_ok:
        return "attn_mask values", "an additive mask with entries other than 0 and -inf (or at most -10000): a bias"
    if not same_heads:
        return "attn_mask pattern", "a mask that differs between heads"
    if not matches:
        return "attn_mask pattern", "a mask whose visible keys are not a band of one run of keys per sequence"
    if not every_row and not (hard and _ZERO_EMPTY_ROWS):
        return "attn_mask rows without keys", ("query rows that see no key, where torch's answer is not zero "
                                               "(finite hidden entries, or torch before 2.5)")
    some, k0, n, lo, hi = (facts[5 + x * mb:5 + (x + 1) * mb] for x in range(5))
    return [(k0[b], n[b], lo[b], hi[b]) if some[b] else None for b in range(mb)]
