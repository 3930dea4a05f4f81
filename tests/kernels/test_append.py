"""flash_attn_with_kvcache's append kernel (families/append.py) on the host emulator: the cache
after the append, the rotated queries and the output, byte for byte those of the torch operations
it replaces (kvcache._torch_append, forced here), and the cache against the float64 oracle's
rotation (reference.rotate, rounded as torch rounds float64: to float32, then to the dtype); plain
caches, cache_batch_idx, paged caches, RoPE on pairs and on halves, causal (local) rotation, bf16,
every RoPE table dtype, replays, and the counts of both paths. The append runs fused into the
split-KV decode's launch (fa2_decode.h's fa2_decode_append: with RoPE tables, the queries rotated
there too) where that is the attention and the new keys are few, else in its own launch first: the
tests parametrized by ``fuse`` run both where the call allows it."""

import warnings

import numpy as np
import pytest
import torch

import rdnattention
from rdnattention import attention_reference, flash_attn_with_kvcache, kvcache, replay, rotary_tables
from rdnattention.errors import UnsupportedError
from rdnattention.families import append as append_family
from rdnattention.reference import rotate, to_odd_float


def _inputs(dtype, b=3, sq=2, new=3, hq=4, hk=2, d=64, cache=48, seed=0, paged=None, rows=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    if paged:  # a pool of pages of `paged` positions, each sequence's pages shuffled in it
        pages = b * cache // paged
        k_cache, v_cache = (torch.randn(pages, paged, hk, d, generator=g).to(dtype) for _ in range(2))
        table = torch.randperm(pages, generator=g).to(torch.int32).view(b, cache // paged)
    else:
        k_cache, v_cache = (torch.randn(rows or b, cache, hk, d, generator=g).to(dtype) for _ in range(2))
        table = None
    k, v = (torch.randn(b, new, hk, d, generator=g).to(dtype) for _ in range(2))
    return q, k_cache, v_cache, k, v, table


def _call(q, k_cache, v_cache, k, v, **kwargs):
    return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, return_softmax_lse=True, **kwargs)


def _both(monkeypatch, inputs, fuse=True, **kwargs):
    """The call with the append kernel and with the torch operations, each on its own copies:
    (out, lse, k_cache, v_cache) of each. ``fuse``: the append in the attention's launch where it
    is one split-KV launch (kvcache.FUSE_MAX_NEW), else the append kernel's own launch first."""
    results = []
    for kernel in (True, False):
        with monkeypatch.context() as m:
            if not fuse:
                m.setattr(kvcache, "FUSE_MAX_NEW", 0)
            if not kernel:
                m.setattr(kvcache, "_append_kernel", lambda *a: False)
            q, k_cache, v_cache = (t.clone() for t in inputs[:3])  # k and v are only read: as given
            k, v = inputs[3:]
            replay.clear()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                out, lse = _call(q, k_cache, v_cache, k, v, **kwargs)
            results.append((out, lse, k_cache, v_cache))
    return results


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.element_size() == 2 else a,
                                              b.view(torch.int16) if b.element_size() == 2 else b)


CASES = {
    "plain": {},
    "rope": {"rope": True},
    "rope_half": {"rope": False},
    "rope_causal": {"rope": True, "causal": True},
    "rope_half_window": {"rope": False, "window_size": (4, 0)},
    "rope_partial": {"rope": True, "rotary_dim": 32},
    "rope_half_partial_causal": {"rope": False, "rotary_dim": 16, "causal": True},
    "cache_batch_idx": {"idx": True},
    "cache_batch_idx_rope": {"idx": True, "rope": False, "causal": True},
    "paged": {"page": 16},
    "paged_rope": {"page": 16, "rope": True, "causal": True},
    "paged_rope_half": {"page": 8, "rope": False},
    "int_seqlens_rope": {"rope": True, "int_length": 7},
}


def _case(name, dtype, table_dtype=torch.float32):
    c = CASES[name]
    q, k_cache, v_cache, k, v, table = _inputs(dtype, paged=c.get("page"), rows=5 if c.get("idx") else None)
    kwargs = {"cache_seqlens": c.get("int_length", torch.tensor([5, 0, 45], dtype=torch.int32))}
    if c.get("idx"):
        kwargs["cache_batch_idx"] = torch.tensor([4, 0, 2], dtype=torch.int32)
    if table is not None:
        kwargs["block_table"] = table
    if "rope" in c:
        cos, sin = rotary_tables(64, c.get("rotary_dim", 64))
        kwargs.update(rotary_cos=cos.to(table_dtype), rotary_sin=sin.to(table_dtype), rotary_interleaved=c["rope"])
    for key in ("causal", "window_size"):
        if key in c:
            kwargs[key] = c[key]
    return (q, k_cache, v_cache, k, v), kwargs


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "own_launch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_is_the_torch_append_byte_for_byte(host_build, monkeypatch, name, dtype, fuse):
    """Fused into the split-KV decode launch (these calls' attention) and in its own launch before it."""
    inputs, kwargs = _case(name, dtype)
    (out, lse, kc, vc), (t_out, t_lse, t_kc, t_vc) = _both(monkeypatch, inputs, fuse=fuse, **kwargs)
    assert not torch.equal(kc, inputs[1]) or kc.numel() == 0  # something was appended
    assert _same_bytes(kc, t_kc) and _same_bytes(vc, t_vc)
    assert _same_bytes(out, t_out) and torch.equal(lse, t_lse)


@pytest.mark.parametrize("table_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["rope", "rope_half_partial_causal"])
def test_tables_of_16_bit_dtypes(host_build, monkeypatch, name, table_dtype):
    """RoPE tables in fp16 or bf16 (flash-attn takes q's dtype or fp32; fp16 always)."""
    dtype = torch.bfloat16 if table_dtype == torch.bfloat16 else torch.float16
    inputs, kwargs = _case(name, dtype, table_dtype)
    (out, lse, kc, vc), (t_out, t_lse, t_kc, t_vc) = _both(monkeypatch, inputs, **kwargs)
    assert _same_bytes(kc, t_kc) and _same_bytes(vc, t_vc)
    assert _same_bytes(out, t_out) and torch.equal(lse, t_lse)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("interleaved, causal", [(True, False), (False, True)])
def test_the_appended_cache_is_the_oracles_rotation_and_the_output_the_oracles(host_build, dtype, interleaved,
                                                                               causal):
    q, k_cache, v_cache, k, v, _ = _inputs(dtype)
    before = k_cache.clone()
    lengths = torch.tensor([5, 0, 45], dtype=torch.int32)
    cos, sin = rotary_tables(64, 48)
    replay.clear()
    counted = rdnattention.stats()["kvcache"]["append_kernel"]
    out, lse = _call(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths, causal=causal,
                     rotary_interleaved=interleaved)
    assert rdnattention.stats()["kvcache"]["append_kernel"] == counted + 1
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    for b, n in enumerate(lengths.tolist()):
        kb = rotate(k[b:b + 1].transpose(1, 2).double(), cos, sin, torch.arange(3) + n, interleaved)
        expect = before[b].clone()
        expect[n:n + 3] = to_odd_float(kb[0].transpose(0, 1)).to(dtype)  # float64 -> dtype, one rounding
        assert _same_bytes(k_cache[b], expect)
        assert torch.equal(v_cache[b, n:n + 3], v[b])
        qpos = torch.arange(2) + n if causal else torch.full((2,), n)
        qb = to_odd_float(rotate(q[b:b + 1].transpose(1, 2).double(), cos, sin, qpos, interleaved)).to(dtype)
        used = n + 3
        ref = attention_reference(qb, k_cache[b:b + 1, :used].transpose(1, 2), v_cache[b:b + 1, :used].transpose(1, 2),
                                  is_causal=causal)
        assert (out[b:b + 1].double() - ref.transpose(1, 2)).abs().max().item() <= tol


@pytest.mark.parametrize("head_dim, rotary_dim", [(40, 24), (8, 8), (256, 128)])
def test_other_head_dims_are_launch_arguments(host_build, monkeypatch, head_dim, rotary_dim):
    """One kernel for every head_dim: 40 and 8 (features in steps of 8), 256; RoPE on halves of part
    of them, causal."""
    q, k_cache, v_cache, k, v, _ = _inputs(torch.float16, d=head_dim)
    cos, sin = rotary_tables(64, rotary_dim)
    kwargs = dict(cache_seqlens=torch.tensor([5, 0, 45], dtype=torch.int32), rotary_cos=cos, rotary_sin=sin,
                  rotary_interleaved=False, causal=True)
    (out, lse, kc, vc), (t_out, t_lse, t_kc, t_vc) = _both(monkeypatch, (q, k_cache, v_cache, k, v), **kwargs)
    assert _same_bytes(kc, t_kc) and _same_bytes(vc, t_vc)
    assert _same_bytes(out, t_out) and torch.equal(lse, t_lse)


def test_rope_rounds_once_to_fp16(host_build):
    """The float64 value 1 + 2^-11 + 2^-40 (k = (1, -1), cos = 1 + 2^-11, sin = 2^-40) is just above
    the tie between 1 and 1 + 2^-10: rounded once, as the kernel and reference.rotate round on every
    device, it is 1 + 2^-10 (through float32 first, it would be the tie 1 + 2^-11, which fp16 rounds
    to 1)."""
    cos = torch.full((4, 1), 1 + 2**-11, dtype=torch.float32)
    sin = torch.full((4, 1), 2**-40, dtype=torch.float32)
    q = torch.zeros(1, 1, 1, 8, dtype=torch.float16)
    k_cache, v_cache = torch.zeros(1, 4, 1, 8, dtype=torch.float16), torch.zeros(1, 4, 1, 8, dtype=torch.float16)
    k = torch.zeros(1, 1, 1, 8, dtype=torch.float16)
    k[0, 0, 0, :2] = torch.tensor([1.0, -1.0])
    flash_attn_with_kvcache(q, k_cache, v_cache, k, k.clone(), rotary_cos=cos, rotary_sin=sin, cache_seqlens=0)
    assert float(np.float16(1 + 2**-11 + 2**-40)) == 1 + 2**-10  # numpy rounds float64 to fp16 once
    assert k_cache[0, 0, 0, 0].item() == 1 + 2**-10
    assert torch.tensor(1 + 2**-11 + 2**-40, dtype=torch.float64).float().half().item() == 1.0  # twice: not so
    assert k_cache[0, 0, 0, 1].item() == -1.0  # -1 - 2^-11 + 2^-40: below the tie either way
    assert torch.equal(k_cache[0, 0, 0, 2:], k[0, 0, 0, 2:])  # past rotary_dim: copied


@pytest.mark.parametrize("name", ["paged", "paged_rope", "cache_batch_idx_rope"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "own_launch"])
def test_replays_run_the_append_kernel_with_their_own_tensors(host_build, monkeypatch, fuse, name):
    """A second call of one geometry replays the plan (the append in the decode's launch, or its own
    first launch, its pointers rewritten; with RoPE tables, the rotated queries in the stream's
    workspace): the same bytes as the torch append on those tensors."""
    if not fuse:
        monkeypatch.setattr(kvcache, "FUSE_MAX_NEW", 0)
    inputs, kwargs = _case(name, torch.float16)
    rope = "rotary_cos" in kwargs
    replay.clear()
    first = [t.clone() for t in inputs]
    _call(*first, **kwargs)
    assert len(replay.cache) == 1
    steps, = [r.steps for r in replay.cache.values()]
    if fuse:  # one launch: the decode's, which appends (and rotates)
        (step,) = steps
        assert step.name.startswith("fa2_dec") and {"k_new", "v_new", "seqused_k"} <= set(step.fields)
        assert step.args.append_rows == 3
        assert ({"q_src", "rotary_cos", "rotary_sin"} <= set(step.fields)) == rope
        assert step.args.rope == (2 - kwargs["rotary_interleaved"] if rope else 0)
    else:
        assert steps[0].name.startswith("fa2_append_") and len(steps) == 2
        assert "k_new" not in steps[1].fields and "q_src" not in steps[1].fields
    second_inputs = [t.clone() for t in inputs]
    second_inputs[3].mul_(-0.5)  # other new keys, other queries, other tensors
    second_inputs[0].mul_(0.75)
    kwargs2 = {**kwargs, "cache_seqlens": torch.tensor([9, 31, 2], dtype=torch.int32)}
    got = [t.clone() for t in second_inputs]
    counted = rdnattention.stats()["kvcache"]["append_kernel"]
    out, lse = _call(*got, **kwargs2)
    assert len(replay.cache) == 1 and rdnattention.stats()["kvcache"]["append_kernel"] == counted + 1
    (t_out, t_lse, t_kc, t_vc) = _both(monkeypatch, second_inputs, **kwargs2)[1]
    assert _same_bytes(got[1], t_kc) and _same_bytes(got[2], t_vc) and _same_bytes(out, t_out)


@pytest.mark.parametrize("what", ["many_new_keys", "row_blocks"])
def test_the_append_runs_its_own_launch_where_it_is_not_fused(host_build, monkeypatch, what):
    """More new keys than kvcache.FUSE_MAX_NEW, or an attention of row blocks (many query rows, not
    one split-KV launch), with RoPE tables: the append kernel's launch, then the attention's; the
    bytes of the torch append."""
    if what == "many_new_keys":
        q, k_cache, v_cache, k, v, _ = _inputs(torch.float16, new=kvcache.FUSE_MAX_NEW + 1, cache=64)
        lengths = torch.tensor([5, 0, 47], dtype=torch.int32)
    else:
        q, k_cache, v_cache, k, v, _ = _inputs(torch.float16, sq=40, new=3, cache=96)
        lengths = torch.tensor([5, 0, 50], dtype=torch.int32)
    cos, sin = rotary_tables(96, 64)
    kwargs = dict(cache_seqlens=lengths, rotary_cos=cos, rotary_sin=sin, causal=True)
    replay.clear()
    _call(q.clone(), k_cache.clone(), v_cache.clone(), k, v, **kwargs)
    steps, = [r.steps for r in replay.cache.values()]
    assert steps[0].name.startswith("fa2_append_rope_") and len(steps) >= 2  # pairs: flash-attn's default
    assert all("k_new" not in step.fields for step in steps[1:])
    (out, lse, kc, vc), (t_out, t_lse, t_kc, t_vc) = _both(monkeypatch, (q, k_cache, v_cache, k, v), **kwargs)
    assert _same_bytes(kc, t_kc) and _same_bytes(vc, t_vc)
    assert _same_bytes(out, t_out) and torch.equal(lse, t_lse)


@pytest.mark.parametrize("interleaved, causal, group, splits",
                         [(True, True, 2, 0), (False, False, 4, 0), (True, False, 1, 0), (False, True, 4, 3)])
def test_rope_tables_rotate_in_the_decode_launch(host_build, monkeypatch, interleaved, causal, group, splits):
    """With RoPE tables the fused launch rotates the new keys and its own query rows (GQA groups of
    1, 2 and 4 query heads per K/V head, two query rows each: one or several row chunks per head,
    with one key slice or three, each slice's workgroups rotating their chunk's rows): one launch,
    the bytes of the torch append, the queries left as given."""
    q, k_cache, v_cache, k, v, _ = _inputs(torch.float16, hq=2 * group, hk=2)
    q_given = q.clone()
    cos, sin = rotary_tables(64, 48)
    kwargs = dict(cache_seqlens=torch.tensor([5, 0, 45], dtype=torch.int32), rotary_cos=cos, rotary_sin=sin,
                  rotary_interleaved=interleaved, causal=causal, num_splits=splits)
    replay.clear()
    _call(q, k_cache.clone(), v_cache.clone(), k, v, **kwargs)
    assert torch.equal(q, q_given)
    (step,), = [r.steps for r in replay.cache.values()]
    assert step.name.startswith("fa2_dec_") and step.args.rope == (1 if interleaved else 2)
    if splits:
        assert step.args.splits == splits and step.grid[0] == splits * 2  # three slices of two row chunks
    assert step.args.q_local == int(causal) and step.args.positions == 64 and step.args.rotary_half == 24
    (out, lse, kc, vc), (t_out, t_lse, t_kc, t_vc) = _both(monkeypatch, (q, k_cache, v_cache, k, v), **kwargs)
    assert _same_bytes(kc, t_kc) and _same_bytes(vc, t_vc)
    assert _same_bytes(out, t_out) and torch.equal(lse, t_lse)


@pytest.mark.parametrize("head_dim", [8, 24])
def test_rope_fuses_from_the_least_head_dim_that_rotates(host_build, monkeypatch, head_dim):
    """The decode kernels below dec.ROPE_MIN_HEAD_DIM (24) are compiled without the rotation: a call
    with RoPE tables there runs the append kernel's launch first; from it on, one launch. The bytes
    of the torch append either way."""
    from rdnattention.families import dec

    q, k_cache, v_cache, k, v, _ = _inputs(torch.float16, d=head_dim)
    cos, sin = rotary_tables(64, head_dim)
    kwargs = dict(cache_seqlens=torch.tensor([5, 0, 45], dtype=torch.int32), rotary_cos=cos, rotary_sin=sin)
    replay.clear()
    _call(q, k_cache.clone(), v_cache.clone(), k, v, **kwargs)
    steps, = [r.steps for r in replay.cache.values()]
    if head_dim < dec.ROPE_MIN_HEAD_DIM:
        assert steps[0].name.startswith("fa2_append_rope_") and len(steps) == 2
    else:
        (step,) = steps
        assert step.name.startswith(f"fa2_dec_hd{head_dim}_") and step.args.rope == 1
    (out, lse, kc, vc), (t_out, t_lse, t_kc, t_vc) = _both(monkeypatch, (q, k_cache, v_cache, k, v), **kwargs)
    assert _same_bytes(kc, t_kc) and _same_bytes(vc, t_vc)
    assert _same_bytes(out, t_out) and torch.equal(lse, t_lse)


def test_the_fused_append_reads_new_rows_at_any_alignment(host_build, monkeypatch):
    """New keys whose rows start 2 bytes past 16-byte boundaries (the fused append copies them value
    by value): one launch, the bytes of the torch append."""
    q, k_cache, v_cache, k, v, table = _inputs(torch.bfloat16, paged=16)
    k = torch.cat([torch.zeros(*k.shape[:3], 1, dtype=k.dtype), k], dim=3)[..., 1:]
    assert k.data_ptr() & 15 and k.stride(3) == 1
    kwargs = dict(cache_seqlens=torch.tensor([5, 0, 45], dtype=torch.int32), block_table=table, causal=True)
    replay.clear()
    _call(q.clone(), k_cache.clone(), v_cache.clone(), k, v, **kwargs)
    (step,), = [r.steps for r in replay.cache.values()]
    assert step.name.startswith("fa2_decpaged_bf16_") and step.args.append_rows == 3
    (out, lse, kc, vc), (t_out, t_lse, t_kc, t_vc) = _both(monkeypatch, (q, k_cache, v_cache, k, v), **kwargs)
    assert _same_bytes(kc, t_kc) and _same_bytes(vc, t_vc)
    assert _same_bytes(out, t_out) and torch.equal(lse, t_lse)


def test_without_an_append_kernel_the_torch_append_runs_counted_and_warned_once(host_build, monkeypatch):
    def missing(*args, **kwargs):
        raise UnsupportedError("no append kernel")

    monkeypatch.setattr(append_family, "select", missing)
    rdnattention.stats(reset=True)
    inputs, kwargs = _case("rope", torch.float16)
    replay.clear()
    with pytest.warns(RuntimeWarning, match="no append kernel for host"):
        _call(*[t.clone() for t in inputs], **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        _call(*[t.clone() for t in inputs], **kwargs)  # a replay of the call
        _call(*[t.clone() for t in inputs], **kwargs)
    counts = rdnattention.stats(reset=True)["kvcache"]
    assert counts["append_torch"] == 3 and counts["append_kernel"] == 0
    assert list(counts["fallbacks"]) == ["no append kernel for host"]


def test_a_refused_call_launches_no_append(host_build):
    """Checked before the append: a call that is refused (cache_seqlens 46 + 3 new keys past the 48
    positions) writes nothing."""
    q, k_cache, v_cache, k, v, _ = _inputs(torch.float16)
    saved = [t.clone() for t in (q, k_cache, v_cache, k, v)]
    with pytest.raises(rdnattention.errors.InvalidArgumentError):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor([5, 0, 46], dtype=torch.int32))
    assert all(torch.equal(a, b) for a, b in zip((q, k_cache, v_cache, k, v), saved))


@pytest.fixture
def unchecked(monkeypatch):
    """RDNATTENTION_CHECK=0: index values are not read, but bounded where they are used."""
    from rdnattention import checks
    monkeypatch.setenv(checks.CHECK_ENV, "0")
    monkeypatch.setattr(checks, "_mode", None)
    yield
    monkeypatch.setattr(checks, "_mode", None)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "own_launch"])
@pytest.mark.parametrize("layout", ["idx", "paged"])
def test_unread_hostile_values_are_bounded_as_the_torch_append_bounds_them(host_build, monkeypatch, unchecked, layout,
                                                                           fuse):
    """Lengths past the cache both ways, rows and pages past it both ways (distinct once bounded,
    so that no two sequences write one row), positions past the tables: the same bytes as the torch
    operations, which clamp them the same way (tests/runtime/test_bounds.py runs such values
    between guard pages). Fused, the caches are those bytes too; the output is not compared there:
    these values make sequences read rows (row 0 of a row or page outside the cache) that others
    write in the same launch, before or after the write (docs/api.md)."""
    q, k_cache, v_cache, k, v, table = _inputs(torch.bfloat16, paged=16 if layout == "paged" else None,
                                               rows=None if layout == "paged" else 5)
    cos, sin = rotary_tables(30, 32)
    kwargs = dict(cache_seqlens=torch.tensor([2**31 - 1, -(2**31), 20], dtype=torch.int32), rotary_cos=cos,
                  rotary_sin=sin, rotary_interleaved=False, causal=True)
    if layout == "paged":  # pages 0-8; sequence 0 at 45.., sequence 1 at 0.., sequence 2 at 20..
        kwargs["block_table"] = torch.tensor([[0, 1, 10**9], [-5, 3, 4], [5, 2**31 - 1, 7]], dtype=torch.int32)
    else:
        kwargs["cache_batch_idx"] = torch.tensor([10**9, -(2**31), 1], dtype=torch.int32)
    (out, lse, kc, vc), (t_out, t_lse, t_kc, t_vc) = _both(monkeypatch, (q, k_cache, v_cache, k, v), fuse=fuse,
                                                           **kwargs)
    assert not torch.equal(kc, k_cache)
    assert _same_bytes(kc, t_kc) and _same_bytes(vc, t_vc)
    if not fuse:
        assert _same_bytes(out, t_out) and torch.equal(lse, t_lse)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "own_launch"])
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_the_kernel_is_the_torch_append_byte_for_byte(monkeypatch, name, dtype, fuse):
    """On an NVIDIA GPU (sm_90's kernels built): the append kernel (fused into the decode's launch,
    or its own) against torch's operations on the GPU, the first call and a replay."""
    if not torch.cuda.is_available() or torch.version.hip is not None:
        pytest.skip("needs an NVIDIA GPU")
    if not fuse:
        monkeypatch.setattr(kvcache, "FUSE_MAX_NEW", 0)
    inputs, kwargs = _case(name, dtype)
    inputs = tuple(t.cuda() for t in inputs)
    kwargs = {key: value.cuda() if isinstance(value, torch.Tensor) else value for key, value in kwargs.items()}
    (out, lse, kc, vc), (t_out, t_lse, t_kc, t_vc) = _both(monkeypatch, inputs, **kwargs)
    assert _same_bytes(kc, t_kc) and _same_bytes(vc, t_vc)
    assert _same_bytes(out, t_out) and torch.equal(lse, t_lse)
    replay.clear()
    counted = rdnattention.stats()["kvcache"]["append_kernel"]
    for _ in range(2):  # planned, then replayed, on copies of the inputs
        q, k_cache, v_cache, k, v = (t.clone() for t in inputs)
        r_out, r_lse = _call(q, k_cache, v_cache, k, v, **kwargs)
        assert _same_bytes(k_cache, t_kc) and _same_bytes(v_cache, t_vc) and _same_bytes(r_out, t_out)
    assert rdnattention.stats()["kvcache"]["append_kernel"] == counted + 2 and len(replay.cache) == 1
