"""Instructions a gfx1100 kernel executes, counted on the RDNA3 ISA emulator (tests/amd_emulator.py).

No AMD GPU is available to time the AMD kernels; what their machine code executes can be counted.
Each kernel named (a prefix of its name is enough) runs one causal call, forced by name, through
the runtime and the HIP driver as tests/kernels/test_amd_emulator.py runs it: GQA with two K/V
heads, 77 keys, 80 query rows per K/V head for the row-block kernels, as many as the tile takes
for the decode kernels (three key slices). Per kernel it prints the instruction words executed by
all waves (a dual-issue word counts once), those of the VALU (V_*), the pair products (V_DOT2*),
the FMAs and the LDS accesses (DS_*), and the largest error against the float64 oracle.

    RDNATTENTION_TINYGRAD=../shared/third_party/tinygrad python -m tuning.amd_counts \\
        fa2_f16_bf16_hd64_g2_ fa2_dec_bf16_hd128_g1_br4_ [--build-dir build]
    RDNATTENTION_TINYGRAD=... python -m tuning.amd_counts fa2_f16_xf_hd64_g2_ --score softcap --rows 256 --keys 256
    RDNATTENTION_TINYGRAD=... python -m tuning.amd_counts fa2_bwd_hd128_ fa2_bwdatomic_hd128_ --rows 128 --keys 128

A backward kernel (the dK/dV pass: fa2_bwd_, or the atomic one: fa2_bwdatomic_) runs with the other
passes of its set (preprocess and dQ, or preprocess and dqcast), all counted; its error is the
largest of dQ's, dK's and dV's against the float64 oracle's, relative to each one's largest value.

To compare two revisions, run it in each checkout (each with its own build) on the same prefixes.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import amd_emulator  # noqa: E402 (tests/amd_emulator.py)

from rdnattention import attention_gradients, attention_reference, ops, plan_flash_attn, route  # noqa: E402
from rdnattention.families import bwd, dec  # noqa: E402
from rdnattention_gen import DEFAULT_VARIANTS  # noqa: E402
from rdnattention_gen.families import spec_from_name  # noqa: E402
from rdnattention_gen.matrix import load_matrix  # noqa: E402

TARGET = "gfx1100"


def serve_on_emulator(mp: pytest.MonkeyPatch, build_dir: Path):
    """CPU tensors served as on a gfx1100 GPU (amd_emulator.serve_as_gpu, as the emulator tests
    run them). Returns the emulator module and the matrix."""
    snapshot = amd_emulator.snapshot()
    if snapshot is None:
        raise SystemExit(f"the RDNA3 emulator is absent: set {amd_emulator.SNAPSHOT_ENV} to a tinygrad source tree "
                         f"holding {amd_emulator.EMULATOR}")
    matrix = load_matrix(DEFAULT_VARIANTS)
    emu, _ = amd_emulator.serve_as_gpu(mp, matrix, build_dir, snapshot, TARGET)
    return emu, matrix


def counted(mp: pytest.MonkeyPatch, emu) -> collections.Counter:
    """A counter of the instructions every later emulated launch executes, by kind."""
    counts: collections.Counter = collections.Counter()
    decode = emu._decode_at

    def counting_decode(pc, arch):
        (program, runtime), inst = decode(pc, arch)
        op = emu._op_name(inst)
        kinds = ("all",) + (("valu",) if op.startswith("V_") else ()) + (("dot2",) if "DOT2" in op else ()) \
            + (("fma",) if "FMA" in op else ()) + (("lds",) if op.startswith("DS_") else ())
        run = runtime.fxn

        def fxn(*args):
            for kind in kinds:
                counts[kind] += 1
            return run(*args)

        return (program, type("Runtime", (), {"fxn": staticmethod(fxn)})), inst

    mp.setattr(emu, "_decode_at", counting_decode)
    return counts


SCORES = ("plain", "softcap", "alibi", "sinks")


def score_options(score: str, heads: int, g: torch.Generator) -> dict:
    """The call's score transform (flash_attn's arguments): a softcap of 30, ALiBi slopes or sinks per head."""
    if score == "softcap":
        return {"softcap": 30.0}
    if score == "alibi":
        return {"alibi_slopes": torch.rand(heads, generator=g) * 0.1}
    if score == "sinks":
        return {"sinks": torch.randn(heads, generator=g)}
    return {}


def run_one(name: str, score: str = "plain", rows: int = 80, keys: int | None = None) -> float:
    """Runs kernel ``name`` on its call (a row-block kernel: ``rows`` query rows per K/V head over
    ``keys`` keys (default 77), causal; a decode kernel: the rows its tile takes over ``keys`` keys
    (default: two steps of its tile and 13 more, at least 77) in three slices; ``score``: the
    transform the call asks for); the largest error against the oracle."""
    spec = spec_from_name(name)
    if spec.family == bwd.NAME:
        return run_backward(spec, score, rows, keys or 77)
    decoding = spec.family == "dec"
    rows = spec.tile.br if decoding else rows
    if keys is None:
        keys = max(77, 2 * spec.tile.bc + 13) if decoding else 77
    dtype = torch.bfloat16 if spec.option("dtype") == "bf16" else torch.float16
    g = torch.Generator().manual_seed(spec.head_dim)
    q, k, v = (torch.randn(1, h, n, spec.head_dim, generator=g).to(dtype)
               for h, n in ((2 if rows == 1 else 4, max(1, rows // 2)), (2, keys), (2, keys)))
    options = score_options(score, q.shape[1], g)
    if decoding:
        call = dec.Call(q=q, k=k, v=v, out=torch.empty_like(q), lse=torch.empty(q.shape[:3]), window=(-1, 0),
                        softmax_scale=spec.head_dim ** -0.5, batch=1, seq_q=q.shape[2], seq_k=k.shape[2], num_splits=3,
                        **options)
        plan = dec.plan(route.device_table(torch.device("cpu")), call, kernel=name)
    else:
        plan = plan_flash_attn(q, k, v, is_causal=True, kernel=name, **options)
    plan.run()
    ref = attention_reference(q, k, v, is_causal=True, **options)
    return (plan.outputs[0].double() - ref).abs().max().item()


def run_backward(spec, score: str, rows: int, keys: int) -> float:
    """The backward set of the dK/dV kernel ``spec`` (its passes forced by name) on a causal GQA
    call of ``rows`` query rows per K/V head over ``keys`` keys; the largest relative error of its
    gradients against the oracle's."""
    from rdnattention_gen.families import family

    atomic = spec.option("layout") == "atomic"
    fam = family(bwd.NAME)
    kernels = tuple(fam.sibling(spec, layout).name for layout in (bwd.ATOMIC if atomic else bwd.DETERMINISTIC))
    dtype = torch.bfloat16 if spec.option("dtype") == "bf16" else torch.float16
    g = torch.Generator().manual_seed(spec.head_dim)
    q, k, v = (torch.randn(1, h, n, spec.head_dim, generator=g).to(dtype)
               for h, n in ((4, max(1, rows // 2)), (2, keys), (2, keys)))
    dout = torch.randn(q.shape, generator=g).to(dtype)
    options = score_options(score, q.shape[1], g)
    out, lse = attention_reference(q, k, v, is_causal=True, return_lse=True, **options)
    grads = ops.backward(dout, q, k, v, out.to(dtype), lse.float(), None, -1, 0, spec.head_dim ** -0.5,
                         options.get("softcap", 0.0), kernels=kernels, atomic=atomic,
                         alibi_slopes=options.get("alibi_slopes"))
    refs = attention_gradients(q, k, v, dout, is_causal=True, **options)
    return max(((gr.double() - r).abs().max() / r.abs().max()).item() for gr, r in zip(grads, refs))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefixes", nargs="+", help="kernel names or prefixes of them (f16, dec and bwd families)")
    parser.add_argument("--build-dir", type=Path, default=Path(os.environ.get("RDNATTENTION_BUILD_DIR", ROOT / "build")))
    parser.add_argument("--score", choices=SCORES, default="plain",
                        help="the call's score transform (name a kernel that serves it: score option xf for a "
                             "softcap or sinks, alibi for ALiBi, or a split-KV kernel)")
    parser.add_argument("--rows", type=int, default=80, help="row-block kernels: query rows per K/V head (default 80)")
    parser.add_argument("--keys", type=int, default=None,
                        help="keys (row-block kernels: default 77; decode kernels: two steps of the tile and 13 more)")
    args = parser.parse_args(argv)
    with pytest.MonkeyPatch.context() as mp:
        emu, matrix = serve_on_emulator(mp, args.build_dir.resolve())
        names = sorted(s.name for s in matrix.specs_for(matrix.target(TARGET))
                       if (s.family in ("f16", "dec") or (s.family == bwd.NAME and s.option("layout") in (None, "atomic")))
                       and any(s.name.startswith(p) for p in args.prefixes))
        if not names:
            raise SystemExit(f"no f16, dec or bwd (dK/dV pass) kernel of {TARGET} starts with {', '.join(args.prefixes)}")
        print(f"{TARGET} kernels executed on the RDNA3 emulator (instruction words of all waves, one call each; "
              f"score transform: {args.score}; row-block calls: {args.rows} rows per K/V head; keys: {args.keys or 'the default'})\n")
        print("| kernel | executed | VALU | V_DOT2 | FMA | LDS (DS_) | max error |")
        print("|---|---|---|---|---|---|---|")
        for name in names:
            with pytest.MonkeyPatch.context() as inner:
                counts = counted(inner, emu)
                err = run_one(name, args.score, args.rows, args.keys)
            print(f"| `{name}` | {counts['all']} | {counts['valu']} | {counts['dot2']} | {counts['fma']} | {counts['lds']} "
                  f"| {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
