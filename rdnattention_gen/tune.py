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

from . import audit, build
from .matrix import Matrix, Target
from .spec import KernelSpec, Tile


class TuneError(RuntimeError):
    """A tuning request that cannot run (no candidates, no GPU of the target, a stale build)."""


@dataclass(frozen=True)
class Candidate:
    spec: KernelSpec
    row: audit.KernelAudit | None
    problems: tuple[str, ...]  # audit violations: pruned when any
    default: bool              # the tile the matrix (or an overlay) gives this key today

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


def register_budgets(target: Target) -> tuple[int, ...]:
    """Waves-per-SIMD caps worth trying on ``target``: those that leave each thread between 128 and
    255 registers (a tighter cap spills the row-block tiles; a looser one changes nothing)."""
    out = []
    for waves in range(1, target.max_waves_per_simd + 1):
        budget = target.vgprs_per_simd // waves // target.vgpr_granule * target.vgpr_granule
        if 128 <= budget < 256:
            out.append(waves)
    return tuple(out)


def candidates(matrix: Matrix, target: Target, family_name: str, head_dims: list[int],
               space: dict[str, tuple[int, ...]]) -> list[tuple[str, int, Tile]]:
    """Every tile of the family's space (with ``space`` overrides) its rules accept on ``target``; a
    register budget for more waves than the tile's LDS lets the target hold is left out."""
    from .families import family

    fam = family(family_name)
    out = []
    for hd in head_dims:
        base = fam.tile_space(target, hd)
        if not base:
            raise TuneError(f"{family_name} has no tile space to tune")
        fields = {**base, "waves": (0,) + register_budgets(target), **space}
        for values in itertools.product(*(fields[k] for k in ("br", "bc", "threads", "tm", "waves"))):
            tile = Tile(*values)
            probe = fam.spec(target, {"head_dim": hd, "gqa_group": 1}, tile)
            if tile.waves and not fam.problems(probe, target) and \
                    tile.waves > target.waves_per_simd(1, probe.lds_bytes, tile.threads):
                continue
            ok = all(not fam.problems(fam.spec(target, {"head_dim": hd, "gqa_group": g}, tile), target)
                     for g in matrix.kernels[family_name]["gqa_groups"])
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
    return collect(m, target, rows)


def collect(matrix: Matrix, target: Target, rows: list[audit.KernelAudit]) -> list[Candidate]:
    by_name = {r.name: r for r in rows}
    out = []
    seen = set()
    for v in matrix.variants_for(target):
        if v.spec.name in seen:  # one kernel serving two entries (a tuned tile under two `when`s)
            continue
        seen.add(v.spec.name)
        row = by_name.get(v.spec.name)
        problems = tuple(audit.violations(target, v.spec, row)) if row else ("not in the audit",)
        out.append(Candidate(v.spec, row, problems, default=v.priority >= 0 and not v.when.to_json()))
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
        lines.append(f"| {c.spec.head_dim} | {c.spec.gqa_group} | {c.label} | {r.vgprs if r else '-'} | "
                     f"{r.lds_bytes if r else '-'} | {r.waves_per_simd if r else '-'} | {(r.bound or '-') if r else '-'} | "
                     f"{share} | {verdict} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- measuring (GPU)

@dataclass(frozen=True)
class Shape:
    batch: int
    heads_q: int
    heads_kv: int
    seq: int
    head_dim: int
    causal: bool

    @property
    def flops(self) -> float:
        f = 4 * self.batch * self.heads_q * self.seq * self.seq * self.head_dim
        return f / 2 if self.causal else f


def shapes_for(spec: KernelSpec, seq: int) -> list[Shape]:
    """The calls a candidate is timed on: [1, 32 query heads, seq, head_dim], K/V heads for its GQA
    group, causal and not."""
    return [Shape(1, 32, 32 // spec.gqa_group, seq, spec.head_dim, causal) for causal in (False, True)]


def measure(build_dir: Path, target: Target, cands: list[Candidate], rounds: int, seq: int, log=print) -> dict:
    """Times every unpruned candidate on the GPU in turn for ``rounds`` rounds; returns
    {(head_dim, group, causal): {"figures": {kernel name: median TFLOP/s}, "default": the kernel the
    dispatcher picks for that call today}}. Each is checked against the float64 oracle first (a
    wrong kernel is reported and never timed)."""
    import os

    import torch

    from rdnattention import drivers
    from rdnattention.dispatch import BUILD_DIR_ENV
    from rdnattention.drivers import host
    from rdnattention.peak import time_ms

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
        for shape in shapes_for(c.spec, seq):
            key = (c.spec.head_dim, c.spec.gqa_group, shape.causal)
            error = harness.oracle_error(c.spec.name, shape, device)
            if not error <= harness.tolerance:
                log(f"tune: {c.spec.name} is wrong against the oracle ({harness.metric} {error:.2e}); not timed")
                continue
            if shape not in inputs:
                g = torch.Generator(device=device).manual_seed(0)
                inputs[shape] = harness.inputs(*(torch.randn(shape.batch, h, seq, shape.head_dim, device=device,
                                                             dtype=torch.float16, generator=g)
                                                 for h in (shape.heads_q, shape.heads_kv, shape.heads_kv)))
            plans[(key, c.spec.name)] = (harness.plan(inputs[shape], shape.causal, c.spec.name), shape)
            defaults[key] = harness.plan(inputs[shape], shape.causal, None).launches[0].kernel.name
    times: dict = {k: [] for k in plans}
    for r in range(rounds):
        for k, (plan, _) in plans.items():
            times[k].append(time_ms(plan.run, device))
        log(f"tune: round {r + 1}/{rounds} timed {len(plans)} (kernel, shape) pairs")
    out: dict = {}
    for (key, name), (_, shape) in plans.items():
        entry = out.setdefault(key, {"figures": {}, "default": defaults[key]})
        entry["figures"][name] = shape.flops / statistics.median(times[(key, name)]) / 1e9
    return out


class _F16Harness:
    """fp16 inputs through plan_flash_attn; the oracle's maximum absolute error (the test sweep's)."""

    tolerance, metric = 2e-3, "max abs error"

    def inputs(self, q, k, v):
        return q, k, v

    def plan(self, inputs, causal: bool, kernel: str | None):
        from rdnattention import plan_flash_attn

        return plan_flash_attn(*inputs, is_causal=causal, kernel=kernel)

    def reference(self, inputs, causal: bool):
        from rdnattention import attention_reference

        return attention_reference(*(t.cpu() for t in inputs), is_causal=causal)

    def error(self, out, ref) -> float:
        return (out.double().cpu() - ref).abs().max().item()

    def oracle_error(self, name: str, shape: Shape, device) -> float:
        import torch

        g = torch.Generator(device=device).manual_seed(1)
        q = torch.randn(1, 4, 200, shape.head_dim, device=device, dtype=torch.float16, generator=g)
        k, v = (torch.randn(1, 4 // (shape.heads_q // shape.heads_kv), 200, shape.head_dim, device=device,
                            dtype=torch.float16, generator=g) for _ in range(2))
        inputs = self.inputs(q, k, v)
        plan = self.plan(inputs, shape.causal, name)
        plan.run()
        return self.error(plan.outputs[0], self.reference(inputs, shape.causal))


class _I8Harness(_F16Harness):
    """int8 inputs (the package's quantizers) through plan_flash_attn_int8qk; the relative RMS error
    against the oracle on the dequantized inputs (tests/test_int8.py's bound)."""

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


# How --measure runs each family's kernels (inputs, forced plan, oracle check).
HARNESSES = {"f16": _F16Harness(), "i8": _I8Harness()}



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
    """The tile variants.yaml alone (no overlay) gives each (head_dim, group, causal) call of
    ``seq`` query rows: what a tuned entry is measured against and written only to differ from."""
    base = dataclasses.replace(matrix, tuned={}, alternates={})
    variants = [v for v in base.variants_for(target) if v.spec.family == family_name and v.priority >= 0]
    out = {}
    for hd, group, causal in keys:
        fits = [v for v in variants if v.spec.head_dim == hd and v.spec.gqa_group == group
                and v.when.admits(causal=causal, seq_q=seq, rows=group * seq)]
        if fits:
            out[(hd, group, causal)] = max(fits, key=lambda v: v.priority).spec.tile
    return out


def winners(cands: list[Candidate], results: dict, base: dict | None = None) -> list[dict]:
    """Per measured (head_dim, group, causal): the best candidate, the dispatcher's current pick
    (``default``), the matrix's own tile (``base``, from matrix_tiles), their figures and all."""
    by_name = {c.spec.name: c for c in cands}
    out = []
    for key, result in sorted(results.items()):
        hd, group, causal = key
        figures = result["figures"]
        best = max(figures, key=figures.get)
        default = result["default"] if result["default"] in figures else None
        base_tile = (base or {}).get(key)
        base_name = next((n for n in figures if by_name[n].spec.tile == base_tile), None)
        reference = base_name or default  # the figure a written entry is measured against
        out.append({"head_dim": hd, "gqa_group": group, "causal": causal, "winner": by_name[best],
                    "default": by_name[default] if default else None, "base_tile": base_tile,
                    "reference": by_name[reference] if reference else None,
                    "figures": {by_name[n].label: _figure(f) for n, f in sorted(figures.items(), key=lambda kv: -kv[1])},
                    "tflops": figures[best], "baseline_tflops": figures.get(reference) if reference else None})
    return out


def tuned_yaml(target: Target, family_name: str, results: list[dict], facts: dict, toolchain: str,
               command: str, previous: str | None = None) -> str:
    """tuned/<target>.yaml: one entry per measured key whose winner is not the matrix's own tile
    (``base_tile``; without one, the dispatcher's pick). Entries of ``previous`` (the file as it
    was) for keys this run did not measure are kept."""
    import yaml

    measured_keys = {(family_name, w["head_dim"], w["gqa_group"], w["causal"]) for w in results}

    def key(e: dict) -> tuple:
        return (e.get("family"), e.get("head_dim"), e.get("gqa_group"), (e.get("when") or {}).get("causal"))

    old = (yaml.safe_load(previous) or {}).get("entries") or [] if previous else []
    entries = [e for e in old if key(e) not in measured_keys]
    for w in results:
        current = w["base_tile"] if w.get("base_tile") is not None else (w["default"].spec.tile if w["default"] else None)
        if w["winner"].spec.tile == current:
            continue
        t = w["winner"].spec.tile
        tile = {"br": t.br, "bc": t.bc, "threads": t.threads, "tm": t.tm, **({"waves": t.waves} if t.waves else {})}
        figures = {"tflops": _figure(w["tflops"])}
        if w["baseline_tflops"] is not None:
            figures["baseline_tflops"] = _figure(w["baseline_tflops"])
        if "fma_peak_tflops" in facts:  # the FP32 FMA peak measured in the same run
            figures["fma_peak_tflops"] = facts["fma_peak_tflops"]
        measured = {"device": facts["device"], **({"clocks": facts["clocks"]} if "clocks" in facts else {}),
                    "toolchain": toolchain, "date": datetime.date.today().isoformat(), "command": command,
                    "figures": figures, "candidates": w["figures"]}
        entries.append({"family": family_name, "head_dim": w["head_dim"], "gqa_group": w["gqa_group"],
                        "when": {"causal": w["causal"]}, "tile": tile, "measured": measured})
    header = (f"# Written by `rdnattention-gen tune` on {facts['device']}: tiles measured faster than the matrix's.\n"
              "# candidates: TFLOP/s of every tile timed for the entry (median of interleaved rounds).\n")
    return header + yaml.safe_dump({"target": target.name, "entries": entries}, sort_keys=False, width=110)


def chart_svg(results: list[dict], title: str) -> str:
    """A bar chart of every candidate's TFLOP/s per measured key (winner and default marked)."""
    rows = []
    for w in results:
        key = f"hd{w['head_dim']} g{w['gqa_group']} {'causal' if w['causal'] else 'full'}"
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
         "row": c.row.to_json() if c.row else None} for c in cands]}
    (build_dir / "tune.json").write_text(json.dumps(data, indent=2) + "\n")


def load_candidates(build_dir: Path, target: Target) -> tuple[str, list[Candidate]]:
    path = build_dir / "tune.json"
    if not path.is_file():
        raise TuneError(f"{path} does not exist: build the candidates first (rdnattention-gen tune without --no-build)")
    try:
        data = json.loads(path.read_text())
        if data["target"] != target.name:
            raise TuneError(f"{path} holds {data['target']} candidates, not {target.name}'s")
        return data["family"], [Candidate(KernelSpec.from_name(c["name"]),
                                          audit.KernelAudit(**c["row"]) if c["row"] else None,
                                          tuple(c["problems"]), c["default"]) for c in data["candidates"]]
    except (ValueError, KeyError, TypeError) as e:  # JSON, missing fields, names that are not kernels
        raise TuneError(f"{path}: not a candidate list this version wrote ({type(e).__name__}: {e}); "
                        "rebuild it (rdnattention-gen tune without --no-build)") from None



def save_measurements(build_dir: Path, results: dict) -> None:
    """Every figure of a --measure run, beside the build (measured.json), for later analysis."""
    data = [{"head_dim": hd, "gqa_group": g, "causal": causal, **r} for (hd, g, causal), r in sorted(results.items())]
    (build_dir / "measured.json").write_text(json.dumps(data, indent=2) + "\n")
