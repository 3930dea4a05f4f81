// Element types and LDS tile layouts. The kernels move packs of values along each product's
// reduction dimension: pairs of fp16 values here (dot() multiplies two pairs into an fp32
// accumulator), quads of int8 values in the int8 family (fa2_i8.h). A pack type says what a pack
// is and how two multiply; a layout says where a pack of an LDS tile lives. Which layout a kernel
// uses is a schedule choice (pipeline.h), not the element type's.
#pragma once

// fp16 pairs, fed to the tier's dot2 lowering as they are.
struct F16Pairs {
  typedef half_t elem_t;
  typedef half2_t pack_t;
  RDNA_DEVICE float dot(pack_t a, pack_t b, float acc) { return rdna_dot2(a, b, acc); }
  RDNA_DEVICE pack_t from_word(unsigned w) { return __builtin_bit_cast(half2_t, w); }
  RDNA_DEVICE pack_t join(half_t x, half_t y) { return pack_t{x, y}; }
  RDNA_DEVICE pack_t make(float x, float y) { return pack_t{(half_t)x, (half_t)y}; }
  RDNA_DEVICE float sum(pack_t p) { return (float)p.x + (float)p.y; }
};

// fp32 pairs: every fp16 value is converted once, when its tile is staged, for targets that
// would otherwise convert before every FMA.
struct F32Pairs {
  typedef float elem_t;
  typedef float pack_t __attribute__((ext_vector_type(2)));
  RDNA_DEVICE float dot(pack_t a, pack_t b, float acc) { return rdna_fma(a.y, b.y, rdna_fma(a.x, b.x, acc)); }
  RDNA_DEVICE pack_t from_word(unsigned w) {
    const half2_t h = __builtin_bit_cast(half2_t, w);
    return pack_t{(float)h.x, (float)h.y};
  }
  RDNA_DEVICE pack_t join(half_t x, half_t y) { return pack_t{(float)x, (float)y}; }
  RDNA_DEVICE pack_t make(float x, float y) { return pack_t{x, y}; }
  RDNA_DEVICE float sum(pack_t p) { return (float)p.x + (float)p.y; }
};

// bf16 pairs, kept as loaded (16-bit pairs in LDS, as fp16's) and widened to fp32 where multiplied:
// a 16-bit shift per value, no convert instruction, then fp32 FMAs. Probabilities are rounded to
// bf16 for P.V (flash-attn rounds them to the input dtype too); the row sum adds them as stored.
// A pack is the 32-bit word as loaded: x in its low half, y in its high half.
struct BF16Pairs {
  typedef rdna_bf16 elem_t;
  typedef unsigned pack_t;
  RDNA_DEVICE float dot(pack_t a, pack_t b, float acc) {
    return rdna_fma(rdna_bf16_hi(a), rdna_bf16_hi(b), rdna_fma(rdna_bf16_lo(a), rdna_bf16_lo(b), acc));
  }
  RDNA_DEVICE pack_t from_word(unsigned w) { return w; }
  RDNA_DEVICE pack_t join(unsigned short x, unsigned short y) { return x | (unsigned)y << 16; }
  RDNA_DEVICE pack_t make(float x, float y) { return rdna_pack_bf16x2(x, y); }
  RDNA_DEVICE float sum(pack_t p) { return rdna_bf16_lo(p) + rdna_bf16_hi(p); }
};

#ifdef RDNA_HAS_DOT2_BF16
// bf16 pairs as BF16Pairs holds them, multiplied by the target's bf16 dot (v_dot2_f32_bf16, gfx11+):
// one instruction per pair product where BF16Pairs takes two widenings and two FMAs.
struct BF16DotPairs : BF16Pairs {
  RDNA_DEVICE float dot(pack_t a, pack_t b, float acc) { return rdna_dot2_bf16(a, b, acc); }
};
#endif

// fp32 pairs of bf16 inputs: every value widened once, when its tile is staged (F32Pairs' layout
// and products, so the main loop is fp16's on the targets that stage fp32).
struct BF16F32Pairs {
  typedef float elem_t;
  typedef float pack_t __attribute__((ext_vector_type(2)));
  RDNA_DEVICE float dot(pack_t a, pack_t b, float acc) { return rdna_fma(a.y, b.y, rdna_fma(a.x, b.x, acc)); }
  RDNA_DEVICE pack_t from_word(unsigned w) { return pack_t{rdna_bf16_lo(w), rdna_bf16_hi(w)}; }
  RDNA_DEVICE pack_t join(unsigned short x, unsigned short y) { return pack_t{rdna_bf16_lo(x), rdna_bf16_lo(y)}; }
  RDNA_DEVICE pack_t make(float x, float y) { return pack_t{x, y}; }
  RDNA_DEVICE float sum(pack_t p) { return (float)p.x + (float)p.y; }
};

// LDS tiles of packs: tile row `row` holds S packs (S a multiple of CHUNK, so every row starts
// 16-byte aligned), and the kernels move runs of up to CHUNK consecutive packs of one row, a
// 16-byte access per run (per plane below). A layout derives from the element type E and adds
// where a pack lives:
//   PackedTile: a row is S whole packs (half2 words, int8 quads).
//   PlanarTile: a row is S x components, then S y components (fp32 pairs). A 16-byte read brings
//   four columns' x (or y) into four consecutive registers, so for both components of a pair
//   product the multiplicand read fresh sits in the same register bank, and the compiler can keep
//   each accumulator off it. Interleaved float2 pairs put x and y in alternate banks, and every
//   accumulator then shares a bank with one of its two products' operands.
template <class E>
struct PackedTile : E {
  typedef typename E::pack_t pack_t;
  typedef typename E::elem_t elem_t;
  static constexpr int CHUNK = 4;
  // Component `comp` of the pack at (row, col).
  RDNA_DEVICE elem_t* elem(pack_t* tile, int S, int row, int col, int comp) {
    return reinterpret_cast<elem_t*>(tile + row * S + col) + comp;
  }
  // N consecutive packs of one row from column col (a multiple of N).
  template <int N>
  RDNA_DEVICE void load_run(pack_t* dst, const pack_t* tile, int S, int row, int col) {
    __builtin_memcpy(dst, __builtin_assume_aligned(tile + row * S + col, N * sizeof(pack_t)), N * sizeof(pack_t));
  }
  template <int N>
  RDNA_DEVICE void store_run(pack_t* tile, int S, int row, int col, const pack_t* src) {
    __builtin_memcpy(__builtin_assume_aligned(tile + row * S + col, N * sizeof(pack_t)), src, N * sizeof(pack_t));
  }
};

template <class E>
struct PlanarTile : E {
  typedef typename E::pack_t pack_t;
  typedef typename E::elem_t elem_t;
  static constexpr int CHUNK = 4;
  RDNA_DEVICE elem_t* plane(pack_t* tile, int S, int row, int comp) {
    return reinterpret_cast<elem_t*>(tile + row * S) + comp * S;
  }
  RDNA_DEVICE const elem_t* plane(const pack_t* tile, int S, int row, int comp) {
    return reinterpret_cast<const elem_t*>(tile + row * S) + comp * S;
  }
  RDNA_DEVICE elem_t* elem(pack_t* tile, int S, int row, int col, int comp) { return plane(tile, S, row, comp) + col; }
  template <int N>
  RDNA_DEVICE void load_run(pack_t* dst, const pack_t* tile, int S, int row, int col) {
    elem_t x[N], y[N];
    __builtin_memcpy(x, __builtin_assume_aligned(plane(tile, S, row, 0) + col, N * sizeof(elem_t)), sizeof(x));
    __builtin_memcpy(y, __builtin_assume_aligned(plane(tile, S, row, 1) + col, N * sizeof(elem_t)), sizeof(y));
#pragma unroll
    for (int k = 0; k < N; ++k) dst[k] = pack_t{x[k], y[k]};
  }
  template <int N>
  RDNA_DEVICE void store_run(pack_t* tile, int S, int row, int col, const pack_t* src) {
    elem_t x[N], y[N];
#pragma unroll
    for (int k = 0; k < N; ++k) x[k] = src[k].x, y[k] = src[k].y;
    __builtin_memcpy(__builtin_assume_aligned(plane(tile, S, row, 0) + col, N * sizeof(elem_t)), x, sizeof(x));
    __builtin_memcpy(__builtin_assume_aligned(plane(tile, S, row, 1) + col, N * sizeof(elem_t)), y, sizeof(y));
  }
};
