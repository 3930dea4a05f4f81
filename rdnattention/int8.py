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

import torch

from . import checks, replay, route
from .checks import NATIVE, check_fp16
from .errors import InvalidArgumentError, UnsupportedError
from .options import NO_SCORE_OPTIONS, Options, check_rotary, validate
from .plan import Plan
from .reference import rotate

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
    """The scale of each amax: amax / 127, at least float32's smallest normal number (values so tiny
    quantize to 0 rather than to a zero or subnormal scale, which the kernels refuse or flush), and
    1 for an all-zero vector."""
    return torch.where(amax > 0, (amax / _LEVELS).clamp_min_(torch.finfo(torch.float32).tiny), 1.0)


def _quantize(name: str, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized symmetrically along every vector of dimension ``dim`` (one scale per position of
    the others): nine tensor launches on a GPU, none of which copies x to float32 first (the amax
    reads x as it is, the division promotes)."""
    x = _check_float(name, x).detach()
    if x.is_cuda:  # max |x|, exact: one reduction launch on a GPU
        amax = torch.linalg.vector_norm(x, float("inf"), dim=dim, dtype=torch.float32)
    else:  # the CPU's inf-norm reduction is not vectorised (about 15x slower than these three)
        amax = x.float().abs().amax(dim)  # not in place: float() of a float32 x is x itself
    if checks.reads(x) and not torch.isfinite(amax).all():
        raise InvalidArgumentError(f"{name} holds a NaN or an infinity; it cannot be quantized")
    scale = _scale(amax)
    q = torch.div(x, scale.unsqueeze(dim)).round_().clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    return q, scale.contiguous()  # the reduction keeps a strided x's dimension order


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
    r = replay.cache.get(key) if key is not None else None
    if r is not None and replay.memory_ok(tensors, r.reach, 3):
        if checks.reads(q):
            _check_scales(q_scale, k_scale, v_scale)
        out, lse = _allocate(q, return_lse, empty_lse=False)
        pointers = {"o": out.data_ptr()}
        if lse is not None:
            pointers["lse"] = lse.data_ptr()
        for name, t in zip(("q", "k", "v", "q_scale", "k_scale", "v_scale"), tensors):
            pointers[name] = t.data_ptr()
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


def flash_attn_int8qk_quantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                                window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
                                rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                                rotary_interleaved: bool = False, return_lse: bool = False):
    """flash_attn's arguments in fp16; RoPE (if given) is applied in fp32, then q and k are quantized
    per token and v per channel, and flash_attn_int8qk runs."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_fp16(name, t, NATIVE)
        if t.dtype != torch.float16:  # the INT8 family's output is fp16: its fp16 entry takes fp16 only
            raise InvalidArgumentError(f"{name} must be float16, got {t.dtype}")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise UnsupportedError("q, k or v requires grad, and int8 attention has no backward pass (quantized "
                               "inputs): run it under torch.no_grad() or torch.inference_mode(), or use flash_attn")
    if check_rotary(rotary_cos, rotary_sin, rotary_interleaved, q, k.shape[2]):
        seq_q, seq_k = q.shape[2], k.shape[2]
        positions_q = torch.arange(seq_q, device=q.device) + (seq_k - seq_q)
        keys = torch.arange(seq_k, device=q.device)
        q = rotate(q.float(), rotary_cos.float(), rotary_sin.float(), positions_q, rotary_interleaved).float()
        k = rotate(k.float(), rotary_cos.float(), rotary_sin.float(), keys, rotary_interleaved).float()
    q_i8, q_scale = quantize_per_token(q)
    k_i8, k_scale = quantize_per_token(k)
    v_i8, v_scale = quantize_per_channel(v)
    return flash_attn_int8qk(q_i8, k_i8, v_i8, q_scale, k_scale, v_scale, is_causal=is_causal,
                             window_size=window_size, softmax_scale=softmax_scale, return_lse=return_lse)


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
