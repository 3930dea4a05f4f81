// The INT8 family's kernel body: the FlashAttention-2 main loop (fa2_forward.h) over int8 quads,
// with both products in int8:
//
//   S = (Q_i8 . K_i8^T) * q_scale[row] * k_scale[key] * softmax_scale   (int32 dot4, then fp32)
//   P = round(127 * exp2(S - m)) in 0..127                               (int8, per tile)
//   O = sum over tiles of alpha-rescaled (P_i8 . V_i8) in fp32; out = O * v_scale[col] / l
//
// l sums P exactly as quantized, so the weights of a row sum to one; the log-sum-exp comes from
// the unquantized P. What moves through LDS are quads: four int8 values along each product's
// reduction dimension in one 32-bit word (Q and K along head_dim, V and P along the keys).
#pragma once

#include "tiles.h"
#include "pairs.h"
#include "pipeline.h"
#include "fa2_policies.h"
#include "fa2_forward.h"

// Four rows' words (one column group of four each) as four quads: quad c holds column c of rows
// 0..3 in its bytes 0..3.
RDNA_DEVICE void rdna_transpose_quads(unsigned r0, unsigned r1, unsigned r2, unsigned r3, int* out) {
  const unsigned lo01 = (r0 & 0x00FF00FFu) | ((r1 & 0x00FF00FFu) << 8);
  const unsigned hi01 = ((r0 >> 8) & 0x00FF00FFu) | (r1 & 0xFF00FF00u);
  const unsigned lo23 = (r2 & 0x00FF00FFu) | ((r3 & 0x00FF00FFu) << 8);
  const unsigned hi23 = ((r2 >> 8) & 0x00FF00FFu) | (r3 & 0xFF00FF00u);
  out[0] = (int)((lo01 & 0xFFFFu) | (lo23 << 16));
  out[1] = (int)((hi01 & 0xFFFFu) | (hi23 << 16));
  out[2] = (int)((lo01 >> 16) | (lo23 & 0xFFFF0000u));
  out[3] = (int)((hi01 >> 16) | (hi23 & 0xFFFF0000u));
}

// int8 quads through the target's dot4, accumulated in int32.
struct ForwardI8 {
  typedef signed char input_t;
  typedef signed char elem_t;
  typedef int pack_t;
  typedef int acc_t;
  static constexpr int PACK = 4;
  static constexpr int VW = 16;  // value columns per staging item: 16 bytes of each of four keys
  static constexpr bool EXACT_LSE = true;
  static constexpr float P_LEVELS = 127.f;  // P in 0..127: the signed dot4 of every target takes it
  RDNA_DEVICE int dot(int a, int b, int acc) { return rdna_dot4_i8(a, b, acc); }
  RDNA_DEVICE pack_t from_word(unsigned w) { return (int)w; }
  // Probabilities below 2^-126 may be 0: they quantize to 0, and the exact sum they miss is < 2^-120.
  RDNA_DEVICE float exp2(float x) { return rdna_exp2_flush(x); }
  // Four key rows' 16 bytes as 16 quads of keys, one per column.
  RDNA_DEVICE void pack_columns(const unsigned (&rows)[PACK][VW / 4], pack_t (&out)[VW]) {
#pragma unroll
    for (int w = 0; w < VW / 4; ++w) rdna_transpose_quads(rows[0][w], rows[1][w], rows[2][w], rows[3][w], out + 4 * w);
  }
  // Four keys' probabilities quantized into one quad; l adds them as quantized, lx unquantized.
  // round(e * 127) is the low byte of e * 127 + 1.5 * 2^23 (an FMA, rounded to nearest).
  RDNA_DEVICE pack_t probabilities(const float (&e)[PACK], float& l, float& lx) {
    constexpr float ROUND = 12582912.f;
    constexpr unsigned ROUND_BITS = 0x4B400000u;
    unsigned w[PACK];
#pragma unroll
    for (int k = 0; k < PACK; ++k) w[k] = __builtin_bit_cast(unsigned, rdna_fma(e[k], P_LEVELS, ROUND));
    lx += (e[0] + e[1]) + (e[2] + e[3]);
    l += (float)(int)((w[0] + w[1]) + (w[2] + w[3]) - PACK * ROUND_BITS);
    return (int)((w[0] & 0xFFu) | (w[1] & 0xFFu) << 8 | (w[2] & 0xFFu) << 16 | w[3] << 24);
  }
};

// The int8 family's scales, for one (batch, K/V head): per-token Q and K scales and per-channel V
// scales, fp32 [batch, heads, seq] and [batch, heads_kv, head_dim]. A row's scale carries the
// softmax scale (the mask's), so the products dequantize straight into the log2 domain.
template <class Args>
struct QuantScales {
  static constexpr bool ENABLED = true;  // the K tile's scales are staged with it (fa2_forward.h)
  const Args& a;
  const float* k;
  const float* v;
  RDNA_METHOD QuantScales(const Args& args, long long b, int head_kv)
      : a(args), k(args.k_scale + b * args.k_scale_stride_b + head_kv * args.k_scale_stride_h),
        v(args.v_scale + b * args.v_scale_stride_b + head_kv * args.v_scale_stride_h) {}
  template <class Mask>
  RDNA_METHOD float row(const Mask& mask, long long b, int head, int pos) const {
    return mask.scale(a.q_scale[b * a.q_scale_stride_b + head * a.q_scale_stride_h + pos]);
  }
  RDNA_METHOD float key(int i) const { return k[i]; }
  template <class Mask>
  RDNA_METHOD float score(const Mask&, int acc, float row, float key) const { return (float)acc * row * key; }
  RDNA_METHOD float value(int c) const { return v[c]; }
};

template <class Pipe, int D, int G, int BR, int BC, int NT, int TM, int LDS_BYTES>
RDNA_DEVICE void fa2_i8_forward(const Fa2I8Args& a, unsigned char* lds) {
  const RowBlockSchedule<BR, G> sched(a.seq_q, a.heads_q, a.heads_kv, a.heavy_first);
  const StridedQ<Fa2I8Args> q{a};
  const StridedKv<Fa2I8Args> kv(a, sched.batch, sched.head_kv);
  const WindowMask<Fa2I8Args> mask{a};
  const QuantScales<Fa2I8Args> scales(a, sched.batch, sched.head_kv);
  const NormalizeEpilogue<Fa2I8Args> epi{a};
  const NoScoreTransform<Fa2I8Args> xf{a};
  fa2_forward<ForwardI8, Pipe, D, D, G, BR, BC, NT, TM, LDS_BYTES>(lds, sched, q, kv, mask, NoRope{}, scales, xf, epi);
}
