// Schedule policies of the FlashAttention-2 main loop (fa2_forward.h): what is read or loaded a
// step ahead, how stores are grouped and how LDS tiles are laid out. They are tuning knobs of a
// target, kept apart from the element type (pairs.h, fa2_i8.h: what a pack is and how two
// multiply) and from the problem (the family's argument struct and policies, fa2_policies.h). A
// family's generator module picks one per kernel; the runtime sizes LDS by the same choice
// (rdnattention/families/f16.py: the P row-pair gap by staging precision).
#pragma once

// PREFETCH: the P.V loop reads each step's fragments while the previous step's products run (and
// int8 key scales are loaded with their K tile, a step ahead). On sm_90 (fp32 pairs; host_f32
// mirrors it) measured faster; off for the AMD kernels, which hold a wave budget (6 waves per SIMD
// on RDNA2: 168 VGPRs) that the second set of fragments would spill.
// K_RUNS: a thread stages four consecutive keys' same 16 bytes and stores each pack row as one run:
// on sm_90 1.04x at head_dim 64, level at 128. The AMD kernels keep a store per pack, as audited.
// SKIP_UNMOVED: the output rescale is skipped for rows whose maximum stayed (fa2_policies.h); on
// sm_90 1.015x at head_dim 64, level at 128. On fp16 pairs it cost gfx1030's head_dim 64 kernel
// 7 VGPRs and a wave per SIMD: off there. (int8 folds the rescale into adding each tile's products.)
// P_ROW_PAIR_GAP: bytes between each two rows of the P tile. A lane stores the rows of its key
// pairs at once, two rows apart; on sm_90 (fp32 pairs) the gap put those stores in different banks
// (12.6M bank conflicts per [1,32,2048,128] call to none). The AMD tiles keep their LDS as it was
// (a gap would push some past the 6-wave LDS budget): 0. Quads need none: a lane's keys fill one
// row of them.
// XF_CASES: the score transforms' row loop in one copy per case (softcap, ALiBi, both, neither),
// picked once per tile (fa2_forward.h): on sm_90 the softcap's cost over plain causal fell from
// 19-33% to 5-10%, ALiBi's from 14-25% to 2-7% and sinks' from 7-8% to 2-4%. The AMD kernels take no
// copies (they spilled GCN's and RDNA2's tightest tiles: 31 VGPRs on gfx90c's ALiBi head_dim 64):
// their softcap is applied where the scores are made, ALiBi under a branch per row
// (tuning/results/amd_score_counts.md).
// TILE: the LDS layout of the element type's packs (pairs.h): planar fp32 pairs on sm_90.
template <bool PREFETCH_, bool K_RUNS_, bool SKIP_UNMOVED_, int P_ROW_PAIR_GAP_, template <class> class TILE,
          bool XF_CASES_ = false>
struct Fa2Pipeline {
  static constexpr bool PREFETCH = PREFETCH_;
  static constexpr bool K_RUNS = K_RUNS_;
  static constexpr bool SKIP_UNMOVED = SKIP_UNMOVED_;
  static constexpr int P_ROW_PAIR_GAP = P_ROW_PAIR_GAP_;
  static constexpr bool XF_CASES = XF_CASES_;
  template <class E>
  using Tile = TILE<E>;
};

// Every register for occupancy: the AMD kernels (fp16 pairs and int8 quads), as audited.
typedef Fa2Pipeline<false, false, false, 0, PackedTile> LeanPipeline;
// Loads and fragments a step ahead, planar fp32 pairs: sm_90's fp16 kernels (host_f32 mirrors them).
typedef Fa2Pipeline<true, true, true, 16, PlanarTile, true> PrefetchPipeline;
// The same for int8 quads: sm_90's int8 kernels (and the host's, so that the emulator runs this path).
typedef Fa2Pipeline<true, true, false, 0, PackedTile> QuadPrefetchPipeline;
