"""Property-based test of the refusal contract: a valid call of an entry point with one argument
made bad (a dtype, a shape, a device, a value out of range, a type) raises a typed error
(rdnattention.errors, or TypeError for an argument Python itself cannot bind), eagerly and again
once the call's geometry has been planned and is replayed, and leaves every tensor it was given
byte-identical."""


import pytest
import torch
from cases import property_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rdnattention import flash_attn, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, rotary_tables
from rdnattention.errors import RdnaAttentionError

EXAMPLES = property_examples()
NAN, INF = float("nan"), float("inf")


def _flash_attn():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 9, 64, generator=g).half()
    k, v = (torch.randn(2, 2, 12, 64, generator=g).half() for _ in range(2))
    return flash_attn, dict(q=q, k=k, v=v), dict(is_causal=True)


def _flash_attn_func():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 9, 4, 64, generator=g).half()
    k, v = (torch.randn(2, 12, 2, 64, generator=g).half() for _ in range(2))
    return flash_attn_func, dict(q=q, k=k, v=v), dict(causal=True)


def _kvcache():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 1, 4, 64, generator=g).half()
    k_cache, v_cache = (torch.randn(2, 16, 2, 64, generator=g).half() for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 64, generator=g).half() for _ in range(2))
    return flash_attn_with_kvcache, dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v), dict(
        cache_seqlens=torch.tensor([3, 9], dtype=torch.int32), causal=True)


def _varlen():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(10, 4, 64, generator=g).half()
    k, v = (torch.randn(14, 2, 64, generator=g).half() for _ in range(2))
    return flash_attn_varlen_func, dict(q=q, k=k, v=v), dict(
        cu_seqlens_q=torch.tensor([0, 4, 10], dtype=torch.int32), cu_seqlens_k=torch.tensor([0, 5, 14], dtype=torch.int32),
        max_seqlen_q=6, max_seqlen_k=9, causal=True)


ENTRIES = {"flash_attn": _flash_attn, "flash_attn_func": _flash_attn_func, "kvcache": _kvcache, "varlen": _varlen}
SCALE = {"flash_attn": "softmax_scale", "flash_attn_func": "softmax_scale", "kvcache": "softmax_scale",
         "varlen": "softmax_scale"}
CAUSAL = {"flash_attn": "is_causal", "flash_attn_func": "causal", "kvcache": "causal", "varlen": "causal"}


def _bad_tensor(t: torch.Tensor, how: str) -> torch.Tensor:
    return {"float64": lambda: t.double(), "int8": lambda: t.to(torch.int8), "meta": lambda: t.to("meta"),
            "rank": lambda: t[0], "head_dim": lambda: t[..., :48].contiguous(), "bool": lambda: t.bool()}[how]()


@st.composite
def mutations(draw):
    entry = draw(st.sampled_from(sorted(ENTRIES)))
    _, tensors, kwargs = ENTRIES[entry]()
    kind = draw(st.sampled_from(["tensor", "scale", "causal", "window", "softcap", "alibi", "sinks", "lengths",
                                 "rotary"]))
    if kind == "tensor":
        name = draw(st.sampled_from(sorted(tensors)))
        how = draw(st.sampled_from(["float64", "int8", "meta", "rank", "head_dim", "bool"]))
        return entry, ("tensor", name, how)
    if kind == "scale":
        return entry, ("kw", SCALE[entry], draw(st.sampled_from([NAN, INF, "0.1", True, 1e39, [0.1]])))
    if kind == "causal":
        return entry, ("kw", CAUSAL[entry], draw(st.sampled_from([1, None, "yes", 0.0])))
    if kind == "window":
        return entry, ("kw", "window_size", draw(st.sampled_from([(-2, 0), (1,), "ab", (1.5, 2), (0, -3), None])))
    if kind == "softcap":
        return entry, ("kw", "softcap", draw(st.sampled_from([-1.0, NAN, INF, "1", None, [1.0]])))
    if kind == "alibi":
        return entry, ("kw", "alibi_slopes", draw(st.sampled_from(["shape", "dtype", "nan", "device"])))
    if kind == "sinks":
        return entry, ("kw", "sinks", draw(st.sampled_from(["shape", "dtype", "nan", "device"])))
    if kind == "lengths" and entry in ("kvcache", "varlen"):
        name = "cache_seqlens" if entry == "kvcache" else draw(st.sampled_from(["cu_seqlens_q", "cu_seqlens_k"]))
        return entry, ("lengths", name, draw(st.sampled_from(["int64", "too_long", "negative", "shape", "float"])))
    if kind == "rotary" and entry in ("flash_attn", "kvcache"):
        return entry, ("rotary", None, draw(st.sampled_from(["one_table", "few_positions", "wide", "dtype"])))
    return entry, ("kw", SCALE[entry], NAN)


def _apply(entry: str, mutation, tensors: dict, kwargs: dict) -> None:
    what, name, how = mutation
    heads = 4
    if what == "tensor":
        tensors[name] = _bad_tensor(tensors[name], how)
    elif what == "kw" and name in ("alibi_slopes", "sinks") and isinstance(how, str):
        kwargs[name] = {"shape": torch.rand(heads + 1), "dtype": torch.rand(heads).half(),
                        "nan": torch.full((heads,), NAN), "device": torch.rand(heads, device="meta")}[how]
    elif what == "kw":
        kwargs[name] = how
    elif what == "lengths":
        t = kwargs[name]
        kwargs[name] = {"int64": t.long(), "too_long": t + 100, "negative": t - 100, "shape": t[:1],
                        "float": t.float()}[how]
    elif what == "rotary":
        cos, sin = rotary_tables(32, 32)
        if how == "one_table":
            kwargs["rotary_cos"] = cos
        elif how == "few_positions":
            kwargs.update(rotary_cos=cos[:2], rotary_sin=sin[:2])
        elif how == "wide":
            cos, sin = rotary_tables(32, 80)  # rotary_dim 80 > head_dim 64
            kwargs.update(rotary_cos=cos, rotary_sin=sin)
        else:
            kwargs.update(rotary_cos=cos.double(), rotary_sin=sin.double())


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_a_bad_argument_is_a_typed_error_and_writes_nothing(host_build, case):
    entry, mutation = case
    fn, tensors, kwargs = ENTRIES[entry]()
    fn(**tensors, **kwargs)  # the good call first: its geometry planned, and replayed where it can be
    fn(**tensors, **kwargs)
    _apply(entry, mutation, tensors, kwargs)
    given_ = {name: t.clone() for name, t in {**tensors, **kwargs}.items()
              if isinstance(t, torch.Tensor) and t.device.type != "meta"}
    for _ in range(2):  # refused eagerly, and again (nothing of the refused call kept)
        with pytest.raises((RdnaAttentionError, TypeError)) as caught:
            fn(**tensors, **kwargs)
        assert caught.type is not TypeError or "argument" in str(caught.value), caught.value
    for name, before in given_.items():
        now = {**tensors, **kwargs}[name]
        assert torch.equal(now, before) or (now.is_floating_point() and torch.equal(now.isnan(), before.isnan())), name
