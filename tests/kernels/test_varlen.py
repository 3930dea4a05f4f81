"""Packed variable-length batches on the host platform: torch's varlen_attn and flash-attn's
flash_attn_varlen_func signatures, each sequence against the float64 oracle on its own rows."""

import pytest
import torch

from rdnattention import attention_reference, flash_attn_varlen_func, varlen_attn
from rdnattention.errors import InvalidArgumentError, UnsupportedError

TOL = 2e-3


class Aux:  # torch.nn.attention.varlen.AuxRequest's field
    lse = True


def _packed(lengths_q, lengths_k, hq=4, hk=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), hq, d, generator=g).half()
    k = torch.randn(sum(lengths_k), hk, d, generator=g).half()
    v = torch.randn(sum(lengths_k), hk, d, generator=g).half()
    cu = lambda n: torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(lengths_q), cu(lengths_k)


def _view(t):  # [total, heads, d] -> [1, heads, total, d]
    return t.unsqueeze(0).transpose(1, 2)


def _check(out, lse, q, k, v, cu_q, cu_k, lengths_k=None, **options):
    for b in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        kb, vb = _view(k[ks]), _view(v[ks])
        if lengths_k is not None:
            kb, vb = kb[:, :, :lengths_k[b]], vb[:, :, :lengths_k[b]]
        ref, ref_lse = attention_reference(_view(q[qs]), kb, vb, return_lse=True, **options)
        assert (_view(out[qs]).double() - ref).abs().max().item() <= TOL if qs.stop > qs.start else True
        if lse is not None and qs.stop > qs.start:
            got = lse[:, qs].unsqueeze(0).double()
            finite = torch.isfinite(ref_lse)
            assert torch.equal(torch.isfinite(got), finite)
            assert (got[finite] - ref_lse[finite]).abs().max().item() <= TOL if finite.any() else True


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (20, 0), (8, 4)])
@pytest.mark.parametrize("lengths_q, lengths_k", [([1, 1, 1], [50, 130, 7]), ([5, 1, 0, 40], [5, 90, 3, 40])])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_varlen_attn_matches_the_oracle(host_build, window, lengths_q, lengths_k, splits):
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k)
    out, lse = varlen_attn(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), return_aux=Aux(), window_size=window,
                           enable_gqa=True, num_splits=splits)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    _check(out, lse, q, k, v, cu_q, cu_k, window_size=window)


def test_seqused_k_limits_each_sequence(host_build):
    q, k, v, cu_q, cu_k = _packed([1, 2], [60, 60])
    used = torch.tensor([13, 60], dtype=torch.int32)
    out = varlen_attn(q, k, v, cu_q, cu_k, 2, 60, enable_gqa=True, seqused_k=used)
    _check(out, None, q, k, v, cu_q, cu_k, lengths_k=used.tolist())


@pytest.mark.parametrize("page", [16, 64])
def test_a_paged_pool_is_the_packed_keys(host_build, page):
    lengths_k = [100, 37]
    q, k, v, cu_q, cu_k = _packed([1, 3], lengths_k)
    pages_per_seq = 128 // page
    order = torch.randperm(2 * pages_per_seq, generator=torch.Generator().manual_seed(4)).to(torch.int32)
    table = order.view(2, pages_per_seq)
    pool_k = torch.zeros(2 * pages_per_seq, page, 2, 64).half()
    pool_v = torch.zeros_like(pool_k)
    for b, n in enumerate(lengths_k):
        rows = torch.arange(n)
        pool_k[table[b].long()[rows // page], rows % page] = k[int(cu_k[b]):int(cu_k[b]) + n]
        pool_v[table[b].long()[rows // page], rows % page] = v[int(cu_k[b]):int(cu_k[b]) + n]
    used = torch.tensor(lengths_k, dtype=torch.int32)
    paged = varlen_attn(q, pool_k, pool_v, cu_q, None, 3, 128, enable_gqa=True, seqused_k=used, block_table=table,
                        window_size=(-1, 0), num_splits=2)
    packed = varlen_attn(q, k, v, cu_q, cu_k, 3, 100, enable_gqa=True, window_size=(-1, 0), num_splits=2)
    _check(paged, None, q, k, v, cu_q, cu_k, window_size=(-1, 0))
    assert (paged.double() - packed.double()).abs().max().item() <= TOL
    fa = flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, 3, 100, causal=True, block_table=table)
    assert (fa.double() - packed.double()).abs().max().item() <= TOL
    # Rows past the last sequence: zero (the paged kernels do not write them; the runtime fills them).
    extra = torch.cat([q, torch.full((5, *q.shape[1:]), float("nan"), dtype=q.dtype)])
    out = varlen_attn(extra, pool_k, pool_v, cu_q, None, 3, 128, enable_gqa=True, seqused_k=used, block_table=table,
                      window_size=(-1, 0))
    assert torch.equal(out[q.shape[0]:], torch.zeros_like(out[q.shape[0]:]))
    assert (out[:q.shape[0]].double() - packed.double()).abs().max().item() <= TOL


def test_flash_attn_varlen_func(host_build):
    q, k, v, cu_q, cu_k = _packed([3, 1, 6], [30, 200, 6])
    out, lse, probs = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 200, causal=True, return_attn_probs=True)
    assert probs is None and lse.shape == (4, 10)
    _check(out, lse, q, k, v, cu_q, cu_k, is_causal=True)
    with pytest.raises(UnsupportedError, match="dropout"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 200, dropout_p=0.1)


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(max_q=2), "longer than max_q = 2"),
    (lambda a: a.update(max_k=100), "longer than max_k = 100"),
    (lambda a: a.update(cu_seq_q=torch.tensor([0, 3, 2, 4], dtype=torch.int32)), "never decrease"),
    (lambda a: a.update(cu_seq_q=torch.tensor([0, 3, 4, 50], dtype=torch.int32)), "past the 10 packed rows"),
    (lambda a: a.update(cu_seq_k=torch.tensor([0, 30, 236], dtype=torch.int32)), "cu_seq_k must be int32 (4,)"),
    (lambda a: a.update(cu_seq_q=a["cu_seq_q"].long()), "cu_seq_q must be int32 1-D"),
    (lambda a: a.update(enable_gqa=False), "pass enable_gqa=True"),
    (lambda a: a.update(key=a["key"].float()), "key must be float16 or bfloat16"),
    (lambda a: a.update(key=a["key"].bfloat16(), value=a["value"].bfloat16()),
     "key is torch.bfloat16 but query is torch.float16"),
    (lambda a: a.update(block_table=torch.zeros(3, 2, dtype=torch.int32)), "must be 4-D"),
    (lambda a: a.update(window_size=(-2, 0)), "window_size values must be >= -1"),
])
def test_what_is_refused(host_build, change, message):
    q, k, v, cu_q, cu_k = _packed([3, 1, 6], [30, 200, 6])
    args = dict(query=q, key=k, value=v, cu_seq_q=cu_q, cu_seq_k=cu_k, max_q=6, max_k=200, enable_gqa=True)
    change(args)
    with pytest.raises(InvalidArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        varlen_attn(**args)


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (50, 0)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_packed_prefill_runs_the_row_block_kernels(host_build, monkeypatch, window, head_dim):
    """Many query rows per K/V head: the f16 kernels of layout varlen (row blocks past a sequence end at once)."""
    from rdnattention.families import f16

    planned = []
    real = f16.plan

    def spy(table, call, **kw):
        plan = real(table, call, **kw)
        planned.append(plan.launches[0].kernel.kind)
        return plan

    monkeypatch.setattr(f16, "plan", spy)
    lengths_q, lengths_k = [130, 7, 0, 64], [130, 200, 5, 64]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, d=head_dim)
    out, lse = varlen_attn(q, k, v, cu_q, cu_k, 130, 200, return_aux=Aux(), window_size=window, enable_gqa=True)
    assert planned == ["f16 varlen"]
    _check(out, lse, q, k, v, cu_q, cu_k, window_size=window)
    used = torch.tensor([100, 3, 0, 64], dtype=torch.int32)
    out = varlen_attn(q, k, v, cu_q, cu_k, 130, 200, window_size=window, enable_gqa=True, seqused_k=used)
    _check(out, None, q, k, v, cu_q, cu_k, lengths_k=used.tolist(), window_size=window)


@pytest.mark.parametrize("lengths_q, lengths_k, family", [([1, 1, 1], [50, 130, 7], "dec"),
                                                          ([130, 7, 64], [130, 200, 64], "f16"),
                                                          ([3, 0], [40, 0], "dec")])
@pytest.mark.parametrize("entry", ["varlen_attn", "flash_attn_varlen_func"])
def test_rows_past_the_last_sequence_are_zero_without_a_fill(host_build, monkeypatch, stale_decode_output, lengths_q,
                                                             lengths_k, family, entry):
    """q holds more rows than the sequences (cu_seqlens_q[-1] < total_q): the kernels write those rows as zeros
    themselves, over an output whose memory held NaNs (the runtime allocates it without a fill), and every
    sequence's rows as the oracle's; the last sequence may be empty."""
    from rdnattention.families import dec, f16

    q, k, v, cu_q, cu_k = _packed(lengths_q + [11], lengths_k + [0])  # 11 query rows past the last sequence
    cu_q, cu_k = cu_q[:-1], cu_k[:-1]
    families = []

    def spying(real_plan):
        def spy(table, call, **kw):
            plan = real_plan(table, call, **kw)
            families.append(plan.launches[0].kernel.family)
            return plan
        return spy

    for module in (dec, f16):
        monkeypatch.setattr(module, "plan", spying(module.plan))
    max_q, max_k = max(lengths_q), max(lengths_k)
    if entry == "varlen_attn":
        out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, enable_gqa=True, window_size=(-1, 0))
    else:
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    assert families == [family]
    total = int(cu_q[-1])
    assert out[total:].shape[0] == 11 and torch.equal(out[total:], torch.zeros_like(out[total:]))
    _check(out, None, q, k, v, cu_q, cu_k, window_size=(-1, 0))
