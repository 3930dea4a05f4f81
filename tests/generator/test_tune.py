"""Register budgets on tiles, alternates (host mirrors, tuning candidates), the static cost model and
the tuner's CPU side: candidates, pruning, ranking, the overlay it writes and its chart."""

import textwrap
import xml.etree.ElementTree as ET

import pytest

from rdnattention.table import Constraints, KernelEntry, TargetTable
from rdnattention.errors import UnsupportedError
from rdnattention_gen import cost, tune
from rdnattention_gen.audit import KernelAudit
from rdnattention_gen.families import family, spec_from_name
from rdnattention_gen.matrix import ALTERNATE, load_matrix
from rdnattention_gen.spec import KernelSpec, Tile
from rdnattention_gen.strict_yaml import VariantsError
from rdnattention_gen.target import register_budgets
from rdnattention_gen.tuned import load_tuned

from conftest import REPO_ROOT

VARIANTS = REPO_ROOT / "rdnattention_gen" / "variants.yaml"


# --------------------------------------------------------------------------- register budgets

def test_a_register_budget_is_part_of_the_name_only_when_set(matrix):
    t = matrix.target("gfx1030")
    fam = family("f16")
    plain = fam.spec(t, {"head_dim": 128, "gqa_group": 2}, Tile(64, 64, 256, 2))
    capped = fam.spec(t, {"head_dim": 128, "gqa_group": 2}, Tile(64, 64, 256, 2, waves=6))
    assert plain.name == "fa2_f16_hd128_g2_br64_bc64_nt256_tm2_w32_dot2_sf16"
    assert capped.name == "fa2_f16_hd128_g2_br64_bc64_nt256_tm2_wv6_w32_dot2_sf16"
    assert spec_from_name(capped.name) == capped and spec_from_name(plain.name) == plain


def test_a_register_budget_beyond_the_targets_wave_slots_is_refused(tmp_path):
    text = VARIANTS.read_text().replace("{br: 64, bc: 32, threads: 256, tm: 4, waves: 2}",
                                        "{br: 64, bc: 32, threads: 256, tm: 4, waves: 11}")
    (tmp_path / "v.yaml").write_text(text)
    with pytest.raises(VariantsError, match=r"waves 11 must be at most the target's 10 waves per SIMD"):
        load_matrix(tmp_path / "v.yaml", tuned_dir=None)


def test_the_amd_defaults_are_built_for_their_occupancy(matrix):
    """The tables say what the audit must show: gfx1030 at 6 waves per SIMD, gfx906 at 2."""
    for target, waves in (("gfx1030", 6), ("gfx906", 2)):
        t = matrix.target(target)
        for hd in (64, 128):
            (choice,) = [c for c in matrix.tile_choices(t.tiles, "f16", hd) if not c.when.to_json()]
            assert choice.tile.waves == waves, (target, hd)


def test_the_rendered_kernel_carries_its_budget(matrix):
    from rdnattention_gen.render import environment, render_kernel

    fam = family("f16")
    spec = fam.spec(matrix.target("gfx1030"), {"head_dim": 64, "gqa_group": 1}, Tile(128, 32, 256, 2, waves=6))
    assert "RDNA_KERNEL_WAVES(256, 6) void fa2_f16_hd64_g1_br128_bc32_nt256_tm2_wv6" in render_kernel(environment(), spec)
    spec = fam.spec(matrix.target("gfx1030"), {"head_dim": 64, "gqa_group": 1}, Tile(128, 32, 256, 2))
    assert "RDNA_KERNEL(256) void" in render_kernel(environment(), spec)


# --------------------------------------------------------------------------- alternates

def test_host_mirrors_every_tile_of_the_default_amd_targets(matrix):
    target = matrix.target("host")
    host = matrix.variants_for(target)
    have = {(v.spec.family, v.spec.head_dim, v.spec.gqa_group, v.spec.tile) for v in host}
    for gpu in ("gfx1030", "gfx906"):
        for v in matrix.variants_for(matrix.target(gpu)):
            if not target.builds(v.spec.family, v.spec.head_dim):  # the host's head_dims: a subset (variants.yaml)
                continue
            assert (v.spec.family, v.spec.head_dim, v.spec.gqa_group, v.spec.tile) in have, (gpu, v.spec.name)
    alternates = [v for v in host if v.priority == ALTERNATE]
    assert alternates and all(v.provenance.startswith("mirrors ") for v in alternates)
    # The forward row-block tiles' occupancy targets (the backward's tiles set none: waves 0)
    forward = [v for v in alternates if v.spec.family != "bwd"]
    assert {v.spec.tile.waves for v in forward if not v.spec.option("dtype")} == {2, 6}
    # The bf16 kernels mirror their own tiles: RDNA's head_dim 128 at 5 waves (variants.yaml f16_bf16)
    assert {v.spec.tile.waves for v in forward if v.spec.option("dtype") == "bf16"} == {2, 5, 6}
    assert {v.spec.tile.waves for v in alternates if v.spec.family == "bwd"} == {0}


def test_only_host_targets_mirror(tmp_path):
    text = VARIANTS.read_text().replace("    tiles: rdna\n  gfx1031:", "    tiles: rdna\n    mirrors: [gfx906]\n  gfx1031:")
    (tmp_path / "v.yaml").write_text(text)
    with pytest.raises(VariantsError, match=r"only host targets mirror other targets' tiles, not amdgcn ones"):
        load_matrix(tmp_path / "v.yaml", tuned_dir=None)


def test_a_mirror_must_stage_as_the_host_does(tmp_path):
    text = VARIANTS.read_text().replace("mirrors: [gfx1030, gfx906]", "mirrors: [gfx1030, sm_90]")
    (tmp_path / "v.yaml").write_text(text)
    with pytest.raises(VariantsError, match=r"targets.host.mirrors: 'sm_90' must name a GPU target that stages in f16"):
        load_matrix(tmp_path / "v.yaml", tuned_dir=None)


def _entry(name, priority, group=1):
    return KernelEntry(name=name, family="f16", head_dim=64, gqa_group=group, tier="cvt_fma", threads=256, br=64,
                       bc=32, tm=4, lds_bytes=1, priority=priority, when=Constraints(), provenance="x", args_digest="d")


def test_an_alternate_runs_only_when_named():
    table = TargetTable("host", "host", REPO_ROOT / "x", False, (_entry("base", 0), _entry("alt", ALTERNATE, 2)))
    assert table.select("f16", head_dim=64, heads_per_kv=2, causal=False, seq_q=8).name == "base"
    assert table.select("f16", head_dim=64, heads_per_kv=2, causal=False, seq_q=8, kernel="alt").name == "alt"
    only = TargetTable("host", "host", REPO_ROOT / "x", False, (_entry("alt", ALTERNATE),))
    with pytest.raises(UnsupportedError, match="no f16 kernel on host serves"):
        only.select("f16", head_dim=64, heads_per_kv=1, causal=False, seq_q=8)


# --------------------------------------------------------------------------- cost model

def _i(address, mnemonic, operands="", target=None):
    return cost.Instruction(address, mnemonic, operands, target)


def test_lds_bytes_by_instruction():
    assert [cost.lds_bytes(m) for m in ("ds_read_b128", "ds_read2_b64", "ds_read2st64_b32", "ds_write_b16",
                                        "ds_read_u16", "ds_bpermute_b32", "ds_add_u32", "v_dot2_f32_f16")] == \
        [16, 16, 8, 2, 2, 4, 0, 0]


def test_the_main_loop_weights_its_rolled_loops_to_the_familys_product_count():
    # key loop 0x00..0x60: 4 products of its own, a rolled loop (0x20..0x30) of 2 products and an
    # LDS read, and a lane-reduction loop without products (0x40..0x48), which counts once.
    code = [_i(0x00, "v_dot2_f32_f16"), _i(0x04, "v_dot2_f32_f16"), _i(0x08, "v_dot2_f32_f16"),
            _i(0x0c, "v_dot2_f32_f16"), _i(0x10, "v_exp_f32"), _i(0x14, "s_waitcnt", "lgkmcnt(0)"),
            _i(0x20, "ds_read_b128"), _i(0x24, "v_dot2_f32_f16"), _i(0x28, "v_dot2_f32_f16"),
            _i(0x2c, "s_waitcnt", "lgkmcnt(0)"), _i(0x30, "s_cbranch_scc1", "", 0x20),
            _i(0x40, "ds_bpermute_b32"), _i(0x48, "s_cbranch_scc0", "", 0x40),
            _i(0x60, "s_cbranch_vccnz", "", 0x00), _i(0x64, "v_mov_b32")]
    counts = cost.loop_counts(code, "v_dot2", products_per_step=20)
    # (20 - 4) / 2 = 8 trips of the rolled loop
    assert counts == cost.LoopCounts(products=20, valu=4 + 4 + 16, lds_bytes=8 * 16 + 4, lds_waits=1 + 8)
    assert cost.loop_counts(code, "v_dot4", products_per_step=20) is None


def test_the_estimate_names_the_bound():
    lds_heavy = cost.LoopCounts(products=100, valu=120, lds_bytes=400, lds_waits=1)
    e = cost.estimate(lds_heavy, waves_per_simd=4, wave_size=32, valu_lanes=32, simds=4, lds_bytes_per_clock=256)
    assert e.bound == "LDS-bound" and e.lds == 4 * 4 * 400 * 32 / 256 and e.share == pytest.approx(400 / e.lds)
    dots = cost.LoopCounts(products=100, valu=120, lds_bytes=10, lds_waits=1)
    e = cost.estimate(dots, waves_per_simd=4, wave_size=32, valu_lanes=32, simds=4, lds_bytes_per_clock=256)
    assert e.bound == "dot-bound" and e.share == pytest.approx(100 / 120)
    e = cost.estimate(dots, waves_per_simd=1, wave_size=64, valu_lanes=16, simds=4, lds_bytes_per_clock=128)
    assert e.bound == "latency-bound" and e.latency == 120 * 4 + 64
    valu = cost.LoopCounts(products=10, valu=120, lds_bytes=10, lds_waits=0)
    assert cost.estimate(valu, waves_per_simd=4, wave_size=32, valu_lanes=32, simds=4,
                         lds_bytes_per_clock=256).bound == "VALU-bound"


def test_the_audit_estimates_the_amd_defaults(default_audit):
    """The model runs on every default row-block kernel; the occupancy-first defaults do not lose to
    the tiles they replace by its estimate (the lds64k ones, which the host still builds)."""
    rows = [r for r in default_audit if r.name.startswith("fa2_f16_hd")]
    assert rows and all(r.bound in ("dot-bound", "VALU-bound", "LDS-bound", "latency-bound") for r in rows)
    assert all(0 < r.peak_share <= 1 and r.loop["products"] > 0 for r in rows)
    for target, waves in (("gfx1030", 6), ("gfx906", 2)):
        for hd in (64, 128):
            (row,) = [r for r in rows if r.target == target and f"_hd{hd}_g2_" in r.name]
            assert row.waves_per_simd >= waves and row.vgpr_spills == 0 and row.scratch_bytes == 0, row


# --------------------------------------------------------------------------- the tuner

def test_register_budgets_follow_the_register_file(matrix):
    assert register_budgets(matrix.target("gfx1030")) == (5, 6, 7, 8)
    assert register_budgets(matrix.target("gfx906")) == (2,)
    assert register_budgets(matrix.target("sm_90")) == (3, 4)


def test_the_space_can_be_narrowed_and_bad_spaces_are_named(matrix):
    space = tune.parse_space("br=64,128 tm=4 waves=0,6")
    assert space == {"br": (64, 128), "tm": (4,), "waves": (0, 6)}
    cands = tune.candidates(matrix, matrix.target("gfx1030"), "f16", [128], space)
    tiles = {t for _, _, t in cands}
    assert Tile(64, 64, 256, 4, 6) in tiles and Tile(128, 16, 256, 4, 6) in tiles  # 43136 B: 6 waves
    # a budget above what the tile's LDS allows is not built: with 32 keys per step 128 rows at
    # head_dim 128 take 51 KB, 4 waves
    assert Tile(128, 32, 256, 4, 0) in tiles and Tile(128, 32, 256, 4, 6) not in tiles
    for bad, match in (("rows=4", "not FIELD=V1,V2"), ("br=x", "must be integers"), ("br=", "not FIELD")):
        with pytest.raises(tune.TuneError, match=match):
            tune.parse_space(bad)


def test_int8_decode_has_its_own_tile_space_and_product_count(matrix):
    """i8dec is dec's algorithm over int8 rows: lane groups of head_dim / 16 lanes (16 int8 values a
    lane), so its candidates are decode tiles, and each step issues four dot4 per key a lane holds."""
    fam = family("i8dec")
    for target in ("gfx1030", "gfx906", "sm_90"):
        cands = tune.candidates(matrix, matrix.target(target), "i8dec", [64, 128], {})
        assert cands and all(t.br == t.tm and t.threads == 128 for _, _, t in cands), target
        assert {hd for _, hd, _ in cands} == {64, 128}
    # head_dim 64: 4 lanes a key, 32 lane groups; 64 keys a step is two keys a lane group.
    (spec,) = [v.spec for v in matrix.variants_for(matrix.target("gfx1030"))
               if v.spec.family == "i8dec" and v.spec.head_dim == 64]
    assert (spec.tile.br, spec.tile.bc) == (1, 64) and fam.products_per_step(spec) == 2 * 4
    # 16 keys a step fill dec's 16 lane groups of 8 lanes at head_dim 64, not i8dec's 32 groups of 4.
    assert tune.candidates(matrix, matrix.target("gfx1030"), "dec", [64], {"bc": (16,)})
    assert not tune.candidates(matrix, matrix.target("gfx1030"), "i8dec", [64], {"bc": (16,)})


def _candidate(label_tile, default=False, problems=()):
    spec = KernelSpec(family="f16", head_dim=128, gqa_group=1, tile=label_tile, wave_size=32, tier="cvt_fma",
                      stage="f32")
    return tune.Candidate(spec, None, tuple(problems), default)


def test_the_overlay_written_loads_and_keeps_what_was_not_measured(matrix, tmp_path):
    base, better = _candidate(Tile(128, 64, 256, 8), default=True), _candidate(Tile(64, 64, 128, 8, waves=3))
    cands = [base, better]
    # causal: the dispatcher already picks `better` (an earlier overlay); the entry must be written
    # again, against the matrix's own tile
    causal, full = (("causal", True),), (("causal", False),)
    results = {(128, 1, causal): {"figures": {base.spec.name: 30.0, better.spec.name: 33.0}, "default": better.spec.name},
               (128, 1, full): {"figures": {base.spec.name: 35.0, better.spec.name: 34.0}, "default": base.spec.name}}
    matrix_tiles = tune.matrix_tiles(matrix, matrix.target("sm_90"), "f16", results, 2048)
    assert matrix_tiles == {(128, 1, causal): Tile(128, 64, 256, 8), (128, 1, full): Tile(128, 64, 256, 8)}
    best = tune.winners(cands, results, matrix_tiles)
    assert [(w["when"], w["winner"].label) for w in best] == [(full, "br128_bc64_nt256_tm8"),
                                                               (causal, "br64_bc64_nt128_tm8_wv3")]
    previous = textwrap.dedent("""\
        target: sm_90
        entries:
          - family: i8
            head_dim: 64
            tile: {br: 64, bc: 64, threads: 256, tm: 4}
            measured: {device: X, toolchain: Y, date: 2026-11-01, figures: {tops: 1.0}}
          - family: f16
            head_dim: 64
            tile: {br: 64, bc: 64, threads: 256, tm: 4}
            measured: {device: X, toolchain: Y, date: 2026-11-01, figures: {tflops: 1.0}}
          - family: f16
            head_dim: 128
            gqa_group: 1
            when: {causal: true}
            tile: {br: 64, bc: 64, threads: 128, tm: 8, waves: 3}
            measured: {device: X, toolchain: Y, date: 2026-11-01, figures: {tflops: 1.0}}
        """)
    text = tune.tuned_yaml(matrix.target("sm_90"), "f16", best, {"device": "NVIDIA H200", "clocks": "1980 MHz SM"},
                           "clang version 22", "rdnattention-gen tune --targets sm_90 --measure --write", previous)
    (tmp_path / "sm_90.yaml").write_text(text)
    target, entries = load_tuned(tmp_path / "sm_90.yaml", {"sm_90"}, matrix.kernels)
    assert [(e.family, e.head_dim, e.gqa_group, e.when, e.tile) for e in entries] == [
        ("i8", 64, None, Constraints(), Tile(64, 64, 256, 4)),  # another family's entry stays
        ("f16", 64, None, Constraints(), Tile(64, 64, 256, 4)),  # a key this run did not measure stays
        ("f16", 128, 1, Constraints(causal=True), Tile(64, 64, 128, 8, waves=3))]  # re-measured: replaced
    f16 = entries[2].measured
    assert f16["figures"] == {"tflops": 33.0, "baseline_tflops": 30.0} and f16["clocks"] == "1980 MHz SM"
    assert f16["candidates"] == {"br64_bc64_nt128_tm8_wv3": 33.0, "br128_bc64_nt256_tm8": 30.0}
    ET.fromstring(tune.chart_svg(best, "f16 tiles <H200>"))  # well-formed, title escaped


def test_rank_puts_pruned_candidates_last():
    def row(share, waves):
        return KernelAudit(target="t", name="n", vgprs=1, sgprs=1, vgpr_spills=0, sgpr_spills=0, scratch_bytes=0,
                           lds_bytes=0, wave_size=32, waves_per_simd=waves, dot2=0, dot4=0, fma_mix=0, mad_mix=0,
                           cvt_f32_f16=0, peak_share=share)
    a = tune.Candidate(_candidate(Tile(64, 32, 256, 4)).spec, row(0.5, 6), (), False)
    b = tune.Candidate(_candidate(Tile(64, 64, 256, 4)).spec, row(0.6, 4), (), True)
    c = tune.Candidate(_candidate(Tile(128, 64, 256, 8)).spec, row(0.9, 4), ("spills 3 VGPRs",), False)
    assert tune.rank([a, c, b]) == [b, a, c]
    table = tune.rank_table([a, b, c])
    assert "pruned: spills 3 VGPRs" in table and "| default |" in table


@pytest.mark.slow
def test_tune_builds_ranks_and_refuses_measuring_without_the_gpu(tmp_path):
    """End to end on the CPU: a narrow space for gfx1030, built and audited, then --measure refused."""
    import subprocess
    import sys

    cli = [sys.executable, "-m", "rdnattention_gen.cli", "tune", "--targets", "gfx1030", "--head-dims", "64",
           "--groups", "1", "--space", "br=128 bc=32 threads=256 tm=2,4 waves=0,6", "--build-dir", str(tmp_path)]
    out = subprocess.run(cli, capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert "tune: 4 f16 tile(s) for gfx1030" in out.stdout and "| 64 | 1 | br128_bc32_nt256_tm2_wv6 |" in out.stdout
    again = subprocess.run(cli + ["--no-build", "--measure"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert again.returncode == 2
    assert "rdnattention-gen: error: --measure needs the gfx1030 GPU; torch sees no GPU here" in again.stderr
    other = subprocess.run(cli[:5] + ["gfx906"] + cli[6:] + ["--no-build"], capture_output=True, text=True,
                           cwd=REPO_ROOT)
    assert other.returncode == 2 and "tune.json holds gfx1030 candidates, not gfx906's" in other.stderr
    (tmp_path / "tune.json").write_text("{not json")
    broken = subprocess.run(cli + ["--no-build"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert broken.returncode == 2 and "tune.json: not a candidate list this version wrote" in broken.stderr
    bad = subprocess.run(cli[:5] + ["gfx1030,gfx906"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert bad.returncode == 2 and "tune one target at a time" in bad.stderr
    for args, message in ((["--groups", "4"], "f16 has no GQA group [4]; its groups: [1, 2]"),
                          (["--head-dims", "64,x"], "--head-dims: '64,x' is not a comma list of integers"),
                          (["--head-dims", "84"], "f16 is not built for head_dim [84]"),
                          (["--family", "f17"], "no kernel family 'f17'"),
                          (["--family", "append", "--head-dims", "512", "--measure"], "append has no tile space to tune")):
        bad = subprocess.run(cli[:5] + ["gfx1030"] + args + ["--build-dir", str(tmp_path / "bad")],
                             capture_output=True, text=True, cwd=REPO_ROOT)
        assert bad.returncode == 2 and f"rdnattention-gen: error: {message}" in bad.stderr, bad.stderr


def test_sass_listings_resolve_labels_for_the_loop_analysis():
    text = textwrap.dedent("""\
            Function : fa2_x
        .headerflags    @"EF_CUDA_SM90"
            /*0000*/                   MOV R1, c[0x0][0x28] ;
        .L_x_1:
            /*0010*/                   LDS.128 R4, [R2] ;
            /*0020*/                   FFMA R8, R4, R5, R8 ;
            /*0030*/                   FFMA R9, R6, R7, R9 ;
            /*0040*/                   MUFU.EX2 R10, R10 ;
            /*0050*/               @P0 BRA `(.L_x_1) ;
            /*0060*/              @!P1 BRA 0x20 ;
            /*0070*/                   EXIT ;
            Function : fa2_y
            /*0000*/                   EXIT ;
        """)
    code = cost.parse_sass(text)
    assert sorted(code) == ["fa2_x", "fa2_y"]
    assert code["fa2_x"][5] == cost.Instruction(0x50, "BRA", "`(.L_x_1)", 0x10)
    assert code["fa2_x"][6] == cost.Instruction(0x60, "BRA", "0x20", 0x20)  # cuobjdump spells addresses
    counts = cost.loop_counts(code["fa2_x"], "FFMA", None, cost.SASS)
    assert counts == cost.LoopCounts(products=2, valu=1 + 2 + 4, lds_bytes=16, lds_waits=0)


@pytest.mark.slow
def test_tune_runs_end_to_end_on_the_host_emulator(tmp_path):
    """The whole tuner (build, audit, oracle check, interleaved timing, overlay, chart) on the host
    platform, which times nothing meaningful but runs every step the GPU run does."""
    import subprocess
    import sys

    tuned = tmp_path / "tuned"
    tuned.mkdir()
    cli = [sys.executable, "-m", "rdnattention_gen.cli", "tune", "--targets", "host", "--head-dims", "64",
           "--groups", "1", "--space", "br=64 bc=32 threads=256 tm=2,4 waves=0", "--build-dir", str(tmp_path / "b"),
           "--tuned", str(tuned), "--measure", "--write", "--seq", "64", "--rounds", "1"]
    out = subprocess.run(cli, capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "tune: head_dim 64 group 1 causal=False:" in out.stdout
    measured = __import__("json").loads((tmp_path / "b" / "measured.json").read_text())
    assert {m["when"]["causal"] for m in measured} == {False, True}
    # the default tile and both candidates were timed (and passed the oracle), plus the mirrored AMD tiles
    assert all(len(m["figures"]) >= 3 for m in measured)
    written = tuned / "host.yaml"
    assert written.is_file() and (tuned / "host-f16.svg").is_file()
    ET.fromstring((tuned / "host-f16.svg").read_text())
    load_tuned(written, {"host"}, load_matrix(tuned_dir=None).kernels)  # strict loader accepts what it wrote


def test_the_fma_peak_probe_is_in_every_code_object_and_runs_on_the_host(host_build, monkeypatch):
    """The benchmark's and the tuner's FP32 FMA peak comes from a probe kernel our toolchain builds
    into each target's code object (no nvcc, no hipcc); on the host it runs, meaninglessly fast or slow."""
    import torch

    from rdnattention import peak
    from rdnattention_gen.render import environment, render_fma_peak

    monkeypatch.setenv("RDNATTENTION_HOST_TARGET", "host")
    assert peak.fma_peak_tflops(torch.device("cpu"), iters=1, reps=1) > 0
    text = render_fma_peak(environment(), load_matrix().target("gfx1030"))
    assert f"RDNA_KERNEL(256) void {peak.KERNEL}(const RdnaFmaPeakArgs a)" in text
    for name, ctype in peak.ARGS.fields:
        assert f"  {ctype} {name};" in text


@pytest.mark.slow
def test_tune_measures_the_int8_family_on_the_host_emulator(tmp_path):
    """The int8 harness: quantized inputs, forced int8 plans, the dequantized oracle, an overlay."""
    import subprocess
    import sys

    tuned = tmp_path / "tuned"
    tuned.mkdir()
    cli = [sys.executable, "-m", "rdnattention_gen.cli", "tune", "--targets", "host", "--family", "i8",
           "--head-dims", "64", "--groups", "1", "--space", "br=64 bc=64 threads=256 tm=2,4 waves=0",
           "--build-dir", str(tmp_path / "b"), "--tuned", str(tuned), "--measure", "--write", "--seq", "64",
           "--rounds", "1"]
    out = subprocess.run(cli, capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "wrong against the oracle" not in out.stdout
    measured = __import__("json").loads((tmp_path / "b" / "measured.json").read_text())
    assert {m["when"]["causal"] for m in measured} == {False, True} and all(len(m["figures"]) >= 2 for m in measured)
    load_tuned(tuned / "host.yaml", {"host"}, load_matrix(tuned_dir=None).kernels)


@pytest.mark.slow
def test_tune_measures_the_decode_family_on_the_host_emulator(tmp_path):
    """The decode harness: one query position per GQA head, 1-8 rows per K/V head, each row count
    a key of its own (`when: {rows: [r, r]}`), in GB/s; what it writes loads."""
    import json
    import subprocess
    import sys

    tuned = tmp_path / "tuned"
    tuned.mkdir()
    cli = [sys.executable, "-m", "rdnattention_gen.cli", "tune", "--targets", "host", "--family", "dec",
           "--head-dims", "64", "--space", "br=1,4 tm=1,4 bc=32 threads=128 waves=0",
           "--build-dir", str(tmp_path / "b"), "--tuned", str(tuned), "--measure", "--write", "--seq", "32",
           "--rounds", "1"]
    out = subprocess.run(cli, capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "wrong against the oracle" not in out.stdout
    assert "tune: head_dim 64 group 1 rows=4..4:" in out.stdout and "GB/s" in out.stdout
    measured = json.loads((tmp_path / "b" / "measured.json").read_text())
    assert sorted(m["when"]["rows"][0] for m in measured) == [1, 2, 4, 8]
    assert all(len(m["figures"]) >= 2 for m in measured)  # the space's tiles (and the defaults)
    written = tuned / "host.yaml"
    if written.is_file():  # only winners that differ from the matrix's tiles are written
        target, entries = load_tuned(written, {"host"}, load_matrix(tuned_dir=None).kernels)
        assert all(e.family == "dec" and e.gqa_group is None and e.when.rows for e in entries)
        assert all("gbps" in e.measured["figures"] for e in entries)
        overlaid = load_matrix(tuned_dir=tuned)  # the overlay merges over the tile tables
        names = {v.spec.name for v in overlaid.variants_for(overlaid.target("host")) if v.spec.family == "dec"}
        assert all(any(f"_br{e.tile.br}_bc{e.tile.bc}_nt{e.tile.threads}_tm{e.tile.tm}_" in n for n in names)
                   for e in entries)
    ET.fromstring((tuned / "host-dec.svg").read_text())


@pytest.mark.slow
def test_tune_measures_the_backward_on_the_host_emulator(tmp_path):
    """The backward harness: each tile's passes built and forced as a set, the atomic and the
    deterministic passes each a key of their own, every set checked against the oracle's gradients
    before it is timed; the dispatcher's pick of each mode named as that key's default."""
    import json
    import subprocess
    import sys

    cli = [sys.executable, "-m", "rdnattention_gen.cli", "tune", "--targets", "host", "--family", "bwd",
           "--head-dims", "64", "--groups", "1", "--space", "br=32 bc=32 threads=128,256 tm=1 waves=0",
           "--build-dir", str(tmp_path / "b"), "--measure", "--seq", "64", "--rounds", "1"]
    out = subprocess.run(cli, capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "wrong against the oracle" not in out.stdout
    assert "(atomic)" in out.stdout and "(dqcast)" in out.stdout and "(pre)" in out.stdout  # the sets' passes built
    measured = json.loads((tmp_path / "b" / "measured.json").read_text())
    assert sorted(m["when"]["passes"] for m in measured) == ["atomic", "deterministic"]
    for m in measured:
        prefix = "fa2_bwdatomic_" if m["when"]["passes"] == "atomic" else "fa2_bwd_"
        assert len(m["figures"]) == 2 and all(n.startswith(prefix) for n in m["figures"])
        assert m["default"] in m["figures"]


def test_tune_refuses_to_write_backward_tiles(tmp_path):
    import subprocess
    import sys

    cli = [sys.executable, "-m", "rdnattention_gen.cli", "tune", "--targets", "host", "--family", "bwd",
           "--build-dir", str(tmp_path / "b"), "--tuned", str(tmp_path), "--measure", "--write"]
    out = subprocess.run(cli, capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode != 0 and "--write: the backward's tiles are set in variants.yaml" in out.stderr
    assert not (tmp_path / "b").exists()  # refused before anything is built


def test_tuned_entries_serve_every_layout_of_their_family(tmp_path):
    """One tile table per algorithm: f16's tuned tile serves its len and varlen kernels, dec's its
    paged ones."""
    (tmp_path / "sm_90.yaml").write_text(textwrap.dedent("""\
        target: sm_90
        entries:
          - family: f16
            head_dim: 64
            when: {causal: true}
            tile: {br: 64, bc: 32, threads: 128, tm: 4}
            measured: {device: X, toolchain: Y, date: 2026-11-01, figures: {tflops: 1.0}}
          - family: dec
            head_dim: 128
            when: {rows: [2, 2]}
            tile: {br: 2, bc: 32, threads: 128, tm: 2, waves: 3}
            measured: {device: X, toolchain: Y, date: 2026-11-01, figures: {gbps: 1.0}}
        """))
    matrix = load_matrix(tuned_dir=tmp_path)
    variants = matrix.variants_for(matrix.target("sm_90"))

    def tuned(family, hd, layout=None, dtype=None):
        return {(v.spec.tile.br, v.spec.tile.bc, v.spec.tile.tm) for v in variants
                if v.spec.family == family and v.spec.option("layout") == layout and v.spec.head_dim == hd
                and v.spec.option("dtype") == dtype and v.provenance == "tuned/sm_90.yaml"}

    # ... and its bf16 kernels (the same main loop on sm_90: fp32 pairs staged)
    assert tuned("f16", 64) == tuned("f16", 64, "len") == tuned("f16", 64, "varlen") == {(64, 32, 4)}
    assert tuned("f16", 64, dtype="bf16") == tuned("f16", 64, "varlen", "bf16") == {(64, 32, 4)}
    assert tuned("dec", 128) == tuned("dec", 128, "paged") == tuned("dec", 128, "paged", "bf16") == {(2, 32, 2)}
