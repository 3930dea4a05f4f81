"""The kernel matrix: targets, tiles and kernel specs, loaded and validated from variants.yaml."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

from .strict_yaml import Node, VariantsError, load

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VARIANTS = REPO_ROOT / "variants.yaml"


class Tier(str, enum.Enum):
    """How the fp16 pair product with an fp32 accumulator is lowered (same result on all)."""

    DOT2 = "dot2"        # v_dot2_f32_f16
    FMA_MIX = "fma_mix"  # two v_fma_mix_f32, selected by the compiler
    MAD_MIX = "mad_mix"  # two v_mad_mix_f32, by inline asm
    CVT_FMA = "cvt_fma"  # convert both halves, then fp32 FMAs


# The instruction a tier's kernels must contain (checked by the audit on amdgcn).
TIER_SIGNATURE = {
    Tier.DOT2: "v_dot2",
    Tier.FMA_MIX: "v_fma_mix_f32",
    Tier.MAD_MIX: "v_mad_mix_f32",
    Tier.CVT_FMA: "v_cvt_f32_f16",
}

PLATFORMS = ("amdgcn", "cuda", "host")
INT8_DOTS = ("sdot4", "sudot4", "none")
MIXED_FMAS = (Tier.FMA_MIX.value, Tier.MAD_MIX.value, Tier.CVT_FMA.value)
STATUSES = ("tested", "builds")
STAGES = ("f16", "f32")
KERNEL_KINDS = ("f16",)
_TARGET_RE = re.compile(r"^(gfx[0-9a-f]{3,4}|sm_[0-9]{2,3}|host(_[a-z0-9]+)?)$")


@dataclass(frozen=True)
class Platform:
    name: str
    description: str
    code_object: str  # file extension of the built code object


@dataclass(frozen=True)
class Target:
    name: str
    platform: str
    family: str
    parts: str
    wave_size: int
    lds_bytes: int
    lds_per_cu: int
    vgprs_per_simd: int
    vgpr_granule: int
    max_waves_per_simd: int
    simds_per_cu: int
    fdot2: bool
    int8_dot: str
    mixed_fma: str
    hw_tier: int
    default: bool
    status: str
    stage: str  # LDS staging precision: f16 pairs, or f32 pairs converted once at staging

    @property
    def tier(self) -> Tier:
        return Tier.DOT2 if self.fdot2 else Tier(self.mixed_fma)

    def waves_per_simd(self, vgprs: int, lds: int, threads: int) -> int:
        """Occupancy from VGPRs (LLVM's allocation rule) and from LDS."""
        alloc = max(self.vgpr_granule, -(-max(vgprs, 1) // self.vgpr_granule) * self.vgpr_granule)
        by_vgpr = min(self.max_waves_per_simd, self.vgprs_per_simd // alloc)
        if lds == 0:
            return by_vgpr
        waves_per_group = -(-threads // self.wave_size)
        groups = self.lds_per_cu // lds
        by_lds = groups * waves_per_group // self.simds_per_cu
        return min(by_vgpr, by_lds)


@dataclass(frozen=True, order=True)
class Tile:
    br: int       # query rows per workgroup (all heads of the GQA group together)
    bc: int       # keys per step
    threads: int  # workgroup size
    tm: int       # query rows per thread (the height of each thread's register tile)


@dataclass(frozen=True, order=True)
class KernelSpec:
    """One generated kernel. ``name`` is its file stem, symbol and dispatch id."""

    kind: str
    head_dim: int
    gqa_group: int
    tile: Tile
    wave_size: int
    tier: Tier
    stage: str

    _NAME = re.compile(
        r"^fa2_(?P<kind>[a-z0-9]+)_hd(?P<hd>\d+)_g(?P<g>\d+)_br(?P<br>\d+)_bc(?P<bc>\d+)"
        r"_nt(?P<nt>\d+)_tm(?P<tm>\d+)_w(?P<w>32|64)_(?P<tier>[a-z0-9_]+?)_s(?P<stage>f16|f32)$")

    @property
    def name(self) -> str:
        t = self.tile
        return (f"fa2_{self.kind}_hd{self.head_dim}_g{self.gqa_group}_br{t.br}_bc{t.bc}"
                f"_nt{t.threads}_tm{t.tm}_w{self.wave_size}_{self.tier.value}_s{self.stage}")

    @classmethod
    def from_name(cls, name: str) -> "KernelSpec":
        m = cls._NAME.match(name)
        if not m:
            raise ValueError(f"not a kernel name: {name!r}")
        return cls(kind=m["kind"], head_dim=int(m["hd"]), gqa_group=int(m["g"]),
                   tile=Tile(br=int(m["br"]), bc=int(m["bc"]), threads=int(m["nt"]), tm=int(m["tm"])),
                   wave_size=int(m["w"]), tier=Tier(m["tier"]), stage=m["stage"])

    # Derived layout, shared by the template and the LDS budget check.
    @property
    def thread_grid(self) -> dict[str, int]:
        """Thread rows, threads per row, keys and output columns per thread (TRW, TCW, TN, TD)."""
        t = self.tile
        trw = t.br // t.tm if t.tm else 0
        tcw = t.threads // trw if trw else 0
        return {"trw": trw, "tcw": tcw, "tn": t.bc // tcw if tcw else 0, "td": self.head_dim // tcw if tcw else 0}

    @property
    def lds_layout(self) -> dict[str, int]:
        """Byte sizes of the kernel's LDS regions (the template carves exactly these)."""
        d, t = self.head_dim, self.tile
        pair = 4 if self.stage == "f16" else 8
        pad = 16 // pair                   # pairs; keeps rows 16-byte aligned and off one bank
        return {
            "q_bytes": (d // 2) * (t.br + pad) * pair,
            "kv_bytes": max((d // 2) * (t.bc + pad), (t.bc // 2) * d) * pair,
            "p_bytes": (t.bc // 2) * (t.br + pad) * pair,
        }

    @property
    def lds_bytes(self) -> int:
        return sum(self.lds_layout.values())

    def problems(self) -> list[str]:
        """Why this spec cannot be generated (empty when it can)."""
        d, g, t, w = self.head_dim, self.gqa_group, self.tile, self.wave_size
        out = []
        if d % 32 or not 32 <= d <= 512:
            out.append(f"head_dim {d} must be a multiple of 32 in 32..512")
        if g < 1 or t.br % g:
            out.append(f"br {t.br} must be a multiple of the GQA group {g}")
        if t.threads % w:
            out.append(f"threads {t.threads} must be a multiple of the wave size {w}")
        if t.br % t.tm or t.threads % (t.br // t.tm):
            out.append(f"threads {t.threads} must be a multiple of br/tm = {t.br / t.tm:g}")
            return out
        grid = self.thread_grid
        tcw = grid["tcw"]
        if tcw & (tcw - 1) or tcw > w:
            out.append(f"threads per row (threads*tm/br = {tcw}) must be a power of two no larger than the wave size {w}")
        if t.bc % (2 * tcw):
            out.append(f"bc {t.bc} must be a multiple of 2 * threads per row = {2 * tcw}")
        if d % (2 * tcw):
            out.append(f"head_dim {d} must be a multiple of 2 * threads per row = {2 * tcw}")
        return out


@dataclass(frozen=True)
class KernelKind:
    kind: str
    template: str
    head_dims: tuple[int, ...]
    gqa_groups: tuple[int, ...]
    tiles: tuple[tuple[int, tuple[Tile, ...]], ...]  # (head_dim, candidates), sorted
    default_tile: tuple[Tile, ...]

    def tiles_for(self, head_dim: int) -> tuple[Tile, ...]:
        """Candidate tiles in order of preference; a target takes the first its LDS holds."""
        return dict(self.tiles).get(head_dim, self.default_tile)


@dataclass(frozen=True)
class Matrix:
    source: Path
    platforms: tuple[Platform, ...]
    targets: tuple[Target, ...]
    kernels: tuple[KernelKind, ...]

    def target(self, name: str) -> Target:
        for t in self.targets:
            if t.name == name:
                return t
        raise KeyError(name)

    def platform(self, name: str) -> Platform:
        return next(p for p in self.platforms if p.name == name)

    def specs_for(self, target: Target) -> list[KernelSpec]:
        specs = [self._spec(target, k, hd, g) for k in self.kernels for hd in k.head_dims for g in k.gqa_groups]
        return sorted(specs, key=lambda s: s.name)

    @staticmethod
    def _spec(target: Target, kind: KernelKind, head_dim: int, group: int) -> KernelSpec:
        candidates = [KernelSpec(kind=kind.kind, head_dim=head_dim, gqa_group=group, tile=tile,
                                 wave_size=target.wave_size, tier=target.tier, stage=target.stage)
                      for tile in kind.tiles_for(head_dim)]
        for spec in candidates:
            if spec.lds_bytes <= target.lds_bytes and not spec.problems():
                return spec
        return candidates[0]  # load_matrix reports why it cannot be built

    def kernel_kind(self, kind: str) -> KernelKind:
        return next(k for k in self.kernels if k.kind == kind)

    def select(self, selector: str) -> list[Target]:
        """A comma list of target names and the groups ``default`` and ``all`` (every GPU target)."""
        groups = {"default": [t.name for t in self.targets if t.default],
                  "all": [t.name for t in self.targets if t.platform != "host"]}
        names = []
        for item in (s.strip() for s in selector.split(",")):
            names += groups.get(item, [item] if item else [])
        known = {t.name for t in self.targets}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise VariantsError(
                f"{self.source.name}: unknown target(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))} (add an entry under targets: to build a new one)")
        return [self.target(n) for n in dict.fromkeys(names)]


# --------------------------------------------------------------------------- loading

def _platform(name: str, node: object, parent: Node) -> Platform:
    if name not in PLATFORMS:
        raise parent.fail(name, f"unknown platform; known: {', '.join(PLATFORMS)}")
    if not isinstance(node, Node):
        raise parent.fail(name, "expected a mapping")
    p = Platform(name=name, description=node.take("description", str),
                 code_object=node.take("code_object", str))
    node.finish()
    return p


def _positive(node: Node, key: str) -> int:
    value = node.take(key, int)
    node.check(key, value > 0, f"must be positive, got {value}")
    return value


def _target(name: str, node: object, parent: Node, platforms: set[str]) -> Target:
    if not _TARGET_RE.match(name):
        raise parent.fail(name, "target names are gfxNNN[N] (lower-case hex), sm_NN, or host[_suffix]")
    if not isinstance(node, Node):
        raise parent.fail(name, "expected a mapping")
    platform = node.take("platform", str)
    if platform not in platforms:
        raise node.fail("platform", f"{platform!r} is not a platform listed under platforms:")
    if (platform == "host") != name.startswith("host"):
        raise node.fail("platform", "host targets are named host or host_<suffix>, and use the host platform")
    if (platform == "cuda") != name.startswith("sm_"):
        raise node.fail("platform", "cuda targets are named sm_NN, and sm_NN targets use the cuda platform")
    wave = node.take("wave_size", int)
    node.check("wave_size", wave in (32, 64), f"must be 32 or 64, got {wave}")
    fields = dict(
        name=name, platform=platform, family=node.take("family", str), parts=node.take("parts", str),
        wave_size=wave, lds_bytes=_positive(node, "lds_bytes"), lds_per_cu=_positive(node, "lds_per_cu"),
        vgprs_per_simd=_positive(node, "vgprs_per_simd"), vgpr_granule=_positive(node, "vgpr_granule"),
        max_waves_per_simd=_positive(node, "max_waves_per_simd"), simds_per_cu=_positive(node, "simds_per_cu"),
        fdot2=node.take("fdot2", bool),
        int8_dot=node.choice("int8_dot", INT8_DOTS), mixed_fma=node.choice("mixed_fma", MIXED_FMAS),
        hw_tier=node.take("hw_tier", int), default=node.take("default", bool),
        status=node.choice("status", STATUSES), stage=node.choice("stage", STAGES),
    )
    if fields["hw_tier"] not in (1, 2):
        raise node.fail("hw_tier", f"must be 1 or 2, got {fields['hw_tier']}")
    if fields["hw_tier"] == 1 and not fields["fdot2"]:
        raise node.fail("hw_tier", "tier 1 needs fdot2: true")
    if fields["hw_tier"] == 2 and fields["int8_dot"] != "none":
        raise node.fail("hw_tier", "tier 2 targets have no int8 dot instruction (int8_dot: none)")
    if fields["lds_bytes"] > fields["lds_per_cu"]:
        raise node.fail("lds_bytes", "must not exceed lds_per_cu")
    node.finish()
    return Target(**fields)


def _int_list(node: Node, key: str) -> tuple[int, ...]:
    values = node.take(key, list)
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        raise node.fail(key, f"expected a non-empty list of positive integers, got {values!r}")
    if len(set(values)) != len(values):
        raise node.fail(key, f"has duplicates: {values!r}")
    return tuple(sorted(values))


def _tiles(node: object, parent: Node, key: str) -> tuple[Tile, ...]:
    """A tile mapping, or a list of them in order of preference."""
    items = node if isinstance(node, list) else [node]
    tiles = []
    for item in items:
        if not isinstance(item, Node):
            raise parent.fail(key, "expected a mapping with br, bc, threads, tm, or a list of them")
        tiles.append(Tile(br=_positive(item, "br"), bc=_positive(item, "bc"), threads=_positive(item, "threads"),
                          tm=_positive(item, "tm")))
        item.finish()
    if not tiles:
        raise parent.fail(key, "expected at least one tile")
    return tuple(tiles)


def _kernel(kind: str, node: object, parent: Node, templates: Path) -> KernelKind:
    if kind not in KERNEL_KINDS:
        raise parent.fail(kind, f"unknown kernel kind; known: {', '.join(KERNEL_KINDS)}")
    if not isinstance(node, Node):
        raise parent.fail(kind, "expected a mapping")
    template = node.take("template", str)
    if not (templates / template).is_file():
        raise node.fail("template", f"no such template in templates/: {template!r}")
    head_dims = _int_list(node, "head_dims")
    groups = _int_list(node, "gqa_groups")
    default_tile = _tiles(node.pop("default_tile", None), node, "default_tile")
    tiles_node = node.child("tiles") if "tiles" in node else None
    tiles = []
    if tiles_node is not None:
        for hd in sorted(tiles_node, key=lambda k: tiles_node.key_lines[k]):
            if not hd.isdigit() or int(hd) not in head_dims:
                raise tiles_node.fail(hd, f"is not one of head_dims {list(head_dims)}")
            tiles.append((int(hd), _tiles(tiles_node.pop(hd), tiles_node, hd)))
    node.finish()
    return KernelKind(kind=kind, template=template, head_dims=head_dims, gqa_groups=groups,
                      tiles=tuple(sorted(tiles)), default_tile=default_tile)


def load_matrix(path: Path | str = DEFAULT_VARIANTS, templates: Path | None = None) -> Matrix:
    """Load and validate a variants file; every error names the file, line and key path."""
    path = Path(path)
    templates = templates or REPO_ROOT / "templates"
    root = load(path)
    platforms_node = root.child("platforms")
    platforms = tuple(platforms_node.items_in(lambda k, v: _platform(k, v, platforms_node)))
    targets_node = root.child("targets")
    names = {p.name for p in platforms}
    target_lines = dict(targets_node.key_lines)
    targets = tuple(targets_node.items_in(lambda k, v: _target(k, v, targets_node, names)))
    kernels_node = root.child("kernels")
    kernels = tuple(kernels_node.items_in(lambda k, v: _kernel(k, v, kernels_node, templates)))
    root.finish()
    matrix = Matrix(source=path, platforms=platforms, targets=targets, kernels=kernels)
    # Combinations: every spec of every target must be generable and fit the target's LDS.
    for target in targets:
        for spec in matrix.specs_for(target):
            problems = spec.problems()
            if not problems and spec.lds_bytes > target.lds_bytes:
                problems = [f"needs {spec.lds_bytes} bytes of LDS, over the {target.lds_bytes} budget"]
            if problems:
                raise VariantsError(f"{path.name}:{target_lines[target.name]}: targets.{target.name}: "
                                    f"kernel {spec.name}: {'; '.join(problems)}")
    return matrix
