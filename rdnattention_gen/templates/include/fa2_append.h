// The append step of flash_attn_with_kvcache (rdnattention/families/append.py): a call's new keys
// and values written into the cache at their positions, k rotated by RoPE there; the queries
// rotated into their own buffer; the cache lengths after the append.
//
// One workgroup per (row i, sequence b) of a [batch, rows] grid flattened into x: row i < seq_new
// appends key and value i of every K/V head; with RoPE tables, row i < seq_q rotates query i of
// every head; row 0 writes seqused_k[b]. Each thread writes one value of a row at a time. Every index
// the kernel is given is bounded here, since a GPU call does not read them: cache_seqlens within
// [0, cache_len - seq_new], cache rows and pages within the cache, table positions within the
// tables (the clamps kvcache.py's torch operations apply).
//
// RoPE, exactly as torch rounds reference.rotate's float64 rotation: the products of 16-bit inputs
// and 32-bit (or 16-bit) table values are exact in float64, so each output is one float64 sum
// (the same whether or not the compiler contracts it into an FMA), then rounded once, to nearest
// even, to the input dtype, as reference.rotate rounds on every device. Features past
// rotary_dim are copied bit for bit.
#pragma once

#include "tiles.h"

// One 16-bit value of the input dtype, as float64 (exact).
template <bool BF16>
RDNA_DEVICE double fa2_append_widen(unsigned short bits) {
  if constexpr (BF16)
    return (double)rdna_bf16_lo(bits);
  else
    return (double)__builtin_bit_cast(half_t, bits);
}

// A float64 value as float32 rounded to odd (truncated, its last bit set where that dropped
// anything). Rounding that float32 to fp16 or bf16 gives the float64 value's own rounding to nearest
// even (float32 keeps 13 and 16 bits beyond theirs): one rounding, on every platform, whatever a
// compiler makes of two conversions in a row.
RDNA_DEVICE float fa2_append_to_odd(double x) {
  const float f = (float)x;
  unsigned u = __builtin_bit_cast(unsigned, f);
  if ((x > 0.0 && (double)f > x) || (x < 0.0 && (double)f < x)) u -= 1u;  // rounded away from zero: one step back
  if ((double)__builtin_bit_cast(float, u) != x) u |= 1u;
  return __builtin_bit_cast(float, u);
}

// A float64 value rounded once, to nearest even, to the input dtype.
template <bool BF16>
RDNA_DEVICE unsigned short fa2_append_narrow(double x) {
  const float f = fa2_append_to_odd(x);
  if constexpr (BF16)
    return (unsigned short)rdna_bf16_bits(f);
  else
    return __builtin_bit_cast(unsigned short, (half_t)f);
}

// Entry c of row pos of a RoPE table of dtype kind (0: fp32, 1: fp16, 2: bf16), as float64.
RDNA_DEVICE double fa2_append_table(const void* t, long long stride, long long stride_c, int pos, int c, int kind) {
  const long long at = pos * stride + c * stride_c;
  if (kind == 0) return (double)static_cast<const float*>(t)[at];
  const unsigned short bits = static_cast<const unsigned short*>(t)[at];
  return kind == 1 ? (double)__builtin_bit_cast(half_t, bits) : (double)rdna_bf16_lo(bits);
}

// Feature d of a row (src, 16-bit values) rotated at table position pos: pairs (2j, 2j+1) where
// ``pairs``, else halves (j, j + half).
template <bool BF16, class Args>
RDNA_DEVICE unsigned short fa2_append_rotate(const Args& a, const unsigned short* src, int d, int pos, bool pairs) {
  const int half = a.rotary_half;
  if (d >= 2 * half) return src[d];
  int j, other;
  bool first;
  if (pairs) {
    j = d >> 1, first = (d & 1) == 0, other = first ? d + 1 : d - 1;
  } else {
    first = d < half, j = first ? d : d - half, other = first ? d + half : d - half;
  }
  const double c = fa2_append_table(a.rotary_cos, a.cos_stride, a.cos_stride_c, pos, j, a.rotary_dtype);
  const double s = fa2_append_table(a.rotary_sin, a.sin_stride, a.sin_stride_c, pos, j, a.rotary_dtype);
  const double x = fa2_append_widen<BF16>(src[d]), y = fa2_append_widen<BF16>(src[other]);
  // first: x * c - y * s (y the pair's second); second: x * c + y * s (y the pair's first).
  return fa2_append_narrow<BF16>(first ? x * c - y * s : x * c + y * s);
}

// The same in a compile-time mode: ROPE 0 copies, 1 rotates pairs, 2 halves.
template <bool BF16, int ROPE, class Args>
RDNA_DEVICE unsigned short fa2_append_rotated(const Args& a, const unsigned short* src, int d, int pos) {
  if (ROPE == 0) return src[d];
  return fa2_append_rotate<BF16>(a, src, d, pos, ROPE == 1);
}

template <int NT, bool BF16, int ROPE, class Args>
RDNA_DEVICE void fa2_append(const Args& a) {
  const int tid = rdna_thread_id();
  const long long block = rdna_block_id_x();
  const int i = (int)(block % a.rows);
  const long long b = block / a.rows;
  const int top = a.cache_len - a.seq_new;
  const int len = rdna_min(rdna_max(a.cache_seqlens[b], 0), top);
  if (i == 0 && tid == 0) a.seqused_k[b] = len + a.seq_new;
  const int D = a.head_dim;
  const int last = a.positions - 1;
  if (i < a.seq_new) {
    const int p = len + i;
    long long row;
    int at;
    if (a.block_table) {  // page block_table[b, p / page_size], row p % page_size
      row = rdna_min(rdna_max(a.block_table[b * a.block_table_stride + (p >> a.page_shift)], 0), a.cache_rows - 1);
      at = p & ((1 << a.page_shift) - 1);
    } else {
      row = a.cache_batch_idx ? rdna_min(rdna_max(a.cache_batch_idx[b], 0), a.cache_rows - 1) : b;
      at = p;
    }
    const int pos = ROPE ? rdna_min(p, last) : 0;
    const unsigned short* const kn = reinterpret_cast<const unsigned short*>(a.k_new) + b * a.kn_stride_b + i * a.kn_stride_s;
    const unsigned short* const vn = reinterpret_cast<const unsigned short*>(a.v_new) + b * a.vn_stride_b + i * a.vn_stride_s;
    unsigned short* const kc = reinterpret_cast<unsigned short*>(a.k) + row * a.kc_stride_b + at * a.kc_stride_s;
    unsigned short* const vc = reinterpret_cast<unsigned short*>(a.v) + row * a.vc_stride_b + at * a.vc_stride_s;
    for (int e = tid; e < a.heads_kv * D; e += NT) {
      const int h = e / D, d = e - h * D;
      kc[h * a.kc_stride_h + d] = fa2_append_rotated<BF16, ROPE>(a, kn + h * a.kn_stride_h, d, pos);
      vc[h * a.vc_stride_h + d] = vn[h * a.vn_stride_h + d];
    }
  }
  if (ROPE && i < a.seq_q) {  // query i at cache_seqlens (+ i under a causal or local mask)
    const int pos = rdna_min(len + (a.q_local ? i : 0), last);
    const unsigned short* const qs = reinterpret_cast<const unsigned short*>(a.q_src) + b * a.qs_stride_b + i * a.qs_stride_s;
    unsigned short* const qo = reinterpret_cast<unsigned short*>(a.q) + b * a.q_stride_b + i * a.q_stride_s;
    for (int e = tid; e < a.heads_q * D; e += NT) {
      const int h = e / D, d = e - h * D;
      qo[h * a.q_stride_h + d] = fa2_append_rotated<BF16, ROPE>(a, qs + h * a.qs_stride_h, d, pos);
    }
  }
}
