"""The INT8 entry points: attention with both products in int8, its custom op
``rdnattention::flash_attn_int8qk_fwd``, and the quantizers that make its inputs.

Scale contract (the scales' values read where checks.reads says; no address depends on them): q,
k, v are int8 [batch, heads, seq, head_dim] (q with heads_q heads, k and v with heads_kv), and they
stand for

    q_real[b, h, s, :] = q[b, h, s, :] * q_scale[b, h, s]      (per token, fp32 [batch, heads_q, seq_q])
    k_real[b, h, s, :] = k[b, h, s, :] * k_scale[b, h, s]      (per token, fp32 [batch, heads_kv, seq_k])
    v_real[b, h, s, d] = v[b, h, s, d] * v_scale[b, h, d]      (per channel, fp32 [batch, heads_kv, head_dim])

Scales are positive and finite. The output is fp16 attention over (q_real, k_real, v_real), with
P quantized to 0..127 inside the kernel (the accuracy this costs is in docs/api.md)."""

from __future__ import annotations

import warnings

import torch

from . import checks, drivers, replay, route, workspace
from .checks import NATIVE, check_fp16
from .errors import InvalidArgumentError, RdnaAttentionError, UnsupportedError
from .families import quant as quant_family
from .options import NO_SCORE_OPTIONS, Options, check_rotary, validate
from .plan import Launch, Plan
from .reference import rotate
from .tally import Tally

_LEVELS = 127.0


def _check_float(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise InvalidArgumentError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if x.dim() != 4:
        raise InvalidArgumentError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(x.shape)}")
    return x


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale of each amax: amax / 127 rounded once to float32, at least float32's smallest normal
    number (values so tiny quantize to 0 rather than to a zero or subnormal scale, which the kernels
    refuse or flush), and 1 for an all-zero vector. Divided in float64: torch's CUDA division by a
    Python number multiplies by its float32 reciprocal, a unit off amax / 127 for some amax (the
    float64 quotient rounds to float32 as the correctly rounded float32 division does: amax / 127 is
    never within float64's error of a float32 rounding boundary)."""
    scale = (amax.double() / _LEVELS).float()
    return torch.where(amax > 0, scale.clamp_min_(torch.finfo(torch.float32).tiny), 1.0)


def _not_finite(name: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{name} holds a NaN or an infinity; it cannot be quantized")


def _torch_quantize(name: str, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized symmetrically along every vector of dimension ``dim`` (one scale per position of
    the others) by torch operations: where torch traces, and where no quant kernel serves x (the
    formula the quant kernels reproduce bit for bit). About ten tensor launches on a GPU, none of which
    copies x to float32 first (the amax reads x as it is, the division promotes)."""
    if x.is_cuda:  # max |x|, exact: one reduction launch on a GPU
        amax = torch.linalg.vector_norm(x, float("inf"), dim=dim, dtype=torch.float32)
    else:  # the CPU's inf-norm reduction is not vectorised (about 15x slower than these three)
        amax = x.float().abs().amax(dim)  # not in place: float() of a float32 x is x itself
    if checks.reads(x) and not torch.isfinite(amax).all():
        raise _not_finite(name)
    scale = _scale(amax)
    q = torch.div(x, scale.unsqueeze(dim)).round_().clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    return q, scale.contiguous()  # the reduction keeps a strided x's dimension order


# Quantizations that ran as torch operations because no quant kernel serves the tensor (kernels
# built before the family existed, a device without kernels, head_dim over the kernels'), by
# reason; each reason warns once (counts()). Calls where torch traces run the torch formula by
# design (the compiler fuses it) and are not counted.
# The hits are the launches of the quant kernel.
_tally = Tally()


def counts(*, reset: bool = False) -> dict:
    """What the quantizations did: ``{"quantize_kernel": launches of the quant kernel,
    "quantize_torch": tensors quantized by torch operations, "fallbacks": {reason: tensors}}`` (a
    copy; also ``rdnattention.stats()["int8"]``). With ``reset=True`` the counts start again from
    zero, and each reason warns again."""
    launched, fallbacks = _tally.read(reset=reset)
    return {"quantize_kernel": launched, "quantize_torch": sum(fallbacks.values()), "fallbacks": fallbacks}


def _fallback(reason: str, tensors: int) -> None:
    if _tally.add(reason, tensors):
        warnings.warn(f"rdnattention: {reason}; int8 quantization runs as torch operations there (the same "
                      "numbers, about ten launches a tensor instead of one launch a call)", RuntimeWarning, stacklevel=4)


def _quant_table(xs: tuple[torch.Tensor, ...]) -> tuple[object, str | None]:
    """(the table whose quant kernel quantizes ``xs`` in one launch, None), or (None, the reason
    the torch formula quantizes them, which fallbacks counts) or (None, None) where that is by
    design (torch traces, subclasses) or xs are not one launch's (devices, dtypes or head_dims
    that differ, an empty tensor: each its own call)."""
    if replay.tracing() or not all(type(x) is torch.Tensor for x in xs):
        return None, None
    first = xs[0]
    if any(x.device != first.device or x.dtype != first.dtype or x.shape[3] != first.shape[3] or x.numel() == 0
           for x in xs):
        return None, None
    if first.shape[3] > quant_family.HEAD_DIM_MAX:
        return None, f"head_dim {first.shape[3]} is over the quant kernels' {quant_family.HEAD_DIM_MAX}"
    try:
        table = route.device_table(first.device)
    except RdnaAttentionError:
        return None, f"no kernels for {first.device.type} tensors"
    try:
        quant_family.select(table)
    except RdnaAttentionError:
        return None, (f"no quant kernel for {table.target} (its kernels were built without the quant family; "
                      "rebuild them: rdnattention-gen build)")
    return table, None


def _quant_outputs(x: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The contiguous int8 values and fp32 scales of x's quantization."""
    b, h, s, d = x.shape
    return (torch.empty((b, h, s, d), dtype=torch.int8, device=x.device),
            torch.empty((b, h, d) if per_channel else (b, h, s), dtype=torch.float32, device=x.device))


def _quant_launch(table, q, k, v, outputs: dict) -> Launch:
    """The one launch that quantizes q and k per token and v per channel (each may be None) into
    ``outputs`` (name -> (int8, scale)), their memory checked."""
    kw = {}
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is not None:
            checks.check_memory(name, x)
            kw[name], (kw[f"{name}_out"], kw[f"{name}_scale"]) = x, outputs[name]
    return quant_family.launch(table, **kw)


# The pointer fields of the quant kernel's launch.
QUANT_ROLES = frozenset({"q_src", "k_src", "v_src", "q", "k", "v", "q_scale", "k_scale", "v_scale"})


def _run_quant(table, device: torch.device, launch: Launch) -> None:
    drivers.for_platform(table.platform).launch(table.code_object, launch, device)
    _tally.hit()


def _check_finite(named: tuple[tuple[str, torch.Tensor, torch.Tensor], ...]) -> None:
    """(name, source, scale): a NaN scale means the source held a NaN or an infinity, where its
    values are read (checks.reads)."""
    for name, x, scale in named:
        if checks.reads(x) and scale.numel() and torch.isnan(scale).any():
            raise _not_finite(name)


def _quantize(name: str, x: torch.Tensor, dim: int, counted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized symmetrically along dimension ``dim`` (-1: per token, 2: per channel): one launch
    of the quant kernel where one serves x, else the torch formula (``counted``: its fallback is
    counted already)."""
    x = _check_float(name, x).detach()
    per_channel = dim == 2
    job = "v" if per_channel else "q"  # the kernel's job that quantizes x
    key = replay.key("quantize", x.device, (x,), (per_channel,)) if type(x) is torch.Tensor and x.numel() else None
    r = replay.lookup(key)
    found = None if r is None else replay.pointers((x,), r.reach, 0)
    if found is not None:  # a geometry seen before: its launch replayed
        values, scale = _quant_outputs(x, per_channel)
        replay.launch(r, {f"{job}_src": found[0], job: values.data_ptr(), f"{job}_scale": scale.data_ptr()},
                      x.device)
        _tally.hit()
        _check_finite(((name, x, scale),))
        return values, scale
    if x.numel() == 0 and type(x) is torch.Tensor:  # nothing to launch: no value, and scale 1 for empty vectors
        q, scale = _quant_outputs(x, per_channel)
        return q, scale.fill_(1.0)
    table, reason = _quant_table((x,))
    if table is None:
        if reason is not None and not counted:
            _fallback(reason, 1)
        return _torch_quantize(name, x, dim)
    outputs = {job: _quant_outputs(x, per_channel)}
    launch = _quant_launch(table, None if per_channel else x, None, x if per_channel else None, outputs)
    _run_quant(table, x.device, launch)
    replay.remember(key, Plan(table=table, device=x.device, launches=[launch], outputs=()), (x,), QUANT_ROLES)
    q, scale = outputs[job]
    _check_finite(((name, x, scale),))
    return q, scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each token's head_dim vector: (int8 [b, h, s, d], fp32 scale
    [b, h, s]) with x ~= x_i8 * scale[..., None]. An all-zero token gets scale 1; scales are never
    below float32's smallest normal number."""
    return _quantize("x", x, -1)


def quantize_per_channel(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each channel over the sequence: (int8 [b, h, s, d], fp32 scale
    [b, h, d]) with v ~= v_i8 * scale[:, :, None, :]. An all-zero channel gets scale 1."""
    return _quantize("v", v, 2)


def _check_int8(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int8:
        raise InvalidArgumentError(f"{name} must be int8, got {t.dtype} (quantize with quantize_per_token / "
                                   "quantize_per_channel, or call flash_attn_int8qk_quantized)")
    if t.dim() != 4:
        raise InvalidArgumentError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    return t


def _check_scale(name: str, s: object, shape: tuple[int, ...], device: torch.device, what: str) -> torch.Tensor:
    if not isinstance(s, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(s).__name__}")
    if s.dtype != torch.float32:
        raise InvalidArgumentError(f"{name} must be float32, got {s.dtype}")
    if tuple(s.shape) != shape:
        raise InvalidArgumentError(f"{name} must have shape {shape} ({what}), got {tuple(s.shape)}")
    if s.device != device:
        raise InvalidArgumentError(f"{name} is on {s.device}, q on {device}")
    if s.numel() and s.stride(-1) != 1 and s.shape[-1] > 1:
        raise InvalidArgumentError(f"{name} must be contiguous in its last dimension, got strides {s.stride()}")
    return s


def _validate(q, k, v, q_scale, k_scale, v_scale, *, is_causal, window_size, softmax_scale,
              return_lse) -> Options:
    """Everything that does not read the tensors' values, so it runs on fake tensors too."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_int8(name, t)
    options = validate(q, k, v, is_causal=is_causal, window_size=window_size, softmax_scale=softmax_scale,
                       rotary_cos=None, rotary_sin=None, rotary_interleaved=False, return_lse=return_lse)
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_k = k.shape[1], k.shape[2]
    _check_scale("q_scale", q_scale, (batch, heads_q, seq_q), q.device, "per token of q")
    _check_scale("k_scale", k_scale, (batch, heads_kv, seq_k), q.device, "per token of k")
    _check_scale("v_scale", v_scale, (batch, heads_kv, head_dim), q.device, "per channel of v")
    return options


def _allocate(q: torch.Tensor, return_lse: bool, empty_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp16 output and the LSE (when not asked for: an empty tensor, or None where ``empty_lse``
    is false)."""
    batch, heads_q, seq_q, head_dim = q.shape
    out = q.new_empty((batch, heads_q, seq_q, head_dim), dtype=torch.float16)
    if not (return_lse or empty_lse):
        return out, None
    lse = q.new_empty((batch, heads_q, seq_q) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def _replayed_outputs(r: replay.Replay, q: torch.Tensor, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """_allocate's outputs of a replayed call (empty_lse False), from ``r``'s stand-ins (made at its
    first replay: replay.stand_in)."""
    like = r.like or replay.keep_stand_ins(r, q.device, (q.shape, torch.float16), (q.shape[:3], torch.float32))
    out = torch.empty_like(like[0], memory_format=replay.CONTIGUOUS)
    return out, torch.empty_like(like[1], memory_format=replay.CONTIGUOUS) if return_lse else None


# The pointer fields of a call's launches (i8 and i8dec structs), each filled by one tensor.
ROLES = frozenset({"q", "k", "v", "o", "lse", "q_scale", "k_scale", "v_scale"})


def _check_scales(q_scale, k_scale, v_scale) -> None:
    """The scales' values, where they are read (checks.reads), in one read."""
    values = checks.Values()
    for name, t in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        values.positive(name, t)
    values.check()


def _plan(q, k, v, q_scale, k_scale, v_scale, o: Options, heavy_first=None, kernel=None) -> Plan:
    """A validated call (see _validate) planned: memory and scale values checked, kernel chosen (route.py)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        checks.check_memory(name, t)
        if name in "qkv" and t.numel() and t.data_ptr() % 16:
            raise InvalidArgumentError(f"{name}'s data pointer must be 16-byte aligned")
    _check_scales(q_scale, k_scale, v_scale)
    table = route.device_table(q.device)
    out, lse = _allocate(q, o.return_lse)
    call = route.Attention(q=q, k=k, v=v, out=out, lse=lse if o.return_lse else None,
                           window=(o.window_left, o.window_right), softmax_scale=o.softmax_scale, batch=q.shape[0],
                           seq_q=q.shape[2], seq_k=k.shape[2], scales=(q_scale, k_scale, v_scale),
                           heavy_first=heavy_first, kernel=kernel)
    return route.plan(table, call).returning(out, lse, empty=out.numel() == 0 or k.shape[2] == 0)


def flash_attn_int8qk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor,
                      k_scale: torch.Tensor, v_scale: torch.Tensor, *, is_causal: bool = False,
                      window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                      return_lse: bool = False):
    """Attention over int8 q, k, v with their scales (the module docstring states the contract):
    is_causal, window_size, softmax_scale and return_lse as in flash_attn. Returns fp16
    [batch, heads_q, seq_q, head_dim] (and the fp32 log-sum-exp). Runs the custom op
    rdnattention::flash_attn_int8qk_fwd (through the dispatcher where torch traces)."""
    tensors = (q, k, v, q_scale, k_scale, v_scale)
    key = None
    if (type(q) is torch.Tensor and type(is_causal) is bool and type(return_lse) is bool
            and type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int
            and type(window_size[1]) is int):
        key = replay.key("flash_attn_int8qk", q.device, tensors,
                         (is_causal, window_size, type(softmax_scale), softmax_scale, return_lse))
    r = replay.lookup(key)
    found = None if r is None else replay.pointers(tensors, r.reach, 3)
    if found is not None:
        if checks.reads(q):
            _check_scales(q_scale, k_scale, v_scale)
        out, lse = _replayed_outputs(r, q, return_lse)
        pointers = dict(zip(("q", "k", "v", "q_scale", "k_scale", "v_scale"), found))
        pointers["o"] = out.data_ptr()
        if lse is not None:
            pointers["lse"] = lse.data_ptr()
        replay.launch(r, pointers, q.device)
        return (out, lse) if return_lse else out
    o = _validate(q, k, v, q_scale, k_scale, v_scale, is_causal=is_causal, window_size=window_size,
                  softmax_scale=softmax_scale, return_lse=return_lse)
    if (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or not all(type(t) is torch.Tensor for t in tensors)):
        out, lse = flash_attn_int8qk_fwd(q, k, v, q_scale, k_scale, v_scale, o.window_left, o.window_right,
                                         o.softmax_scale, o.return_lse)
    else:
        plan = _plan(q, k, v, q_scale, k_scale, v_scale, o)
        replay.run(plan, key, tensors, ROLES)
        out, lse = plan.outputs
    return (out, lse) if return_lse else out


def plan_flash_attn_int8qk(q, k, v, q_scale, k_scale, v_scale, *, is_causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                           return_lse: bool = False, heavy_first: bool | None = None, kernel: str | None = None) -> Plan:
    """Validates and plans a flash_attn_int8qk call without running it (benchmarks, forcing a kernel)."""
    o = _validate(q, k, v, q_scale, k_scale, v_scale, is_causal=is_causal, window_size=window_size,
                  softmax_scale=softmax_scale, return_lse=return_lse)
    if heavy_first is not None and not isinstance(heavy_first, bool):
        raise InvalidArgumentError(f"heavy_first must be a bool or None, got {heavy_first!r}")
    if kernel is not None and not isinstance(kernel, str):
        raise InvalidArgumentError(f"kernel must be a kernel name (str) or None, got {kernel!r}")
    return _plan(q, k, v, q_scale, k_scale, v_scale, o, heavy_first=heavy_first, kernel=kernel)


def _regions(outputs: dict) -> tuple[int, tuple[tuple[str, int], ...]]:
    """Where a replayed quantized call keeps its int8 values and scales in the stream's workspace
    (replay.launch's ``regions``): each of ``outputs``' tensors (name -> (int8, scale)) in a region
    of its own, 256-byte aligned."""
    fields, at = [], 0
    for name, (values, scale) in outputs.items():
        for field, t in ((name, values), (f"{name}_scale", scale)):
            fields.append((field, at))
            at += workspace.align(t.numel() * t.element_size())
    return at, tuple(fields)


# The pointer fields of a quantized call's launches: the quant kernel's sources beside ROLES.
QUANTIZED_ROLES = ROLES | {"q_src", "k_src", "v_src"}


def flash_attn_int8qk_quantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                                window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                                rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                                rotary_interleaved: bool = False, return_lse: bool = False):
    """flash_attn's arguments in fp16; RoPE (if given) is applied in fp32, then q and k are quantized
    per token and v per channel (one launch of the quant kernel where one is built), and
    flash_attn_int8qk runs. An eager call of a geometry seen before replays both launches."""
    tensors = (q, k, v)
    key = None
    if (rotary_cos is None and rotary_sin is None and type(q) is torch.Tensor and type(is_causal) is bool
            and type(return_lse) is bool and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int and q.dtype == torch.float16):
        key = replay.key("flash_attn_int8qk_quantized", q.device, tensors,
                         (is_causal, window_size, type(softmax_scale), softmax_scale, return_lse))
    r = replay.lookup(key)
    found = None if r is None else replay.pointers(tensors, r.reach, 0)
    if found is not None:
        out, lse = _replayed_outputs(r, q, return_lse)
        pointers = dict(zip(("q_src", "k_src", "v_src"), found))
        pointers["o"] = out.data_ptr()
        if lse is not None:
            pointers["lse"] = lse.data_ptr()
        reads = checks.reads(q)
        if reads:  # the scales are read after the launch: tensors of the call's own
            outputs = {name: _quant_outputs(x, name == "v") for name, x in (("q", q), ("k", k), ("v", v))}
            for name in "qkv":
                pointers[name], pointers[f"{name}_scale"] = (t.data_ptr() for t in outputs[name])
        replay.launch(r, pointers, q.device, None if reads else r.extra)
        _tally.hit()
        if reads:
            _check_finite(tuple((name, x, outputs[name][1]) for name, x in (("q", q), ("k", k), ("v", v))))
        return (out, lse) if return_lse else out
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_fp16(name, t, NATIVE)
        if t.dtype != torch.float16:  # the INT8 family's output is fp16: its fp16 entry takes fp16 only
            raise InvalidArgumentError(f"{name} must be float16, got {t.dtype}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise UnsupportedError("q, k or v requires grad, and int8 attention has no backward pass (quantized "
                               "inputs): run it under torch.no_grad() or torch.inference_mode(), or use flash_attn")
    # Everything the attention's validation reads of q, k and v (shapes, devices, options) is the same
    # in int8: refused here, before anything is quantized.
    validate(q, k, v, is_causal=is_causal, window_size=window_size, softmax_scale=softmax_scale,
             rotary_cos=None, rotary_sin=None, rotary_interleaved=False, return_lse=return_lse)
    if check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, k.shape[2]):
        seq_q, seq_k = q.shape[2], k.shape[2]
        positions_q = torch.arange(seq_q, device=q.device) + (seq_k - seq_q)
        keys = torch.arange(seq_k, device=q.device)
        q = rotate(q.float(), rotary_cos.float(), rotary_sin.float(), positions_q, rotary_interleaved).float()
        k = rotate(k.float(), rotary_cos.float(), rotary_sin.float(), keys, rotary_interleaved).float()
    table, reason = _quant_table((q, k, v))
    if table is None:  # each by its own call: the torch formula, or an empty tensor
        if reason is not None:
            _fallback(reason, 3)
        (q_i8, q_scale), (k_i8, k_scale) = (_quantize(name, x, -1, reason is not None) for name, x in (("q", q), ("k", k)))
        v_i8, v_scale = _quantize("v", v, 2, reason is not None)
        return flash_attn_int8qk(q_i8, k_i8, v_i8, q_scale, k_scale, v_scale, is_causal=is_causal,
                                 window_size=window_size, softmax_scale=softmax_scale, return_lse=return_lse)
    outputs = {name: _quant_outputs(x, name == "v") for name, x in (("q", q), ("k", k), ("v", v))}
    quant = _quant_launch(table, q, k, v, outputs)
    _run_quant(table, q.device, quant)
    (q_i8, q_scale), (k_i8, k_scale), (v_i8, v_scale) = outputs.values()
    _check_finite((("q", q, q_scale), ("k", k, k_scale), ("v", v, v_scale)))
    o = _validate(q_i8, k_i8, v_i8, q_scale, k_scale, v_scale, is_causal=is_causal, window_size=window_size,
                  softmax_scale=softmax_scale, return_lse=return_lse)
    plan = _plan(q_i8, k_i8, v_i8, q_scale, k_scale, v_scale, o)
    if plan.table is table:  # kept for the calls of this geometry: both launches, replayed
        replay.remember(key, plan, tensors, QUANTIZED_ROLES, extra=_regions(outputs), before=(quant,))
    plan.run()
    out, lse = plan.outputs
    return (out, lse) if return_lse else out


@torch.library.custom_op("rdnattention::flash_attn_int8qk_fwd", mutates_args=())
def flash_attn_int8qk_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_scale: torch.Tensor,
                          k_scale: torch.Tensor, v_scale: torch.Tensor, window_left: int, window_right: int,
                          softmax_scale: float, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The INT8 forward as a custom op (its arguments the kernel's, as in ops.py), with a fake
    implementation: flash_attn_int8qk runs it where torch traces or the tensors are subclasses."""
    o = Options(window_left=window_left, window_right=window_right, softmax_scale=softmax_scale,
                rotary_cos=None, rotary_sin=None, rotary_interleaved=False, return_lse=return_lse,
                seqused_k=None, score=NO_SCORE_OPTIONS)
    plan = _plan(q, k, v, q_scale, k_scale, v_scale, o)
    plan.run()
    return plan.outputs


@flash_attn_int8qk_fwd.register_fake
def _(q, k, v, q_scale, k_scale, v_scale, window_left, window_right, softmax_scale, return_lse):
    return _allocate(q, return_lse)
