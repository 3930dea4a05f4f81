"""rdnattention-gen: list, generate, build, audit and probe the kernel matrix."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import DEFAULT_VARIANTS, TUNED_DIR, audit, build, docs, kernel_audit, packaging, probe, toolchain, tune
from .matrix import Matrix, load_matrix
from .ninja_paths import NinjaPathError
from .render import generate, write_if_changed
from .strict_yaml import VariantsError
from .target import Target


def _targets(matrix: Matrix, selector: str) -> list[Target]:
    return matrix.select(selector)


def _head_dim_list(text: str) -> tuple[int, ...]:
    """--head-dims: a comma list of positive integers."""
    try:
        dims = tuple(int(item) for item in text.split(","))
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of positive head_dims, such as 64,128")
    return dims


def cmd_list(matrix: Matrix, args: argparse.Namespace) -> int:
    for target in _targets(matrix, args.targets):
        flags = [f"wave{target.wave_size}", f"tier {target.tier.value}", f"hw tier {target.hw_tier}",
                 "default" if target.default else "opt-in", target.status]
        print(f"{target.name:8} {target.family:8} {', '.join(flags)}")
        for v in matrix.variants_for(target):
            when = f", when {v.when}" if v.when.to_json() else ""
            tuned = f", {v.provenance}" if v.priority >= 2 else ""
            print(f"    {v.spec.name}  (LDS {v.spec.lds_bytes} B{when}{tuned})")
    return 0


def cmd_generate(matrix: Matrix, args: argparse.Namespace) -> int:
    targets = _targets(matrix, args.targets)
    written, total = generate(matrix, targets, args.build_dir.resolve() / "gen")
    print(f"generate: {total} files for {len(targets)} target(s), {written} changed")
    return 0


def cmd_build(matrix: Matrix, args: argparse.Namespace) -> int:
    if args.user:
        from rdnattention.dispatch import user_kernel_dir
        args.build_dir = user_kernel_dir()
        try:
            args.build_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise build.BuildError(f"cannot create the per-user kernel directory {args.build_dir} ({e.strerror}); "
                                   "set XDG_DATA_HOME to a directory, or build with --build-dir") from None
        print(f"build: into the per-user kernel directory {args.build_dir}")
    rows = build.build(matrix, _targets(matrix, args.targets), args.build_dir, jobs=args.jobs,
                       audit_processes=args.jobs or os.cpu_count() or 1)
    if rows:
        print(kernel_audit.table(rows))
        print(f"audit: {len(rows)} kernels, no spills, no scratch, LDS within budget, tier instructions present, "
              "launch ABI as the runtime launches (AMD)")
    return 0


def cmd_audit(matrix: Matrix, args: argparse.Namespace) -> int:
    rows = []
    for target in _targets(matrix, args.targets):
        rows += build.audit_target(matrix, target, args.build_dir.resolve())
    if args.json:
        print(json.dumps([r.to_json() for r in rows], indent=2))
    else:
        print(kernel_audit.table(rows))
    return 0


def cmd_probe(matrix: Matrix, args: argparse.Namespace) -> int:
    targets = _targets(matrix, args.targets)
    results = probe.probe(toolchain.find(), targets)
    features = list(probe.PROBES)
    widths = {f: max(7, len(f)) for f in features}
    print(f"{'target':8}  " + "  ".join(f"{f:>{widths[f]}}" for f in features))
    mismatches = []
    for target in targets:
        if target.name not in results:
            continue
        got, want = results[target.name], probe.claimed(target)
        cells = []
        for f in features:
            mark = "yes" if got[f] else "no"
            if got[f] != want[f]:
                mark += "!"
                mismatches.append(f"{target.name}: {f} is {'accepted' if got[f] else 'rejected'} by the "
                                  f"compiler but variants.yaml says {'yes' if want[f] else 'no'}")
            cells.append(f"{mark:>{widths[f]}}")
        print(f"{target.name:8}  " + "  ".join(cells))
    if mismatches:
        print("probe: variants.yaml disagrees with the compiler:\n  " + "\n  ".join(mismatches), file=sys.stderr)
        return 1
    print("probe: every claim in variants.yaml matches the compiler")
    return 0


def _package_targets(matrix: Matrix, args: argparse.Namespace) -> tuple[list[Target], str]:
    """The targets a kernel wheel holds (a family's opt-in GPU targets, or --targets) and its name."""
    if args.family:
        targets = [t for t in matrix.targets if t.family == args.family and not t.default and t.platform != "host"]
        if not targets:
            families = sorted({t.family for t in matrix.targets if not t.default and t.platform != "host"})
            raise packaging.PackagingError(f"family {args.family!r} has no opt-in GPU targets; families that do: "
                                           f"{', '.join(families)}")
        return targets, args.name or args.family
    if not args.name:
        raise packaging.PackagingError("name the distribution: --family FAMILY, or --targets LIST --name NAME")
    return _targets(matrix, args.targets), args.name


def cmd_package(matrix: Matrix, args: argparse.Namespace) -> int:
    targets, name = _package_targets(matrix, args)
    packaging.refuse_host(targets)
    build.build(matrix, targets, args.build_dir, jobs=args.jobs)
    wheel = packaging.kernel_wheel(name, targets, args.build_dir.resolve(), args.out)
    print(f"package: {wheel} ({wheel.stat().st_size // 1024} KiB; {', '.join(t.name for t in targets)})")
    return 0


def cmd_docs(matrix: Matrix, args: argparse.Namespace) -> int:
    targets = [t for t in _targets(matrix, args.targets) if t.platform != "host"]
    audited = targets
    if args.audit != "all":
        if not args.check:
            raise docs.DocsError("--audit names the targets --check compiles; writing the page audits every target "
                                 "(leave --audit out)")
        build_dir = args.build_dir.resolve()
        chosen = ({t.name for t in targets if (build_dir / t.name / "audit.json").is_file()} if args.audit == "built"
                  else {t.name for t in _targets(matrix, args.audit)})
        # whole instruction sets: their targets share a compile and a row (docs.hardware_md)
        isas = {matrix.target(n).isa for n in chosen}
        audited = [t for t in targets if t.isa in isas]
    rows = build.build(matrix, audited, args.build_dir, jobs=args.jobs,
                       audit_processes=args.jobs or os.cpu_count() or 1)
    gen_root = args.build_dir.resolve() / "gen"
    with build.one_builder(args.build_dir.resolve()):
        generate(matrix, [t for t in targets if t not in audited], gen_root)
        inputs = {t.name: build.audit_inputs(t, gen_root) for t in targets}
    text = docs.hardware_md(matrix, rows, toolchain.find().identity, inputs)
    if args.check:
        current = args.out.read_text() if args.out.is_file() else ""
        unaudited = {t.name for t in targets if t not in audited}
        if unaudited:
            current = docs.without_audit_rows(current, unaudited)
        if current != text:
            print(f"rdnattention-gen: error: {args.out} is out of date; run: rdnattention-gen docs", file=sys.stderr)
            return 1
        held = f" ({len(unaudited)} target(s) held to their sources' digest: {', '.join(sorted(unaudited))})" \
            if unaudited else ""
        print(f"docs: {args.out} is up to date{held}")
        return 0
    changed = write_if_changed(args.out, text)
    print(f"docs: {args.out} {'written' if changed else 'unchanged'}")
    return 0


def cmd_tune(matrix: Matrix, args: argparse.Namespace) -> int:
    targets = _targets(matrix, args.targets)
    if len(targets) != 1:
        raise tune.TuneError(f"tune one target at a time; --targets names {len(targets)}")
    target = targets[0]
    if args.write and args.family == "bwd":
        raise tune.TuneError("--write: the backward's tiles are set in variants.yaml (its passes share one tile, "
                             "which the tuned overlay cannot name); --measure prints what each one times")
    if not 0 <= args.min_gain < 1:
        raise tune.TuneError(f"--min-gain {args.min_gain} must be a share in [0, 1), e.g. 0.02 for 2%")
    build_dir = args.build_dir.resolve()
    if args.no_build:
        family_name, cands = tune.load_candidates(build_dir, target)
    else:
        head_dims = tune.parse_ints("--head-dims", args.head_dims)
        groups = tune.parse_ints("--groups", args.groups)
        family_name = args.family
        cands = tune.prepare(matrix, target, family_name, head_dims, groups, build_dir,
                             tune.parse_space(args.space), jobs=args.jobs)
        tune.save_candidates(build_dir, target, family_name, cands)
    print(tune.rank_table(cands))
    live = sum(1 for c in cands if not c.problems)
    print(f"tune: {live} of {len(cands)} kernels pass the audit")
    if not args.measure:
        return 0
    results = tune.measure(build_dir, target, cands, args.rounds, args.seq)
    tune.save_measurements(build_dir, results)
    best = tune.winners(cands, results, tune.matrix_tiles(matrix, target, family_name, results, args.seq))
    harness = tune.HARNESSES[family_name]
    for w in best:
        ref = w["reference"]
        base = (f", {'matrix tile' if ref and ref.spec.tile == w['base_tile'] else 'current'} {ref.label} "
                f"{w['baseline']:.4g}" if ref else "")
        print(f"tune: head_dim {w['head_dim']} group {w['gqa_group']} {tune.when_text(w['when'])}: "
              f"{w['winner'].label} {w['figure']:.4g} {harness.unit}{base}")
    if args.write:
        facts = tune.device_facts()
        command = "rdnattention-gen " + " ".join(sys.argv[1:]) if sys.argv[1:] else "rdnattention-gen tune"
        path = args.tuned / f"{target.name}.yaml"
        text = tune.tuned_yaml(target, family_name, best, facts, _toolchain_identity(build_dir, target), command,
                               previous=path.read_text() if path.is_file() else None, min_gain=args.min_gain)
        chart = path.with_name(f"{target.name}-{family_name}.svg")  # one chart per family and target
        write_if_changed(path, text)
        write_if_changed(chart, tune.chart_svg(best, f"{family_name} tiles on {facts['device']} "
                                                     f"({harness.title(args.seq)})"))
        print(f"tune: wrote {path} and {chart}")
    return 0


def _toolchain_identity(build_dir: Path, target: Target) -> str:
    stamp = build_dir / target.name / "toolchain.txt"
    return stamp.read_text().strip().splitlines()[0] if stamp.is_file() else "unknown"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rdnattention-gen", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, fn, help: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.set_defaults(fn=fn)
        sp.add_argument("--targets", default="default",
                        help="default, all (every GPU target), host, or a comma list such as gfx1030,gfx906")
        sp.add_argument("--variants", type=Path, default=DEFAULT_VARIANTS, help="the matrix file (default: %(default)s)")
        sp.add_argument("--tuned", type=Path, default=TUNED_DIR,
                        help="directory of tuned/<target>.yaml overlays (default: %(default)s)")
        sp.add_argument("--build-dir", type=Path, default=Path("build"), help="output directory (default: %(default)s)")
        return sp

    def narrowing(sp: argparse.ArgumentParser, chosen=lambda m, args: _targets(m, args.targets)):
        """--head-dims for a command; ``chosen(matrix, args)`` gives the targets it narrows."""
        sp.set_defaults(narrowed_targets=chosen)
        sp.add_argument("--head-dims", dest="keep_head_dims", type=_head_dim_list, default=None, metavar="LIST",
                        help="only these head_dims, a comma list such as 64,128, of each family the targets build "
                             "(the append and quantization kernels take any head_dim and stay); a build takes a "
                             "fraction of the time, and calls at other head_dims are refused (default: all)")
        return sp

    narrowing(add("list", cmd_list, "show targets and the kernels each gets"))
    narrowing(add("generate", cmd_generate, "render kernel sources into BUILD_DIR/gen"))
    b = narrowing(add("build", cmd_build, "generate, compile with ninja, audit, write dispatch tables"))
    b.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: ninja's choice)")
    b.add_argument("--user", action="store_true",
                   help="build into the per-user kernel directory the runtime searches (instead of --build-dir)")
    k = narrowing(add("package", cmd_package,
                      "build targets and pack them as a kernel wheel, rdnattention-kernels-NAME"),
                  lambda m, args: _package_targets(m, args)[0])  # the wheel's targets
    k.set_defaults(targets="")
    k.add_argument("--family", help="every opt-in target of this family (rdna1, rdna3, gcn5, ...); NAME defaults to it")
    k.add_argument("--name", help="the distribution's name: rdnattention-kernels-NAME")
    k.add_argument("--out", type=Path, default=Path("dist"), help="where the wheel goes (default: %(default)s)")
    k.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: ninja's choice)")
    a = narrowing(add("audit", cmd_audit, "report the resources of built kernels and enforce the rules"))
    a.add_argument("--json", action="store_true", help="print a JSON list, one object per kernel")
    d = add("docs", cmd_docs, "build every GPU target and regenerate docs/hardware.md from the matrix and audit")
    d.set_defaults(targets="all")
    d.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: ninja's choice)")
    d.add_argument("--out", type=Path, default=Path("docs") / "hardware.md", help="output file (default: %(default)s)")
    d.add_argument("--check", action="store_true", help="fail if the file differs instead of writing it")
    d.add_argument("--audit", default="all",
                   help="with --check: the targets compiled and audited, as a target list or `built` (those the build "
                        "directory holds an audit of); the others' rows are held to the digest of their sources the "
                        "page records (default: %(default)s)")
    add("probe", cmd_probe, "compile tiny probes per target and check variants.yaml's feature claims")
    t = add("tune", cmd_tune, "build tile candidates for one target, prune by the audit, rank by the cost "
                              "model; with --measure time them on the GPU, with --write record the winners")
    t.set_defaults(build_dir=Path("build") / "tune")
    t.add_argument("--family", default="f16", help="the kernel family to tune (default: %(default)s)")
    t.add_argument("--head-dims", default="64,128", help="comma list (default: %(default)s)")
    t.add_argument("--groups", default="1,2", help="GQA groups to build and time (default: %(default)s)")
    t.add_argument("--space", help="override the tile space, e.g. 'br=64,128 tm=4,8 waves=0,6'")
    t.add_argument("--no-build", action="store_true", help="use the candidates already built in --build-dir")
    t.add_argument("--measure", action="store_true", help="time the candidates on the GPU (needs the target's GPU)")
    t.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default: %(default)s)")
    t.add_argument("--min-gain", type=float, default=0.02,
                   help="--write only winners faster than the tile they replace by more than this share "
                        "(default: %(default)s, the spread of repeated runs)")
    t.add_argument("--seq", type=int, default=2048, help="sequence length of the timed calls: query rows and keys (decode: 16 x seq keys) (default: %(default)s)")
    t.add_argument("--write", action="store_true", help="write tuned/<target>.yaml and its chart (with --measure)")
    t.add_argument("-j", "--jobs", type=int, default=None, help="parallel compiles (default: ninja's choice)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        matrix = load_matrix(args.variants, args.tuned)
        keep = getattr(args, "keep_head_dims", None)
        if keep:
            matrix = matrix.narrowed(keep, [t.name for t in args.narrowed_targets(matrix, args)])
        return args.fn(matrix, args)
    except (VariantsError, toolchain.ToolchainError, build.BuildError, audit.AuditError, NinjaPathError,
            packaging.PackagingError, tune.TuneError, docs.DocsError) as e:
        print(f"rdnattention-gen: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
