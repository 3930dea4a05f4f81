// The INT8 family's quantization (rdnattention/families/quant.py): up to three tensors quantized
// symmetrically to int8 in one launch, q and k per token, v per channel, each written contiguous
// with fp32 scales.
//
// The numbers are the torch formula's (rdnattention/int8.py _quantize) bit for bit: amax is exact;
// scale = amax / 127 by IEEE division, at least float32's smallest normal (1 for an all-zero
// vector); each value is x / scale by IEEE division, rounded to nearest even, clamped to +-127. A
// vector holding a NaN or an infinity gets a NaN scale and zeros: its amax is carried as infinity,
// which the max-reductions keep (a NaN they would drop).
//
// The grid is one-dimensional: q_blocks workgroups of q's rows, then k_blocks of k's, then v_blocks
// of v's columns. A token row is one wave's: lanes stride its head_dim, a butterfly of shuffles
// reduces. A column block is (batch, head, one wave's width of features): lane i reads feature i of
// every row its wave takes (waves take rows in turn), the waves' maxima meet in LDS.
#pragma once

#include "tiles.h"

constexpr float FA2_QUANT_LEVELS = 127.f;
constexpr float FA2_QUANT_TINY = 0x1p-126f;  // float32's smallest normal number

// Element `at` of a source of dtype kind (0: fp32, 1: fp16, 2: bf16), as float32 (exact).
RDNA_DEVICE float fa2_quant_load(const void* x, long long at, int kind) {
  if (kind == 0) return static_cast<const float*>(x)[at];
  const unsigned short bits = static_cast<const unsigned short*>(x)[at];
  return kind == 1 ? (float)__builtin_bit_cast(half_t, bits) : rdna_bf16_lo(bits);
}

// |x| as the max-reductions carry it: a NaN or an infinity as infinity.
RDNA_DEVICE float fa2_quant_magnitude(float x) {
  const float a = __builtin_fabsf(x);
  return a <= 3.40282347e+38f ? a : __builtin_inff();
}

// The scale of a vector of largest magnitude amax (fa2_quant_magnitude's): NaN where it held a NaN
// or an infinity. Below 127 times the least normal, amax / 127 rounds to at most that normal, which
// the floor makes it: no division on sub-normal operands (the slow path of AMD's division sequence).
RDNA_DEVICE float fa2_quant_scale(float amax) {
  if (!(amax <= 3.40282347e+38f)) return __builtin_nanf("");
  if (amax == 0.f) return 1.f;
  return amax < FA2_QUANT_LEVELS * FA2_QUANT_TINY ? FA2_QUANT_TINY : amax / FA2_QUANT_LEVELS;
}

// x quantized at `scale` (0 where the scale is NaN). At the floor scale, 2^-126, x / scale is x * 2^126
// exactly (|x| < 127 * 2^-126 there), so that case multiplies.
RDNA_DEVICE signed char fa2_quant_value(float x, float scale) {
  if (scale != scale) return 0;
  const float r = __builtin_rintf(scale == FA2_QUANT_TINY ? x * 0x1p126f : x / scale);
  return (signed char)(int)rdna_min(rdna_max(r, -FA2_QUANT_LEVELS), FA2_QUANT_LEVELS);
}

// Token row `row` (of [batch, heads, seq] rows) of one per-token job, by one wave.
RDNA_DEVICE void fa2_quant_token_row(const void* x, long long sb, long long sh, long long ss, long long sd,
                                     int heads, int seq, long long row, int D, int kind, signed char* out,
                                     float* scales, int lane) {
  const long long s = row % seq, bh = row / seq;
  const long long base = (bh / heads) * sb + (bh % heads) * sh + s * ss;
  float amax = 0.f;
  for (int d = lane; d < D; d += RDNA_WAVE_SIZE) amax = __builtin_fmaxf(amax, fa2_quant_magnitude(fa2_quant_load(x, base + d * sd, kind)));
#pragma unroll
  for (int mask = RDNA_WAVE_SIZE / 2; mask > 0; mask >>= 1) amax = __builtin_fmaxf(amax, rdna_shfl_xor(amax, mask));
  const float scale = fa2_quant_scale(amax);
  if (lane == 0) scales[row] = scale;
  signed char* const o = out + row * D;
  for (int d = lane; d < D; d += RDNA_WAVE_SIZE) o[d] = fa2_quant_value(fa2_quant_load(x, base + d * sd, kind), scale);
}

template <int NT>
RDNA_DEVICE void fa2_quant(const Fa2QuantArgs& a, unsigned char* lds) {
  constexpr int WAVES = NT / RDNA_WAVE_SIZE;
  const int tid = rdna_thread_id();
  const int lane = tid % RDNA_WAVE_SIZE, wave = tid / RDNA_WAVE_SIZE;
  const int D = a.head_dim;
  long long block = rdna_block_id_x();
  if (block < a.q_blocks) {
    const long long row = block * WAVES + wave;
    if (row < a.q_rows)
      fa2_quant_token_row(a.q_src, a.qs_stride_b, a.qs_stride_h, a.qs_stride_s, a.qs_stride_d, a.heads_q, a.seq_q,
                          row, D, a.x_dtype, a.q, a.q_scale, lane);
    return;
  }
  block -= a.q_blocks;
  if (block < a.k_blocks) {
    const long long row = block * WAVES + wave;
    if (row < a.k_rows)
      fa2_quant_token_row(a.k_src, a.ks_stride_b, a.ks_stride_h, a.ks_stride_s, a.ks_stride_d, a.heads_k, a.seq_k,
                          row, D, a.x_dtype, a.k, a.k_scale, lane);
    return;
  }
  block -= a.k_blocks;
  if (block >= a.v_blocks) return;
  // A column block of v: (batch * heads_v + head) * chunks + chunk, a chunk a wave's width of features.
  const int chunks = (D + RDNA_WAVE_SIZE - 1) / RDNA_WAVE_SIZE;
  const long long bh = block / chunks;
  const int d = (int)(block % chunks) * RDNA_WAVE_SIZE + lane;
  const int S = a.seq_v;
  const long long base = (bh / a.heads_v) * a.vs_stride_b + (bh % a.heads_v) * a.vs_stride_h + d * a.vs_stride_d;
  float amax = 0.f;
  if (d < D) {
#pragma unroll 8
    for (int s = wave; s < S; s += WAVES)
      amax = __builtin_fmaxf(amax, fa2_quant_magnitude(fa2_quant_load(a.v_src, base + s * a.vs_stride_s, a.x_dtype)));
  }
  float* const part = reinterpret_cast<float*>(lds);
  part[tid] = amax;
  rdna_block_sync();
#pragma unroll
  for (int w = 0; w < WAVES; ++w) amax = __builtin_fmaxf(amax, part[w * RDNA_WAVE_SIZE + lane]);
  if (d >= D) return;
  const float scale = fa2_quant_scale(amax);
  if (wave == 0) a.v_scale[bh * D + d] = scale;
  signed char* const o = a.v + bh * S * D + d;
#pragma unroll 8
  for (int s = wave; s < S; s += WAVES) o[(long long)s * D] = fa2_quant_value(fa2_quant_load(a.v_src, base + s * a.vs_stride_s, a.x_dtype), scale);
}
