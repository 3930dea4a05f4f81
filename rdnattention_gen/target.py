"""A build target as variants.yaml describes it: its platform, resources and fp16 product tier,
and the arithmetic on them (occupancy, register budgets). Imports nothing of the generator, so
every module can name a target."""

from __future__ import annotations

import enum
from dataclasses import dataclass

MIXED_FMAS = ("fma_mix", "mad_mix", "cvt_fma")
STATUSES = ("tested", "builds")
STAGES = ("f16", "f32")


class Tier(str, enum.Enum):
    """How a target multiplies fp16 pairs into an fp32 accumulator (same result on all)."""

    DOT2 = "dot2"        # v_dot2_f32_f16
    FMA_MIX = "fma_mix"  # two v_fma_mix_f32, selected by the compiler
    MAD_MIX = "mad_mix"  # two v_mad_mix_f32, by inline asm
    CVT_FMA = "cvt_fma"  # convert both halves, then fp32 FMAs


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
    valu_lanes: int           # lanes one SIMD's VALU completes per clock (a wave instruction: wave_size / this)
    lds_bytes_per_clock: int  # LDS bandwidth of one CU/WGP/SM (the simds_per_cu SIMDs sharing it)
    fdot2: bool
    int8_dot: str
    mixed_fma: str
    hw_tier: int
    default: bool
    status: str
    stage: str  # LDS staging precision: f16 pairs, or f32 pairs converted once at staging
    tiles: str  # the tile table its kernels take their tiles from
    isa: str    # targets with the same isa share an instruction set and a compile, not code objects (default: its own name)
    # Host targets: GPU targets whose every tile this one builds too (as alternates), so that the
    # oracle sweep runs each of their kernels' tile configurations on the CPU.
    mirrors: tuple[str, ...] = ()
    # (family, head_dims): the head_dims it builds of the families listed (a subset of each one's);
    # every head_dim of the others.
    head_dims: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # v_dot2_f32_bf16 (gfx11+): bf16 pairs multiplied into an fp32 accumulator in one instruction,
    # the bf16 kernels' tier ``bf16_dot2`` (else ``shift_fma``).
    bf16_dot: bool = False
    # The split-KV decode's score transforms (fa2_decode.h): the most query rows a tile applies ALiBi
    # in (its tiles of more rows are compiled without it, and the runtime gives ALiBi calls smaller
    # ones), and whether the transforms come in a copy of code per case. Both cost registers: the
    # defaults are those every target's tiles afford.
    decode_alibi_rows: int = 2
    decode_xf_cases: bool = False

    def builds(self, family: str, head_dim: int) -> bool:
        """Whether this target builds kernels of ``family`` for ``head_dim`` (see ``head_dims``)."""
        return head_dim in dict(self.head_dims).get(family, (head_dim,))

    @property
    def tier(self) -> Tier:
        return Tier.DOT2 if self.fdot2 else Tier(self.mixed_fma)

    @property
    def adds_floats_in_memory(self) -> bool:
        """Whether fp32 values can be added into global memory without a compare-and-swap loop per
        value: every NVIDIA target, the host's emulator (its loop is the CPU's, run only to test),
        and AMD's RDNA3 and later (global_atomic_add_f32). GCN and RDNA1/RDNA2 have none (the compiler
        makes a global_atomic_cmpswap loop), so the backward's atomic passes are not built there."""
        return self.platform != "amdgcn" or self.family in ("rdna3", "rdna3.5", "rdna4")

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


def register_budgets(target: Target, lowest: int = 128) -> tuple[int, ...]:
    """Waves-per-SIMD caps worth trying on ``target``: those that leave each thread between
    ``lowest`` and 255 registers (for the row-block tiles 128: a tighter cap spills them; a looser
    one changes nothing)."""
    out = []
    for waves in range(1, target.max_waves_per_simd + 1):
        budget = target.vgprs_per_simd // waves // target.vgpr_granule * target.vgpr_granule
        if lowest <= budget < 256:
            out.append(waves)
    return tuple(out)
