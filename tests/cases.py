"""The oracle sweep's cases, from the matrix: every family of it x every head_dim the host targets
build for it x every case the family declares (rdnattention_gen/families/<family>.py:
oracle_cases), each at the head_dims its layout's kernels are built for, and again in every dtype
the family is also built for (bf16) at the head_dims of those kernels, so a new family, layout,
dtype, head_dim or case is swept without editing the tests. How a case becomes a call of the entry point
that serves its family: ENTRY_POINTS, by family and layout."""

import functools
import os

import torch
from hypothesis import strategies as st

from rdnattention import (attention_reference, flash_attn, flash_attn_int8qk, flash_attn_int8qk_quantized,
                          flash_attn_varlen_func, flash_attn_with_kvcache, quantize_per_channel, quantize_per_token,
                          rotary_tables)
from rdnattention.int8 import _torch_quantize
from rdnattention.reference import rotate
from rdnattention_gen.families import family
from rdnattention_gen.matrix import load_matrix

HOST_TARGETS = ("host", "host_f32")  # host: the fp16-staging GPU targets' kernels; host_f32: sm_90's
FAMILY = family("f16")
# Parsed once: the helpers below are asked hundreds of times while the sweeps are collected, and a
# parse of variants.yaml takes most of a second of CPU (in every pytest worker).
MATRIX = load_matrix()
HEAD_DIMS = list(MATRIX.kernels["f16"]["head_dims"])
VARIANTS = [name for name, case in FAMILY.oracle_cases.items() if case.layout is None]  # flash_attn's plain calls
TOL = 2e-3      # output: fp16 rounding of the result, of the probabilities and (RoPE) of rotated Q/K
LSE_TOL = 2e-3  # log-sum-exp, fp32
# bf16 inputs, against the oracle on the same bf16 values: the same roundings as fp16's (the output;
# the probabilities for P.V where LDS holds 16-bit pairs; RoPE's rotated Q/K) with bf16's unit
# roundoff, 2^-8 (8 significant bits), 8x fp16's 2^-11: 8x each tolerance. The output alone rounds
# by up to 2^-8 of |out| <= max|v| (~4 here): the sweep's largest errors, ~8e-3, are that rounding
# (host_f32's, whose probabilities stay fp32, are as large). The LSE sums the probabilities as
# rounded, each within 2^-8 of its value: at most 2^-8 = 3.9e-3 off (RoPE's rounding adds to it).
BF16_TOL = 8 * TOL
BF16_LSE_TOL = 8 * LSE_TOL
TOLS = {"fp16": (TOL, LSE_TOL), "bf16": (BF16_TOL, BF16_LSE_TOL)}
# Each dtype's unit roundoff: half a unit in the last place of a value in [1, 2).
UNIT_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def output_bound(ref: torch.Tensor, dtype: str) -> torch.Tensor:
    """Per element, how far an output may lie from the float64 oracle ``ref``: TOLS' output
    tolerance, which covers the output's own rounding up to |out| = 2, and past 2 that rounding's
    growth, half a unit in the last place per unit of |ref|. Random inputs (the property tests')
    reach outputs near max|v|, about 4, where rounding the oracle's own value to the dtype is
    already off by up to TOL (fp16: 2^-11 * 4), and any error before the rounding then moves it a
    whole unit."""
    return TOLS[dtype][0] + UNIT_ROUNDOFF[dtype] * (ref.abs() - 2).clamp(min=0)
# The dtype options of the families (None: fp16) and the torch dtype of each, as test ids spell them.
DTYPES = {"fp16": None, "bf16": "bf16"}
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# INT8, against the oracle on the dequantized inputs: P's 7-bit quantization and the fp16 output
# (relative RMS error of the output, as tests/kernels/test_int8.py); the LSE comes from the unquantized P.
INT8_REL_RMS = 0.03
INT8_LSE_TOL = 1e-3
# The backward: each gradient against the oracle's, relative to the oracle's largest element of it.
# A gradient is sums of products of the forward's quantities with dO: the probabilities, recomputed
# from the saved LSE, carry its error (the forward's LSE bound: e^x - 1 ~ x); O, in delta = rowsum(dO
# O), and the stored gradient are each rounded to the dtype (unit roundoff UNIT). Products and sums
# are fp32: nothing beside those.
UNIT = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
GRAD_TOL = {torch.float16: LSE_TOL + 2 * UNIT[torch.float16], torch.bfloat16: BF16_LSE_TOL + 2 * UNIT[torch.bfloat16]}


# Against torch's float32 results (the SDPA patch, the transformers integration): (output,
# gradients), fp16 as tests/runtime/test_sdpa_patch.py compares them, bf16 8x (its unit roundoff's
# ratio to fp16's).
TORCH_TOLS = {"fp16": (3e-3, 1e-2), "bf16": (2.4e-2, 8e-2)}


def property_examples(default: int = 40) -> int:
    """Examples per property test (hypothesis): ``default`` in the suite, RDNATTENTION_PROPERTY_EXAMPLES
    for a longer search."""
    return int(os.environ.get("RDNATTENTION_PROPERTY_EXAMPLES", default))


def query_and_key_lengths(draw, most_keys: int = 700) -> tuple[int, int]:
    """(seq_q, seq_k) for a property test's call (``draw``: hypothesis's): half the time decode, a
    few queries on 100 to ``most_keys`` keys (the split-KV kernels), else up to 70 queries on up to
    90 keys, zero included."""
    if draw(st.booleans()):
        return draw(st.integers(1, 4)), draw(st.integers(100, most_keys))
    return draw(st.integers(0, 70)), draw(st.integers(0, 90))


def small_head_dims(name: str, layout: str | None = None, limit: int = 128) -> dict[str, list[int]]:
    """By dtype (fp16, bf16), the head_dims up to ``limit`` the host target builds kernels of family
    ``name`` and ``layout`` for: the property tests' draws (the emulator runs every thread)."""
    return {dtype: [d for d in host_head_dims("host", name, layout, dtype=dtype) if d <= limit] for dtype in DTYPES}


def cancellation_floor(q, k, v, dout) -> float:
    """What fp32 arithmetic leaves of a backward gradient that is zero by cancellation (q, k, v,
    dout [batch, heads, seq, head_dim], the default softmax scale): dS = P (dP - delta) with
    dP = dO . V and delta = dO . O two head_dim-long fp32 sums that are equal where a row sees one
    key (P = 1, O = V), each within head_dim u32 |dO| |V| of its value; dQ and dK add
    softmax_scale |K| (|Q|) times that over the probabilities of a row (summing to 1) and of a key
    (at most the rows of its GQA group, group x seq_q)."""
    head_dim, rows = q.shape[3], q.shape[1] // k.shape[1] * q.shape[2]
    top = lambda t: t.abs().max().item()  # noqa: E731
    return 2 * head_dim ** -0.5 * head_dim * 2.0**-24 * top(dout) * top(v) * max(top(q), top(k)) * rows


def host_head_dims(target: str, name: str, layout: str | None = None, dtype: str = "fp16",
                   score: str | None = None) -> list[int]:
    """The head_dims ``target`` builds kernels of family ``name`` compiled for ``layout``, ``dtype``
    (fp16, bf16) and ``score`` (a score option: alibi; None: none) for."""
    return sorted({v.spec.head_dim for v in _variants(target)
                   if v.spec.family == name and v.spec.option("layout") == layout
                   and v.spec.option("dtype") == DTYPES[dtype] and v.spec.option("score") == score})


@functools.cache
def _variants(target: str) -> tuple:
    """The dispatch entries of ``target``, worked out once (a tenth of a second each time)."""
    return tuple(MATRIX.variants_for(MATRIX.target(target)))


def bf16_head_dims(fam: str) -> list[int]:
    """The head_dims variants.yaml builds family ``fam``'s bf16 kernels for (every GPU target builds
    them all; the host targets a subset: host_head_dims)."""
    return list(MATRIX.kernels[fam].get("dtypes", {}).get("bf16", ()))


def sweep() -> list[tuple[str, str, int, str, str]]:
    """(host target, family, head_dim, case, dtype) for every family of the matrix, every case it
    declares and every dtype it is built for (fp16, and bf16 where variants.yaml lists it), at the
    head_dims of the case's layout and score option in that dtype."""
    m = MATRIX
    return [(t, name, hd, case, dtype) for dtype in DTYPES for t in HOST_TARGETS for name in forward_families(m)
            for case, c in family(name).oracle_cases.items() for hd in _head_dims(t, name, c.layout, dtype, c.score)]


def _head_dims(target: str, name: str, layout: str | None, dtype: str, score: str | None = None) -> list[int]:
    """The head_dims a case runs at: those the kernels are built for (in its layout, dtype and score
    option), or, for a family whose kernels take the head_dim at launch (the append's
    launch_head_dims), those it lists where the target builds its kernels."""
    built = host_head_dims(target, name, layout, dtype, score)
    launched = getattr(family(name), "launch_head_dims", None)
    return list(launched) if launched and built else built


def forward_families(m) -> list[str]:
    """The families of matrix ``m`` the forward's sweep runs: all but the backward pass's
    (tests/kernels/test_backward.py sweeps its gradients)."""
    return [name for name in m.kernels if not getattr(family(name), "backward", False)]


def sweep_id(p) -> str:
    """A sweep point's test id: fp16's as before (target-family-head_dim-case), other dtypes appended."""
    return "-".join(map(str, p[:4] if p[4] == "fp16" else p))


def layout_of(fam: str, case: str) -> str | None:
    return family(fam).oracle_cases[case].layout


def score_of(fam: str, case: str) -> str | None:
    return family(fam).oracle_cases[case].score


def make_case(name, head_dim, fam="f16", dtype="fp16"):
    """q, k, v [batch, heads, seq, head_dim] (fp16, or ``dtype``: bf16) and the flash_attn options of
    case ``name`` of family ``fam`` (layout options as the case declares them: see OracleCase)."""
    cases = family(fam).oracle_cases
    case = cases[name]
    g = torch.Generator().manual_seed(head_dim * 100 + list(cases).index(name))
    dt = TORCH_DTYPES[dtype]
    q = torch.randn(case.batch, case.heads_q, case.seq_q, head_dim, generator=g).to(dt)
    k = torch.randn(case.batch, case.heads_kv, case.seq_k, head_dim, generator=g).to(dt)
    v = torch.randn(case.batch, case.heads_kv, case.seq_k, head_dim, generator=g).to(dt)
    options = dict(case.options)
    if options.pop("rope", False):
        # Partial rotation where head_dim allows it, rotate-half and interleaved alternating.
        rotary_dim = head_dim if head_dim <= 64 else head_dim // 2
        options["rotary_cos"], options["rotary_sin"] = rotary_tables(case.seq_k + 3, rotary_dim)
        options["rotary_interleaved"] = head_dim % 64 == 0
    if "seqused_k" in options:
        options["seqused_k"] = torch.tensor(options["seqused_k"], dtype=torch.int32)
    alibi = options.pop("alibi", None)
    if alibi is not None:  # Bloom's slopes 2^(-8h/H), per batch scaled by a factor in [1, 2)
        slopes = 2.0 ** (-8.0 * torch.arange(1, case.heads_q + 1) / case.heads_q)
        if alibi == "batch":
            slopes = slopes * (1 + torch.rand(case.batch, 1, generator=g))
        options["alibi_slopes"] = slopes.float()
    if options.pop("sinks", False):  # near the rows' log-sum-exps, so that they weigh
        options["sinks"] = (torch.randn(case.heads_q, generator=g) * 2 + 3).float()
    return q, k, v, options


# --- entry points: each runs a case and returns (out, lse, ref, ref_lse, int8)

def _flash_attn(q, k, v, options):
    if "num_splits" in options:  # a slice count: through the cache entry point, which takes one
        return _kvcache(q, k, v, options)
    out, lse = flash_attn(q, k, v, return_lse=True, **options)
    return (out, lse, *attention_reference(q, k, v, return_lse=True, **options), False)


def _packed(t, lengths):  # [batch, heads, longest, d] -> [sum(lengths), heads, d]
    return torch.cat([t[b, :, :n].transpose(0, 1) for b, n in enumerate(lengths)])


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _varlen(q, k, v, options):
    """Sequence b: its first seqlens_q[b] query rows and seqlens_k[b] keys, packed."""
    lq, lk = options.pop("seqlens_q"), options.pop("seqlens_k")
    causal, window = options.pop("is_causal", False), options.pop("window_size", (-1, -1))
    slopes = options.pop("alibi_slopes", None)

    def alibi(b):  # sequence b's slopes: [batch, heads] per sequence
        return slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
    out, lse, _ = flash_attn_varlen_func(_packed(q, lq), _packed(k, lk), _packed(v, lk), _cu(lq), _cu(lk), max(lq),
                                         max(lk), causal=causal, window_size=window, return_attn_probs=True,
                                         alibi_slopes=slopes, **options)
    refs = [attention_reference(q[b:b + 1, :, :nq], k[b:b + 1, :, :nk], v[b:b + 1, :, :nk], return_lse=True,
                                is_causal=causal, window_size=window, alibi_slopes=alibi(b), **options)
            for b, (nq, nk) in enumerate(zip(lq, lk))]
    ref = torch.cat([r[0, :].transpose(0, 1) for r, _ in refs])  # packed [total_q, heads, d]
    ref_lse = torch.cat([x[0] for _, x in refs], dim=1)         # [heads, total_q]
    return out, lse, ref, ref_lse, False


def _int8(q, k, v, options):
    (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
    out, lse = flash_attn_int8qk(qi, ki, vi, qs, ks, vs, return_lse=True, **options)
    dequantized = (qi.double() * qs.double()[..., None], ki.double() * ks.double()[..., None],
                   vi.double() * vs.double()[:, :, None, :])
    return (out, lse, *attention_reference(*dequantized, return_lse=True, **options), True)


def _quantized(q, k, v, options):
    """flash_attn_int8qk_quantized (its quant kernel, then the INT8 attention): the output must be
    flash_attn_int8qk's on the torch formula's quantization (the quant kernel's int8 values and
    scales are the formula's bit for bit), and the oracle's on those inputs dequantized."""
    out, lse = flash_attn_int8qk_quantized(q, k, v, return_lse=True, **options)
    (qi, qs), (ki, ks), (vi, vs) = _torch_quantize("q", q, -1), _torch_quantize("k", k, -1), _torch_quantize("v", v, 2)
    want, want_lse = flash_attn_int8qk(qi, ki, vi, qs, ks, vs, return_lse=True, **options)
    assert torch.equal(out, want) and torch.equal(lse, want_lse), "the formula's quantization"
    dequantized = (qi.double() * qs.double()[..., None], ki.double() * ks.double()[..., None],
                   vi.double() * vs.double()[:, :, None, :])
    return (out, lse, *attention_reference(*dequantized, return_lse=True, **options), True)


def _kvcache(q, k, v, options):
    """flash_attn_with_kvcache on the keys as a cache (token-major), paged where the case gives a page size."""
    page = options.pop("page_size", None)
    lengths = options.pop("seqused_k", None)
    kc, vc = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [batch, seq_k, heads_kv, d]
    block_table = None
    if page is not None:  # pages of every sequence in a shuffled order in one pool
        b, sk, hk, d = kc.shape
        order = torch.randperm(b * sk // page, generator=torch.Generator().manual_seed(sk + page)).to(torch.int32)
        block_table = order.view(b, sk // page)
        pool = torch.empty(b * sk // page, page, hk, d, dtype=kc.dtype)
        kc, vc = (pool.clone().index_copy_(0, order.long(), t.reshape(-1, page, hk, d)) for t in (kc, vc))
    causal = options.pop("is_causal", False)
    out, lse = flash_attn_with_kvcache(q.transpose(1, 2).contiguous(), kc, vc, cache_seqlens=lengths,
                                       block_table=block_table, causal=causal, return_softmax_lse=True, **options)
    options.pop("num_splits", None)
    ref, ref_lse = attention_reference(q, k, v, is_causal=causal, seqused_k=lengths, return_lse=True, **options)
    return out.transpose(1, 2), lse, ref, ref_lse, False


def _append(q, k, v, options):
    """flash_attn_with_kvcache appending the last ``append`` keys and values of k, v to a cache of
    the others (each sequence's cache ``b`` positions shorter, garbage past its length), RoPE'd on
    pairs or halves (``append_rope``) at their positions: the cache after the append must be
    reference.rotate's, rounded as torch rounds it (float32, then the dtype), and the output the
    oracle's on that cache and the queries rotated so."""
    n, interleaved = options.pop("append"), options.pop("append_rope", None)
    causal = options.pop("is_causal", False)
    b, hk, sk, d = k.shape
    seq_q = q.shape[2]
    g = torch.Generator().manual_seed(sk * d + n)
    kc, vc = (torch.randn(b, sk + 4, hk, d, generator=g).to(k.dtype) for _ in range(2))
    lengths = torch.tensor([sk - n - i for i in range(b)], dtype=torch.int32)
    for i, length in enumerate(lengths.tolist()):
        kc[i, :length], vc[i, :length] = k[i, :, :length].transpose(0, 1), v[i, :, :length].transpose(0, 1)
    k_new, v_new = k[:, :, sk - n:].transpose(1, 2).contiguous(), v[:, :, sk - n:].transpose(1, 2).contiguous()
    tables = {}
    if interleaved is not None:
        rotary_dim = d if d <= 64 else d // 2
        cos, sin = rotary_tables(sk + 4 + seq_q, rotary_dim)
        tables = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    want_k, want_v, q_in = kc.clone(), vc.clone(), q.clone()
    for i, length in enumerate(lengths.tolist()):
        new_k = k_new[i:i + 1].transpose(1, 2)
        if tables:
            new_k = rotate(new_k, cos, sin, torch.arange(n) + length, interleaved)  # in q's dtype, as torch rounds
            qpos = torch.arange(seq_q) + length if causal else torch.full((seq_q,), length)
            q_in[i:i + 1] = rotate(q[i:i + 1], cos, sin, qpos, interleaved)
        want_k[i, length:length + n], want_v[i, length:length + n] = new_k[0].transpose(0, 1), v_new[i]
    out, lse = flash_attn_with_kvcache(q.transpose(1, 2).contiguous(), kc, vc, k_new, v_new, cache_seqlens=lengths,
                                       causal=causal, return_softmax_lse=True, **tables)
    assert torch.equal(kc.view(torch.int16), want_k.view(torch.int16)), "the keys appended"
    assert torch.equal(vc.view(torch.int16), want_v.view(torch.int16)), "the values appended"
    ref, ref_lse = attention_reference(q_in, want_k.transpose(1, 2), want_v.transpose(1, 2), is_causal=causal,
                                       seqused_k=lengths + n, return_lse=True)
    return out.transpose(1, 2), lse, ref, ref_lse, False


# (family, layout) -> the entry point that serves it.
ENTRY_POINTS = {("f16", None): _flash_attn, ("f16", "len"): _flash_attn, ("f16", "varlen"): _varlen,
                ("dec", None): _flash_attn, ("dec", "paged"): _kvcache,
                ("i8", None): _int8, ("i8dec", None): _int8, ("quant", None): _quantized,
                ("append", None): _append, ("append", "rope"): _append, ("append", "ropehalf"): _append}


def run_case(fam, name, head_dim, dtype="fp16"):
    """Case ``name`` of family ``fam`` at ``head_dim`` in ``dtype`` through the entry point that
    serves the family's kernels of the case's layout: (out, lse, ref, ref_lse, int8)."""
    q, k, v, options = make_case(name, head_dim, fam, dtype)
    return ENTRY_POINTS[(fam, layout_of(fam, name))](q, k, v, options)


def mirrored_kernels(families: tuple[str, ...]) -> list[tuple[str, str]]:
    """(host target, kernel) for every alternate of ``families`` the host targets build as mirrors
    of GPU targets' tiles (host: the AMD tables; host_f32: sm_90's tuned tiles)."""
    return sorted((t, v.spec.name) for t in HOST_TARGETS for v in _variants(t)
                  if v.priority < 0 and v.spec.family in families)


def fresh_replays(monkeypatch) -> None:
    """rdnattention.replay as a new process has it, for one test: no replay kept, no guard current,
    no length followed (monkeypatch restores the module's own afterwards)."""
    from rdnattention import replay
    for name, value in (("cache", {}), ("by_length", {}), ("_guard", None), ("_following", None),
                        ("_last", (None, None, None))):
        monkeypatch.setattr(replay, name, value)


def counted_express(monkeypatch) -> list[bool]:
    """A list that records, for every call of an express function (replay.express) made from now
    on, whether it served the call (False: it refused, and the entry point took its own path)."""
    from rdnattention import replay
    served: list[bool] = []
    make = replay.express

    def express(*args, **kw):
        run = make(*args, **kw)
        if run is None:
            return None

        def counted(*tensors):
            out = run(*tensors)
            served.append(out is not None)
            return out
        return counted
    monkeypatch.setattr(replay, "express", express)
    return served
