// Precision and staging policies: the kernels move "pairs" of values along each product's
// reduction dimension through LDS, and dot() multiplies two pairs into an fp32 accumulator.
#pragma once

// fp16 pairs, fed to the tier's dot2 lowering as they are.
struct F16Pairs {
  typedef half_t elem_t;
  typedef half2_t pair_t;
  RDNA_DEVICE float dot(pair_t a, pair_t b, float acc) { return rdna_dot2(a, b, acc); }
  RDNA_DEVICE pair_t from_halves(unsigned w) { return __builtin_bit_cast(half2_t, w); }
  RDNA_DEVICE pair_t make(float x, float y) { return pair_t{(half_t)x, (half_t)y}; }
  RDNA_DEVICE float sum(pair_t p) { return (float)p.x + (float)p.y; }
};

// fp32 pairs: every fp16 value is converted once, when its tile is staged, for targets that
// would otherwise convert before every FMA.
struct F32Pairs {
  typedef float elem_t;
  typedef float pair_t __attribute__((ext_vector_type(2)));
  RDNA_DEVICE float dot(pair_t a, pair_t b, float acc) { return rdna_fma(a.y, b.y, rdna_fma(a.x, b.x, acc)); }
  RDNA_DEVICE pair_t from_halves(unsigned w) {
    const half2_t h = __builtin_bit_cast(half2_t, w);
    return pair_t{(float)h.x, (float)h.y};
  }
  RDNA_DEVICE pair_t make(float x, float y) { return pair_t{x, y}; }
  RDNA_DEVICE float sum(pair_t p) { return (float)p.x + (float)p.y; }
};
