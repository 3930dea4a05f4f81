// The combine step of split-KV decode: merges the normalised partial rows of every key slice
// (fa2_decode.h) by their log2-domain LSEs into the fp16 output and the natural-log LSE.
//
// One workgroup per row of the padded [batch, heads_q, seq_q] row space; rows past a sequence's
// query rows do not exist. Its threads form G = NT / L groups of L = D/8 lanes (8 fp32 values of
// the row each); group g merges slices g, g + G, ... against its own running maximum, several
// slices' loads in flight at once, and the groups' results meet in LDS. With the slices spread over G
// groups, a call with many slices (few rows, long caches) waits out the cache latency G times
// less often than one group walking them all.
#pragma once

#include "tiles.h"
#include "fa2_decode.h"  // fa2_query_rows

template <int D, int NT, class Args>
RDNA_DEVICE void fa2_combine(const Args& a, unsigned char* lds) {
  constexpr int L = D / 8, G = NT / L;
  static_assert(D % 8 == 0 && L <= NT && NT % L == 0, "lanes per row");
  const int tid = rdna_thread_id(), g = tid / L, c0 = tid % L * 8;
  const long long total = (long long)a.batch * a.heads_q * a.seq_q;
  const long long row = rdna_block_id_x();
  const int p = (int)(row % a.seq_q), head = (int)(row / a.seq_q % a.heads_q);
  const long long b = row / ((long long)a.seq_q * a.heads_q);
  const long long q0 = a.cu_seqlens_q ? a.cu_seqlens_q[b] : 0;
  if (p >= fa2_query_rows(a, b)) return;  // the whole workgroup

  // One pass: each slice's LSE and values are read together and merged against a running
  // maximum, so a group's loads all go out at once (a first pass for the maximum would wait out
  // the cache latency twice). Slices that saw no key (LSE -inf) weigh nothing; a NaN LSE makes
  // the row NaN.
  float mx = -__builtin_inff(), sum = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int s = g; s < a.splits; s += G) {
    const float lse = a.part_lse[s * total + row];
    float part[8];
    __builtin_memcpy(part, __builtin_assume_aligned(a.part_o + (s * total + row) * D + c0, 16), sizeof(part));
    const float m_new = rdna_fmax(mx, lse);
    const float ref = m_new == -__builtin_inff() ? 0.f : m_new;
    const float keep = rdna_exp2(mx - ref), w = rdna_exp2(lse - ref);
    mx = m_new;
    sum = sum * keep + w;
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] = rdna_fma(part[c], w, acc[c] * keep);
  }

  // The groups meet: acc [G][D], then (reference, sum) [G]; group 0 merges and stores.
  float* const accl = reinterpret_cast<float*>(lds);
  float* const stat = accl + G * D;
  __builtin_memcpy(__builtin_assume_aligned(accl + g * D + c0, 16), acc, sizeof(acc));
  if (c0 == 0) stat[2 * g] = mx, stat[2 * g + 1] = sum;
  rdna_block_sync();
  if (g != 0) return;
  float top = -__builtin_inff();
  for (int h = 0; h < G; ++h) top = rdna_fmax(top, stat[2 * h]);
  const float ref_all = top == -__builtin_inff() ? 0.f : top;
  float total_sum = 0.f, out[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int h = 0; h < G; ++h) {
    // A group that merged no slice (maximum -inf) has sum 0 and zero values: weight 0.
    const float hm = stat[2 * h];
    const float w = hm == -__builtin_inff() ? 0.f : rdna_exp2(hm - ref_all);
    total_sum += stat[2 * h + 1] * w;
    const float* src = accl + h * D + c0;
#pragma unroll
    for (int c = 0; c < 8; ++c) out[c] = rdna_fma(src[c], w, out[c]);
  }
  const float inv = total_sum == 0.f ? 0.f : 1.f / total_sum;
  half_t* dst = a.o + b * a.o_stride_b + head * a.o_stride_h + (q0 + p) * a.o_stride_s + c0;
  rdna_store_row<8, 8>(dst, 0, out, inv);
  if (a.lse && c0 == 0)
    a.lse[b * a.lse_stride_b + head * a.lse_stride_h + q0 + p] =
        total_sum == 0.f ? -__builtin_inff() : (ref_all + rdna_log2(total_sum)) * 0.6931471805599453f;
}
