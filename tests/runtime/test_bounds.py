"""Index and scale values the runtime does not read (a GPU tensor's, by default; any tensor's with
RDNATTENTION_CHECK=0) are the caller's contract, and the kernels and the cache append bound every
address they form from them: a hostile value computes nonsense, but never faults, nor reads or
writes outside the tensors a call was given (docs/api.md: which checks read values).

Each case runs in a process of its own with RDNATTENTION_CHECK=0 on the host emulator, every tensor
it passes (and the runtime's outputs and split-KV scratch) between inaccessible guard regions
(tests/guarded.py): once flush against the guard after each tensor, once against the guard before.
A read or write past either end of any of them kills the process; the tensors the call only reads
must come back byte-identical; the call must return (no value is read, so none is refused)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT

import rdnattention
from rdnattention import checks, flash_attn, flash_attn_with_kvcache
from rdnattention.errors import InvalidArgumentError

TESTS = Path(__file__).resolve().parent.parent

_CODE = """
import sys, torch
sys.path.insert(0, {tests!r})
import guarded
from guarded import guarded as g
guarded.guard_allocations()
import rdnattention
from rdnattention import (flash_attn, flash_attn_int8qk, flash_attn_varlen_func, flash_attn_with_kvcache, varlen_attn,
                          workspace)
from rdnattention.errors import RdnaAttentionError

def case():
    gen = torch.Generator().manual_seed(0)
    def rnd(*shape):
        return g(torch.randn(*shape, generator=gen).half())
    def ints(*values):
        return g(torch.tensor(values, dtype=torch.int32))
    written = {{}}  # tensors the call writes (caches it appends to): excluded from the comparison
{setup}
    return given, written, call

for end in (True, False):
    guarded.END = end
    workspace.release()
    given, written, call = case()
    def snapshot(t):
        return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()
    before = {{n: snapshot(t) for n, t in given.items()}}
    try:
        call()
        print("returned")
    except RdnaAttentionError as e:
        print(f"{{type(e).__name__}}: {{e}}")
    print("changed:", [n for n, t in given.items() if n not in written and not torch.equal(snapshot(t), before[n])])
"""

# Shared inputs: 2 sequences, 4 query heads, 2 K/V heads, head_dim 64.
_CACHE = """
    q = rnd(2, 1, 4, 64)
    k_cache, v_cache = rnd(2, 64, 2, 64), rnd(2, 64, 2, 64)
    k, v = rnd(2, 1, 2, 64), rnd(2, 1, 2, 64)
"""
_POOL = """
    q = rnd(2, 1, 4, 64)
    pool_k, pool_v = rnd(8, 16, 2, 64), rnd(8, 16, 2, 64)
    k, v = rnd(2, 1, 2, 64), rnd(2, 1, 2, 64)
"""
_PACKED = """
    q = rnd(5, 4, 64)
    pk, pv = rnd(70, 2, 64), rnd(70, 2, 64)
"""

CASES = {
    # seqused_k: the f16 len kernels (with RoPE: query positions below 0 have no table row), and
    # the split-KV kernels (a decode row per K/V head)
    "seqused-k-rope": """
    q, k, v = rnd(2, 4, 8, 64), rnd(2, 4, 32, 64), rnd(2, 4, 32, 64)
    cos, sin = (g(t) for t in rdnattention.rotary_tables(32, 32))
    used = ints(2**31 - 1, -2**31)
    given = dict(q=q, k=k, v=v, cos=cos, sin=sin, used=used)
    call = lambda: flash_attn(q, k, v, rotary_cos=cos, rotary_sin=sin, seqused_k=used, is_causal=True)
""",
    "seqused-k-decode": """
    q, k, v = rnd(2, 4, 1, 64), rnd(2, 2, 300, 64), rnd(2, 2, 300, 64)
    used = ints(10**9, -10**9)
    given = dict(q=q, k=k, v=v, used=used)
    call = lambda: flash_attn(q, k, v, seqused_k=used)
""",
    # cache_seqlens: the append's positions, the tables' rows, the kernels' lengths
    "cache-seqlens-append": _CACHE + """
    lengths = ints(2**31 - 1, -5)
    given, written = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, lengths=lengths), {"k_cache", "v_cache"}
    call = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True)
""",
    "cache-seqlens-rope": _CACHE + """
    cos, sin = (g(t) for t in rdnattention.rotary_tables(20, 32))
    lengths = ints(63, -(2**31))
    given = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, lengths=lengths, cos=cos, sin=sin)
    written = {"k_cache", "v_cache"}
    call = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=lengths, causal=True)
""",
    "cache-seqlens-no-append": _CACHE + """
    lengths = ints(10**6, -10**6)
    given = dict(q=q, k_cache=k_cache, v_cache=v_cache, lengths=lengths)
    call = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
""",
    # cache_batch_idx: the append's rows and the split-KV kernels' cache rows
    "cache-batch-idx-append": _CACHE + """
    idx, lengths = ints(10**9, -(10**9)), ints(10, 20)
    given = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, idx=idx, lengths=lengths)
    written = {"k_cache", "v_cache"}
    call = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, cache_batch_idx=idx)
""",
    "cache-batch-idx": _CACHE + """
    idx, lengths = ints(2, -1), ints(64, 64)
    given = dict(q=q, k_cache=k_cache, v_cache=v_cache, idx=idx, lengths=lengths)
    call = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_batch_idx=idx,
                                           num_splits=3)
""",
    # cache_leftpad: the keys' offsets and counts of the packed call it becomes (below 0, past the
    # lengths, far past the cache), with the append, and with a prefill (the f16 varlen kernels)
    "cache-leftpad-append": _CACHE + """
    leftpad, lengths = ints(-(2**31), 2**31 - 1), ints(10, 2**31 - 1)
    given = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, leftpad=leftpad, lengths=lengths)
    written = {"k_cache", "v_cache"}
    call = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, cache_leftpad=leftpad,
                                           causal=True, return_softmax_lse=True)
""",
    "cache-leftpad-prefill": _CACHE + """
    q = rnd(2, 40, 4, 64)
    leftpad, lengths = ints(64, -7), ints(30, 64)
    given = dict(q=q, k_cache=k_cache, v_cache=v_cache, leftpad=leftpad, lengths=lengths)
    call = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_leftpad=leftpad,
                                           causal=True)
""",
    # block_table: the append's pages and the paged kernels' pages (one past the pool, far past it,
    # below it), with several slices merged
    "block-table-append": _POOL + """
    table, lengths = ints(-1, 10**9, 8, 3, 2**31 - 1, 0, 0, -(2**31)).view(2, 4), ints(20, 50)
    given = dict(q=q, k=k, v=v, pool_k=pool_k, pool_v=pool_v, table=table, lengths=lengths)
    written = {"pool_k", "pool_v"}
    call = lambda: flash_attn_with_kvcache(q, pool_k, pool_v, k, v, cache_seqlens=lengths, block_table=table)
""",
    # the append kernel with RoPE on halves over a paged pool: several new rows and query rows at
    # positions past the tables (bf16, fp16 tables), pages and lengths past the pool both ways
    "block-table-append-rope": """
    q = g(torch.randn(2, 3, 4, 64, generator=gen).bfloat16())
    pool_k, pool_v = (g(torch.randn(8, 16, 2, 64, generator=gen).bfloat16()) for _ in range(2))
    k, v = (g(torch.randn(2, 3, 2, 64, generator=gen).bfloat16()) for _ in range(2))
    cos, sin = (g(t.half()) for t in rdnattention.rotary_tables(5, 16))
    table, lengths = ints(-7, 2**31 - 1, 9, 8, 10**9, 3, -(2**31), 1).view(2, 4), ints(2**31 - 1, -(2**31))
    given = dict(q=q, k=k, v=v, pool_k=pool_k, pool_v=pool_v, table=table, lengths=lengths, cos=cos, sin=sin)
    written = {"pool_k", "pool_v"}
    call = lambda: flash_attn_with_kvcache(q, pool_k, pool_v, k, v, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=lengths, block_table=table, rotary_interleaved=False,
                                           causal=True)
""",
    "cache-batch-idx-append-rope": _CACHE + """
    cos, sin = (g(t) for t in rdnattention.rotary_tables(3, 64))
    idx, lengths = ints(2, -(2**31)), ints(-1, 64)
    given = dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, idx=idx, lengths=lengths, cos=cos, sin=sin)
    written = {"k_cache", "v_cache"}
    call = lambda: flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=lengths, cache_batch_idx=idx)
""",
    "block-table-slices": _POOL + """
    table, lengths = ints(8, 9, 100, -2, 7, -(2**31), 10**6, 8).view(2, 4), ints(64, 64)
    given = dict(q=q, pool_k=pool_k, pool_v=pool_v, table=table, lengths=lengths)
    call = lambda: flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lengths, block_table=table,
                                           num_splits=3, return_softmax_lse=True)
""",
    "block-table-lengths": _POOL + """
    table, lengths = ints(0, 1, 2, 3, 4, 5, 6, 7).view(2, 4), ints(2**31 - 1, -7)
    given = dict(q=q, pool_k=pool_k, pool_v=pool_v, table=table, lengths=lengths)
    call = lambda: flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lengths, block_table=table)
""",
    # cu_seqlens: packed decode (split-KV kernels, several slices merged) and packed prefill (f16 varlen)
    "cu-seqlens-decode": _PACKED + """
    cu_q, cu_k = ints(0, 10**9, 5), ints(0, 40, 2**31 - 1)
    given = dict(q=q, pk=pk, pv=pv, cu_q=cu_q, cu_k=cu_k)
    call = lambda: varlen_attn(q, pk, pv, cu_q, cu_k, 4, 40, enable_gqa=True, num_splits=3)
""",
    "cu-seqlens-negative-decreasing": _PACKED + """
    cu_q, cu_k = ints(-3, 1, 5), ints(-50, 30, 20)
    given = dict(q=q, pk=pk, pv=pv, cu_q=cu_q, cu_k=cu_k)
    call = lambda: varlen_attn(q, pk, pv, cu_q, cu_k, 4, 40, enable_gqa=True)
""",
    "cu-seqlens-prefill": """
    q, pk, pv = rnd(100, 2, 64), rnd(120, 2, 64), rnd(120, 2, 64)
    cu_q, cu_k = ints(5, 1, 10**6), ints(-100, 50, 2**31 - 1)
    given = dict(q=q, pk=pk, pv=pv, cu_q=cu_q, cu_k=cu_k)
    call = lambda: flash_attn_varlen_func(q, pk, pv, cu_q, cu_k, 64, 64, causal=True, return_attn_probs=True)
""",
    # the backward of packed sequences (each pass moves its arguments to a sequence's clamped
    # offsets): offsets below 0 and past the rows, decreasing, and a sequence longer than the
    # longest the call names; the atomic passes (the host's default) and the deterministic ones
    "cu-seqlens-backward": """
    q, pk, pv, dout = rnd(100, 2, 64), rnd(120, 2, 64), rnd(120, 2, 64), rnd(100, 2, 64)
    cu_q, cu_k = ints(5, 1, 10**6), ints(-100, 50, 2**31 - 1)
    for t in (q, pk, pv):
        t.requires_grad_()
    given = dict(q=q, pk=pk, pv=pv, cu_q=cu_q, cu_k=cu_k, dout=dout)
    call = lambda: flash_attn_varlen_func(q, pk, pv, cu_q, cu_k, 64, 64, causal=True).backward(dout)
""",
    "cu-seqlens-backward-deterministic": """
    q, pk, pv, dout = rnd(100, 2, 64), rnd(120, 2, 64), rnd(120, 2, 64), rnd(100, 2, 64)
    cu_q, cu_k = ints(0, 90, 100), ints(0, 2**31 - 1, 3)
    for t in (q, pk, pv):
        t.requires_grad_()
    given = dict(q=q, pk=pk, pv=pv, cu_q=cu_q, cu_k=cu_k, dout=dout)
    call = lambda: flash_attn_varlen_func(q, pk, pv, cu_q, cu_k, 64, 64, window_size=(7, 3),
                                          deterministic=True).backward(dout)
""",
    "varlen-seqused-k": _PACKED + """
    cu_q, cu_k, used = ints(0, 1, 5), ints(0, 30, 70), ints(31, 10**9)
    given = dict(q=q, pk=pk, pv=pv, cu_q=cu_q, cu_k=cu_k, used=used)
    call = lambda: varlen_attn(q, pk, pv, cu_q, cu_k, 4, 64, enable_gqa=True, seqused_k=used)
""",
    "varlen-block-table": """
    q, pool_k, pool_v = rnd(5, 4, 64), rnd(8, 16, 2, 64), rnd(8, 16, 2, 64)
    cu_q, table, used = ints(0, 1, 5), ints(9, -1, 2**31 - 1, 3, 0, 10**5, 8, 8).view(2, 4), ints(64, -64)
    given = dict(q=q, pool_k=pool_k, pool_v=pool_v, cu_q=cu_q, table=table, used=used)
    call = lambda: varlen_attn(q, pool_k, pool_v, cu_q, None, 4, 64, enable_gqa=True, seqused_k=used,
                               block_table=table)
""",
    "varlen-func-paged-cu-k": """
    q, pool_k, pool_v = rnd(2, 4, 64), rnd(8, 16, 2, 64), rnd(8, 16, 2, 64)
    cu_q, cu_k, table = ints(0, 1, 2), ints(0, 2**31 - 1, -5), ints(0, 1, 2, 3, 4, 5, 6, 7).view(2, 4)
    given = dict(q=q, pool_k=pool_k, pool_v=pool_v, cu_q=cu_q, cu_k=cu_k, table=table)
    call = lambda: flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, 1, 64, block_table=table)
""",
    # INT8 scales: no address depends on them; zero, negative, NaN and infinite ones compute nonsense
    "int8-scales": """
    q8, k8, v8 = (g(torch.randint(-127, 128, (1, 2, n, 64), generator=gen, dtype=torch.int8)) for n in (16, 40, 40))
    qs, ks = g(torch.full((1, 2, 16), float("nan"))), g(torch.full((1, 2, 40), -1.0))
    vs = g(torch.tensor([0.0, float("inf")]).repeat(64).view(1, 2, 64))
    given = dict(q8=q8, k8=k8, v8=v8, qs=qs, ks=ks, vs=vs)
    call = lambda: flash_attn_int8qk(q8, k8, v8, qs, ks, vs, is_causal=True)
""",
}


def _run(setup: str) -> subprocess.CompletedProcess:
    code = _CODE.format(tests=str(TESTS), setup=textwrap.indent(textwrap.dedent(setup).strip(), "    "))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=300,
                          env={**os.environ, "RDNATTENTION_CHECK": "0", "RDNATTENTION_HOST_THREADS": "2"})


@pytest.mark.parametrize("setup", list(CASES.values()), ids=list(CASES))
def test_values_that_are_not_read_are_bounded_by_the_kernels(host_build, setup):
    out = _run(setup)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.split("\n")[:4] == ["returned", "changed: []", "returned", "changed: []"], out.stdout


def test_the_guards_fault_on_a_read_one_byte_past_a_tensor():
    out = _run("""
    import ctypes
    t = rnd(1, 2, 16, 64)
    given = dict(t=t)
    call = lambda: ctypes.string_at(t.data_ptr() + t.numel() * t.element_size(), 1)
""")
    assert out.returncode < 0 and "returned" not in out.stdout, out.stdout + out.stderr[-2000:]


def test_small_valid_lengths_with_rope_read_no_table_row_below_0(host_build):
    """seqused_k below seq_q puts the first queries before key 0: they have no table row, and are
    left unrotated (they see no key under a causal mask) rather than read before the tables."""
    out = _run("""
    q, k, v = rnd(2, 4, 8, 64), rnd(2, 4, 32, 64), rnd(2, 4, 32, 64)
    cos, sin = (g(t) for t in rdnattention.rotary_tables(32, 32))
    used = ints(0, 3)
    given = dict(q=q, k=k, v=v, cos=cos, sin=sin, used=used)
    call = lambda: flash_attn(q, k, v, rotary_cos=cos, rotary_sin=sin, seqused_k=used, is_causal=True)
""")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.split("\n")[:4] == ["returned", "changed: []", "returned", "changed: []"], out.stdout


# --- RDNATTENTION_CHECK --------------------------------------------------------------------------

@pytest.fixture()
def check_mode(monkeypatch):
    def set_mode(value: str | None):
        if value is None:
            monkeypatch.delenv(checks.CHECK_ENV, raising=False)
        else:
            monkeypatch.setenv(checks.CHECK_ENV, value)
        monkeypatch.setattr(checks, "_mode", None)
    yield set_mode
    monkeypatch.setattr(checks, "_mode", None)


@pytest.mark.parametrize("value, mode, cpu, other", [(None, "auto", True, False), ("", "auto", True, False),
                                                     ("1", "always", True, True), ("0", "never", False, False)])
def test_which_values_each_mode_reads(check_mode, value, mode, cpu, other):
    check_mode(value)
    assert checks.check_mode() == mode
    assert checks.reads(torch.zeros(1)) is cpu
    assert checks.reads(torch.zeros(1, device="meta")) is other  # a device that is not the CPU


def test_a_bad_check_mode_is_a_typed_error(check_mode):
    check_mode("yes")
    with pytest.raises(InvalidArgumentError, match="RDNATTENTION_CHECK='yes' must be 1 .*, 0 .* or unset"):
        checks.check_mode()


def _kv_call():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 1, 4, 64, generator=g).half()
    k_cache, v_cache = (torch.randn(2, 64, 2, 64, generator=g).half() for _ in range(2))
    k, v = (torch.randn(2, 1, 2, 64, generator=g).half() for _ in range(2))
    return q, k_cache, v_cache, k, v


@pytest.mark.parametrize("mode", ["0", "1"])
def test_a_bad_value_is_refused_where_it_is_read_and_bounded_where_it_is_not(host_build, check_mode, mode):
    check_mode(mode)
    q, k_cache, v_cache, k, v = _kv_call()
    lengths = torch.tensor([64, 3], dtype=torch.int32)  # no room for the new key in sequence 0
    if mode == "1":
        with pytest.raises(InvalidArgumentError,
                           match=r"cache_seqlens \+ seq_new \(1\) must lie in \[0, cache_len = 64\]"):
            flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths)
    else:
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths)
        assert out.shape == q.shape and torch.equal(k_cache[0, 63], k[0, 0])  # written at the last row there is


@pytest.mark.parametrize("paged, rope, idx", [(False, False, False), (False, True, False), (False, False, True),
                                             (True, False, False), (True, True, False)])
def test_valid_calls_give_the_same_results_whether_values_are_read_or_not(host_build, check_mode, paged, rope, idx):
    """The device-side bounds change nothing for valid values: results and caches are identical."""
    results = []
    for mode in ("1", "0"):
        check_mode(mode)
        q, k_cache, v_cache, k, v = _kv_call()
        kw = dict(cache_seqlens=torch.tensor([10, 40], dtype=torch.int32), causal=True, return_softmax_lse=True)
        if paged:
            k_cache, v_cache = k_cache.view(8, 16, 2, 64), v_cache.view(8, 16, 2, 64)
            kw["block_table"] = torch.tensor([[7, 0, 5, 2], [1, 6, 3, 4]], dtype=torch.int32)
        if idx:
            kw["cache_batch_idx"] = torch.tensor([1, 0], dtype=torch.int32)
        if rope:
            kw["rotary_cos"], kw["rotary_sin"] = rdnattention.rotary_tables(64, 32)
        for _ in range(2):  # planned, then replayed
            out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
        results.append((out, lse, k_cache, v_cache))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    used = torch.tensor([[1, 5, 7], [2, 3, 4]], dtype=torch.int32)  # and flash_attn's seqused_k alike
    q = torch.randn(3, 2, 4, 64).half()
    kk = torch.randn(3, 2, 16, 64).half()
    check_mode("0")
    unread = flash_attn(q, kk, kk, seqused_k=used[0])
    check_mode("1")
    assert torch.equal(unread, flash_attn(q, kk, kk, seqused_k=used[0]))
