// FlashAttention-2 backward pass (the bwd family): dQ, dK and dV from Q, K, V, the output O, its
// gradient dO and the forward's log-sum-exp, recomputing the probabilities P = exp(S - LSE) tile by
// tile instead of storing them. Three passes, each a kernel of its own (PASS: the family's layout
// option pre, none, dq; rdnattention/families/bwd.py says which grid each runs on), so that each
// holds only its own arguments (one kernel of all three spilled SGPRs on RDNA2):
//   preprocess  delta[row] = sum over columns of dO * O (fp32), less the LSE's gradient where it has one
//   dkdv        per (key block, K/V head): dV = sum P^T dO, dK = scale * sum dS^T Q over every query
//               row of every query head of the GQA group that sees the block's keys
//   dq          per (row block, query head): dQ = scale * sum dS K over the keys its rows see
// where dS = P (dP - delta) with dP = dO V^T, times the softcap's derivative 1 - tanh^2 where the
// scores are capped. Every sum is accumulated in fp32 registers in one fixed order and stored once
// (no atomics), so the gradients are deterministic.
//
// Inputs are staged in LDS as fp32 rows, each 16-bit pair converted once through the pair policy P
// (pairs.h: F32Pairs for fp16, BF16F32Pairs for bf16), so every product is an fp32 FMA:
//   qs, dos  [BR][D + 4]   the Q and dO rows of a row block
//   ks, vs   [BC][D + 4]   the K and V rows of a key block
//   ps, dss  [BR][BC]      P and dS of the tile
//   lse2, dl [BR]          each row's LSE (log2 domain) and delta
// (the preprocess pass: NT partial sums).
// A score (r, c) is one lane's dot products over D (16-byte reads; the rows' padding keeps the
// lanes of a wave reading consecutive rows off each other's banks); an accumulated gradient row is
// shared by TPK = NT / BC (dK, dV) or TPR = NT / BR (dQ) lanes, each owning column pairs
// 2 (j + TPK i), so that the lanes of a row read consecutive pairs and store 32-bit words.
#pragma once

#include "tiles.h"
#include "pairs.h"
#include "fa2_policies.h"

// The rows [first, first + R) of one head (rows at or past `limit`: zeros) into an fp32 tile of
// row stride RS, 16 bytes (8 values) per item, each pair widened by P::from_word.
template <class P, int D, int R, int RS, int NT>
RDNA_DEVICE void fa2_bwd_stage(float* tile, const half_t* base, long long stride_s, int first, int limit) {
  constexpr int CH = D / 8;
  const u32x4 zero = {0u, 0u, 0u, 0u};
  for (int i = rdna_thread_id(); i < R * CH; i += NT) {
    const int r = i / CH, c = i % CH, pos = first + r;
    const u32x4 w = pos < limit ? rdna_load16(base + (long long)pos * stride_s + 8 * c) : zero;
    float x[8];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const typename P::pack_t p = P::from_word(w[e]);
      x[2 * e] = p.x;
      x[2 * e + 1] = p.y;
    }
    __builtin_memcpy(__builtin_assume_aligned(tile + r * RS + 8 * c, 16), x, sizeof(x));
  }
}

// The dot product of two fp32 rows of D values in LDS, 16 bytes at a time.
template <int D>
RDNA_DEVICE float fa2_bwd_dot(const float* a, const float* b) {
  float acc = 0.f;
#pragma unroll 4
  for (int d = 0; d < D; d += 4) {
    float x[4], y[4];
    __builtin_memcpy(x, __builtin_assume_aligned(a + d, 16), sizeof(x));
    __builtin_memcpy(y, __builtin_assume_aligned(b + d, 16), sizeof(y));
    acc = rdna_fma(x[0], y[0], acc);
    acc = rdna_fma(x[1], y[1], acc);
    acc = rdna_fma(x[2], y[2], acc);
    acc = rdna_fma(x[3], y[3], acc);
  }
  return acc;
}

// One gradient row slice: N column pairs 2 (j + STEP i), scaled, stored as 16-bit pairs.
template <int N, int STEP, bool BF16>
RDNA_DEVICE void fa2_bwd_store(half_t* row, int j, const float (&g)[N][2], float scale) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const unsigned w = BF16 ? rdna_pack_bf16x2(g[i][0] * scale, g[i][1] * scale)
                            : rdna_pack_half2(g[i][0] * scale, g[i][1] * scale);
    __builtin_memcpy(__builtin_assume_aligned(row + 2 * (j + STEP * i), 4), &w, sizeof(w));
  }
}

// acc[i] += w * tile row's column pairs 2 (j + STEP i).
template <int N, int STEP>
RDNA_DEVICE void fa2_bwd_axpy(float (&acc)[N][2], float w, const float* row, int j) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float x[2];
    __builtin_memcpy(x, __builtin_assume_aligned(row + 2 * (j + STEP * i), 8), sizeof(x));
    acc[i][0] = rdna_fma(w, x[0], acc[i][0]);
    acc[i][1] = rdna_fma(w, x[1], acc[i][1]);
  }
}

// P and dS of the tile of rows [q0, q0 + BR) and keys [k0, k0 + BC) (staged in qs/dos, ks/vs, with
// the rows' LSE and delta) into ps and dss.
template <int D, int BR, int BC, int RS, int NT, class Args, class Mask>
RDNA_DEVICE void fa2_bwd_scores(const Args& a, const Mask& mask, const float* qs, const float* dos, const float* ks,
                                const float* vs, const float* lse2, const float* dl, float* ps, float* dss, int q0,
                                int k0) {
  for (int e = rdna_thread_id(); e < BR * BC; e += NT) {
    const int r = e / BC, c = e % BC, pos = q0 + r, key = k0 + c;
    float p = 0.f, ds = 0.f;
    if (mask.visible(key, pos, mask.diag(pos))) {
      float s = mask.scale(fa2_bwd_dot<D>(qs + r * RS, ks + c * RS));
      float cap = 1.f;  // d(capped score) / d(score)
      if (a.softcap_log2 != 0.f) {
        s = CapFma{}(s, a.softcap_log2, a.softcap_inv);
        const float t = s * a.softcap_inv;  // tanh(score / softcap)
        cap = rdna_fma(-t, t, 1.f);
      }
      p = rdna_exp2(s - lse2[r]);
      const float dp = fa2_bwd_dot<D>(dos + r * RS, vs + c * RS);
      ds = p * (dp - dl[r]) * cap;
    }
    ps[e] = p;
    dss[e] = ds;
  }
}

// D: the head_dim; P: the pair policy of the input dtype; BF16: bf16 rows.
template <class P, int D, int BR, int BC, int NT, int LDS_BYTES, bool BF16, int PASS>
RDNA_DEVICE void fa2_backward(const Fa2BwdArgs& a, unsigned char* lds) {
  constexpr int RS = D + 4;  // fp32 per staged row
  constexpr int TPK = NT / BC, TPR = NT / BR;
  constexpr int NK = D / (2 * TPK), NQ = D / (2 * TPR);  // column pairs per lane (dK and dV; dQ)
  static_assert(D % 8 == 0 && NT % BC == 0 && NT % BR == 0 && D % (2 * TPK) == 0 && D % (2 * TPR) == 0,
                "thread grid");
  static_assert(LDS_BYTES == (PASS == 0 ? NT * 4 : ((2 * BR + 2 * BC) * RS + 2 * BR * BC + 2 * BR) * 4), "LDS layout");
  float* const qs = reinterpret_cast<float*>(lds);
  float* const dos = qs + BR * RS;
  float* const ks = dos + BR * RS;
  float* const vs = ks + BC * RS;
  float* const ps = vs + BC * RS;
  float* const dss = ps + BR * BC;
  float* const lse2 = dss + BR * BC;
  float* const dl = lse2 + BR;

  const int tid = rdna_thread_id();
  const long long b = rdna_block_id_z();
  const WindowMask<Fa2BwdArgs> mask{a};
  const float log2e = 1.4426950408889634f;

  if constexpr (PASS == 0) {  // delta = rowsum(dO * O) - dLSE, a row per TPR lanes, partial sums met in LDS (qs)
    const int h = rdna_block_id_y(), q0 = rdna_block_id_x() * BR, r = tid / TPR, j = tid % TPR;
    const int pos = q0 + r;
    float sum = 0.f;
    if (pos < a.seq_q) {
      const half_t* o = a.o + b * a.o_stride_b + h * a.o_stride_h + (long long)pos * a.o_stride_s;
      const half_t* g = a.dout + b * a.dout_stride_b + h * a.dout_stride_h + (long long)pos * a.dout_stride_s;
      for (int c = j; c < D / 8; c += TPR) {
        const u32x4 wo = rdna_load16(o + 8 * c), wg = rdna_load16(g + 8 * c);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const typename P::pack_t x = P::from_word(wo[e]), y = P::from_word(wg[e]);
          sum = rdna_fma(x.y, y.y, rdna_fma(x.x, y.x, sum));
        }
      }
    }
    qs[tid] = sum;
    rdna_block_sync();
    if (tid < BR && q0 + tid < a.seq_q) {
      float total = 0.f;
      for (int x = 0; x < TPR; ++x) total += qs[tid * TPR + x];
      if (a.dlse) total -= a.dlse[b * a.dlse_stride_b + h * a.dlse_stride_h + q0 + tid];
      a.delta[(b * a.heads_q + h) * a.seq_q + q0 + tid] = total;
    }
    return;
  }

  if constexpr (PASS == 1) {  // dK, dV of one key block
    const int hkv = rdna_block_id_y(), k0 = rdna_block_id_x() * BC, c = tid / TPK, j = tid % TPK;
    const int group = a.heads_q / a.heads_kv;
    fa2_bwd_stage<P, D, BC, RS, NT>(ks, a.k + b * a.k_stride_b + hkv * a.k_stride_h, a.k_stride_s, k0, a.seq_k);
    fa2_bwd_stage<P, D, BC, RS, NT>(vs, a.v + b * a.v_stride_b + hkv * a.v_stride_h, a.v_stride_s, k0, a.seq_k);
    float dk[NK][2], dv[NK][2];
#pragma unroll
    for (int i = 0; i < NK; ++i) dk[i][0] = dk[i][1] = dv[i][0] = dv[i][1] = 0.f;
    // The query rows that see any key of the block: key >= diag - left and key <= diag + right.
    const int off = mask.offset(), last_key = rdna_min(k0 + BC, a.seq_k) - 1;
    const int q_lo = a.window_right < 0 ? 0 : rdna_max(0, k0 - off - a.window_right);
    const int q_hi = a.window_left < 0 ? a.seq_q : rdna_min(a.seq_q, last_key - off + a.window_left + 1);
    for (int h = hkv * group; h < (hkv + 1) * group; ++h) {
      for (int q0 = q_lo / BR * BR; q0 < q_hi; q0 += BR) {
        rdna_block_sync();  // the previous tile's reads are done
        fa2_bwd_stage<P, D, BR, RS, NT>(qs, a.q + b * a.q_stride_b + h * a.q_stride_h, a.q_stride_s, q0, a.seq_q);
        fa2_bwd_stage<P, D, BR, RS, NT>(dos, a.dout + b * a.dout_stride_b + h * a.dout_stride_h, a.dout_stride_s, q0,
                                        a.seq_q);
        if (tid < BR) {
          const int pos = q0 + tid;
          const bool in = pos < a.seq_q;
          lse2[tid] = in ? a.lse[b * a.lse_stride_b + h * a.lse_stride_h + pos] * log2e : 0.f;
          dl[tid] = in ? a.delta[(b * a.heads_q + h) * a.seq_q + pos] : 0.f;
        }
        rdna_block_sync();
        fa2_bwd_scores<D, BR, BC, RS, NT>(a, mask, qs, dos, ks, vs, lse2, dl, ps, dss, q0, k0);
        rdna_block_sync();
        for (int r = 0; r < BR; ++r) {
          fa2_bwd_axpy<NK, TPK>(dv, ps[r * BC + c], dos + r * RS, j);
          fa2_bwd_axpy<NK, TPK>(dk, dss[r * BC + c], qs + r * RS, j);
        }
      }
    }
    if (k0 + c < a.seq_k) {
      const long long kr = b * a.dk_stride_b + hkv * a.dk_stride_h + (long long)(k0 + c) * a.dk_stride_s;
      const long long vr = b * a.dv_stride_b + hkv * a.dv_stride_h + (long long)(k0 + c) * a.dv_stride_s;
      fa2_bwd_store<NK, TPK, BF16>(a.dk + kr, j, dk, a.softmax_scale);
      fa2_bwd_store<NK, TPK, BF16>(a.dv + vr, j, dv, 1.f);
    }
    return;
  }

  // dQ of one row block (PASS 2)
  const int h = rdna_block_id_y(), q0 = rdna_block_id_x() * BR, r = tid / TPR, j = tid % TPR;
  const int hkv = h / (a.heads_q / a.heads_kv);
  fa2_bwd_stage<P, D, BR, RS, NT>(qs, a.q + b * a.q_stride_b + h * a.q_stride_h, a.q_stride_s, q0, a.seq_q);
  fa2_bwd_stage<P, D, BR, RS, NT>(dos, a.dout + b * a.dout_stride_b + h * a.dout_stride_h, a.dout_stride_s, q0,
                                  a.seq_q);
  if (tid < BR) {
    const int pos = q0 + tid;
    const bool in = pos < a.seq_q;
    lse2[tid] = in ? a.lse[b * a.lse_stride_b + h * a.lse_stride_h + pos] * log2e : 0.f;
    dl[tid] = in ? a.delta[(b * a.heads_q + h) * a.seq_q + pos] : 0.f;
  }
  float dq[NQ][2];
#pragma unroll
  for (int i = 0; i < NQ; ++i) dq[i][0] = dq[i][1] = 0.f;
  const int key_lo = mask.key_lo(q0), key_hi = mask.key_hi(rdna_min(a.seq_q, q0 + BR) - 1);
  for (int k0 = key_lo / BC * BC; k0 < key_hi; k0 += BC) {
    rdna_block_sync();  // the previous tile's reads are done (and the rows' staging, the first time)
    fa2_bwd_stage<P, D, BC, RS, NT>(ks, a.k + b * a.k_stride_b + hkv * a.k_stride_h, a.k_stride_s, k0, a.seq_k);
    fa2_bwd_stage<P, D, BC, RS, NT>(vs, a.v + b * a.v_stride_b + hkv * a.v_stride_h, a.v_stride_s, k0, a.seq_k);
    rdna_block_sync();
    fa2_bwd_scores<D, BR, BC, RS, NT>(a, mask, qs, dos, ks, vs, lse2, dl, ps, dss, q0, k0);
    rdna_block_sync();
    for (int c = 0; c < BC; ++c) fa2_bwd_axpy<NQ, TPR>(dq, dss[r * BC + c], ks + c * RS, j);
  }
  if (q0 + r < a.seq_q)
    fa2_bwd_store<NQ, TPR, BF16>(a.dq + b * a.dq_stride_b + h * a.dq_stride_h + (long long)(q0 + r) * a.dq_stride_s,
                                 j, dq, a.softmax_scale);
}
