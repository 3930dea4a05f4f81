// The combine step of split-KV decode: merges the normalised partial rows of every key slice
// (fa2_decode.h) by their log2-domain LSEs into the fp16 output and the natural-log LSE.
//
// L = D/8 lanes per row, 8 fp32 values each; a workgroup takes NT/L consecutive rows of the
// padded [batch, heads_q, seq_q] row space. Rows past a sequence's query rows do not exist.
#pragma once

#include "tiles.h"
#include "fa2_decode.h"  // fa2_query_rows

template <int D, int NT, class Args>
RDNA_DEVICE void fa2_combine(const Args& a) {
  constexpr int L = D / 8, ROWS = NT / L;
  static_assert(D % 8 == 0 && L <= NT && NT % L == 0, "lanes per row");
  const int tid = rdna_thread_id(), c0 = tid % L * 8;
  const long long total = (long long)a.batch * a.heads_q * a.seq_q;
  const long long row = (long long)rdna_block_id_x() * ROWS + tid / L;
  if (row >= total) return;
  const int p = (int)(row % a.seq_q), head = (int)(row / a.seq_q % a.heads_q);
  const long long b = row / ((long long)a.seq_q * a.heads_q);
  const long long q0 = a.cu_seqlens_q ? a.cu_seqlens_q[b] : 0;
  if (p >= fa2_query_rows(a, b)) return;

  float mx = -__builtin_inff();
  for (int s = 0; s < a.splits; ++s) mx = rdna_fmax(mx, a.part_lse[s * total + row]);
  const float ref = mx == -__builtin_inff() ? 0.f : mx;
  // Slices that saw no key (LSE -inf) weigh nothing; a NaN LSE makes the row NaN.
  float sum = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 1
  for (int s = 0; s < a.splits; ++s) {
    const float w = rdna_exp2(a.part_lse[s * total + row] - ref);
    sum += w;
    float part[8];
    __builtin_memcpy(part, __builtin_assume_aligned(a.part_o + (s * total + row) * D + c0, 16), sizeof(part));
#pragma unroll
    for (int c = 0; c < 8; ++c) acc[c] = rdna_fma(part[c], w, acc[c]);
  }
  const float inv = sum == 0.f ? 0.f : 1.f / sum;
  half_t* out = a.o + b * a.o_stride_b + head * a.o_stride_h + (q0 + p) * a.o_stride_s + c0;
  rdna_store_row<8, 8>(out, 0, acc, inv);
  if (a.lse && c0 == 0)
    a.lse[b * a.lse_stride_b + head * a.lse_stride_h + q0 + p] =
        sum == 0.f ? -__builtin_inff() : (ref + rdna_log2(sum)) * 0.6931471805599453f;
}
