// Precision and staging policies: the kernels move "pairs" of values along each product's
// reduction dimension through LDS, and dot() multiplies two pairs into an fp32 accumulator.
//
// LDS tiles of pairs: tile row `row` holds S pairs (S a multiple of CHUNK, so every row starts
// 16-byte aligned), and the kernels move runs of up to CHUNK consecutive pairs of one row, a
// 16-byte access per run (per plane below). Each policy says where a pair lives:
//   F16Pairs: a row is S half2 words.
//   F32Pairs: a row is S x components, then S y components (planar). A 16-byte read brings four
//   columns' x (or y) into four consecutive registers, so for both components of a pair product
//   the multiplicand read fresh sits in the same register bank, and the compiler can keep each
//   accumulator off it. Interleaved float2 pairs put x and y in alternate banks, and every
//   accumulator then shares a bank with one of its two products' operands.
//
// P_ROW_PAIR_GAP: bytes between each two rows of the P tile (fa2_forward.h). Its lanes store
// their key pairs' rows at once, two rows apart; on sm_90 (fp32 pairs) the gap put those stores
// in different banks (12.6M bank conflicts per [1,32,2048,128] call to none). fp16 pairs keep
// their AMD tiles' LDS as it was (a gap would push some past the 6-wave LDS budget): 0.
// K_RUNS: a thread stages four consecutive keys' same eight columns and stores each pair row as one
// run (fa2_forward.h): on sm_90 1.04x at head_dim 64, level at 128. fp16 pairs (AMD) keep a store
// per pair, as audited.
// SKIP_UNMOVED: the output rescale is skipped for rows whose maximum stayed (fa2_policies.h); on
// sm_90 1.015x at head_dim 64, level at 128. On fp16 pairs it cost gfx1030's head_dim 64 kernel
// 7 VGPRs and a wave per SIMD: off.
// PREFETCH: the P.V loop reads each step's fragments while the previous step's products run
// (fa2_forward.h). On for fp32 pairs, whose targets (sm_90; host_f32 mirrors it) measured it
// faster; off for fp16 pairs, whose AMD kernels hold a wave budget (6 waves per SIMD on RDNA2:
// 168 VGPRs) that the second set of fragments would spill.
#pragma once

// fp16 pairs, fed to the tier's dot2 lowering as they are.
struct F16Pairs {
  typedef half_t elem_t;
  typedef half2_t pair_t;
  static constexpr bool PREFETCH = false;
  static constexpr int P_ROW_PAIR_GAP = 0;
  static constexpr bool K_RUNS = false;
  static constexpr bool SKIP_UNMOVED = false;
  RDNA_DEVICE float dot(pair_t a, pair_t b, float acc) { return rdna_dot2(a, b, acc); }
  RDNA_DEVICE pair_t from_halves(unsigned w) { return __builtin_bit_cast(half2_t, w); }
  RDNA_DEVICE pair_t join(half_t x, half_t y) { return pair_t{x, y}; }
  RDNA_DEVICE pair_t make(float x, float y) { return pair_t{(half_t)x, (half_t)y}; }
  RDNA_DEVICE float sum(pair_t p) { return (float)p.x + (float)p.y; }

  static constexpr int CHUNK = 4;
  // Component `comp` of the pair at (row, col).
  RDNA_DEVICE elem_t* elem(pair_t* tile, int S, int row, int col, int comp) {
    return reinterpret_cast<elem_t*>(tile + row * S + col) + comp;
  }
  // N consecutive pairs of one row from column col (a multiple of N).
  template <int N>
  RDNA_DEVICE void load_run(pair_t* dst, const pair_t* tile, int S, int row, int col) {
    __builtin_memcpy(dst, __builtin_assume_aligned(tile + row * S + col, N * sizeof(pair_t)), N * sizeof(pair_t));
  }
  template <int N>
  RDNA_DEVICE void store_run(pair_t* tile, int S, int row, int col, const pair_t* src) {
    __builtin_memcpy(__builtin_assume_aligned(tile + row * S + col, N * sizeof(pair_t)), src, N * sizeof(pair_t));
  }
};

// fp32 pairs: every fp16 value is converted once, when its tile is staged, for targets that
// would otherwise convert before every FMA.
struct F32Pairs {
  typedef float elem_t;
  typedef float pair_t __attribute__((ext_vector_type(2)));
  static constexpr bool PREFETCH = true;
  static constexpr int P_ROW_PAIR_GAP = 16;
  static constexpr bool K_RUNS = true;
  static constexpr bool SKIP_UNMOVED = true;
  RDNA_DEVICE float dot(pair_t a, pair_t b, float acc) { return rdna_fma(a.y, b.y, rdna_fma(a.x, b.x, acc)); }
  RDNA_DEVICE pair_t from_halves(unsigned w) {
    const half2_t h = __builtin_bit_cast(half2_t, w);
    return pair_t{(float)h.x, (float)h.y};
  }
  RDNA_DEVICE pair_t join(half_t x, half_t y) { return pair_t{(float)x, (float)y}; }
  RDNA_DEVICE pair_t make(float x, float y) { return pair_t{x, y}; }
  RDNA_DEVICE float sum(pair_t p) { return (float)p.x + (float)p.y; }

  static constexpr int CHUNK = 4;
  RDNA_DEVICE float* plane(pair_t* tile, int S, int row, int comp) {
    return reinterpret_cast<float*>(tile + row * S) + comp * S;
  }
  RDNA_DEVICE const float* plane(const pair_t* tile, int S, int row, int comp) {
    return reinterpret_cast<const float*>(tile + row * S) + comp * S;
  }
  RDNA_DEVICE elem_t* elem(pair_t* tile, int S, int row, int col, int comp) { return plane(tile, S, row, comp) + col; }
  template <int N>
  RDNA_DEVICE void load_run(pair_t* dst, const pair_t* tile, int S, int row, int col) {
    float x[N], y[N];
    __builtin_memcpy(x, __builtin_assume_aligned(plane(tile, S, row, 0) + col, N * sizeof(float)), sizeof(x));
    __builtin_memcpy(y, __builtin_assume_aligned(plane(tile, S, row, 1) + col, N * sizeof(float)), sizeof(y));
#pragma unroll
    for (int k = 0; k < N; ++k) dst[k] = pair_t{x[k], y[k]};
  }
  template <int N>
  RDNA_DEVICE void store_run(pair_t* tile, int S, int row, int col, const pair_t* src) {
    float x[N], y[N];
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = src[k].x, y[k] = src[k].y;
    __builtin_memcpy(__builtin_assume_aligned(plane(tile, S, row, 0) + col, N * sizeof(float)), x, sizeof(x));
    __builtin_memcpy(__builtin_assume_aligned(plane(tile, S, row, 1) + col, N * sizeof(float)), y, sizeof(y));
  }
};
