"""The generated fp16 kernel on the host platform, against the float64 oracle."""

import re

import pytest
import torch

import rdnattention
from rdnattention import attention_reference, flash_attn, rotary_tables
from rdnattention.errors import InvalidArgumentError, KernelsNotBuiltError, UnsupportedError

TOL = 2e-3  # max abs error on N(0,1) inputs: fp16 output rounding plus fp16 probabilities


def _inputs(b, hq, hk, sq, sk, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g).half()
    k = torch.randn(b, hk, sk, d, generator=g).half()
    v = torch.randn(b, hk, sk, d, generator=g).half()
    return q, k, v


def _built(matrix, head_dim: int) -> None:
    """Skips a test whose head_dim the host target does not build here: an install's tests run on a
    build of a few head_dims (RDNATTENTION_TEST_HEAD_DIMS, tests/conftest.py)."""
    if not matrix.target("host").builds("f16", head_dim):
        pytest.skip(f"head_dim {head_dim} is not in this build (RDNATTENTION_TEST_HEAD_DIMS)")


def _check(out, ref):
    assert out.dtype == torch.float16 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL, f"max abs error {err:.2e} > {TOL}"


# Sequence lengths are not multiples of the tiles (BR/G rows, BC keys).
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq, hk", [(2, 2), (4, 2)])
@pytest.mark.parametrize("seq", [1, 77, 200])
def test_matches_oracle(host_build, matrix, head_dim, causal, hq, hk, seq):
    _built(matrix, head_dim)
    q, k, v = _inputs(1, hq, hk, seq, seq, head_dim, seed=seq * 7 + head_dim + hq + causal)
    _check(flash_attn(q, k, v, is_causal=causal), attention_reference(q, k, v, is_causal=causal))


@pytest.mark.parametrize("hq, hk, sq, sk, causal, window", [
    (2, 2, 130, 300, True, (-1, -1)),   # cross-attention aligned to the end of the keys
    (6, 2, 33, 33, False, (-1, -1)),    # 3 query heads per K/V head: the group-1 kernel
    (8, 1, 70, 70, True, (-1, -1)),     # MQA
    (2, 2, 150, 150, False, (16, 8)),   # two-sided window
    (2, 2, 150, 150, True, (40, -1)),   # causal sliding window
    (2, 2, 40, 10, True, (-1, -1)),     # rows before the first key see nothing: zeros
])
def test_masks_and_shapes(host_build, hq, hk, sq, sk, causal, window):
    q, k, v = _inputs(2, hq, hk, sq, sk, 64, seed=sq + sk)
    out = flash_attn(q, k, v, is_causal=causal, window_size=window)
    _check(out, attention_reference(q, k, v, is_causal=causal, window_size=window))


def test_softmax_scale(host_build, matrix):
    _built(matrix, 128)
    q, k, v = _inputs(1, 2, 2, 90, 90, 128, seed=5)
    _check(flash_attn(q, k, v, softmax_scale=0.05), attention_reference(q, k, v, softmax_scale=0.05))


def test_strided_views(host_build):
    q, k, v = _inputs(2, 4, 4, 64, 64, 64, seed=9)
    qs = q.transpose(1, 2).contiguous().transpose(1, 2)  # [b, s, h, d] storage
    out = flash_attn(qs, k, v, is_causal=True)
    _check(out, attention_reference(q, k, v, is_causal=True))


def test_inputs_are_not_modified(host_build):
    q, k, v = _inputs(1, 2, 2, 50, 50, 64, seed=3)
    copies = [t.clone() for t in (q, k, v)]
    flash_attn(q, k, v, is_causal=True)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), copies))


def test_shuffled_fiber_order_gives_identical_results(host_build, matrix):
    _built(matrix, 128)
    q, k, v = _inputs(1, 4, 2, 150, 150, 128, seed=11)
    plain = flash_attn(q, k, v, is_causal=True)
    try:
        for seed in (1, 2, 3):
            rdnattention.set_host_shuffle(seed)
            assert torch.equal(flash_attn(q, k, v, is_causal=True), plain)
    finally:
        rdnattention.set_host_shuffle(None)


@pytest.mark.parametrize("mutate, message", [
    (lambda q, k, v: (q.float(), k, v), "q must be float16 or bfloat16, got torch.float32"),
    (lambda q, k, v: (q, k.bfloat16(), v), r"k is torch.bfloat16 but q is torch.float16: q, k, v must share one dtype"),
    (lambda q, k, v: (q[0], k, v), "q must be 4-D [batch, heads, seq, head_dim], got shape (2, 16, 64)"),
    (lambda q, k, v: (q, k[:, :, :, :32], v), "k shape (1, 2, 16, 32) does not match q shape (1, 2, 16, 64)"),
    (lambda q, k, v: (q, k, v[:, :, :8]), "v shape (1, 2, 8, 64) must equal k shape (1, 2, 16, 64)"),
    (lambda q, k, v: (torch.cat([q, q[:, :1]], 1), k, v), "q heads (3) must be a multiple of k/v heads (2)"),
    (lambda q, k, v: (q.transpose(2, 3), k, v), "q must be contiguous in its last dimension"),
    (lambda q, k, v: (q[..., 1:33], k[..., :32], v[..., :32]), "q rows must start on 16-byte boundaries"),
])
def test_bad_arguments_raise_typed_errors(host_build, mutate, message):
    q, k, v = _inputs(1, 2, 2, 16, 16, 64, seed=1)
    with pytest.raises(InvalidArgumentError) as err:
        flash_attn(*mutate(q, k, v))
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("kwargs, message", [
    ({"window_size": (-2, 0)}, "window_size values must be >= -1"),
    ({"window_size": 4}, "window_size must be a pair of ints"),
    ({"is_causal": 1}, "is_causal must be a bool"),
    ({"softmax_scale": float("nan")}, "softmax_scale must be a finite number"),
])
def test_bad_options_raise_typed_errors(host_build, kwargs, message):
    q, k, v = _inputs(1, 2, 2, 16, 16, 64, seed=1)
    with pytest.raises(InvalidArgumentError, match=message):
        flash_attn(q, k, v, **kwargs)


def test_head_dim_without_a_kernel(host_build, matrix):
    """A head_dim of the matrix the host target does not build (it builds a subset: variants.yaml;
    an install's tests, a build narrowed to a few head_dims: tests/conftest.py): refused, naming
    the head_dims built of each family that could serve it."""
    built = dict(matrix.target("host").head_dims)
    assert 72 not in built["f16"] and 72 not in built["dec"]
    q, k, v = _inputs(1, 2, 2, 32, 32, 72, seed=1)  # 32 query rows: the row-block kernels first
    with pytest.raises(UnsupportedError, match=re.escape(
            f"no f16 kernel for head_dim 72 on host; built head_dims: {list(built['f16'])}; nor a dec kernel "
            f"(built head_dims: {list(built['dec'])})")):
        flash_attn(q, k, v)


def test_missing_build_names_the_command(monkeypatch, tmp_path):
    from rdnattention import dispatch
    monkeypatch.setattr(dispatch, "search_path", lambda: [tmp_path])
    dispatch.table_for.cache_clear()
    try:
        q, k, v = _inputs(1, 2, 2, 16, 16, 64, seed=1)
        with pytest.raises(KernelsNotBuiltError, match="rdnattention-gen build (--user )?--targets host$"):
            flash_attn(q, k, v)
    finally:
        dispatch.table_for.cache_clear()


def _rope_inputs():
    q, k, v = _inputs(1, 2, 2, 20, 20, 64, seed=4)
    cos, sin = rotary_tables(20, 32)
    return q, k, v, cos, sin


@pytest.mark.parametrize("change, message", [
    (lambda c, s: {"rotary_cos": c}, "rotary_cos and rotary_sin must be given together"),
    (lambda c, s: {"rotary_cos": c.double(), "rotary_sin": s.double()},
     r"rotary_cos must be float32 or q's dtype \(torch.float16\), got torch.float64"),
    (lambda c, s: {"rotary_cos": c.bfloat16(), "rotary_sin": s.bfloat16()},
     r"rotary_cos must be float32 or q's dtype \(torch.float16\), got torch.bfloat16"),
    (lambda c, s: {"rotary_cos": c.half(), "rotary_sin": s}, "rotary_cos .* and rotary_sin .* must have the same shape, strides and dtype"),
    (lambda c, s: {"rotary_cos": c[:19], "rotary_sin": s[:19]}, "rotary tables have 19 positions; keys need 20"),
    (lambda c, s: {"rotary_cos": c[0], "rotary_sin": s[0]}, r"rotary_cos must be 2-D \[positions, rotary_dim/2\]"),
    (lambda c, s: {"rotary_cos": torch.ones(20, 40), "rotary_sin": torch.ones(20, 40)},
     "rotary_dim 80 \\(2 \\* table width\\) exceeds head_dim 64"),
    (lambda c, s: {"rotary_cos": c, "rotary_sin": s[:, :8]}, "rotary_cos .* and rotary_sin .* must have the same shape"),
    (lambda c, s: {"rotary_cos": c, "rotary_sin": s, "rotary_interleaved": "yes"}, "rotary_interleaved must be a bool"),
    (lambda c, s: {"rotary_cos": c[:, :8], "rotary_sin": s[:, :8], "q": torch.randn(1, 2, 21, 64).half()},
     r"with RoPE, seq_q \(21\) must not exceed seq_k \(20\)"),
])
def test_bad_rotary_arguments(host_build, change, message):
    q, k, v, cos, sin = _rope_inputs()
    options = change(cos, sin)
    q = options.pop("q", q)
    with pytest.raises(InvalidArgumentError, match=message):
        flash_attn(q, k, v, **options)


@pytest.mark.parametrize("args, message", [
    ((20, 33), "rotary_dim must be a positive even int, got 33"),
    ((20, 0), "rotary_dim must be a positive even int, got 0"),
    ((0, 32), "positions must be a positive int, got 0"),
])
def test_rotary_tables_validate(args, message):
    with pytest.raises(InvalidArgumentError, match=message):
        rotary_tables(*args)


def test_rotary_tables_values():
    cos, sin = rotary_tables(5, 8, base=100.0)
    assert cos.shape == sin.shape == (5, 4) and cos.dtype == torch.float32
    angle = 3 * 100.0 ** (-2 / 8)
    assert abs(cos[3, 1].item() - torch.tensor(angle).cos().item()) < 1e-6
    assert abs(sin[3, 1].item() - torch.tensor(angle).sin().item()) < 1e-6


def test_rope_with_a_strided_table(host_build):
    q, k, v, _, _ = _rope_inputs()
    cos, sin = rotary_tables(20, 64)
    cos_view, sin_view = cos[:, :16], sin[:, :16]  # row stride 32, rotary_dim 32
    out = flash_attn(q, k, v, rotary_cos=cos_view, rotary_sin=sin_view)
    _check(out, attention_reference(q, k, v, rotary_cos=cos_view, rotary_sin=sin_view))


def test_lse_of_rows_without_keys_is_minus_inf(host_build):
    q, k, v = _inputs(1, 2, 2, 12, 4, 64, seed=2)
    out, lse = flash_attn(q, k, v, is_causal=True, return_lse=True)
    ref, ref_lse = attention_reference(q, k, v, is_causal=True, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, 12)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and torch.isinf(lse[:, :, :8]).all()
    assert (lse[:, :, 8:].double() - ref_lse[:, :, 8:]).abs().max() <= 2e-3
    assert (out[:, :, :8] == 0).all()


def test_empty_inputs(host_build):
    q, k, v = _inputs(1, 2, 2, 0, 5, 64, seed=2)
    out, lse = flash_attn(q, k, v, return_lse=True)
    assert out.shape == (1, 2, 0, 64) and lse.shape == (1, 2, 0)
    q, k, v = _inputs(1, 2, 2, 3, 0, 64, seed=2)
    out, lse = flash_attn(q, k, v, return_lse=True)
    assert (out == 0).all() and torch.isinf(lse).all()
