"""The tuner: tile candidates for one target, pruned by the audit, ranked by the cost model, timed on
the GPU when one of that target is present, and the winners written to tuned/<target>.yaml.

    rdnattention-gen tune --targets gfx1030                      # build, audit, rank (no GPU needed)
    rdnattention-gen tune --targets sm_90 --measure --write      # ... then time on the GPU, write

Steps, for one family and its head_dims:
  1. candidates: the family's tile space (``Family.tile_space``: rows, keys per step, threads,
     rows per thread, register budgets), less the tiles its rules reject on the target;
  2. one build of them all, as alternates beside the target's own kernels (``build/tune/``);
  3. prune: any audit violation (spills, scratch, LDS) removes a candidate before timing;
  4. rank: the cost model's share of the product peak (cost.py), where the platform has one;
  5. measure (``--measure``, needs the GPU): every survivor and the current default, timed in
     turn round after round (never one build after another), each checked against the float64
     oracle first; the median of the rounds decides;
  6. write (``--write``): per (head_dim, GQA group, mask), the winner when it is not the matrix's
     own tile, with the device, clocks, toolchain, date and every candidate's figure, and a chart.

The measuring step needs only the built candidate directory: build where the compiler is, measure
where the GPU is (``--no-build``)."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from rdnattention.table import Constraints

from . import audit, build
from .families import family, spec_from_name
from .family import HeadDimAxis
from .matrix import Matrix
from .spec import KernelSpec, Tile
from .target import Target, register_budgets


class TuneError(RuntimeError):
    """A tuning request that cannot run (no candidates, no GPU of the target, a stale build)."""


@dataclass(frozen=True)
class Candidate:
    spec: KernelSpec
    row: audit.KernelAudit | None
    problems: tuple[str, ...]  # audit violations: pruned when any
    default: bool              # the tile the matrix (or an overlay) gives this key today
    whens: tuple = ()          # the dispatch constraints of its entries (Constraints); empty: any call

    def serves(self, facts: dict) -> bool:
        """Whether a call of these facts may name this kernel (its entries' `when`)."""
        return not self.whens or any(w.admits(**facts) for w in self.whens)

    @property
    def label(self) -> str:
        t = self.spec.tile
        return f"br{t.br}_bc{t.bc}_nt{t.threads}_tm{t.tm}" + (f"_wv{t.waves}" if t.waves else "")


def parse_space(text: str | None) -> dict[str, tuple[int, ...]]:
    """``"br=64,128 tm=4,8 waves=0,6"``: values per tile field, overriding the family's space."""
    out: dict[str, tuple[int, ...]] = {}
    fields = {f.name for f in dataclasses.fields(Tile)}
    for item in (text or "").split():
        key, _, values = item.partition("=")
        if key not in fields or not values:
            raise TuneError(f"--space: {item!r} is not FIELD=V1,V2 with FIELD one of {', '.join(sorted(fields))}")
        try:
            out[key] = tuple(int(v) for v in values.split(","))
        except ValueError:
            raise TuneError(f"--space: {item!r}: values must be integers") from None
    return out


def candidates(matrix: Matrix, target: Target, family_name: str, head_dims: list[int],
               space: dict[str, tuple[int, ...]]) -> list[tuple[str, int, Tile]]:
    """Every tile of the family's space (with ``space`` overrides) its rules accept on ``target``; a
    register budget for more waves than the tile's LDS lets the target hold is left out."""
    fam = family(family_name)
    out = []
    for hd in head_dims:
        base = fam.tile_space(target, hd)
        if not base:
            raise TuneError(f"{family_name} has no tile space to tune")
        fields = {"waves": (0,) + register_budgets(target), **base, **space}  # a family may name its budgets
        for values in itertools.product(*(fields[k] for k in ("br", "bc", "threads", "tm", "waves"))):
            tile = Tile(*values)
            probe = fam.spec(target, {"head_dim": hd, "gqa_group": 1}, tile)
            if tile.waves and not fam.problems(probe, target) and \
                    tile.waves > target.waves_per_simd(1, probe.lds_bytes, tile.threads):
                continue
            ok = all(not fam.problems(fam.spec(target, {"head_dim": hd, "gqa_group": g}, tile), target)
                     for g in matrix.kernels[family_name].get("gqa_groups", [1]))
            if ok:
                out.append((family_name, hd, tile))
    return out


def parse_ints(option: str, text: str) -> list[int]:
    """``--head-dims 64,128``, ``--groups 1,2``."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise TuneError(f"{option}: {text!r} is not a comma list of integers") from None
    return values


def restricted(matrix: Matrix, family_name: str, head_dims: list[int], groups: list[int]) -> Matrix:
    """The matrix with only ``family_name`` at ``head_dims`` and ``groups`` (what tuning builds);
    group 1 always, as every dispatch table's fallback."""
    axes = dict(matrix.kernels[family_name])
    axes["head_dims"] = [h for h in axes["head_dims"] if h in head_dims]
    # The plain kernels only: the family's layout options take the same tiles (one tile table per
    # algorithm), so what the plain kernels measure holds for them; a family whose layouts are the
    # passes of one call (bwd) keeps them, each tile's passes timed together.
    if not family(family_name).tune_layouts:
        axes.pop("layouts", None)
    axes.pop("dtypes", None)  # fp16's: the bf16 kernels take the same tiles but where a table overrides them
    axes.pop("scores", None)  # likewise the alibi kernels
    if "gqa_groups" in axes:
        unknown = sorted(set(groups) - set(axes["gqa_groups"]))
        if unknown:
            raise TuneError(f"{family_name} has no GQA group {unknown}; its groups: {list(axes['gqa_groups'])}")
        axes["gqa_groups"] = [g for g in axes["gqa_groups"] if g in groups or g == 1]
    return dataclasses.replace(matrix, kernels={family_name: axes})


def prepare(matrix: Matrix, target: Target, family_name: str, head_dims: list[int], groups: list[int],
            build_dir: Path, space: dict[str, tuple[int, ...]], jobs: int | None = None,
            log=print) -> list[Candidate]:
    """Builds every candidate beside the target's own tiles and audits them (step 1-3)."""
    if family_name not in matrix.kernels:
        raise TuneError(f"no kernel family {family_name!r}; families: {', '.join(sorted(matrix.kernels))}")
    missing = [h for h in head_dims if h not in matrix.kernels[family_name]["head_dims"]]
    if missing:
        raise TuneError(f"{family_name} is not built for head_dim {missing}; its head_dims: "
                        f"{matrix.kernels[family_name]['head_dims']}")
    m = restricted(matrix, family_name, head_dims, groups)
    cands = candidates(m, target, family_name, head_dims, space)
    if not cands:
        raise TuneError(f"no {family_name} tile of the space fits {target.name}")
    m = m.with_alternates(target.name, cands)
    log(f"tune: {len(cands)} {family_name} tile(s) for {target.name}, head_dim {head_dims}, "
        f"group {groups}; building into {build_dir}")
    rows = build.build(m, [target], build_dir, jobs=jobs, log=log, enforce=False)
    return [c for c in collect(m, target, rows) if c.spec.family == family_name]


def collect(matrix: Matrix, target: Target, rows: list[audit.KernelAudit]) -> list[Candidate]:
    by_name = {r.name: r for r in rows}
    variants: dict = {}  # kernel name -> its variants (a tuned tile may serve under two `when`s)
    for v in matrix.variants_for(target):
        variants.setdefault(v.spec.name, []).append(v)
    out = []
    for name, vs in variants.items():
        v = vs[0]
        row = by_name.get(name)
        problems = tuple(audit.violations(target, v.spec, row)) if row else ("not in the audit",)
        whens = () if any(not x.when.to_json() for x in vs) else tuple(x.when for x in vs)
        out.append(Candidate(v.spec, row, problems, default=any(x.priority >= 0 and not x.when.to_json() for x in vs),
                             whens=whens))
    return out


def rank(cands: list[Candidate]) -> list[Candidate]:
    """Survivors first, by the cost model's share (highest first), then occupancy."""
    return sorted(cands, key=lambda c: (bool(c.problems), -(c.row.peak_share or 0) if c.row else 0,
                                        -(c.row.waves_per_simd or 0) if c.row else 0, c.spec.name))


def rank_table(cands: list[Candidate]) -> str:
    lines = ["| head_dim | group | tile | VGPR | LDS | waves/SIMD | bound | share of peak | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in rank(cands):
        r = c.row
        share = f"{r.peak_share:.0%}" if r and r.peak_share is not None else "-"
        verdict = "pruned: " + "; ".join(c.problems) if c.problems else ("default" if c.default else "candidate")
        layout = c.spec.option("layout")  # a pass of the backward, or a layout the tuner builds
        lines.append(f"| {c.spec.head_dim} | {c.spec.gqa_group} | {c.label}{f' ({layout})' if layout else ''} | "
                     f"{r.vgprs if r else '-'} | "
                     f"{r.lds_bytes if r else '-'} | {r.waves_per_simd if r else '-'} | {(r.bound or '-') if r else '-'} | "
                     f"{share} | {verdict} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- measuring (GPU)

@dataclass(frozen=True)
class Shape:
    """One timed call: [batch, heads_q, seq_q, head_dim] queries against seq_k keys of heads_kv
    heads. ``when``: the overlay's `when` for the calls it stands for, as sorted (key, value) items
    (``(("causal", True),)``, ``(("rows", (4, 4)),)``); with the head_dim and GQA group it is the
    key a winner is chosen for."""
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    causal: bool
    when: tuple

    @property
    def flops(self) -> float:
        f = 4 * self.batch * self.heads_q * self.seq_q * self.seq_k * self.head_dim
        return f / 2 if self.causal else f

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.heads_kv * self.seq_k * self.head_dim * 2  # fp16 K and V


def when_dict(when: tuple) -> dict:
    """A Shape's ``when`` as the overlay writes it: {"causal": True}, {"rows": [4, 4]}."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in when}


def when_key(when: dict | None) -> tuple:
    """The inverse of when_dict, for comparing an overlay entry's `when` with a measured key."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in (when or {}).items()))


def when_text(when: tuple) -> str:
    return " ".join(f"{k}={'..'.join(map(str, v)) if isinstance(v, tuple) else v}" for k, v in when) or "any"


def measure(build_dir: Path, target: Target, cands: list[Candidate], rounds: int, seq: int, log=print) -> dict:
    """Times every unpruned candidate on the GPU in turn for ``rounds`` rounds; returns
    {(head_dim, group, when): {"figures": {kernel name: median figure}, "default": the kernel the
    dispatcher picks for that call today}}, the figure in the family harness's unit (TFLOP/s, GB/s).
    Each is checked against the float64 oracle first (a wrong kernel is reported and never timed)."""
    import os

    import torch

    from rdnattention import drivers
    from rdnattention.dispatch import BUILD_DIR_ENV
    from rdnattention.drivers import host
    from rdnattention.peak import graphed, time_ms

    families = sorted({c.spec.family for c in cands})
    unknown = [f for f in families if f not in HARNESSES]
    if unknown:
        raise TuneError(f"--measure times the {', '.join(sorted(HARNESSES))} families; {', '.join(unknown)} "
                        "has no timing harness (rank its candidates without --measure)")
    os.environ[BUILD_DIR_ENV] = str(build_dir.resolve())
    if target.platform == "host":  # the CPU emulator: how CI runs the tuner end to end (not for speed)
        os.environ[host.TARGET_ENV] = target.name
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            raise TuneError(f"--measure needs the {target.name} GPU; torch sees no GPU here")
        device = torch.device("cuda")
        present = drivers.target_of(device)
        if present != target.name:
            raise TuneError(f"--measure times {target.name} kernels, but the GPU here is {present}")
    live = [c for c in cands if not c.problems]
    plans: dict = {}
    defaults: dict = {}
    inputs: dict = {}  # one q, k, v per shape, shared by its candidates
    for c in live:
        harness = HARNESSES[c.spec.family]
        for shape in harness.shapes(c.spec, seq):
            if not c.serves(harness.facts(shape.when, seq, c.spec.gqa_group)):
                continue  # a tile for other calls (a `when` of the tile table)
            key = (c.spec.head_dim, c.spec.gqa_group, shape.when)
            error = harness.oracle_error(c.spec.name, shape, device)
            if not error <= harness.tolerance:
                log(f"tune: {c.spec.name} is wrong against the oracle ({harness.metric} {error:.2e}); not timed")
                continue
            if shape not in inputs:
                g = torch.Generator(device=device).manual_seed(0)
                inputs[shape] = harness.inputs(*(torch.randn(shape.batch, h, n, shape.head_dim, device=device,
                                                             dtype=torch.float16, generator=g)
                                                 for h, n in ((shape.heads_q, shape.seq_q),
                                                              (shape.heads_kv, shape.seq_k),
                                                              (shape.heads_kv, shape.seq_k))))
            plans[(key, c.spec.name)] = (harness.plan(inputs[shape], shape.causal, c.spec.name), shape, harness)
            defaults[key] = harness.default(inputs[shape], shape)
    # Calls shorter than their host launch (decode) are timed from graph replays on a GPU.
    timed = {k: (graphed(plan.run, device, h.graph_calls), h.graph_calls) if h.graph_calls and device.type == "cuda"
             else (plan.run, 1) for k, (plan, _, h) in plans.items()}
    times: dict = {k: [] for k in plans}
    for r in range(rounds):
        for k, (fn, calls) in timed.items():
            times[k].append(time_ms(fn, device) / calls)
        log(f"tune: round {r + 1}/{rounds} timed {len(plans)} (kernel, shape) pairs")
    out: dict = {}
    for (key, name), (_, shape, harness) in plans.items():
        entry = out.setdefault(key, {"figures": {}, "default": defaults[key]})
        entry["figures"][name] = harness.figure(shape, statistics.median(times[(key, name)]))
    return out


class _F16Harness:
    """fp16 inputs through plan_flash_attn, [1, 32 query heads, seq, head_dim] (K/V heads for the
    GQA group), causal and not, in TFLOP/s; the oracle's maximum absolute error (the test sweep's)."""

    tolerance, metric = 2e-3, "max abs error"
    unit, figure_key = "TFLOP/s", "tflops"
    graph_calls = 0  # > 0: time a GPU's calls from a graph of this many (calls shorter than their launch)

    def shapes(self, spec: KernelSpec, seq: int) -> list[Shape]:
        return [Shape(1, 32, 32 // spec.gqa_group, seq, seq, spec.head_dim, causal, (("causal", causal),))
                for causal in (False, True)]

    def facts(self, when: tuple, seq: int, group: int) -> dict:
        """The call facts a tile table's `when` is matched against, for a measured key."""
        return {"causal": dict(when)["causal"], "seq_q": seq, "rows": group * seq}

    def figure(self, shape: Shape, ms: float) -> float:
        return shape.flops / ms / 1e9

    def title(self, seq: int) -> str:
        return f"TFLOP/s, [1, 32, {seq}, head_dim]"

    def inputs(self, q, k, v):
        return q, k, v

    def default(self, inputs, shape: Shape) -> str:
        """The kernel the dispatcher picks for the call of ``shape`` today."""
        return self.plan(inputs, shape.causal, None).launches[0].kernel.name

    def plan(self, inputs, causal: bool, kernel: str | None):
        from rdnattention import plan_flash_attn

        return plan_flash_attn(*inputs, is_causal=causal, kernel=kernel)

    def reference(self, inputs, causal: bool):
        from rdnattention import attention_reference

        return attention_reference(*(t.cpu() for t in inputs), is_causal=causal)

    def error(self, out, ref) -> float:
        return (out.double().cpu() - ref).abs().max().item()

    def check_shape(self, shape: Shape) -> tuple[int, int, int, int]:
        """(query heads, K/V heads, query rows, keys) of the small call each candidate is checked on."""
        return 4, 4 // (shape.heads_q // shape.heads_kv), 200, 200

    def oracle_error(self, name: str, shape: Shape, device) -> float:
        import torch

        g = torch.Generator(device=device).manual_seed(1)
        hq, hk, sq, sk = self.check_shape(shape)
        q = torch.randn(1, hq, sq, shape.head_dim, device=device, dtype=torch.float16, generator=g)
        k, v = (torch.randn(1, hk, sk, shape.head_dim, device=device, dtype=torch.float16, generator=g)
                for _ in range(2))
        inputs = self.inputs(q, k, v)
        plan = self.plan(inputs, shape.causal, name)
        plan.run()
        return self.error(self.result(plan), self.reference(inputs, shape.causal))

    def result(self, plan):
        """What a candidate's run is checked on: its output."""
        return plan.outputs[0]


class _I8Harness(_F16Harness):
    """int8 inputs (the package's quantizers) through plan_flash_attn_int8qk; the relative RMS error
    against the oracle on the dequantized inputs (tests/kernels/test_int8.py's bound)."""

    tolerance, metric = 0.03, "relative RMS error"

    def inputs(self, q, k, v):
        from rdnattention import quantize_per_channel, quantize_per_token

        (qi, qs), (ki, ks), (vi, vs) = quantize_per_token(q), quantize_per_token(k), quantize_per_channel(v)
        return qi, ki, vi, qs, ks, vs

    def plan(self, inputs, causal: bool, kernel: str | None):
        from rdnattention import plan_flash_attn_int8qk

        return plan_flash_attn_int8qk(*inputs, is_causal=causal, kernel=kernel)

    def reference(self, inputs, causal: bool):
        from rdnattention import attention_reference

        qi, ki, vi, qs, ks, vs = (t.cpu().double() for t in inputs)
        return attention_reference(qi * qs[..., None], ki * ks[..., None], vi * vs[:, :, None, :], is_causal=causal)

    def error(self, out, ref) -> float:
        return ((out.double().cpu() - ref).norm() / ref.norm()).item()


class _DecHarness(_F16Harness):
    """Split-KV decode: one query position of 8 K/V heads, 1, 2, 4 and 8 query rows per K/V head
    (GQA groups), against 16 x seq keys (more bytes than a GPU's L2 at the default seq), in GB/s of
    K and V read, timed from graph replays; each row count is a key of its own (`when: {rows: [r, r]}`)."""

    unit, figure_key = "GB/s", "gbps"
    graph_calls = 20
    ROWS = (1, 2, 4, 8)

    def shapes(self, spec: KernelSpec, seq: int) -> list[Shape]:
        return [Shape(1, 8 * r, 8, 1, 16 * seq, spec.head_dim, False, (("rows", (r, r)),)) for r in self.ROWS]

    def facts(self, when: tuple, seq: int, group: int) -> dict:
        rows = dict(when)["rows"][0]
        return {"causal": False, "seq_q": rows, "rows": rows}

    def figure(self, shape: Shape, ms: float) -> float:
        return shape.kv_bytes / ms / 1e6

    def title(self, seq: int) -> str:
        return f"GB/s of K and V, 8 K/V heads x {16 * seq} keys, one query position"

    def check_shape(self, shape: Shape) -> tuple[int, int, int, int]:
        return 2 * shape.heads_q // shape.heads_kv, 2, 1, 300


class _BwdHarness(_F16Harness):
    """The backward: a causal call [1, 32, seq, head_dim] (and GQA 32/8 where the group is 4), its
    gradients against a fixed dO from the forward's output and log-sum-exp; each tile's passes forced
    by name as a set: the atomic passes (dK/dV with dQ added by atomics, then dqcast) where the
    target builds them, and the deterministic ones, each a key of its own (`passes`). TFLOP/s counted
    as 2.5 x the forward's FLOPs (tuning/bench_bwd.py's count); the error is the largest of dQ's,
    dK's and dV's against the float64 oracle, relative to that gradient's largest element
    (tests/kernels/test_backward.py's bound for fp16)."""

    tolerance, metric = 2e-3 + 2 * 2.0**-11, "relative max error of dq, dk, dv"
    figure_key = "tflops"
    MODES = {None: "deterministic", "atomic": "atomic"}  # the set's dK/dV kernel's layout -> its key

    def shapes(self, spec: KernelSpec, seq: int) -> list[Shape]:
        if spec.option("layout") not in self.MODES:
            return []  # the preprocess, dQ and dqcast passes are timed with their set
        return [Shape(1, 32, 32, seq, seq, spec.head_dim, True,
                      (("causal", True), ("passes", self.MODES[spec.option("layout")])))]

    def facts(self, when: tuple, seq: int, group: int) -> dict:
        return {"causal": True, "seq_q": seq, "rows": group * seq}

    def figure(self, shape: Shape, ms: float) -> float:
        return 2.5 * shape.flops / ms / 1e9

    def title(self, seq: int) -> str:
        return f"backward TFLOP/s (2.5 x the forward's FLOPs), [1, 32, {seq}, head_dim] causal"

    def inputs(self, q, k, v):
        """q, k, v, the forward's output and log-sum-exp (torch's fp32 arithmetic: the tuner builds
        no forward kernels), and dO."""
        import torch

        group = q.shape[1] // k.shape[1]
        k32, v32 = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
        scores = (q.float() @ k32.transpose(-1, -2)) * q.shape[-1] ** -0.5
        seq_q, seq_k = q.shape[2], k.shape[2]
        hidden = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).triu(seq_k - seq_q + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
        lse = scores.logsumexp(-1)
        out = (torch.softmax(scores, -1) @ v32).to(q.dtype)
        del scores
        g = torch.Generator(device=q.device).manual_seed(2)
        return q, k, v, out, lse, torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=g)

    def default(self, inputs, shape: Shape) -> str:
        """The dK/dV kernel the dispatcher picks for the passes of ``shape``'s key."""
        return self.plan(inputs, True, None, atomic=dict(shape.when)["passes"] == "atomic").launches[1].kernel.name

    def plan(self, inputs, causal: bool, kernel: str | None, atomic: bool | None = None):
        """The passes of ``kernel``'s set (its tile and mode); for None, the dispatcher's passes of
        the mode ``atomic`` asks for (None: its default mode)."""
        from rdnattention import ops
        from rdnattention.families import bwd

        q, k, v, out, lse, dout = inputs
        names = (None, None, None)
        if kernel is not None:
            fam = family(bwd.NAME)
            spec = fam.from_name(kernel)
            atomic = spec.option("layout") == "atomic"
            names = tuple(fam.sibling(spec, layout).name for layout in (bwd.ATOMIC if atomic else bwd.DETERMINISTIC))
        return ops.backward_plan(dout, q, k, v, out, lse, None, -1, 0 if causal else -1, q.shape[-1] ** -0.5, 0.0,
                                 kernels=names, atomic=atomic)

    def result(self, plan):
        return plan.outputs  # dq, dk, dv

    def reference(self, inputs, causal: bool):
        from rdnattention import attention_gradients

        q, k, v, _, _, dout = inputs
        return attention_gradients(*(t.cpu() for t in (q, k, v, dout)), is_causal=causal)

    def error(self, out, ref) -> float:
        return max(((g.double().cpu() - r).abs().max() / r.abs().max()).item() for g, r in zip(out, ref))


# How --measure runs each family's kernels (shapes, inputs, forced plan, oracle check, figure).
HARNESSES = {"f16": _F16Harness(), "i8": _I8Harness(), "dec": _DecHarness(), "bwd": _BwdHarness()}


def device_facts() -> dict:
    """The GPU's name and clocks as torch and the driver report them."""
    import platform

    import torch

    from rdnattention.peak import fma_peak_tflops

    if not torch.cuda.is_available():
        return {"device": f"host emulator on {platform.processor() or platform.machine()}"}
    props = torch.cuda.get_device_properties(0)
    facts = {"device": props.name}
    clock = getattr(props, "clock_rate", None)
    if clock:
        facts["clocks"] = f"{clock // 1000} MHz SM (boost, as the driver reports it)"
    # the probe in the candidates' own code object (the build directory measure() selected)
    facts["fma_peak_tflops"] = _figure(fma_peak_tflops(torch.device("cuda")))
    return facts


def matrix_tiles(matrix: Matrix, target: Target, family_name: str, keys, seq: int) -> dict:
    """The tile variants.yaml alone (no overlay) gives each measured (head_dim, group, when) call
    (``seq`` as the harness reads it): what a tuned entry is measured against and written only to
    differ from."""
    harness = HARNESSES[family_name]
    base = dataclasses.replace(matrix, tuned={}, alternates={})
    variants = [v for v in base.variants_for(target) if v.spec.family == family_name and v.priority >= 0]
    out = {}
    for hd, group, when in keys:
        facts = harness.facts(when, seq, group)
        fits = [v for v in variants if v.spec.head_dim == hd and v.spec.gqa_group == group and v.when.admits(**facts)]
        if fits:
            out[(hd, group, when)] = max(fits, key=lambda v: v.priority).spec.tile
    return out


def winners(cands: list[Candidate], results: dict, base: dict | None = None) -> list[dict]:
    """Per measured (head_dim, group, when): the best candidate, the dispatcher's current pick
    (``default``), the matrix's own tile (``base``, from matrix_tiles), their figures and all."""
    by_name = {c.spec.name: c for c in cands}
    out = []
    for key, result in sorted(results.items()):
        hd, group, when = key
        figures = result["figures"]
        best = max(figures, key=figures.get)
        default = result["default"] if result["default"] in figures else None
        base_tile = (base or {}).get(key)
        base_name = next((n for n in figures if by_name[n].spec.tile == base_tile), None)
        reference = base_name or default  # the figure a written entry is measured against
        out.append({"head_dim": hd, "gqa_group": group, "when": when, "winner": by_name[best],
                    "default": by_name[default] if default else None, "base_tile": base_tile,
                    "reference": by_name[reference] if reference else None,
                    "figures": {by_name[n].label: _figure(f) for n, f in sorted(figures.items(), key=lambda kv: -kv[1])},
                    "figure": figures[best], "baseline": figures.get(reference) if reference else None})
    return out


def tuned_yaml(target: Target, family_name: str, results: list[dict], facts: dict, toolchain: str,
               command: str, previous: str | None = None, min_gain: float = 0.0) -> str:
    """tuned/<target>.yaml: one entry per measured key whose winner is not the matrix's own tile
    (``base_tile``; without one, the dispatcher's pick) and beats it by more than ``min_gain``
    (0.02: 2%, the spread of repeated runs). Entries of ``previous`` (the file as it was) for keys
    this run did not measure are kept."""
    import yaml

    grouped = not isinstance(family(family_name), HeadDimAxis)  # families with a GQA-group axis
    harness = HARNESSES[family_name]

    def key(e: dict) -> tuple:
        return (e.get("family"), e.get("head_dim"), e.get("gqa_group"), when_key(e.get("when")))

    measured_keys = {(family_name, w["head_dim"], w["gqa_group"] if grouped else None, w["when"]) for w in results}
    old = (yaml.safe_load(previous) or {}).get("entries") or [] if previous else []
    entries = [e for e in old if key(e) not in measured_keys]
    for w in results:
        current = w["base_tile"] if w.get("base_tile") is not None else (w["default"].spec.tile if w["default"] else None)
        if w["winner"].spec.tile == current:
            continue
        if w["baseline"] is not None and w["figure"] <= w["baseline"] * (1 + min_gain):
            continue  # within the noise of the tile it would replace
        t = w["winner"].spec.tile
        tile = {"br": t.br, "bc": t.bc, "threads": t.threads, "tm": t.tm, **({"waves": t.waves} if t.waves else {})}
        figures = {harness.figure_key: _figure(w["figure"])}
        if w["baseline"] is not None:
            figures[f"baseline_{harness.figure_key}"] = _figure(w["baseline"])
        if "fma_peak_tflops" in facts:  # the FP32 FMA peak measured in the same run
            figures["fma_peak_tflops"] = facts["fma_peak_tflops"]
        measured = {"device": facts["device"], **({"clocks": facts["clocks"]} if "clocks" in facts else {}),
                    "toolchain": toolchain, "date": datetime.date.today().isoformat(), "command": command,
                    "figures": figures, "candidates": w["figures"]}
        entries.append({"family": family_name, "head_dim": w["head_dim"],
                        **({"gqa_group": w["gqa_group"]} if grouped else {}),
                        "when": when_dict(w["when"]), "tile": tile, "measured": measured})
    header = (f"# Written by `rdnattention-gen tune` on {facts['device']}: tiles measured faster than the matrix's.\n"
              "# candidates: every tile timed for the entry (median of interleaved rounds; TFLOP/s, decode GB/s).\n")
    return header + yaml.safe_dump({"target": target.name, "entries": entries}, sort_keys=False, width=110)


def chart_svg(results: list[dict], title: str) -> str:
    """A bar chart of every candidate's figure per measured key (winner and default marked)."""
    rows = []
    for w in results:
        key = f"hd{w['head_dim']} g{w['gqa_group']} {when_text(w['when'])}"
        best = w["winner"].label
        default = w["default"].label if w["default"] else None
        for label, value in w["figures"].items():
            rows.append((key, label, value, label == best, label == default))
    top = max((r[2] for r in rows), default=0.0) or 1.0
    bar_h, left, width = 14, 330, 420
    height = 40 + bar_h * len(rows) + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 80}" height="{height}" '
           'font-family="sans-serif" font-size="11">',
           f'<text x="10" y="20" font-size="14">{_xml(title)}</text>']
    for i, (key, label, value, best, default) in enumerate(rows):
        y = 36 + i * bar_h
        color = "#2a7" if best else ("#888" if default else "#58c")
        tag = " (winner)" if best else (" (default)" if default else "")
        out.append(f'<text x="10" y="{y + 10}">{_xml(key)}  {_xml(label)}{tag}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{width * value / top:.1f}" height="{bar_h - 3}" fill="{color}"/>')
        out.append(f'<text x="{left + width * value / top + 4:.1f}" y="{y + 10}">{value:.4g}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _figure(value: float) -> float:
    """Four significant digits (TFLOP/s on a GPU, thousandths of one on the host emulator)."""
    return float(f"{value:.4g}")


def _xml(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def save_candidates(build_dir: Path, target: Target, family_name: str, cands: list[Candidate]) -> None:
    """What --no-build reads back: the candidates and their audit, beside the build."""
    data = {"target": target.name, "family": family_name, "candidates": [
        {"name": c.spec.name, "problems": list(c.problems), "default": c.default,
         "whens": [w.to_json() for w in c.whens], "row": c.row.to_json() if c.row else None} for c in cands]}
    (build_dir / "tune.json").write_text(json.dumps(data, indent=2) + "\n")


def load_candidates(build_dir: Path, target: Target) -> tuple[str, list[Candidate]]:
    path = build_dir / "tune.json"
    if not path.is_file():
        raise TuneError(f"{path} does not exist: build the candidates first (rdnattention-gen tune without --no-build)")
    try:
        data = json.loads(path.read_text())
        if data["target"] != target.name:
            raise TuneError(f"{path} holds {data['target']} candidates, not {target.name}'s")
        return data["family"], [Candidate(spec_from_name(c["name"]),
                                          audit.KernelAudit(**c["row"]) if c["row"] else None,
                                          tuple(c["problems"]), c["default"],
                                          tuple(Constraints.from_json(w) for w in c["whens"]))
                                for c in data["candidates"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # unreadable, JSON, fields, names
        raise TuneError(f"{path}: not a candidate list this version wrote ({type(e).__name__}: {e}); "
                        "rebuild it (rdnattention-gen tune without --no-build)") from None



def save_measurements(build_dir: Path, results: dict) -> None:
    """Every figure of a --measure run, beside the build (measured.json), for later analysis."""
    data = [{"head_dim": hd, "gqa_group": g, "when": when_dict(when), **r}
            for (hd, g, when), r in sorted(results.items())]
    (build_dir / "measured.json").write_text(json.dumps(data, indent=2) + "\n")
