// The combine step of split-KV decode: merges the normalised partial rows of every key slice
// (fa2_decode.h) by their log2-domain LSEs into the fp16 (BF16: bf16) output and the natural-log LSE; a
// row's attention sink (sinks, fp32 [heads_q]; null: none) joins its sum here, after every slice.
//
// One workgroup per row of the padded [batch, heads_q, seq_q] row space; rows past a sequence's
// query rows do not exist. Its threads form G = NT / L groups of L = D/8 lanes (8 fp32 values of
// the row each; where L does not divide NT, the NT - G * L threads left over only meet the
// barrier); group g merges slices g, g + G, ... against its own running maximum, several
// slices' loads in flight at once, and the groups' results meet in LDS. With the slices spread over G
// groups, a call with many slices (few rows, long caches) waits out the cache latency G times
// less often than one group walking them all.
#pragma once

#include "tiles.h"
#include "fa2_decode.h"  // fa2_query_rows, fa2_merge_partials, fa2_store_final_row

template <int D, int NT, bool BF16 = false, class Args>
RDNA_DEVICE void fa2_combine(const Args& a, unsigned char* lds) {
  constexpr int L = D / 8, G = NT / L;
  static_assert(D % 8 == 0 && L <= NT, "lanes per row");
  const int tid = rdna_thread_id(), g = tid / L, c0 = tid % L * 8;
  const bool grouped = NT % L == 0 || g < G;  // in a group (not one of the threads left over)
  const long long total = (long long)a.batch * a.heads_q * a.seq_q;
  const long long row = rdna_block_id_x();
  const int p = (int)(row % a.seq_q), head = (int)(row / a.seq_q % a.heads_q);
  const long long b = row / ((long long)a.seq_q * a.heads_q);
  const Fa2Span qs = fa2_query_rows(a, b);
  const long long q0 = qs.first;
  if (p >= qs.count) return;  // the whole workgroup

  // One pass: each slice's LSE and values are read together and merged against a running
  // maximum, so a group's loads all go out at once (a first pass for the maximum would wait out
  // the cache latency twice). Slices that saw no key (LSE -inf) weigh nothing; a NaN LSE makes
  // the row NaN.
  float mx = -__builtin_inff(), sum = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int s = g; grouped && s < a.splits; s += G) {
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
  if (grouped) {
    __builtin_memcpy(__builtin_assume_aligned(accl + g * D + c0, 16), acc, sizeof(acc));
    if (c0 == 0) stat[2 * g] = mx, stat[2 * g + 1] = sum;
  }
  rdna_block_sync();
  if (g != 0) return;
  float ref, out[8];
  float sum_all = fa2_merge_partials(stat, 2, accl + c0, D, G, out, ref);
  if (a.sinks) fa2_join_sink(a.sinks[head] * 1.4426950408889634f, sum_all, ref, out);  // the row's sink, once
  fa2_store_final_row<8, BF16>(a, b, head, q0 + p, c0, out, sum_all, ref);
}
