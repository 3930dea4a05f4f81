"""Host cost per call of every entry point and path, each beside torch's scaled_dot_product_attention
on the same shapes (GQA through enable_gqa, token-major tensors as their [batch, heads, seq,
head_dim] views, packed batches as the padded batch, caches as their used keys).

    python -m tuning.overhead                  # a GPU if there is one, then the CPU
    python -m tuning.overhead --device cpu     # the CPU alone: the emulator's launch stubbed
    python -m tuning.overhead --device cuda --only decode
    python -m tuning.overhead --device cpu --profile kvcache.paged.append
    python -m tuning.overhead --device cuda --only kvcache --unfused   # the append in its own launch
    python -m tuning.overhead --device cuda --only kvcache --kernel-time  # and the GPU's time per call

Two figures per call:
- back-to-back: wall time per call of a loop of calls with one synchronisation at the end (the
  least over rounds): the host's cost once it exceeds the kernels', else the kernels'.
- one call: wall time of one call and a synchronisation, the GPU idle before it (median over
  calls): what a step that waits for its result pays.
- with ``--cold``, a call made after the processor's caches were emptied (timing.Evictor), the
  host's cost alone (until the call returns; median over 200 calls): what a call pays between a
  model's other operations, as in generate(), where everything a call reads has to be fetched
  again. A loop of calls keeps it all in the caches.
- with ``--host`` (a GPU), the host's cost per call with warm caches: the wall clock until 100
  calls made back to back have returned, the GPU not waited for (issue_us), the least of 5 loops.
  Where the kernels are longer than the host's work, back-to-back measures them; this measures
  the host's work alone, ours against torch's.
- with ``--kernel-time`` (a GPU), the GPU's time per call: every kernel the calls ran (ours,
  launched through the driver, included), summed by torch.profiler's CUDA activity, over 50 calls.
  Where the back-to-back figure is close to it, the GPU bounds it and the host's cost is hidden.

On the CPU the host emulator's launch is replaced by a no-op (``stubbed_launch``), split-KV calls
are planned for a GPU of ``--units`` compute units (the H200's 132) and torch runs its ops on one
thread, so our figures are the Python around the launches a GPU gets (validation, planning,
argument packing, allocation; the append kernel's launch is stubbed like the others, and where
no append kernel is built, the torch operations of the append); torch's CPU figures run
the math, so they are shown for reference only. ``--check`` sets RDNATTENTION_CHECK for the run
(docs/api.md: which checks read values): unset, CPU tensors' values are read (free of a device
synchronisation there) and GPU tensors' are not; ``--check 0`` makes the CPU path the GPU's."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .timing import Evictor, cold_us, host_us, issue_us, kernel_us, one_call_us


@dataclass(frozen=True)
class Case:
    """One path of one entry point: ``build(device)`` makes the inputs and returns (ours, sdpa), two
    closures that each run one call."""

    name: str
    call: str  # the entry point and what it is given, for the table
    build: Callable[[torch.device], tuple[Callable[[], object], Callable[[], object]]]
    patched: bool = False  # ours is torch's function, timed inside rdnattention.sdpa_patched() (torch's outside)


H, HKV, D = 32, 8, 128
KEYS = 8192
PREFILL = 128


def _randn(*shape, device, dtype=torch.float16):
    return torch.randn(*shape, device=device, dtype=dtype)


def _sdpa(q, k, v, **kw):
    """torch's sdpa on [batch, heads, seq, head_dim] views; GQA through enable_gqa."""
    gqa = q.shape[1] != k.shape[1]
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kw)


def _flash_attn(rows: int, heads_kv: int, keys: int, causal: bool = False):
    def build(device):
        import rdnattention
        q = _randn(1, H, rows, D, device=device)
        k, v = (_randn(1, heads_kv, keys, D, device=device) for _ in range(2))
        return (lambda: rdnattention.flash_attn(q, k, v, is_causal=causal)), _sdpa(q, k, v, is_causal=causal)
    return build


def _flash_attn_func(rows: int, heads_kv: int, keys: int, causal: bool = False):
    def build(device):
        import rdnattention
        q = _randn(1, rows, H, D, device=device)
        k, v = (_randn(1, keys, heads_kv, D, device=device) for _ in range(2))
        ours = lambda: rdnattention.flash_attn_func(q, k, v, causal=causal)  # noqa: E731
        return ours, _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return build


def _sdpa_entry(rows: int, keys: int, causal: bool, patched: bool = False):
    """rdnattention.scaled_dot_product_attention, or (``patched``) torch's function as programs call it,
    which the case times inside sdpa_patched() (Case.patched)."""
    def build(device):
        import rdnattention
        q = _randn(1, H, rows, D, device=device)
        k, v = (_randn(1, HKV, keys, D, device=device) for _ in range(2))
        def ours():
            if patched:  # looked up per call, as a program's call finds it: the patched function while timed
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            return rdnattention.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return ours, _sdpa(q, k, v, is_causal=causal)
    return build


PAGE = 256


def _kvcache(*, rows: int = 1, paged: bool = False, append: bool = False, rope: bool = False, batch: int = 1):
    """flash_attn_with_kvcache on a cache of KEYS positions, KEYS - 1 of them used (the new key,
    where appended, fills the last), GQA H / HKV, token-major."""
    def build(device):
        import rdnattention
        used = KEYS - rows if append else KEYS
        q = _randn(batch, rows, H, D, device=device)
        if paged:
            per = KEYS // PAGE
            k_cache, v_cache = (_randn(batch * per, PAGE, HKV, D, device=device) for _ in range(2))
            table = torch.arange(batch * per, device=device, dtype=torch.int32).view(batch, per)
        else:
            k_cache, v_cache = (_randn(batch, KEYS, HKV, D, device=device) for _ in range(2))
            table = None
        lengths = torch.full((batch,), used, dtype=torch.int32, device=device)
        kw = dict(cache_seqlens=lengths, block_table=table, causal=True)
        if append:
            kw.update(k=_randn(batch, rows, HKV, D, device=device), v=_randn(batch, rows, HKV, D, device=device))
        if rope:
            cos, sin = rdnattention.rotary_tables(KEYS, D, device=device)
            kw.update(rotary_cos=cos, rotary_sin=sin)
        ours = lambda: rdnattention.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)  # noqa: E731
        kt, vt = (_randn(batch, HKV, KEYS, D, device=device) for _ in range(2))
        return ours, _sdpa(q.transpose(1, 2), kt, vt, is_causal=False)
    return build


def _varlen(entry: str, rows: int, keys: int, batch: int = 4):
    """A packed batch of ``batch`` sequences of ``rows`` queries and ``keys`` keys each, GQA, causal."""
    def build(device):
        import rdnattention
        q = _randn(batch * rows, H, D, device=device)
        k, v = (_randn(batch * keys, HKV, D, device=device) for _ in range(2))
        cu_q = torch.arange(0, batch * rows + 1, rows, dtype=torch.int32, device=device)
        cu_k = torch.arange(0, batch * keys + 1, keys, dtype=torch.int32, device=device)
        if entry == "varlen_attn":
            ours = lambda: rdnattention.varlen_attn(q, k, v, cu_q, cu_k, rows, keys, window_size=(-1, 0),  # noqa: E731
                                                    enable_gqa=True)
        else:
            ours = lambda: rdnattention.flash_attn_varlen_func(q, k, v, cu_q, cu_k, rows, keys,  # noqa: E731
                                                               causal=True)
        qp = _randn(batch, H, rows, D, device=device)
        kp, vp = (_randn(batch, HKV, keys, D, device=device) for _ in range(2))
        return ours, _sdpa(qp, kp, vp, is_causal=rows > 1 and rows == keys)
    return build


def _int8(rows: int, keys: int, quantized: bool = False):
    def build(device):
        import rdnattention
        q = _randn(1, H, rows, D, device=device)
        k, v = (_randn(1, HKV, keys, D, device=device) for _ in range(2))
        if quantized:
            ours = lambda: rdnattention.flash_attn_int8qk_quantized(q, k, v)  # noqa: E731
        else:
            (q8, qs), (k8, ks) = rdnattention.quantize_per_token(q), rdnattention.quantize_per_token(k)
            v8, vs = rdnattention.quantize_per_channel(v)
            ours = lambda: rdnattention.flash_attn_int8qk(q8, k8, v8, qs, ks, vs)  # noqa: E731
        return ours, _sdpa(q, k, v)
    return build


class _Module:
    """What transformers' attention functions read of the attention module."""
    is_causal = True
    training = False
    num_key_value_groups = H // HKV


GROWN = 8192  # distinct cache lengths a growing case cycles through: more than one figure's calls


def _transformers(keys: int, growing: bool, layers: int = 1):
    """transformers' attention function (``attn_implementation="rdnattention"``) beside its own sdpa
    attention, one decode step of a Llama layer (no mask, GQA H / HKV): on a cache of ``keys`` keys,
    or (``growing``) one that holds one key more every ``layers`` calls, as DynamicCache's does
    during generate() (each layer's cache one key longer per step; one layer: each call a new length)."""
    def build(device):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        import rdnattention.integrations.transformers as rt
        q = _randn(1, H, 1, D, device=device)
        most = keys + (GROWN if growing else 0)
        kb, vb = (_randn(HKV * most * D, device=device) for _ in range(2))
        # contiguous K/V of each length (views of one buffer), as DynamicCache's cat leaves them; made
        # here, so that the figures are the attention functions' alone
        caches = [(kb[:HKV * n * D].view(1, HKV, n, D), vb[:HKV * n * D].view(1, HKV, n, D))
                  for n in ([keys + i for i in range(GROWN)] if growing else [keys])]
        at, module = [0], _Module()

        def call(fn):
            def run():
                k, v = caches[at[0] // layers % len(caches)]
                at[0] += 1
                return fn(module, q, k, v, None, scaling=D ** -0.5)
            return run
        return call(rt.attention_forward), call(sdpa_attention_forward)
    return build


CASES = (
    Case("prefill", f"flash_attn q [1,{H},{PREFILL},{D}] k/v [1,{HKV},{PREFILL},{D}] causal",
         _flash_attn(PREFILL, HKV, PREFILL, causal=True)),
    Case("decode.mha.1", f"flash_attn q [1,{H},1,{D}] k/v [1,{H},{KEYS},{D}]", _flash_attn(1, H, KEYS)),
    Case("decode.mha.4", f"flash_attn q [1,{H},4,{D}] k/v [1,{H},{KEYS},{D}]", _flash_attn(4, H, KEYS)),
    Case("decode.gqa.1", f"flash_attn q [1,{H},1,{D}] k/v [1,{HKV},{KEYS},{D}]", _flash_attn(1, HKV, KEYS)),
    Case("decode.gqa.4", f"flash_attn q [1,{H},4,{D}] k/v [1,{HKV},{KEYS},{D}]", _flash_attn(4, HKV, KEYS)),
    Case("decode.gqa.short", f"flash_attn q [1,{H},1,{D}] k/v [1,{HKV},64,{D}]", _flash_attn(1, HKV, 64)),
    Case("func.prefill", f"flash_attn_func q [1,{PREFILL},{H},{D}] k/v [1,{PREFILL},{HKV},{D}] causal",
         _flash_attn_func(PREFILL, HKV, PREFILL, causal=True)),
    Case("func.decode", f"flash_attn_func q [1,1,{H},{D}] k/v [1,{KEYS},{HKV},{D}]", _flash_attn_func(1, HKV, KEYS)),
    Case("kvcache.contiguous", f"flash_attn_with_kvcache q [1,1,{H},{D}] cache [1,{KEYS},{HKV},{D}] cache_seqlens",
         _kvcache()),
    Case("kvcache.contiguous.append", "the same, appending k/v [1,1,8,128]", _kvcache(append=True)),
    Case("kvcache.contiguous.rope", "the same, appending, RoPE tables", _kvcache(append=True, rope=True)),
    Case("kvcache.paged", f"flash_attn_with_kvcache q [1,1,{H},{D}] pool [{KEYS // PAGE},{PAGE},{HKV},{D}] "
                          "block_table", _kvcache(paged=True)),
    Case("kvcache.paged.append", "the same, appending k/v [1,1,8,128]", _kvcache(paged=True, append=True)),
    Case("kvcache.paged.rope", "the same, appending, RoPE tables", _kvcache(paged=True, append=True, rope=True)),
    Case("kvcache.batch8.append", f"flash_attn_with_kvcache q [8,1,{H},{D}] cache [8,{KEYS},{HKV},{D}], appending",
         _kvcache(append=True, batch=8)),
    Case("varlen.prefill", f"varlen_attn 4 x {PREFILL} queries and keys, causal", _varlen("varlen_attn", PREFILL,
                                                                                          PREFILL)),
    Case("varlen.decode", "varlen_attn 4 x 1 query, 4 x 2048 keys", _varlen("varlen_attn", 1, 2048)),
    Case("varlen_func.prefill", f"flash_attn_varlen_func 4 x {PREFILL}, causal",
         _varlen("flash_attn_varlen_func", PREFILL, PREFILL)),
    Case("varlen_func.decode", "flash_attn_varlen_func 4 x 1 query, 4 x 2048 keys",
         _varlen("flash_attn_varlen_func", 1, 2048)),
    Case("int8.prefill", f"flash_attn_int8qk q [1,{H},{PREFILL},{D}] k/v [1,{HKV},{PREFILL},{D}]",
         _int8(PREFILL, PREFILL)),
    Case("int8.decode", f"flash_attn_int8qk q [1,{H},1,{D}] k/v [1,{HKV},{KEYS},{D}]", _int8(1, KEYS)),
    Case("int8.quantized", f"flash_attn_int8qk_quantized q [1,{H},{PREFILL},{D}] (quantizes q, k, v)",
         _int8(PREFILL, PREFILL, quantized=True)),
    Case("sdpa.prefill", f"scaled_dot_product_attention q [1,{H},{PREFILL},{D}] enable_gqa, causal",
         _sdpa_entry(PREFILL, PREFILL, True)),
    Case("sdpa.decode", f"scaled_dot_product_attention q [1,{H},1,{D}] k/v [1,{HKV},{KEYS},{D}] enable_gqa",
         _sdpa_entry(1, KEYS, False)),
    Case("sdpa.patched.prefill", f"torch's scaled_dot_product_attention inside sdpa_patched(), q [1,{H},{PREFILL},{D}] "
                                 "enable_gqa, causal", _sdpa_entry(PREFILL, PREFILL, causal=True, patched=True),
         patched=True),
    Case("sdpa.patched.decode", f"the same, q [1,{H},1,{D}] k/v [1,{HKV},{KEYS},{D}]",
         _sdpa_entry(1, KEYS, causal=False, patched=True), patched=True),
    Case("transformers.decode", f"transformers' attention function, q [1,{H},1,{D}] k/v [1,{HKV},2048,{D}] "
                                "(beside its sdpa_attention_forward)", _transformers(2048, growing=False)),
    Case("transformers.decode.growing", "the same, the cache one key longer at every call (DynamicCache in "
                                        "generate())", _transformers(2048, growing=True)),
    Case("transformers.decode.step", "the same, 16 calls per length: a step of a 16-layer model, per layer",
         _transformers(2048, growing=True, layers=16)),
)


@contextlib.contextmanager
def stubbed_launch(units: int):
    """The host emulator's launches replaced by a no-op (every launch of the runtime goes through
    drivers.host.launch_kernel), and split-KV calls planned for a device of ``units`` compute units,
    so that they take the launches and scratch they take on such a GPU."""
    from rdnattention.drivers import host
    from rdnattention.families import _splitkv
    launch, count, threads = host.launch_kernel, _splitkv.units, torch.get_num_threads()
    host.launch_kernel = lambda *a, **kw: None
    _splitkv.units = lambda device: units
    torch.set_num_threads(1)  # torch's own ops on one thread: a thread pool's start-up is not the host's cost
    try:
        yield
    finally:
        host.launch_kernel, _splitkv.units = launch, count
        torch.set_num_threads(threads)


def machine_unit_ns(calls: int = 100_000, rounds: int = 7) -> float:
    """What one tensor's replay key costs this machine's Python (its shape, strides, dtype and device
    read into a tuple), least over ``rounds``: the unit most of a replayed call is made of, printed
    with every table so that figures taken on machines of different speeds can be compared."""
    import timeit
    t = torch.empty(2, 3, 4, 5, dtype=torch.float16)
    return min(timeit.repeat(lambda: (t.shape, t.stride(), t.dtype, t.device), number=calls, repeat=rounds)) / calls * 1e9


def back_to_back_us(fn, sync, budget_s: float, rounds: int = 7) -> float:
    """The least over ``rounds`` of timing.host_us (a loop of calls, one ``sync()`` at the end), each
    loop about ``budget_s / rounds`` long: the round the machine's other work disturbed least."""
    once = one_call_us(fn, sync, reps=3, warmup=2) * 1e-6
    calls = max(3, min(5000, int(budget_s / rounds / max(once, 1e-6))))
    return min(host_us(fn, calls, sync, warmup=2) for _ in range(rounds))


def one_call(fn, sync, budget_s: float) -> float:
    """timing.one_call_us with as many calls as fit ``budget_s`` (5 to 500)."""
    once = one_call_us(fn, sync, reps=3, warmup=2) * 1e-6
    return one_call_us(fn, sync, reps=max(5, min(500, int(budget_s / max(once, 1e-6)))), warmup=0)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def measure(cases, device: torch.device, budget_s: float, units: int, kernel_time: bool = False,
            cold: bool = False, host: bool = False) -> list[dict]:
    """Each case's four figures on ``device`` (on the CPU: ours with the launch stubbed), with
    ``kernel_time`` on a GPU each one's GPU time per call (kernel_us), with ``cold`` each one's host
    time after the caches were emptied (cold_us), with ``host`` on a GPU each one's host time with
    warm caches, the GPU not waited for (issue_us)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    evict = Evictor() if cold else None
    rows = []
    for case in cases:
        with torch.inference_mode():
            try:
                ours, sdpa = case.build(device)
            except Exception as e:  # noqa: BLE001 - a path this build or device lacks is reported, not fatal
                rows.append(dict(case=case, error=f"{type(e).__name__}: {str(e)[:120]}"))
                continue
            stub = stubbed_launch(units) if device.type == "cpu" else contextlib.nullcontext()

            try:
                with stub, _patch(case, device):
                    ours_b2b = back_to_back_us(ours, sync, budget_s)
                    ours_one = one_call(ours, sync, budget_s / 2)
                    ours_cold = cold_us(ours, sync, evict) if cold else None
            except Exception as e:  # noqa: BLE001
                rows.append(dict(case=case, error=f"{type(e).__name__}: {str(e)[:120]}"))
                continue
            sdpa_b2b = back_to_back_us(sdpa, sync, budget_s, rounds=3)
            sdpa_one = one_call(sdpa, sync, budget_s / 2)
            row = dict(case=case, ours_b2b=ours_b2b, ours_one=ours_one, sdpa_b2b=sdpa_b2b, sdpa_one=sdpa_one)
            if cold:
                row["ours_cold"], row["sdpa_cold"] = ours_cold, cold_us(sdpa, sync, evict)
            if host and device.type == "cuda":
                with _patch(case, device):
                    row["ours_host"] = issue_us(ours, 100, sync)
                row["sdpa_host"] = issue_us(sdpa, 100, sync)
            if kernel_time and device.type == "cuda":
                with _patch(case, device):
                    row["ours_gpu"] = kernel_us(ours)
                row["sdpa_gpu"] = kernel_us(sdpa)
        rows.append(row)
        del ours, sdpa
    return rows


def table(rows: list[dict], device: torch.device) -> str:
    cpu = device.type == "cpu"
    gpu_time = any("ours_gpu" in r for r in rows)
    cold = any("ours_cold" in r for r in rows)
    host = any("ours_host" in r for r in rows)
    ours = "ours, launch stubbed" if cpu else "ours"
    sdpa = "torch sdpa (runs the math)" if cpu else "torch sdpa"
    extra = ((" ours: GPU us | sdpa: GPU us |" if gpu_time else "")
             + (" ours: cold us | sdpa: cold us | cold ratio |" if cold else "")
             + (" ours: host us | sdpa: host us | host ratio |" if host else ""))
    more = 2 * gpu_time + 3 * cold + 3 * host
    lines = [f"| path | call | {ours}: back-to-back us | one call us | {sdpa}: back-to-back us | one call us | "
             "back-to-back ratio | one-call ratio |" + extra, "|---|---|---|---|---|---|---|---|" + "---|" * more]
    for r in rows:
        case = r["case"]
        if "error" in r:
            lines.append(f"| {case.name} | {case.call} | {r['error']} | | | | | |" + " |" * more)
            continue
        ratios = ("-", "-") if cpu else (_ratio(r["ours_b2b"], r["sdpa_b2b"]), _ratio(r["ours_one"], r["sdpa_one"]))
        gpu = f" {_fmt(r.get('ours_gpu'))} | {_fmt(r.get('sdpa_gpu'))} |" if gpu_time else ""
        if cold:
            gpu += (f" {_fmt(r.get('ours_cold'))} | {_fmt(r.get('sdpa_cold'))} | "
                    f"{'-' if cpu else _ratio(r.get('ours_cold'), r.get('sdpa_cold'))} |")
        if host:
            gpu += (f" {_fmt(r.get('ours_host'))} | {_fmt(r.get('sdpa_host'))} | "
                    f"{_ratio(r.get('ours_host'), r.get('sdpa_host'))} |")
        lines.append(f"| {case.name} | {case.call} | {_fmt(r['ours_b2b'])} | {_fmt(r['ours_one'])} | "
                     f"{_fmt(r['sdpa_b2b'])} | {_fmt(r['sdpa_one'])} | {ratios[0]} | {ratios[1]} |" + gpu)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu", "all"), default="all",
                   help="cuda: the GPU; cpu: the host emulator with its launch stubbed; all (default): both, the "
                        "GPU where there is one")
    p.add_argument("--only", default="", help="comma-separated prefixes of the case names to run")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of calls per figure (default 1)")
    p.add_argument("--check", choices=("default", "0", "1"), default="default",
                   help="RDNATTENTION_CHECK for the run: default leaves it as the environment has it")
    p.add_argument("--units", type=int, default=132,
                   help="on the CPU, plan split-KV calls for a GPU of this many compute units (default 132, the "
                        "H200's), so that they take the launches they take there")
    p.add_argument("--profile", metavar="CASE", help="instead of the table: cProfile of CASE's calls on --device")
    p.add_argument("--unfused", action="store_true",
                   help="flash_attn_with_kvcache's append in its own launch before the attention's, never in the "
                        "split-KV decode's (kvcache.FUSE_MAX_NEW = 0): the calls as they ran before the fusion")
    p.add_argument("--cold", action="store_true",
                   help="three more columns: ours' and torch's host time per call made after the processor's caches "
                        "were emptied (timing.Evictor), and their ratio")
    p.add_argument("--host", action="store_true",
                   help="on a GPU, also each call's host time with warm caches, the GPU not waited for")
    p.add_argument("--kernel-time", action="store_true",
                   help="on cuda: two more columns, ours' and torch's GPU time per call (torch.profiler)")
    args = p.parse_args(argv)
    if args.check != "default":
        os.environ["RDNATTENTION_CHECK"] = args.check
    if args.unfused:
        from rdnattention import kvcache
        kvcache.FUSE_MAX_NEW = 0

    prefixes = [s for s in args.only.split(",") if s]
    cases = [c for c in CASES if not prefixes or any(c.name.startswith(s) for s in prefixes)]
    devices = []
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    elif args.device == "cuda":
        print("no CUDA device", file=sys.stderr)
        return 1
    if args.device in ("cpu", "all"):
        devices.append(torch.device("cpu"))
    if args.profile:
        return _profile(next(c for c in CASES if c.name == args.profile), devices[0], args.units)
    print(f"torch {torch.__version__}, RDNATTENTION_CHECK={os.environ.get('RDNATTENTION_CHECK', '(unset)')}, "
          f"this machine's unit: {machine_unit_ns():.0f} ns")
    for device in devices:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (host emulator, launch stubbed)"
        print(f"\n{name}\n")
        print(table(measure(cases, device, args.budget, args.units, args.kernel_time, args.cold, args.host), device))
    return 0


def _patch(case: Case, device: torch.device):
    """The context a case's calls of ours run in: sdpa_patched() for the cases that time torch's
    function as programs call it, else none (a context manager per use: a generator's is entered once)."""
    if not case.patched:
        return contextlib.nullcontext()
    import rdnattention
    return rdnattention.sdpa_patched(devices=device.type, strict=True)


def _profile(case: Case, device: torch.device, units: int) -> int:
    import cProfile
    import pstats
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        ours, _ = case.build(device)
        stub = stubbed_launch(units) if device.type == "cpu" else contextlib.nullcontext()
        with stub, _patch(case, device):
            for _ in range(10):
                ours()
            sync()
            profile = cProfile.Profile()
            profile.runcall(lambda: [ours() for _ in range(2000)])
            sync()
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
