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

// Four gradient values of one row, scaled, stored as two 16-bit pairs (8 bytes).
template <bool BF16>
RDNA_DEVICE void fa2_bwd_store4(half_t* out, const float* g, float scale) {
  unsigned w[2];
#pragma unroll
  for (int e = 0; e < 2; ++e)
    w[e] = BF16 ? rdna_pack_bf16x2(g[2 * e] * scale, g[2 * e + 1] * scale)
                : rdna_pack_half2(g[2 * e] * scale, g[2 * e + 1] * scale);
  __builtin_memcpy(__builtin_assume_aligned(out, 8), w, sizeof(w));
}

// acc[k][4 i + e] += sum over red < RED of w[red][o0 + k] x[red][4 (cg + CG i) + e]: a TK x 4 NCH
// register tile of a gradient (rows o0 .. o0 + TK - 1 of the OUTS rows the weights w [RED][OUTS]
// give; columns in 16-byte chunks cg + CG i of the fp32 rows x [RED][RS]). Per step, one read of
// the TK weights and NCH 16-byte reads of x feed 4 TK NCH FMAs; the lanes of a wave read
// consecutive chunks of one row of x (cg is the lane's fastest index) and share the weights.
template <int RED, int OUTS, int RS, int TK, int NCH, int CG>
RDNA_DEVICE void fa2_bwd_gemm(float (&acc)[TK][4 * NCH], const float* w, const float* x, int o0, int cg) {
  constexpr int WA = 4 * (TK % 4 == 0 ? 4 : TK % 2 == 0 ? 2 : 1);  // bytes of alignment of a weight run
#pragma unroll 2
  for (int red = 0; red < RED; ++red) {
    float wv[TK], xv[NCH][4];
    __builtin_memcpy(wv, __builtin_assume_aligned(w + red * OUTS + o0, WA), sizeof(wv));
#pragma unroll
    for (int i = 0; i < NCH; ++i)
      __builtin_memcpy(xv[i], __builtin_assume_aligned(x + red * RS + 4 * (cg + CG * i), 16), sizeof(xv[i]));
#pragma unroll
    for (int k = 0; k < TK; ++k)
#pragma unroll
      for (int i = 0; i < NCH; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[k][4 * i + e] = rdna_fma(wv[k], xv[i][e], acc[k][4 * i + e]);
  }
}

// s[i][j] = a row (r0 + GA i) . b row (c0 + GB j) over D, for TM rows of a and TN rows of b (fp32
// rows of stride RS in LDS): each step's 16-byte reads of TM + TN rows feed 4 TM TN FMAs.
template <int D, int RS, int TM, int TN, int GA, int GB>
RDNA_DEVICE void fa2_bwd_outer(float (&s)[TM][TN], const float* a, const float* b, int r0, int c0) {
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) s[i][j] = 0.f;
#pragma unroll 2
  for (int d = 0; d < D; d += 4) {
    float x[TM][4], y[TN][4];
#pragma unroll
    for (int i = 0; i < TM; ++i)
      __builtin_memcpy(x[i], __builtin_assume_aligned(a + (r0 + GA * i) * RS + d, 16), sizeof(x[i]));
#pragma unroll
    for (int j = 0; j < TN; ++j)
      __builtin_memcpy(y[j], __builtin_assume_aligned(b + (c0 + GB * j) * RS + d, 16), sizeof(y[j]));
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[i][j] = rdna_fma(x[i][e], y[j][e], s[i][j]);
  }
}

// P and dS of the tile of rows [q0, q0 + BR) and keys [k0, k0 + BC) (staged in qs/dos, ks/vs, with
// the rows' LSE and delta), each thread a TM x TN register tile of rows r0 + (BR / TM) i and keys
// c0 + (BC / TN) j. DQ (the dQ pass): dS only, into dss as [BC][BR], the lanes of a wave running
// along the rows; else P and dS into ps and dss as [BR][BC], the lanes running along the keys (so
// the phase after reads a row of weights per step, and the stores of a wave are consecutive).
template <int D, int BR, int BC, int RS, int NT, int TM, int TN, bool DQ, class Args, class Mask>
RDNA_DEVICE void fa2_bwd_scores(const Args& a, const Mask& mask, const float* qs, const float* dos, const float* ks,
                                const float* vs, const float* lse2, const float* dl, float* ps, float* dss, int q0,
                                int k0) {
  constexpr int GR = BR / TM, GC = BC / TN;
  static_assert(GR * GC == NT, "score thread grid");
  const int tid = rdna_thread_id();
  const int r0 = DQ ? tid % GR : tid / GC, c0 = DQ ? tid / GR : tid % GC;
  float s[TM][TN], dp[TM][TN];
  fa2_bwd_outer<D, RS, TM, TN, GR, GC>(s, qs, ks, r0, c0);
  fa2_bwd_outer<D, RS, TM, TN, GR, GC>(dp, dos, vs, r0, c0);
  // A tile whose rows all exist and see every key skips the per-score tests (one uniform branch).
  const bool whole = q0 + BR <= a.seq_q && mask.template whole<BC>(k0, q0, q0 + BR - 1);
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    const int r = r0 + GR * i, pos = q0 + r, diag = mask.diag(pos);
    const float l = lse2[r], dd = dl[r];
#pragma unroll
    for (int j = 0; j < TN; ++j) {
      const int c = c0 + GC * j;
      float p = 0.f, ds = 0.f;
      if (whole || mask.visible(k0 + c, pos, diag)) {
        float x = mask.scale(s[i][j]);
        float cap = 1.f;  // d(capped score) / d(score)
        if (a.softcap_log2 != 0.f) {
          x = CapFma{}(x, a.softcap_log2, a.softcap_inv);
          const float t = x * a.softcap_inv;  // tanh(score / softcap)
          cap = rdna_fma(-t, t, 1.f);
        }
        p = rdna_exp2(x - l);
        ds = p * (dp[i][j] - dd) * cap;
      }
      if constexpr (DQ) {
        dss[c * BR + r] = ds;
      } else {
        ps[r * BC + c] = p;
        dss[r * BC + c] = ds;
      }
    }
  }
}

// D: the head_dim; P: the pair policy of the input dtype; BF16: bf16 rows. TM x TN: each thread's
// tile of scores; CG: the lanes across a gradient row (16-byte column chunks cg + CG i), the other
// NT / CG lanes each owning TK consecutive rows of it (keys in the dK/dV pass, query rows in dQ's).
// The generator chooses them (rdnattention_gen/families/bwd.py micro_tiles).
template <class P, int D, int BR, int BC, int NT, int LDS_BYTES, bool BF16, int PASS, int TM, int TN, int CG>
RDNA_DEVICE void fa2_backward(const Fa2BwdArgs& a, unsigned char* lds) {
  constexpr int RS = D + 4;  // fp32 per staged row
  constexpr int TPR = NT / BR;  // the preprocess pass's lanes per row
  constexpr int OUTS = PASS == 1 ? BC : BR, TK = PASS == 0 ? 1 : OUTS * CG / NT, NCH = PASS == 0 ? 1 : D / (4 * CG);
  static_assert(D % 8 == 0 && NT % BR == 0 && BR % 4 == 0 && BC % 4 == 0, "thread grid");
  static_assert(PASS == 0 || (NT % CG == 0 && (D / 4) % CG == 0 && TK * (NT / CG) == OUTS && TM * TN * NT == BR * BC),
                "register tiles");
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

  // The gradient tile this thread accumulates: rows o0 .. o0 + TK - 1, column chunks cg + CG i.
  const int o0 = TK * (tid / CG), cg = tid % CG;

  if constexpr (PASS == 1) {  // dK, dV of one key block
    const int hkv = rdna_block_id_y(), k0 = rdna_block_id_x() * BC;
    const int group = a.heads_q / a.heads_kv;
    float acc[2][TK][4 * NCH] = {};  // dK, dV
    fa2_bwd_stage<P, D, BC, RS, NT>(ks, a.k + b * a.k_stride_b + hkv * a.k_stride_h, a.k_stride_s, k0, a.seq_k);
    fa2_bwd_stage<P, D, BC, RS, NT>(vs, a.v + b * a.v_stride_b + hkv * a.v_stride_h, a.v_stride_s, k0, a.seq_k);
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
        fa2_bwd_scores<D, BR, BC, RS, NT, TM, TN, false>(a, mask, qs, dos, ks, vs, lse2, dl, ps, dss, q0, k0);
        rdna_block_sync();
        fa2_bwd_gemm<BR, BC, RS, TK, NCH, CG>(acc[1], ps, dos, o0, cg);   // dV += P^T dO
        fa2_bwd_gemm<BR, BC, RS, TK, NCH, CG>(acc[0], dss, qs, o0, cg);   // dK += dS^T Q
      }
    }
#pragma unroll
    for (int k = 0; k < TK; ++k) {
      if (k0 + o0 + k < a.seq_k) {
        half_t* const dk = a.dk + b * a.dk_stride_b + hkv * a.dk_stride_h + (long long)(k0 + o0 + k) * a.dk_stride_s;
        half_t* const dv = a.dv + b * a.dv_stride_b + hkv * a.dv_stride_h + (long long)(k0 + o0 + k) * a.dv_stride_s;
#pragma unroll
        for (int i = 0; i < NCH; ++i) {
          fa2_bwd_store4<BF16>(dk + 4 * (cg + CG * i), acc[0][k] + 4 * i, a.softmax_scale);
          fa2_bwd_store4<BF16>(dv + 4 * (cg + CG * i), acc[1][k] + 4 * i, 1.f);
        }
      }
    }
    return;
  }

  if constexpr (PASS == 2) {  // dQ of one row block
    const int h = rdna_block_id_y(), q0 = rdna_block_id_x() * BR;
    const int hkv = h / (a.heads_q / a.heads_kv);
    float acc[1][TK][4 * NCH] = {};  // dQ
    fa2_bwd_stage<P, D, BR, RS, NT>(qs, a.q + b * a.q_stride_b + h * a.q_stride_h, a.q_stride_s, q0, a.seq_q);
    fa2_bwd_stage<P, D, BR, RS, NT>(dos, a.dout + b * a.dout_stride_b + h * a.dout_stride_h, a.dout_stride_s, q0,
                                    a.seq_q);
    if (tid < BR) {
      const int pos = q0 + tid;
      const bool in = pos < a.seq_q;
      lse2[tid] = in ? a.lse[b * a.lse_stride_b + h * a.lse_stride_h + pos] * log2e : 0.f;
      dl[tid] = in ? a.delta[(b * a.heads_q + h) * a.seq_q + pos] : 0.f;
    }
    const int key_lo = mask.key_lo(q0), key_hi = mask.key_hi(rdna_min(a.seq_q, q0 + BR) - 1);
    for (int k0 = key_lo / BC * BC; k0 < key_hi; k0 += BC) {
      rdna_block_sync();  // the previous tile's reads are done (and the rows' staging, the first time)
      fa2_bwd_stage<P, D, BC, RS, NT>(ks, a.k + b * a.k_stride_b + hkv * a.k_stride_h, a.k_stride_s, k0, a.seq_k);
      fa2_bwd_stage<P, D, BC, RS, NT>(vs, a.v + b * a.v_stride_b + hkv * a.v_stride_h, a.v_stride_s, k0, a.seq_k);
      rdna_block_sync();
      fa2_bwd_scores<D, BR, BC, RS, NT, TM, TN, true>(a, mask, qs, dos, ks, vs, lse2, dl, ps, dss, q0, k0);
      rdna_block_sync();
      fa2_bwd_gemm<BC, BR, RS, TK, NCH, CG>(acc[0], dss, ks, o0, cg);  // dQ += dS K
    }
#pragma unroll
    for (int k = 0; k < TK; ++k) {
      if (q0 + o0 + k < a.seq_q) {
        half_t* const dq = a.dq + b * a.dq_stride_b + h * a.dq_stride_h + (long long)(q0 + o0 + k) * a.dq_stride_s;
#pragma unroll
        for (int i = 0; i < NCH; ++i) fa2_bwd_store4<BF16>(dq + 4 * (cg + CG * i), acc[0][k] + 4 * i, a.softmax_scale);
      }
    }
  }
}
