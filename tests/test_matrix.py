"""variants.yaml loading: the shipped matrix, spec names, and exact error messages."""

from pathlib import Path

import pytest

from rdnattention_gen.matrix import DEFAULT_VARIANTS, KernelSpec, Tier, Tile, load_matrix
from rdnattention_gen.strict_yaml import VariantsError

DEFAULT_TARGETS = ["gfx1030", "gfx1031", "gfx1032", "gfx1033", "gfx1034", "gfx1035", "gfx1036",
                   "gfx1011", "gfx1012", "gfx906"]


def test_shipped_matrix_lists_the_seed_targets(matrix):
    assert [t.name for t in matrix.select("default")] == DEFAULT_TARGETS
    names = {t.name for t in matrix.targets}
    assert {"gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1200", "gfx1201"} <= names
    assert {"gfx1010", "gfx904", "gfx900", "gfx902", "gfx90c", "gfx803", "host", "host_f32"} <= names
    assert {"sm_90", "sm_61", "sm_60"} <= names


@pytest.mark.parametrize("name, tier, wave", [
    ("gfx1030", Tier.DOT2, 32), ("gfx906", Tier.DOT2, 64), ("gfx1010", Tier.FMA_MIX, 32),
    ("gfx904", Tier.FMA_MIX, 64), ("gfx900", Tier.MAD_MIX, 64), ("gfx803", Tier.CVT_FMA, 64),
    ("gfx1100", Tier.DOT2, 32), ("host", Tier.CVT_FMA, 32), ("sm_90", Tier.CVT_FMA, 32), ("sm_61", Tier.CVT_FMA, 32),
])
def test_tier_and_wave_follow_the_hardware(matrix, name, tier, wave):
    target = matrix.target(name)
    assert (target.tier, target.wave_size) == (tier, wave)


def test_every_spec_name_round_trips(matrix):
    specs = {s for t in matrix.targets for s in matrix.specs_for(t)}
    assert specs
    for spec in specs:
        assert KernelSpec.from_name(spec.name) == spec


def test_name_spells_every_field():
    spec = KernelSpec(kind="f16", head_dim=128, gqa_group=2, tile=Tile(br=128, bc=32, threads=256, tm=8),
                      wave_size=64, tier=Tier.MAD_MIX, stage="f16")
    assert spec.name == "fa2_f16_hd128_g2_br128_bc32_nt256_tm8_w64_mad_mix_sf16"
    with pytest.raises(ValueError, match="not a kernel name"):
        KernelSpec.from_name("fa2_f16_hd128")


def test_target_selection(matrix):
    assert [t.name for t in matrix.select("gfx906,gfx1030,gfx906")] == ["gfx906", "gfx1030"]
    assert "host" not in {t.name for t in matrix.select("all")}
    with pytest.raises(VariantsError, match=r"^variants.yaml: unknown target\(s\) gfx9999; known: "):
        matrix.select("gfx9999")


MINIMAL = """\
platforms:
  amdgcn: {description: gpu, code_object: hsaco}
targets:
  gfx1030:
    platform: amdgcn
    family: rdna2
    parts: test card
    wave_size: 32
    lds_bytes: 65536
    lds_per_cu: 131072
    vgprs_per_simd: 1024
    vgpr_granule: 8
    max_waves_per_simd: 16
    simds_per_cu: 4
    fdot2: true
    int8_dot: sdot4
    mixed_fma: fma_mix
    hw_tier: 1
    default: true
    status: builds
    stage: f16
kernels:
  f16:
    template: fa2_f16.hip.j2
    head_dims: [64]
    gqa_groups: [1, 2]
    default_tile: {br: 128, bc: 64, threads: 256, tm: 8}
"""


def _load(tmp_path: Path, text: str):
    path = tmp_path / "variants.yaml"
    path.write_text(text)
    return load_matrix(path)


def test_minimal_matrix_loads(tmp_path):
    matrix = _load(tmp_path, MINIMAL)
    assert [s.name for s in matrix.specs_for(matrix.target("gfx1030"))] == [
        "fa2_f16_hd64_g1_br128_bc64_nt256_tm8_w32_dot2_sf16", "fa2_f16_hd64_g2_br128_bc64_nt256_tm8_w32_dot2_sf16"]


@pytest.mark.parametrize("old, new, message", [
    ("    wave_size: 32\n", "    wave_size: 32\n    wave_sise: 32\n",
     "variants.yaml:9: targets.gfx1030.wave_sise: unknown key"),
    ("    wave_size: 32\n", "    wave_size: 48\n",
     "variants.yaml:8: targets.gfx1030.wave_size: must be 32 or 64, got 48"),
    ("    int8_dot: sdot4\n", "    int8_dot: dp4a\n",
     "variants.yaml:16: targets.gfx1030.int8_dot: 'dp4a' is not one of sdot4, sudot4, none"),
    ("    fdot2: true\n", "    fdot2: yes please\n",
     "variants.yaml:15: targets.gfx1030.fdot2: expected bool, got 'yes please'"),
    ("    lds_bytes: 65536\n", "    lds_bytes: 65536\n    lds_bytes: 32768\n",
     "variants.yaml:10: duplicate key 'lds_bytes' (first at line 9)"),
    ("    status: builds\n", "",
     "variants.yaml:4: targets.gfx1030.status: is missing"),
    ("    stage: f16\n", "    stage: f8\n",
     "variants.yaml:21: targets.gfx1030.stage: 'f8' is not one of f16, f32"),
    ("  gfx1030:\n", "  gfx1030x:\n",
     "variants.yaml:4: targets.gfx1030x: target names are gfxNNN[N] (lower-case hex), sm_NN, or host[_suffix]"),
    ("    hw_tier: 1\n", "    hw_tier: 2\n",
     "variants.yaml:18: targets.gfx1030.hw_tier: tier 2 targets have no int8 dot instruction (int8_dot: none)"),
    ("    default_tile: {br: 128, bc: 64, threads: 256, tm: 8}\n", "    default_tile: {br: 128, bc: 64, threads: 256, tm: 3}\n",
     "variants.yaml:4: targets.gfx1030: kernel fa2_f16_hd64_g1_br128_bc64_nt256_tm3_w32_dot2_sf16: "
     "threads 256 must be a multiple of br/tm = 42.6667"),
    ("    head_dims: [64]\n", "    head_dims: [64, 80]\n",
     "variants.yaml:4: targets.gfx1030: kernel fa2_f16_hd80_g1_br128_bc64_nt256_tm8_w32_dot2_sf16: "
     "head_dim 80 must be a multiple of 32 in 32..512; head_dim 80 must be a multiple of 2 * threads per row = 32"),
    ("    head_dims: [64]\n", "    head_dims: [512]\n",
     "variants.yaml:4: targets.gfx1030: kernel fa2_f16_hd512_g1_br128_bc64_nt256_tm8_w32_dot2_sf16: "
     "needs 221696 bytes of LDS, over the 65536 budget"),
    ("    template: fa2_f16.hip.j2\n", "    template: nope.j2\n",
     "variants.yaml:24: kernels.f16.template: no such template in templates/: 'nope.j2'"),
    ("kernels:\n", "kernel:\n", "variants.yaml:1: kernels: is missing"),
    ("    default_tile: {br: 128, bc: 64, threads: 256, tm: 8}\n",
     "    default_tile: {br: 128, bc: 64, threads: 256, tm: 8}\n    tiles:\n      128: {br: 128, bc: 32, threads: 256, tm: 8}\n",
     "variants.yaml:29: kernels.f16.tiles.128: is not one of head_dims [64]"),
])
def test_errors_name_file_line_and_key(tmp_path, old, new, message):
    assert old in MINIMAL
    with pytest.raises(VariantsError) as err:
        _load(tmp_path, MINIMAL.replace(old, new, 1))
    assert str(err.value) == message


def test_yaml_syntax_error_has_a_line(tmp_path):
    with pytest.raises(VariantsError, match=r"^variants.yaml:3: "):
        _load(tmp_path, "platforms:\n  amdgcn: {description: x\ntargets: [\n")


def test_default_file_is_the_repository_one():
    assert DEFAULT_VARIANTS.name == "variants.yaml" and DEFAULT_VARIANTS.is_file()
