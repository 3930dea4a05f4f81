// The INT8 family's kernel body: FlashAttention-2 forward with both products in int8.
//
//   S = (Q_i8 . K_i8^T) * q_scale[row] * k_scale[key] * softmax_scale   (int32 dot4, then fp32)
//   P = round(127 * exp2(S - m)) in 0..127                               (int8, per tile)
//   O = sum over tiles of alpha-rescaled (P_i8 . V_i8) in fp32; out = O * v_scale[col] / l
//
// l sums P exactly as quantized, so the weights of a row sum to one; the log-sum-exp comes from
// the unquantized P. Threads form the same
// (BR/TM) x TCW grid as the fp16 body (fa2_forward.h); what moves through LDS are quads: four
// int8 values along each product's reduction dimension in one 32-bit word.
//   qt  [D/4][BR+pad]   Q transposed, quads along head_dim
//   kv  K tile [D/4][BC+pad] likewise, then the V tile [BC/4][D] as quads of four keys
//   pt  [BC/4][BR+pad]  P transposed, quads of four keys
//   ks  [BC]            the K tile's scales
// The family's lds_layout (Python) states the same sizes; LDS_BYTES is checked against them.
#pragma once

#include "tiles.h"
#include "fa2_policies.h"

RDNA_DEVICE u32x4 rdna_load16_i8(const signed char* p) { return *reinterpret_cast<const u32x4*>(p); }

// Four rows' 4-byte slices (one column group of four keys each) as four quads of keys: quad c
// holds column c of rows 0..3 in its bytes 0..3.
RDNA_DEVICE void rdna_transpose_quads(unsigned r0, unsigned r1, unsigned r2, unsigned r3, int (&out)[4]) {
  const unsigned lo01 = (r0 & 0x00FF00FFu) | ((r1 & 0x00FF00FFu) << 8);
  const unsigned hi01 = ((r0 >> 8) & 0x00FF00FFu) | (r1 & 0xFF00FF00u);
  const unsigned lo23 = (r2 & 0x00FF00FFu) | ((r3 & 0x00FF00FFu) << 8);
  const unsigned hi23 = ((r2 >> 8) & 0x00FF00FFu) | (r3 & 0xFF00FF00u);
  out[0] = (int)((lo01 & 0xFFFFu) | (lo23 << 16));
  out[1] = (int)((hi01 & 0xFFFFu) | (hi23 << 16));
  out[2] = (int)((lo01 >> 16) | (lo23 & 0xFFFF0000u));
  out[3] = (int)((hi01 >> 16) | (hi23 & 0xFFFF0000u));
}

// acc[i][j] = dot4(a[i], b[j]) + acc[i][j]
template <int M, int N>
RDNA_DEVICE void rdna_outer_dot4(int (&acc)[M][N], const int (&a)[M], const int (&b)[N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) acc[i][j] = rdna_dot4_i8(a[i], b[j], acc[i][j]);
}

template <class Args, int D, int G, int BR, int BC, int NT, int TM, int LDS_BYTES>
RDNA_DEVICE void fa2_i8_forward(const Args& a, unsigned char* lds) {
  constexpr int TRW = BR / TM;
  constexpr int TCW = NT / TRW;
  constexpr int TN = BC / TCW;
  constexpr int TD = D / TCW;
  constexpr int RPH = BR / G;
  constexpr int D4 = D / 4, BC4 = BC / 4;
  constexpr int PAD = 4;  // quads: 16 bytes
  constexpr int QS = BR + PAD, KS = BC + PAD;
  constexpr int Q_QUADS = D4 * QS;
  constexpr int KV_QUADS = rdna_max(D4 * KS, BC4 * D);
  constexpr int P_QUADS = BC4 * QS;
  constexpr int CM = rdna_chunk<TM, PAD>, CK = rdna_chunk<TN, PAD>, CD = rdna_chunk<TD, PAD>;
  constexpr int K_ITEMS = BC * D / 16;       // 16-byte chunks of the K tile
  constexpr int V_ITEMS = BC4 * (D / 16);    // (four keys) x (16 columns) blocks of the V tile
  constexpr int KI = (K_ITEMS + NT - 1) / NT, VI = (V_ITEMS + NT - 1) / NT;
  constexpr float P_LEVELS = 127.f;
  static_assert(BR % TM == 0 && NT % TRW == 0 && TCW <= RDNA_WAVE_SIZE && (TCW & (TCW - 1)) == 0, "thread grid");
  static_assert(TN % 4 == 0 && CK == 4 && D % 16 == 0 && TD % 2 == 0 && BR % G == 0, "tile shape");
  static_assert(LDS_BYTES == (Q_QUADS + KV_QUADS + P_QUADS) * 4 + BC * 4, "LDS layout");

  int* const qt = reinterpret_cast<int*>(lds);
  int* const kvt = qt + Q_QUADS;
  int* const pt = kvt + KV_QUADS;
  float* const ks = reinterpret_cast<float*>(pt + P_QUADS);

  const RowBlockSchedule<BR, G> sched(a.seq_q, a.heads_q, a.heads_kv, a.heavy_first);
  const WindowMask<Args> mask{a};
  const int tid = rdna_thread_id();
  const int ty = tid / TCW, tx = tid % TCW;
  const int row0 = ty * TM;
  const int block_pos = sched.block_pos;
  const int head0 = sched.head0;
  const long long b = sched.batch;
  const signed char* const kbase = a.k + b * a.k_stride_b + sched.head_kv * a.k_stride_h;
  const signed char* const vbase = a.v + b * a.v_stride_b + sched.head_kv * a.v_stride_h;
  const float* const kscale = a.k_scale + b * a.k_scale_stride_b + sched.head_kv * a.k_scale_stride_h;

  const int last_pos = rdna_min(mask.seq_q(), block_pos + RPH) - 1;
  const int key_lo = mask.key_lo(block_pos);
  const int key_hi = mask.key_hi(last_pos);
  const u32x4 zero = {0u, 0u, 0u, 0u};

  // Q, transposed: a 16-byte chunk of a row is four quads down a column.
  for (int i = tid; i < BR * D / 16; i += NT) {
    const int r = i % BR, c = i / BR;
    const int pos = block_pos + r % RPH;
    const signed char* src = a.q + b * a.q_stride_b + (head0 + r / RPH) * a.q_stride_h + (long long)pos * a.q_stride_s;
    const u32x4 chunk = pos < mask.seq_q() ? rdna_load16_i8(src + 16 * c) : zero;
    int* dst = qt + 4 * c * QS + r;
    dst[0] = (int)chunk.x;
    dst[QS] = (int)chunk.y;
    dst[2 * QS] = (int)chunk.z;
    dst[3 * QS] = (int)chunk.w;
  }

  int pos[TM], diag[TM];
  float qs[TM];  // the row's Q scale times the softmax scale (log2 domain)
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int r = row0 + i;
    pos[i] = block_pos + r % RPH;
    diag[i] = mask.diag(pos[i]);
    qs[i] = pos[i] < mask.seq_q()
                ? a.q_scale[b * a.q_scale_stride_b + (head0 + r / RPH) * a.q_scale_stride_h + pos[i]] * a.scale_log2
                : 0.f;
  }
  // l sums P as quantized (it normalises O, so a row's weights sum to one); lf sums P unquantized
  // (it gives the log-sum-exp, as exact as the fp16 kernel's).
  float o[TM][TD], m[TM], l[TM], lf[TM];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    m[i] = -__builtin_inff();
    l[i] = 0.f;
    lf[i] = 0.f;
#pragma unroll
    for (int c = 0; c < TD; ++c) o[i][c] = 0.f;
  }

  u32x4 k_stage[KI];
  u32x4 v_stage[VI][4];
  auto load_k = [&](int k0) {
#pragma unroll
    for (int t = 0; t < KI; ++t) {
      const int i = tid + t * NT, key = k0 + i % BC;
      k_stage[t] = i < K_ITEMS && key < a.seq_k ? rdna_load16_i8(kbase + (long long)key * a.k_stride_s + 16 * (i / BC))
                                                : zero;
    }
  };
  auto load_v = [&](int k0) {
#pragma unroll
    for (int t = 0; t < VI; ++t) {
      const int i = tid + t * NT, key = k0 + 4 * (i / (D / 16)), col = (i % (D / 16)) * 16;
#pragma unroll
      for (int r = 0; r < 4; ++r)
        v_stage[t][r] = i < V_ITEMS && key + r < a.seq_k
                            ? rdna_load16_i8(vbase + (long long)(key + r) * a.v_stride_s + col)
                            : zero;
    }
  };

  const int k_first = key_lo / BC * BC;
  if (k_first < key_hi) load_k(k_first);
  for (int k0 = k_first; k0 < key_hi; k0 += BC) {
    rdna_block_sync();  // the previous tile's V and P reads are done
#pragma unroll
    for (int t = 0; t < KI; ++t) {
      const int i = tid + t * NT;
      if (i < K_ITEMS) {
        int* dst = kvt + 4 * (i / BC) * KS + i % BC;
        dst[0] = (int)k_stage[t].x;
        dst[KS] = (int)k_stage[t].y;
        dst[2 * KS] = (int)k_stage[t].z;
        dst[3 * KS] = (int)k_stage[t].w;
      }
    }
    for (int j = tid; j < BC; j += NT) ks[j] = k0 + j < a.seq_k ? kscale[k0 + j] : 0.f;
    load_v(k0);
    rdna_block_sync();

    // S = Q K^T in int32: a TM x TN register tile per thread.
    int si[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) si[i][j] = 0;
#pragma unroll 4
    for (int d4 = 0; d4 < D4; ++d4) {
      int qf[TM], kf[TN];
      rdna_lds_read<TM, CM>(qf, qt + d4 * QS + row0, CM);
      rdna_lds_read<TN, CK>(kf, kvt + d4 * KS + tx * CK, TCW * CK);
      rdna_outer_dot4(si, qf, kf);
    }
    float kscl[TN];
#pragma unroll
    for (int j = 0; j < TN; ++j) kscl[j] = ks[((j / CK) * TCW + tx) * CK + j % CK];

    // Dequantize, scale and mask; masked scores are -inf.
    float s[TM][TN];
    const bool whole = mask.template whole<BC>(k0, block_pos, last_pos);
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) {
        const int key = k0 + ((j / CK) * TCW + tx) * CK + j % CK;
        const float v = (float)si[i][j] * qs[i] * kscl[j];
        s[i][j] = whole || mask.visible(key, pos[i], diag[i]) ? v : -__builtin_inff();
      }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
      float tile_max = -__builtin_inff();
#pragma unroll
      for (int j = 0; j < TN; ++j) tile_max = rdna_fmax(tile_max, s[i][j]);
      for (int x = 1; x < TCW; x <<= 1) tile_max = rdna_fmax(tile_max, rdna_shfl_xor(tile_max, x));
      const float m_old = m[i];
      const float m_ref = fa2_softmax_update(m[i], l[i], o[i], tile_max);
      lf[i] *= rdna_exp2(m_old - m_ref);
#pragma unroll
      for (int j = 0; j < TN; j += 4) {
        // Quantized probabilities of four consecutive keys; the row sum adds them as stored.
        unsigned quad = 0;
        float sum = 0.f, exact = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = rdna_exp2(s[i][j + e] - m_ref);
          const float q = __builtin_floorf(p * P_LEVELS + 0.5f);
          exact += p;
          sum += q;
          quad |= (unsigned)(int)q << (8 * e);
        }
        lf[i] += exact;
        l[i] += sum;
        pt[((j / CK) * TCW + tx) * QS + row0 + i] = (int)quad;
      }
    }

    rdna_block_sync();  // K reads are done; kvt becomes the V tile
#pragma unroll
    for (int t = 0; t < VI; ++t) {
      const int i = tid + t * NT;
      if (i < V_ITEMS) {
        int* dst = kvt + (i / (D / 16)) * D + (i % (D / 16)) * 16;
        int quads[16];
        const u32x4* rows = v_stage[t];
        rdna_transpose_quads(rows[0].x, rows[1].x, rows[2].x, rows[3].x, *reinterpret_cast<int(*)[4]>(quads + 0));
        rdna_transpose_quads(rows[0].y, rows[1].y, rows[2].y, rows[3].y, *reinterpret_cast<int(*)[4]>(quads + 4));
        rdna_transpose_quads(rows[0].z, rows[1].z, rows[2].z, rows[3].z, *reinterpret_cast<int(*)[4]>(quads + 8));
        rdna_transpose_quads(rows[0].w, rows[1].w, rows[2].w, rows[3].w, *reinterpret_cast<int(*)[4]>(quads + 12));
        __builtin_memcpy(__builtin_assume_aligned(dst, 16), quads, sizeof(quads));
      }
    }
    if (k0 + BC < key_hi) load_k(k0 + BC);
    rdna_block_sync();

    // O += P V over key quads, in int32 for the tile, then into the fp32 accumulator.
    int oi[TM][TD];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int c = 0; c < TD; ++c) oi[i][c] = 0;
    for (int kq = 0; kq < BC4; ++kq) {
      int pf[TM], vf[TD];
      rdna_lds_read<TM, CM>(pf, pt + kq * QS + row0, CM);
      rdna_lds_read<TD, CD>(vf, kvt + kq * D + tx * CD, TCW * CD);
      rdna_outer_dot4(oi, pf, vf);
    }
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int c = 0; c < TD; ++c) o[i][c] += (float)oi[i][c];
  }

  // Epilogue: per-channel V scale, 1/l, fp16 store; LSE of the dequantized scaled scores.
  const float* const vscale = a.v_scale + b * a.v_scale_stride_b + sched.head_kv * a.v_scale_stride_h;
  float vs[TD];
#pragma unroll
  for (int c = 0; c < TD; ++c) vs[c] = vscale[((c / CD) * TCW + tx) * CD + c % CD];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    for (int x = 1; x < TCW; x <<= 1) l[i] += rdna_shfl_xor(l[i], x);
    for (int x = 1; x < TCW; x <<= 1) lf[i] += rdna_shfl_xor(lf[i], x);
    if (pos[i] >= mask.seq_q()) continue;
    const int head = head0 + (row0 + i) / RPH;
    const float inv = l[i] == 0.f ? 0.f : 1.f / l[i];
    float row[TD];
#pragma unroll
    for (int c = 0; c < TD; ++c) row[c] = o[i][c] * vs[c];
    half_t* out = a.o + b * a.o_stride_b + head * a.o_stride_h + (long long)pos[i] * a.o_stride_s + tx * CD;
    rdna_store_row<TD, CD>(out, TCW * CD, row, inv);
    if (a.lse && tx == 0) {
      const float ln2 = 0.6931471805599453f;
      a.lse[b * a.lse_stride_b + head * a.lse_stride_h + pos[i]] =
          lf[i] == 0.f ? -__builtin_inff() : (m[i] + rdna_log2(lf[i])) * ln2;
    }
  }
}
