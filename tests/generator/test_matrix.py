"""variants.yaml loading: the shipped matrix, spec names, and exact error messages."""

import re
from pathlib import Path

import pytest

from rdnattention.families import family as runtime_family
from rdnattention_gen import DEFAULT_VARIANTS
from rdnattention_gen.families import FAMILIES, family, spec_from_name
from rdnattention_gen.matrix import load_matrix
from rdnattention_gen.spec import KernelSpec, Tile
from rdnattention_gen.strict_yaml import VariantsError
from rdnattention_gen.target import Tier

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
        assert spec_from_name(spec.name) == spec


def test_names_and_lds_are_the_runtime_familys(matrix):
    """A spec spells its name and sizes its LDS with its runtime family module: the generator
    family's schema is that module's, and its layout comes to the same bytes."""
    for name, fam in FAMILIES.items():
        assert fam.schema is runtime_family(name).NAMES, name
    specs = {s for t in matrix.targets for s in matrix.specs_for(t)}
    for spec in specs:
        assert spec.lds_bytes == family(spec.family).lds_bytes(spec), spec.name


def test_name_spells_every_field():
    spec = KernelSpec(family="f16", head_dim=128, gqa_group=2, tile=Tile(br=128, bc=32, threads=256, tm=8),
                      wave_size=64, tier="mad_mix", stage="f16")
    assert spec.name == "fa2_f16_hd128_g2_br128_bc32_nt256_tm8_w64_mad_mix_sf16"
    with pytest.raises(ValueError, match="not a kernel name"):
        spec_from_name("fa2_f16_hd128")


def test_target_selection(matrix):
    assert [t.name for t in matrix.select("gfx906,gfx1030,gfx906")] == ["gfx906", "gfx1030"]
    assert "host" not in {t.name for t in matrix.select("all")}
    with pytest.raises(VariantsError, match=r"^variants.yaml: unknown target\(s\) gfx9999; known: "):
        matrix.select("gfx9999")


def test_a_narrowed_matrix_builds_only_those_head_dims(matrix):
    """`rdnattention-gen build --head-dims`: of each family a target builds, the head_dims listed
    among its own (the host's subsets kept), and whole the families whose kernels take the head_dim
    at launch; the targets not named as they were."""
    launch = {name for name, fam in FAMILIES.items() if fam.head_dim_at_launch}
    assert launch == {"append", "quant"}
    narrow = matrix.narrowed((64, 200), ["host"])
    full, specs = matrix.specs_for(matrix.target("host")), narrow.specs_for(narrow.target("host"))
    assert {s for s in specs if s.family not in launch} == {s for s in full if s.family not in launch
                                                            and s.head_dim in (64, 200)}
    assert {s for s in specs if s.family in launch} == {s for s in full if s.family in launch} != set()
    built = dict(narrow.target("host").head_dims)
    assert built["f16"] == (64, 200) and built["dec"] == (64, 200) and built["i8"] == (64,)
    assert narrow.target("gfx1030") == matrix.target("gfx1030")
    every = matrix.narrowed((64,))  # every target
    assert all(s.head_dim == 64 or s.family in launch for t in every.targets for s in every.specs_for(t))


def test_a_head_dim_no_family_of_a_target_builds_is_named(matrix):
    with pytest.raises(VariantsError, match=re.escape("head_dim 72: host builds none of its kernels there; it builds "
                                                      "head_dims [8, 24, 32, 40, 64, 80, ")):
        matrix.narrowed((64, 72), ["gfx1030", "host"])
    assert matrix.narrowed((72,), ["gfx1030"]).target("gfx1030").builds("f16", 72)


MINIMAL = """\
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
    tiles: small
kernels:
  f16:
    head_dims: [64]
    gqa_groups: [1, 2]
tiles:
  small:
    f16:
      default: {br: 128, bc: 64, threads: 256, tm: 8}
"""
TILE = "      default: {br: 128, bc: 64, threads: 256, tm: 8}\n"


def _load(tmp_path: Path, text: str, tuned: dict[str, str] | None = None):
    path = tmp_path / "variants.yaml"
    path.write_text(text)
    tuned_dir = tmp_path / "tuned"
    tuned_dir.mkdir(exist_ok=True)
    for name, body in (tuned or {}).items():
        (tuned_dir / name).write_text(body)
    return load_matrix(path, tuned_dir)


def test_a_layout_option_is_built_with_the_familys_tiles_at_its_head_dims(tmp_path):
    matrix = _load(tmp_path, MINIMAL.replace("    gqa_groups: [1, 2]\n", "    gqa_groups: [1, 2]\n    layouts:\n"
                                             "      varlen: [64]\n"))
    specs = matrix.specs_for(matrix.target("gfx1030"))
    assert [(s.name, s.option("layout")) for s in specs if s.option("layout")] == [
        ("fa2_f16varlen_hd64_g1_br128_bc64_nt256_tm8_w32_dot2_sf16", "varlen"),
        ("fa2_f16varlen_hd64_g2_br128_bc64_nt256_tm8_w32_dot2_sf16", "varlen")]
    assert all(family("f16").from_name(s.name) == s for s in specs)  # the name spells the option back


@pytest.mark.parametrize("layouts, message", [
    ("      paged: [64]\n", "variants.yaml:26: kernels.f16.layouts.paged: not a layout of f16 (its layouts: len, "
                             "varlen)"),
    ("      len: [128]\n", "variants.yaml:26: kernels.f16.layouts.len: head_dims [128] are not f16's head_dims [64]"),
    ("      len: []\n", "variants.yaml:26: kernels.f16.layouts.len: expected a non-empty list of positive integers"),
])
def test_a_bad_layout_option_is_named(tmp_path, layouts, message):
    text = MINIMAL.replace("    gqa_groups: [1, 2]\n", "    gqa_groups: [1, 2]\n    layouts:\n" + layouts)
    with pytest.raises(VariantsError, match=re.escape(message)):
        _load(tmp_path, text)


def test_a_dtype_option_is_built_for_every_layout_with_the_familys_tiles_unless_its_own(tmp_path):
    text = MINIMAL.replace("    gqa_groups: [1, 2]\n", "    gqa_groups: [1, 2]\n    layouts:\n      varlen: [64]\n"
                           "    dtypes:\n      bf16: [64]\n")
    specs = _load(tmp_path, text).specs_for(_load(tmp_path, text).target("gfx1030"))
    assert sorted((s.name, s.option("layout"), s.option("dtype")) for s in specs if s.option("dtype")) == [
        ("fa2_f16_bf16_hd64_g1_br128_bc64_nt256_tm8_w32_shift_fma_sbf16", None, "bf16"),
        ("fa2_f16_bf16_hd64_g2_br128_bc64_nt256_tm8_w32_shift_fma_sbf16", None, "bf16"),
        ("fa2_f16varlen_bf16_hd64_g1_br128_bc64_nt256_tm8_w32_shift_fma_sbf16", "varlen", "bf16"),
        ("fa2_f16varlen_bf16_hd64_g2_br128_bc64_nt256_tm8_w32_shift_fma_sbf16", "varlen", "bf16")]
    assert all(family("f16").from_name(s.name) == s for s in specs)  # the name spells the option back
    assert len([s for s in specs if not s.option("dtype")]) == 4  # the fp16 kernels as they were
    # A tile table's f16_bf16 entry gives the bf16 kernels their own tile; fp16's keep theirs.
    own = text + "    f16_bf16:\n      64: {br: 64, bc: 64, threads: 256, tm: 4, waves: 5}\n"
    specs = _load(tmp_path, own).specs_for(_load(tmp_path, own).target("gfx1030"))
    assert {(s.option("dtype"), s.tile.br, s.tile.waves) for s in specs} == {(None, 128, 0), ("bf16", 64, 5)}


def test_bf16_kernels_take_the_targets_bf16_dot_where_it_has_one(matrix):
    """gfx11+ (bf16_dot: true) multiply bf16 pairs with v_dot2_f32_bf16 (tier bf16_dot2, pairs
    BF16DotPairs); the others widen by a shift (shift_fma), fp32-staging targets once when staged.
    The backward's bf16 passes that stage rows keep them bf16 with the bf16 dot (and on the host,
    with its shifts), else widen them to fp32 when staged (shift_fma)."""
    def bf16(name):
        return [s for s in matrix.specs_for(matrix.target(name)) if s.option("dtype") == "bf16"]
    for name, tier, stage, pairs in [("gfx1100", "bf16_dot2", "bf16", "BF16DotPairs"),
                                     ("gfx1201", "bf16_dot2", "bf16", "BF16DotPairs"),
                                     ("gfx1030", "shift_fma", "bf16", "BF16Pairs"),
                                     ("gfx906", "shift_fma", "bf16", "BF16Pairs"),
                                     ("sm_90", "shift_fma", "f32", "BF16F32Pairs"),
                                     ("host", "shift_fma", "bf16", "BF16Pairs")]:
        forward = [s for s in bf16(name) if s.family in ("f16", "dec")]
        assert forward, name
        assert {(s.tier, s.stage) for s in forward} == {(tier, stage)}, name
        assert {family(s.family).context(s)["pairs"] for s in forward} == {pairs}, name
        backward = {(s.tier, s.stage, family(s.family).context(s)["pairs"]) for s in bf16(name)
                    if s.family == "bwd" and s.option("layout") not in ("pre", "dqcast")}
        rows = {"gfx1100": ("bf16_dot2", "bf16", "BF16DotPairs"), "gfx1201": ("bf16_dot2", "bf16", "BF16DotPairs"),
                "host": ("shift_fma", "bf16", "BF16Pairs")}.get(name, ("shift_fma", "f32", "BF16F32Pairs"))
        assert backward == {rows}, name
    assert [t.name for t in matrix.targets if t.bf16_dot] == [
        "gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1200", "gfx1201"]


def test_a_bf16_dot_claim_off_amdgcn_is_refused(tmp_path):
    text = Path(DEFAULT_VARIANTS).read_text().replace("  sm_90: &cuda\n    platform: cuda\n",
                                                      "  sm_90: &cuda\n    platform: cuda\n    bf16_dot: true\n", 1)
    with pytest.raises(VariantsError, match=r"targets\.sm_90\.bf16_dot: v_dot2_f32_bf16 is an AMD instruction"):
        _load(tmp_path, text)


def test_a_score_option_is_built_for_every_layout_and_dtype_with_its_own_tiles_where_listed(tmp_path):
    text = MINIMAL.replace("    gqa_groups: [1, 2]\n", "    gqa_groups: [1, 2]\n    layouts:\n      varlen: [64]\n"
                           "    dtypes:\n      bf16: [64]\n    scores:\n      alibi: [64]\n")
    m = _load(tmp_path, text)
    specs = m.specs_for(m.target("gfx1030"))
    assert sorted((s.name, s.option("layout"), s.option("dtype")) for s in specs if s.option("score") == "alibi") == [
        ("fa2_f16_alibi_hd64_g1_br128_bc64_nt256_tm8_w32_dot2_sf16", None, None),
        ("fa2_f16_alibi_hd64_g2_br128_bc64_nt256_tm8_w32_dot2_sf16", None, None),
        ("fa2_f16_bf16_alibi_hd64_g1_br128_bc64_nt256_tm8_w32_shift_fma_sbf16", None, "bf16"),
        ("fa2_f16_bf16_alibi_hd64_g2_br128_bc64_nt256_tm8_w32_shift_fma_sbf16", None, "bf16"),
        ("fa2_f16varlen_alibi_hd64_g1_br128_bc64_nt256_tm8_w32_dot2_sf16", "varlen", None),
        ("fa2_f16varlen_alibi_hd64_g2_br128_bc64_nt256_tm8_w32_dot2_sf16", "varlen", None),
        ("fa2_f16varlen_bf16_alibi_hd64_g1_br128_bc64_nt256_tm8_w32_shift_fma_sbf16", "varlen", "bf16"),
        ("fa2_f16varlen_bf16_alibi_hd64_g2_br128_bc64_nt256_tm8_w32_shift_fma_sbf16", "varlen", "bf16")]
    assert all(family("f16").from_name(s.name) == s for s in specs)  # the name spells the option back
    assert len([s for s in specs if not s.option("score")]) == 8  # the others as they were
    # f16_alibi tiles for the alibi kernels, f16_bf16_alibi for the bf16 ones first; the others keep theirs.
    own = text + ("    f16_alibi:\n      64: {br: 64, bc: 64, threads: 256, tm: 4}\n"
                  "    f16_bf16_alibi:\n      64: {br: 32, bc: 64, threads: 256, tm: 2}\n")
    m = _load(tmp_path, own)
    assert {(s.option("dtype"), s.option("score"), s.tile.br) for s in m.specs_for(m.target("gfx1030"))} == {
        (None, None, 128), ("bf16", None, 128), (None, "alibi", 64), ("bf16", "alibi", 32)}
    with pytest.raises(VariantsError, match=re.escape("kernels.f16.scores.softcap: not a score option of f16 (its "
                                                      "score options: alibi, xf)")):
        _load(tmp_path, MINIMAL.replace("    gqa_groups: [1, 2]\n", "    gqa_groups: [1, 2]\n    scores:\n"
                                                                    "      softcap: [64]\n"))
    with pytest.raises(VariantsError, match=re.escape("is not one of f16_alibi's head_dims [64]")):
        _load(tmp_path, text + "    f16_alibi:\n      128: {br: 64, bc: 64, threads: 256, tm: 4}\n")


@pytest.mark.parametrize("tiles, message", [
    ("    f16_fp32:\n      64: {br: 64, bc: 64, threads: 256, tm: 4}\n", "tiles.small.f16_fp32: not a kernel family"),
    ("    f16_bf16:\n      default: {br: 64, bc: 64, threads: 256, tm: 4}\n",
     "an option's tiles are head_dims only"),
    ("    f16_bf16:\n      128: {br: 64, bc: 64, threads: 256, tm: 4}\n", "is not one of f16_bf16's head_dims [64]"),
])
def test_a_bad_dtype_option_or_its_tiles_are_named(tmp_path, tiles, message):
    text = MINIMAL.replace("    gqa_groups: [1, 2]\n", "    gqa_groups: [1, 2]\n    dtypes:\n      bf16: [64]\n")
    with pytest.raises(VariantsError, match=re.escape(message)):
        _load(tmp_path, text + tiles)
    with pytest.raises(VariantsError, match=re.escape("kernels.f16.dtypes.fp32: not a dtype of f16")):
        _load(tmp_path, MINIMAL.replace("    gqa_groups: [1, 2]\n", "    gqa_groups: [1, 2]\n    dtypes:\n      fp32: [64]\n"))


def test_target_names_match_in_full(tmp_path):
    with pytest.raises(VariantsError, match="target names are gfxNNN"):
        _load(tmp_path, MINIMAL.replace("  gfx1030:\n", '  "gfx1030\\n":\n', 1))


def test_minimal_matrix_loads(tmp_path):
    matrix = _load(tmp_path, MINIMAL)
    assert [s.name for s in matrix.specs_for(matrix.target("gfx1030"))] == [
        "fa2_f16_hd64_g1_br128_bc64_nt256_tm8_w32_dot2_sf16", "fa2_f16_hd64_g2_br128_bc64_nt256_tm8_w32_dot2_sf16"]


@pytest.mark.parametrize("old, new, message", [
    ("    wave_size: 32\n", "    wave_size: 32\n    wave_sise: 32\n",
     "variants.yaml:7: targets.gfx1030.wave_sise: unknown key"),
    ("    wave_size: 32\n", "    wave_size: 48\n",
     "variants.yaml:6: targets.gfx1030.wave_size: must be 32 or 64, got 48"),
    ("    int8_dot: sdot4\n", "    int8_dot: dp4a\n",
     "variants.yaml:14: targets.gfx1030.int8_dot: 'dp4a' is not one of sdot4, sudot4, none"),
    ("    fdot2: true\n", "    fdot2: yes please\n",
     "variants.yaml:13: targets.gfx1030.fdot2: expected bool, got 'yes please'"),
    ("    lds_bytes: 65536\n", "    lds_bytes: 65536\n    lds_bytes: 32768\n",
     "variants.yaml:8: duplicate key 'lds_bytes' (first at line 7)"),
    ("    status: builds\n", "",
     "variants.yaml:2: targets.gfx1030.status: is missing"),
    ("    stage: f16\n", "    stage: f8\n",
     "variants.yaml:19: targets.gfx1030.stage: 'f8' is not one of f16, f32"),
    ("  gfx1030:\n", "  gfx1030x:\n",
     "variants.yaml:2: targets.gfx1030x: target names are gfxNNN[N] (lower-case hex), sm_NN, or host[_suffix]"),
    ("  gfx1030:\n", "  sm_90:\n",
     "variants.yaml:3: targets.sm_90.platform: amdgcn targets are named gfxNNN[N]"),
    ("    hw_tier: 1\n", "    hw_tier: 2\n",
     "variants.yaml:16: targets.gfx1030.hw_tier: tier 2 targets have no int8 dot instruction (int8_dot: none)"),
    ("    tiles: small\n", "    tiles: big\n",
     "variants.yaml:2: targets.gfx1030.tiles: no tile table 'big'; tables: small"),
    (TILE, TILE.replace("tm: 8", "tm: 3"),
     "variants.yaml:28: tiles.small.f16.default: kernel fa2_f16_hd64_g1_br128_bc64_nt256_tm3_w32_dot2_sf16 for "
     "gfx1030: threads 256 must be a multiple of br/tm = 42.6667"),
    ("    head_dims: [64]\n", "    head_dims: [64, 72]\n",
     "variants.yaml:28: tiles.small.f16.default: kernel fa2_f16_hd72_g1_br128_bc64_nt256_tm8_w32_dot2_sf16 for "
     "gfx1030: head_dim 72 padded to a multiple of 2 * threads per row = 32 is 96: more than a quarter of its "
     "columns would be padding"),
    ("    head_dims: [64]\n", "    head_dims: [64, 260]\n",
     "variants.yaml:28: tiles.small.f16.default: kernel fa2_f16_hd260_g1_br128_bc64_nt256_tm8_w32_dot2_sf16 for "
     "gfx1030: head_dim 260 must be a multiple of 8 in 8..256 or of 32 in 288..512; needs 132096 bytes of LDS, "
     "over the 65536 budget"),
    ("    head_dims: [64]\n", "    head_dims: [512]\n",
     "variants.yaml:28: tiles.small.f16.default: kernel fa2_f16_hd512_g1_br128_bc64_nt256_tm8_w32_dot2_sf16 for "
     "gfx1030: needs 221696 bytes of LDS, over the 65536 budget"),
    ("  f16:\n    head_dims", "  f17:\n    head_dims",
     "variants.yaml:22: kernels.f17: unknown kernel family; known: append, bwd, dec, f16, i8, i8dec, quant"),
    ("    gqa_groups: [1, 2]\n", "    gqa_groups: [1, 2]\n    template: fa2_f16.hip.j2\n",
     "variants.yaml:25: kernels.f16.template: unknown key"),
    ("kernels:\n", "kernel:\n", "variants.yaml:1: kernels: is missing"),
    (TILE, TILE + "      128: {br: 128, bc: 32, threads: 256, tm: 8}\n",
     "variants.yaml:29: tiles.small.f16.128: is not one of f16's head_dims [64]"),
    (TILE, TILE + "    inherit: nope\n",
     "variants.yaml:29: tiles.small.inherit: no tile table 'nope'; tables: small"),
    (TILE, "      default:\n        - {br: 128, bc: 64, threads: 256, tm: 8}\n        - {br: 64, bc: 64, threads: 128, tm: 8}\n",
     "variants.yaml:28: tiles.small.f16.default: needs exactly one tile without `when:` (the one every other call uses)"),
    (TILE, "      default:\n        - {br: 128, bc: 64, threads: 256, tm: 8}\n"
           "        - {br: 64, bc: 64, threads: 128, tm: 8, when: {causal: true}}\n"
           "        - {br: 32, bc: 64, threads: 128, tm: 4, when: {causal: true}}\n",
     "variants.yaml:2: targets.gfx1030: fa2_f16_hd64_g1_br32_bc64_nt128_tm4_w32_dot2_sf16 (variants.yaml:31: "
     "tiles.small.f16.default[2]) and fa2_f16_hd64_g1_br64_bc64_nt128_tm8_w32_dot2_sf16 (variants.yaml:30: "
     "tiles.small.f16.default[1]) both serve some calls at the same priority; give them disjoint `when:`; "
     "fa2_f16_hd64_g2_br32_bc64_nt128_tm4_w32_dot2_sf16 (variants.yaml:31: tiles.small.f16.default[2]) and "
     "fa2_f16_hd64_g2_br64_bc64_nt128_tm8_w32_dot2_sf16 (variants.yaml:30: tiles.small.f16.default[1]) both serve "
     "some calls at the same priority; give them disjoint `when:`"),
    (TILE, "      default: {br: 128, bc: 64, threads: 256, tm: 8, when: {seq_q: [10, 5]}}\n",
     "variants.yaml:28: tiles.small.f16.default.when.seq_q: expected [min, max] with 0 <= min <= max (max null: "
     "open), got [10, 5]"),
])
def test_errors_name_file_line_and_key(tmp_path, old, new, message):
    assert old in MINIMAL
    with pytest.raises(VariantsError) as err:
        _load(tmp_path, MINIMAL.replace(old, new, 1))
    assert str(err.value) == message


def test_a_tile_pads_the_head_dim_to_what_its_threads_divide(tmp_path):
    """16 threads per row take 80 columns as 96 (at most a quarter padding), in LDS and registers:
    the kernel's LDS is the layout's at 96, its template gets both head_dims."""
    matrix = _load(tmp_path, MINIMAL.replace("    head_dims: [64]\n", "    head_dims: [64, 80]\n"))
    spec = next(s for s in matrix.specs_for(matrix.target("gfx1030")) if s.head_dim == 80)
    f16 = family("f16")
    assert runtime_family("f16").padded_head_dim(80, 128, 256, 8) == 96
    assert f16.lds_layout(spec) == runtime_family("f16").lds_layout(96, 128, 64, "f16")
    assert f16.context(spec)["padded_head_dim"] == 96
    # 4 threads per row divide any multiple of 8: nothing padded.
    assert runtime_family("f16").padded_head_dim(40, 128, 256, 2) == 40


def test_a_target_builds_the_head_dims_it_lists(tmp_path):
    text = MINIMAL.replace("    head_dims: [64]\n", "    head_dims: [40, 64, 128]\n").replace(
        "    tiles: small\n", "    tiles: small\n    head_dims:\n      f16: [40, 64]\n").replace(
        TILE, "      default: {br: 128, bc: 32, threads: 256, tm: 2}\n")
    matrix = _load(tmp_path, text)
    assert {s.head_dim for s in matrix.specs_for(matrix.target("gfx1030"))} == {40, 64}
    for listed, message in (("      f17: [64]\n", "targets.gfx1030.head_dims.f17: not a kernel family under kernels: "
                                                   "(f16)"),
                            ("      f16: [32, 64]\n", "targets.gfx1030.head_dims.f16: [32] are not f16's head_dims")):
        with pytest.raises(VariantsError, match=re.escape(message)):
            _load(tmp_path, text.replace("      f16: [40, 64]\n", listed))


def test_constrained_tiles_reach_the_dispatch_entries(tmp_path):
    text = MINIMAL.replace(TILE, "      default:\n        - {br: 128, bc: 64, threads: 256, tm: 8}\n"
                                 "        - {br: 64, bc: 64, threads: 128, tm: 8, when: {causal: true}}\n")
    matrix = _load(tmp_path, text)
    variants = [v for v in matrix.variants_for(matrix.target("gfx1030")) if v.spec.gqa_group == 1]
    assert [(v.spec.tile.br, v.when.to_json(), v.priority) for v in variants] == [(128, {}, 0), (64, {"causal": True}, 1)]


def test_tile_tables_inherit(tmp_path):
    text = MINIMAL.replace("    head_dims: [64]\n", "    head_dims: [64, 128]\n").replace("    tiles: small\n", "    tiles: child\n")
    text += ("      128: {br: 64, bc: 32, threads: 256, tm: 4}\n"
             "  child:\n    inherit: small\n    f16:\n      64: {br: 32, bc: 32, threads: 256, tm: 2}\n")
    matrix = _load(tmp_path, text)
    tiles = {s.head_dim: s.tile for s in matrix.specs_for(matrix.target("gfx1030"))}
    assert tiles == {64: Tile(br=32, bc=32, threads=256, tm=2), 128: Tile(br=64, bc=32, threads=256, tm=4)}


TUNED = """\
target: gfx1030
entries:
  - family: f16
    head_dim: 64
    tile: {br: 64, bc: 64, threads: 128, tm: 8}
    measured:
      device: Radeon RX 6800 XT
      toolchain: clang version 22
      date: 2026-11-29
      figures: {tflops: 10.5, baseline_tflops: 9.0}
"""


def test_tuned_entry_replaces_the_matrix_tile(tmp_path):
    matrix = _load(tmp_path, MINIMAL, {"gfx1030.yaml": TUNED})
    variants = matrix.variants_for(matrix.target("gfx1030"))
    assert {(v.spec.tile.br, v.priority, v.provenance) for v in variants} == {(64, 2, "tuned/gfx1030.yaml")}


def test_constrained_tuned_entry_is_added(tmp_path):
    tuned = TUNED.replace("    head_dim: 64\n", "    head_dim: 64\n    gqa_group: 1\n    when: {causal: true}\n")
    matrix = _load(tmp_path, MINIMAL, {"gfx1030.yaml": tuned})
    variants = [(v.spec.gqa_group, v.spec.tile.br, v.priority) for v in matrix.variants_for(matrix.target("gfx1030"))]
    assert variants == [(2, 128, 0), (1, 128, 0), (1, 64, 3)]


@pytest.mark.parametrize("old, new, message", [
    ("target: gfx1030\n", "target: gfx1031\n",
     "tuned/gfx1030.yaml:1: target: 'gfx1031' does not match the file name gfx1030.yaml"),
    ("    head_dim: 64\n", "    head_dim: 96\n",
     "tuned/gfx1030.yaml:4: entries[0].head_dim: 96 is not one of f16's head_dims [64]"),
    ("      device: Radeon RX 6800 XT\n", "",
     "tuned/gfx1030.yaml:6: entries[0].measured.device: is missing"),
    ("      figures: {tflops: 10.5, baseline_tflops: 9.0}\n", "      figures: {tflops: fast}\n",
     "tuned/gfx1030.yaml:10: entries[0].measured.figures.tflops: expected int or float, got 'fast'"),
    ("    tile: {br: 64, bc: 64, threads: 128, tm: 8}\n", "    tile: {br: 64, bc: 64, threads: 128, tm: 3}\n",
     "tuned/gfx1030.yaml:3: entries[0]: kernel fa2_f16_hd64_g1_br64_bc64_nt128_tm3_w32_dot2_sf16 for gfx1030: "
     "threads 128 must be a multiple of br/tm = 21.3333"),
])
def test_tuned_errors_name_file_line_and_key(tmp_path, old, new, message):
    assert old in TUNED
    with pytest.raises(VariantsError) as err:
        _load(tmp_path, MINIMAL, {"gfx1030.yaml": TUNED.replace(old, new, 1)})
    assert str(err.value) == message


def test_yaml_syntax_error_has_a_line(tmp_path):
    with pytest.raises(VariantsError, match=r"^variants.yaml:3: "):
        _load(tmp_path, "platforms:\n  amdgcn: {description: x\ntargets: [\n")


def test_default_file_is_the_repository_one():
    assert DEFAULT_VARIANTS.name == "variants.yaml" and DEFAULT_VARIANTS.is_file()


def test_decode_lanes_round_up_to_a_power_of_two(matrix):
    """dec at head_dim 40: 5 lanes of values a key, 8 lanes (three of them padding), so rows up to 8
    and 16 lane groups of 128 threads."""
    dec = family("dec")
    target = matrix.target("gfx1030")

    def problems(fam, tile, head_dim=40):
        return fam.problems(fam.spec(target, {"head_dim": head_dim, "gqa_group": 1}, tile), target)

    assert problems(dec, Tile(br=8, bc=16, threads=128, tm=8)) == []
    assert problems(dec, Tile(br=16, bc=16, threads=128, tm=16)) == [
        "br 16 must be a power of two, at most the lanes that share a key (head_dim / 8, rounded up to a power of "
        "two: 8): each lane's share of the rows' scores is reduced by halving"]
    assert problems(dec, Tile(br=4, bc=8, threads=128, tm=4)) == [
        "bc 8 must be a multiple of the lane groups threads / 8 lanes = 16"]
    assert problems(dec, Tile(br=1, bc=16, threads=128, tm=1), head_dim=36) == [
        "head_dim 36 must be a multiple of 8 up to 8 * wave size = 256 (head_dim / 8 lanes, rounded up to a power "
        "of two, share each key)"]


def test_head_dims_in_steps_of_8(matrix):
    """Every multiple of 8 up to 256 (and of 32 to 512) for f16; up to 256 for dec; the GPU targets
    build them all."""
    steps = list(range(8, 257, 8))
    assert list(matrix.kernels["f16"]["head_dims"]) == steps + list(range(288, 513, 32))
    assert list(matrix.kernels["dec"]["head_dims"]) == steps
    for name in ("gfx1030", "gfx906", "sm_90", "sm_61"):
        built = {(s.family, s.head_dim) for s in matrix.specs_for(matrix.target(name))}
        assert {hd for f, hd in built if f == "f16"} == set(matrix.kernels["f16"]["head_dims"]), name
        assert {hd for f, hd in built if f == "dec"} == set(steps), name


def test_the_host_targets_run_each_padded_path(matrix):
    """The oracle sweep runs the host targets' kernels: among them fp16 kernels that pad the
    head_dim (host and host_f32), and decode kernels whose key lanes are padded."""
    from rdnattention_gen.families.dec import key_lanes
    from rdnattention_gen.families.f16 import padded_head_dim

    for name in ("host", "host_f32"):
        variants = [v for v in matrix.variants_for(matrix.target(name)) if v.priority >= 0]
        assert any(v.spec.family == "f16" and padded_head_dim(v.spec) > v.spec.head_dim for v in variants), name
        assert any(v.spec.family == "dec" and key_lanes(v.spec.head_dim, 8) * 8 > v.spec.head_dim
                   for v in variants), name
        assert any(v.spec.head_dim % 32 for v in variants if v.spec.family == "f16" and v.spec.option("layout"))


def test_a_backward_tile_without_register_tiles_is_refused(tmp_path):
    """The bwd family's threads must split each pass's tiles into whole register tiles, or give
    some lanes none (families/bwd.py micro_tiles): at head_dim 80 (20 16-byte chunks a row) 64
    threads make row groups of 64, 32 or 16 lanes' worth, which neither divide nor outnumber the
    dK/dV pass's 72 key rows, so the matrix names the rule, the values and where the tile came from."""
    text = MINIMAL.replace("kernels:\n", "kernels:\n  bwd:\n    head_dims: [80]\n").replace(
        TILE, TILE + "    bwd:\n      default: {br: 8, bc: 72, threads: 64, tm: 1}\n")
    with pytest.raises(VariantsError) as err:
        _load(tmp_path, text)
    assert str(err.value) == (
        "variants.yaml:32: tiles.small.bwd.default: kernel fa2_bwd_hd80_br8_bc72_nt64_w32_dot2_sf16 for gfx1030: "
        "br 8 x bc 72 over 64 threads has no register tiles: br and bc must be multiples of 4, br * bc a multiple "
        "of threads (or fewer) with a TM x TN score tile per thread (TM dividing br, TN dividing bc), and some CG "
        "dividing threads and head_dim / 4 = 20 whose threads / CG row groups divide the gradient's 72 rows (or "
        "outnumber them)")


def test_backward_tiles_that_leave_lanes_idle_are_accepted():
    """A tile of fewer scores than threads, or of fewer gradient rows than row groups, gives the
    first lanes one each (GCN's 256-thread tiles at head_dims 80 and 256); exact tiles keep theirs."""
    from rdnattention_gen.families.bwd import micro_tiles
    assert micro_tiles(80, 32, 32, 256, None) == (2, 2, 4)  # 32 key rows x 4 lanes of 256
    assert micro_tiles(80, 32, 32, 256, "dq") == (2, 2, 4)
    assert micro_tiles(256, 8, 16, 256, None) == (1, 1, 64)  # 128 scores over 256 lanes
    assert micro_tiles(128, 64, 64, 256, None) == (4, 4, 32)  # sm_90: 8 rows x 32 lanes, exact
    assert micro_tiles(80, 8, 72, 64, None) is None
    # The atomic pass's dQ rows (br of them) share the dK/dV grid: a CG whose row groups fit both.
    # (12 rows: 16 lanes across a row would leave 8 row groups for them.)
    assert micro_tiles(64, 12, 32, 128, "atomic") == micro_tiles(64, 12, 32, 128, "dq") == (3, 1, 8)
    assert micro_tiles(64, 12, 32, 128, None) == (3, 1, 16)
    assert micro_tiles(64, 64, 64, 256, "dqcast") == (1, 1, 1)  # no register tiles: a pass over rows


def test_backward_stages_16_bit_rows_where_the_target_multiplies_them(matrix):
    """The backward's passes that stage rows (dK/dV, dQ, atomic) keep them 16-bit as loaded where
    the target multiplies them without converting: fp16 on the dot2 and fma_mix tiers, bf16 with a
    bf16 dot, and both on the host emulator that stands for those targets; everywhere else, and in
    the row passes, they are fp32. A 16-bit-staged kernel is named after its tier and stage, and its
    rows take half the LDS."""
    from rdnattention.families import bwd as runtime
    seen = {"f16": set(), "bf16": set()}
    for t in matrix.targets:
        for v in matrix.variants_for(t):
            spec = v.spec
            if spec.family != "bwd":
                continue
            rows, host = spec.option("layout") not in ("pre", "dqcast") and t.stage == "f16", t.platform == "host"
            if spec.option("dtype") is None:
                stage = "f16" if rows and (t.tier.value in ("dot2", "fma_mix") or host) else "f32"
                tier = t.tier.value
            else:
                stage = "bf16" if rows and (t.bf16_dot or host) else "f32"
                tier = "bf16_dot2" if t.bf16_dot else "shift_fma"
            assert spec.stage == stage and spec.option("stage") == (None if stage == "f32" else stage), spec.name
            assert spec.name.endswith(f"_{tier}_s{stage}") == (stage != "f32"), (t.name, spec.name)
            if stage != "f32":
                seen[stage].add(t.name)
                layout = runtime.lds_layout(spec.head_dim, spec.tile.br, spec.tile.bc, spec.tile.threads,
                                            spec.option("layout"), stage)
                f32 = runtime.lds_layout(spec.head_dim, spec.tile.br, spec.tile.bc, spec.tile.threads,
                                         spec.option("layout"))
                assert spec.lds_bytes == sum(layout.values())
                assert layout["q_do_bytes"] == 2 * spec.tile.br * (spec.head_dim + 8) * 2
                assert 2 * layout["k_v_bytes"] == f32["k_v_bytes"] + 2 * spec.tile.bc * 16  # 16 B of padding a row
    assert {"gfx1030", "gfx906", "gfx1100", "gfx1010", "host"} <= seen["f16"]
    assert {"gfx1100", "gfx1201", "host"} <= seen["bf16"] and not seen["bf16"] & {"gfx1030", "gfx906"}
    assert not (seen["f16"] | seen["bf16"]) & {"gfx900", "gfx803", "sm_90", "sm_61", "host_f32"}


@pytest.mark.parametrize("layout", [None, "dq", "atomic"])
def test_backward_register_tiles_of_the_shipped_matrix(matrix, layout):
    """Every shipped backward tile has register tiles in each pass (the 64 x 64 tile: 4 x 4 scores a
    thread, and a gradient tile of 8 rows x one 16-byte chunk at head_dim 128)."""
    from rdnattention_gen.families.bwd import micro_tiles
    tiles = {(v.spec.head_dim, v.spec.tile.br, v.spec.tile.bc, v.spec.tile.threads)
             for t in matrix.targets for v in matrix.variants_for(t) if v.spec.family == "bwd"}
    assert tiles and all(micro_tiles(*t, layout) is not None for t in tiles)
    assert micro_tiles(128, 64, 64, 256, layout) == (4, 4, 32)
