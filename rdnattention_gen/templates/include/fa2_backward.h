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
// scores are capped (ALiBi's bias, slope |key - diag| after the cap, has derivative 1 in the score). Every sum is accumulated in fp32 registers in one fixed order and stored once
// (no atomics), so the gradients are deterministic.
// The atomic passes trade that for one recomputation fewer (5 head_dim-long products per visible
// score, not 7):
//   atomic      dkdv's, and each step's dQ rows dS K added into an fp32 sum [batch, heads_q, seq_q, D]
//               by atomics (zeroed by the preprocess pass), so its order of summation varies
//   dqcast      per (row block, query head): dQ = scale * that sum, in the input dtype
//
// Packed batches (varlen: cu_seqlens_q set): sequence b's rows are cu_seqlens_q[b] .. [b + 1] - 1 of
// [1, heads, total, head_dim] views (its keys by cu_seqlens_k), and the passes run on a copy of the
// arguments moved to the sequence (fa2_bwd_sequence): the grid's batch is the sequence, its blocks
// past the sequence's rows or keys return at once, and masks align each sequence's queries to the
// end of its keys, as the forward's.
//
// Inputs are staged in LDS as rows of the pair policy P's element (pairs.h), 32 or 16 bits:
//   fp32 (F32Pairs, BF16F32Pairs: sm_90, and the targets whose tier converts before every FMA): each
//     16-bit pair widened once, when staged, so every product is an fp32 FMA;
//   16-bit as loaded (F16Pairs on the fp16 tiers that multiply fp16 without converting, dot2 and
//     fma_mix; BF16DotPairs where the target has a bf16 dot; the host stands for them with F16Pairs
//     and BF16Pairs): half the LDS. The score products S = Q K^T and dP = dO V^T take pairs of them
//     (P::dot: v_dot2_f32_f16, two v_fma_mix_f32, v_dot2_f32_bf16), the gradient products a value
//     beside an fp32 weight (fp16: widened in v_fma_mix_f32, or once where dual issue pays; bf16: by a
//     shift). 16-bit products are exact in fp32, so the stages differ only in how their fp32 sums round.
//   qs, dos  [BR][RS]      the Q and dO rows of a row block (RS: D + 4 fp32, or D + 8 fp16 values)
//   ks, vs   [BC][RS]      the K and V rows of a key block
//   ps, dss  [BR][BC]      P and dS of the tile (the dQ pass: dS only, as [BC][BR])
//   lse2, dl [BR]          each row's LSE (log2 domain) and delta
// (the preprocess pass: NT partial sums). The next step's rows are loaded into registers while the
// gradients of this one accumulate, and stored to LDS after.
// Each step has two phases, each a register tile per thread in the forward kernels' manner (every
// value read from LDS used by several FMAs; 16-byte reads; rows padded by 16 bytes so that lanes
// reading consecutive rows meet no bank twice):
//   scores     a TM x TN tile of S = Q K^T and dP = dO V^T, outer products over D, then P and dS;
//   gradients  a TK x 4 NCH tile of dV += P^T dO and dK += dS^T Q (dQ += dS K): per row of the
//              reduction, TK weights (P or dS) and NCH 16-byte chunks of the operand's row.
#pragma once

#include "tiles.h"
#include "pairs.h"
#include "fa2_policies.h"

// The rows [first, first + R) of one head (rows at or past `limit`: zeros), 16 bytes (8 values) per
// item, held in registers from the global loads to the LDS stores: every load of a tile is issued
// before the first store, and the next tile's loads overlap the work on this one.
template <int D, int R, int NT>
struct Fa2BwdRows {
  static constexpr int CH = D / 8, N = (R * CH + NT - 1) / NT;
  u32x4 w[N];

  RDNA_METHOD void load(const half_t* base, long long stride_s, int first, int limit) {
    const u32x4 zero = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const int i = rdna_thread_id() + n * NT, pos = first + i / CH;
      w[n] = i < R * CH && pos < limit ? rdna_load16(base + (long long)pos * stride_s + 8 * (i % CH)) : zero;
    }
  }
  // Into an fp32 tile of row stride RS, each pair widened by P::from_word.
  template <class P, int RS>
  RDNA_METHOD void store(float* tile) const {
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const int i = rdna_thread_id() + n * NT;
      if (i < R * CH) {
        float x[8];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const typename P::pack_t p = P::from_word(w[n][e]);
          x[2 * e] = p.x;
          x[2 * e + 1] = p.y;
        }
        __builtin_memcpy(__builtin_assume_aligned(tile + i / CH * RS + 8 * (i % CH), 16), x, sizeof(x));
      }
    }
  }
  // Into a 16-bit tile (fp16 or bf16) of row stride RS, as loaded.
  template <class P, int RS, typename T>
  RDNA_METHOD void store(T* tile) const {
    static_assert(sizeof(T) == 2, "16-bit rows");
#pragma unroll
    for (int n = 0; n < N; ++n) {
      const int i = rdna_thread_id() + n * NT;
      if (i < R * CH) __builtin_memcpy(__builtin_assume_aligned(tile + i / CH * RS + 8 * (i % CH), 16), &w[n], 16);
    }
  }
};

// The Q and dO rows [q0, q0 + BR) of query head h into registers, with each row's LSE (log2 domain)
// and delta (lane r: row q0 + r; zeros past the rows).
template <int D, int BR, int NT>
RDNA_DEVICE void fa2_bwd_fetch_rows(const Fa2BwdArgs& a, long long b, int h, int q0, Fa2BwdRows<D, BR, NT>& qr,
                                    Fa2BwdRows<D, BR, NT>& dr, float& lse2, float& dl) {
  qr.load(a.q + b * a.q_stride_b + h * a.q_stride_h, a.q_stride_s, q0, a.seq_q);
  dr.load(a.dout + b * a.dout_stride_b + h * a.dout_stride_h, a.dout_stride_s, q0, a.seq_q);
  const int tid = rdna_thread_id(), pos = q0 + tid;
  const bool in = tid < BR && pos < a.seq_q;
  lse2 = in ? a.lse[b * a.lse_stride_b + h * a.lse_stride_h + pos] * 1.4426950408889634f : 0.f;
  dl = in ? a.delta[b * a.delta_stride_b + h * a.delta_stride_h + pos] : 0.f;
}

// The ALiBi slope (log2 domain) of batch b's query head h; 0 without ALiBi.
RDNA_DEVICE float fa2_bwd_slope(const Fa2BwdArgs& a, long long b, int h) {
  return a.alibi_slopes ? a.alibi_slopes[b * a.alibi_stride_b + h] * 1.4426950408889634f : 0.f;
}

// Packed batches: the arguments of sequence b, its rows and keys moved to its first (the pointers of
// rows by their sequence strides, the log-sum-exp, its gradient and the scratch along theirs), its
// lengths its own, every batch stride unused (the caller's batch index becomes 0); the slopes keep
// the sequence's row. The offsets are clamped into the tensors' rows (fa2_packed_span), as the
// forward's: offsets that break the call's contract give nonsense within the tensors, never an
// access outside them. Dense batches: the arguments as they are.
RDNA_DEVICE Fa2BwdArgs fa2_bwd_sequence(const Fa2BwdArgs& args, long long b, int D) {
  Fa2BwdArgs a = args;
  // Keys each sequence uses (seqused_k; null: all): its first seqused_k[b], clamped into its own, as
  // the forward's (the queries align to the end of them; the others get no gradient).
  if (!args.cu_seqlens_q) {
    if (args.seqused_k) a.seq_k = fa2_count(args.seqused_k[b], a.seq_k);
    return a;
  }
  const Fa2Span qs = fa2_packed_span(args.cu_seqlens_q, b, args.total_q);
  const Fa2Span ks = fa2_packed_span(args.cu_seqlens_k, b, args.total_k);
  const long long q0 = qs.first, k0 = ks.first;
  a.seq_q = qs.count;
  a.seq_k = ks.count;
  a.q += q0 * a.q_stride_s;
  a.o += q0 * a.o_stride_s;
  a.dout += q0 * a.dout_stride_s;
  a.dq += q0 * a.dq_stride_s;
  a.k += k0 * a.k_stride_s;
  a.v += k0 * a.v_stride_s;
  a.dk += k0 * a.dk_stride_s;
  a.dv += k0 * a.dv_stride_s;
  a.lse += q0;
  if (a.dlse) a.dlse += q0;
  a.delta += q0;
  if (a.dq_accum) a.dq_accum += q0 * D;
  if (a.alibi_slopes) a.alibi_slopes += b * a.alibi_stride_b;
  if (args.seqused_k) a.seq_k = fa2_count(args.seqused_k[b], a.seq_k);
  return a;
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

// A value of a staged row as its gradient products take it: fp32 as it is; fp16 widened where it
// is multiplied (v_fma_mix_f32), or, where TK products share it on a dual-issue target, widened once
// (WIDE) into an fp32 value whose FMAs pair into dual-issue words: one conversion and TK / 2 words
// where TK v_fma_mix_f32 take TK.
template <bool WIDE>
RDNA_DEVICE float fa2_bwd_operand(float x) { return x; }
template <bool WIDE>
RDNA_DEVICE float fa2_bwd_operand(half_t x) { return WIDE ? rdna_opaque((float)x) : (float)x; }
template <bool WIDE>
RDNA_DEVICE float fa2_bwd_operand(rdna_bf16 x) { return (float)x; }  // a shift, once per value read

// acc[k][4 i + e] += sum over red < RED of w[red][o0 + k] x[red][4 (cg + CG i) + e]: a TK x 4 NCH
// register tile of a gradient (rows o0 .. o0 + TK - 1 of the OUTS rows the weights w [RED][OUTS]
// give; columns in chunks of four, cg + CG i, of the rows x [RED][RS]: fp32, 16 bytes a chunk, or
// fp16, 8 bytes, each value widened in its FMA). Per step, one read of the TK weights and NCH chunk
// reads of x feed 4 TK NCH FMAs; the lanes of a wave read consecutive chunks of one row of x (cg is
// the lane's fastest index) and share the weights.
template <int RED, int OUTS, int RS, int TK, int NCH, int CG, typename X>
RDNA_DEVICE void fa2_bwd_gemm(float (&acc)[TK][4 * NCH], const float* w, const X* x, int o0, int cg) {
  constexpr int WA = 4 * (TK % 4 == 0 ? 4 : TK % 2 == 0 ? 2 : 1);  // bytes of alignment of a weight run
  constexpr bool WIDE = RDNA_DUAL_ISSUE && TK >= 4;
#pragma unroll 2
  for (int red = 0; red < RED; ++red) {
    float wv[TK], xf[NCH][4];
    X xv[NCH][4];
    __builtin_memcpy(wv, __builtin_assume_aligned(w + red * OUTS + o0, WA), sizeof(wv));
#pragma unroll
    for (int i = 0; i < NCH; ++i) {
      __builtin_memcpy(xv[i], __builtin_assume_aligned(x + red * RS + 4 * (cg + CG * i), sizeof(xv[i])), sizeof(xv[i]));
#pragma unroll
      for (int e = 0; e < 4; ++e) xf[i][e] = fa2_bwd_operand<WIDE>(xv[i][e]);
    }
#pragma unroll
    for (int k = 0; k < TK; ++k)
#pragma unroll
      for (int i = 0; i < NCH; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[k][4 * i + e] = rdna_fma(wv[k], xf[i][e], acc[k][4 * i + e]);
  }
}

// As fa2_bwd_gemm, with the weights w [OUTS][RED] read along their rows (the row of each output, four
// reductions per 16-byte read): the dQ += dS K of the atomic pass, from dS as the dK/dV gemm reads it.
template <int RED, int RS, int TK, int NCH, int CG, typename X>
RDNA_DEVICE void fa2_bwd_gemm_rows(float (&acc)[TK][4 * NCH], const float* w, const X* x, int o0, int cg) {
  static_assert(RED % 4 == 0, "four reductions per weight read");
  constexpr bool WIDE = RDNA_DUAL_ISSUE && TK >= 4;
#pragma unroll 1
  for (int red = 0; red < RED; red += 4) {
    float wv[TK][4];
#pragma unroll
    for (int k = 0; k < TK; ++k)
      __builtin_memcpy(wv[k], __builtin_assume_aligned(w + (o0 + k) * RED + red, 16), sizeof(wv[k]));
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      X xv[NCH][4];
      float xf[NCH][4];
#pragma unroll
      for (int i = 0; i < NCH; ++i) {
        __builtin_memcpy(xv[i], __builtin_assume_aligned(x + (red + r) * RS + 4 * (cg + CG * i), sizeof(xv[i])),
                         sizeof(xv[i]));
#pragma unroll
        for (int e = 0; e < 4; ++e) xf[i][e] = fa2_bwd_operand<WIDE>(xv[i][e]);
      }
#pragma unroll
      for (int k = 0; k < TK; ++k)
#pragma unroll
        for (int i = 0; i < NCH; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[k][4 * i + e] = rdna_fma(wv[k][r], xf[i][e], acc[k][4 * i + e]);
    }
  }
}

// s[i][j] = a row (r0 + GA i) . b row (c0 + GB j) over D, for TM rows of a and TN rows of b (rows of
// P's elements, stride RS values, in LDS): each step's 16-byte reads of TM + TN rows feed TM TN
// products of each pack they bring (P::dot: two fp32 FMAs per fp32 pair, in the order of the values,
// or one 16-bit pair product).
template <class P, int D, int RS, int TM, int TN, int GA, int GB>
RDNA_DEVICE void fa2_bwd_outer(float (&s)[TM][TN], const typename P::elem_t* a, const typename P::elem_t* b, int r0,
                               int c0) {
  typedef typename P::pack_t pack_t;
  constexpr int PACKS = 16 / (int)sizeof(pack_t), STEP = 16 / (int)sizeof(typename P::elem_t);
#pragma unroll
  for (int i = 0; i < TM; ++i)
#pragma unroll
    for (int j = 0; j < TN; ++j) s[i][j] = 0.f;
#pragma unroll 2
  for (int d = 0; d < D; d += STEP) {
    pack_t x[TM][PACKS], y[TN][PACKS];
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
        for (int e = 0; e < PACKS; ++e) s[i][j] = P::dot(x[i][e], y[j][e], s[i][j]);
  }
}

// P and dS of the tile of rows [q0, q0 + BR) and keys [k0, k0 + BC) (staged in qs/dos, ks/vs, with
// the rows' LSE and delta; the query head's ALiBi slope, log2 domain, or 0), each thread a TM x TN register tile of rows r0 + (BR / TM) i and keys
// c0 + (BC / TN) j. DQ (the dQ pass): dS only, into dss as [BC][BR], the lanes of a wave running
// along the rows; else P and dS into ps and dss as [BR][BC], the lanes running along the keys (so
// the phase after reads a row of weights per step, and the stores of a wave are consecutive).
template <class P, int D, int BR, int BC, int RS, int NT, int TM, int TN, bool DQ, class Args, class Mask, typename T>
RDNA_DEVICE void fa2_bwd_scores(const Args& a, const Mask& mask, const T* qs, const T* dos, const T* ks,
                                const T* vs, const float* lse2, const float* dl, float* ps, float* dss, int q0,
                                int k0, float slope) {
  constexpr int GR = BR / TM, GC = BC / TN;
  // A tile of fewer scores than threads: a score for each of the first BR x BC lanes.
  static_assert(GR * GC == NT || (GR * GC < NT && TM == 1 && TN == 1), "score thread grid");
  if (GR * GC < NT && rdna_thread_id() >= GR * GC) return;
  // The lanes of a wave cover FX consecutive register tiles along the fast index (keys; rows for
  // DQ) times the slow index's next ones, so that a step's reads meet few distinct rows of each
  // operand (8 x 4 for 32 lanes, not 16 x 2).
  constexpr int GF = DQ ? GR : GC, GS = DQ ? GC : GR, FX = GF % 8 == 0 ? 8 : GF % 4 == 0 ? 4 : GF % 2 == 0 ? 2 : 1;
  const int tid = rdna_thread_id(), fast = tid % FX + FX * (tid / FX / GS), slow = tid / FX % GS;
  const int r0 = DQ ? fast : slow, c0 = DQ ? slow : fast;
  float s[TM][TN], dp[TM][TN];
  fa2_bwd_outer<P, D, RS, TM, TN, GR, GC>(s, qs, ks, r0, c0);
  fa2_bwd_outer<P, D, RS, TM, TN, GR, GC>(dp, dos, vs, r0, c0);
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
        if (slope != 0.f) x = rdna_fma(-slope, __builtin_fabsf((float)(k0 + c - diag)), x);  // ALiBi
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

// D: the head_dim; P: the pair policy of the input dtype and staging (its elem_t: fp32, or the 16-bit
// values as loaded); BF16: bf16 rows. TM x TN: each thread's
// tile of scores; CG: the lanes across a gradient row (16-byte column chunks cg + CG i), the other
// NT / CG lanes each owning TK consecutive rows of it (keys in the dK/dV pass, query rows in dQ's).
// The generator chooses them (rdnattention_gen/families/bwd.py micro_tiles).
template <class P, int D, int BR, int BC, int NT, int LDS_BYTES, bool BF16, int PASS, int TM, int TN, int CG>
RDNA_DEVICE void fa2_backward(const Fa2BwdArgs& args, unsigned char* lds) {
  typedef typename P::elem_t row_t;  // a staged value: fp32, or fp16 or bf16 as loaded
  constexpr int RS = D + 16 / (int)sizeof(row_t);  // values per staged row: 16 bytes of padding
  constexpr int TPR = NT / BR;  // the preprocess pass's lanes per row
  constexpr bool ROWS = PASS == 0 || PASS == 4;  // a pass over rows with no register tiles
  constexpr int OUTS = PASS == 1 || PASS == 3 ? BC : BR, NCH = ROWS ? 1 : D / (4 * CG);
  constexpr int TK = ROWS || OUTS * CG < NT ? 1 : OUTS * CG / NT;
  constexpr int TKQ = ROWS || BR * CG < NT ? 1 : BR * CG / NT;  // the atomic pass's dQ rows per thread
  static_assert(D % 8 == 0 && NT % BR == 0 && BR % 4 == 0 && BC % 4 == 0, "thread grid");
  // More row groups than gradient rows: a row for each of the first OUTS x CG lanes (OWNS), the
  // others idle in the gradient phase; fewer scores than threads: a score for each of the first.
  static_assert(ROWS || (NT % CG == 0 && (D / 4) % CG == 0 &&
                         (TK * (NT / CG) == OUTS || (TK == 1 && NT / CG > OUTS)) &&
                         (PASS != 3 || TKQ * (NT / CG) == BR || (TKQ == 1 && NT / CG > BR)) &&
                         (TM * TN * NT == BR * BC || (TM * TN == 1 && BR * BC < NT))),
                "register tiles");
  static_assert(LDS_BYTES == (PASS == 0 ? NT * 4
                              : PASS == 4 ? 0
                                          : (2 * BR + 2 * BC) * RS * (int)sizeof(row_t) + (2 * BR * BC + 2 * BR) * 4),
                "LDS layout");
  row_t* const qs = reinterpret_cast<row_t*>(lds);
  row_t* const dos = qs + BR * RS;
  row_t* const ks = dos + BR * RS;
  row_t* const vs = ks + BC * RS;
  float* const ps = reinterpret_cast<float*>(vs + BC * RS);
  float* const dss = ps + BR * BC;
  float* const lse2 = dss + BR * BC;
  float* const dl = lse2 + BR;

  const int tid = rdna_thread_id();
  // The grid's batch; packed, the sequence's arguments and batch index 0 (fa2_bwd_sequence).
  const Fa2BwdArgs a = fa2_bwd_sequence(args, rdna_block_id_z(), D);
  const long long b = args.cu_seqlens_q ? 0 : rdna_block_id_z();
  const WindowMask<Fa2BwdArgs> mask{a};

  if constexpr (PASS == 0) {  // delta = rowsum(dO * O) - dLSE, a row per TPR lanes, partial sums met in LDS (qs)
    const int h = rdna_block_id_y(), q0 = rdna_block_id_x() * BR, r = tid / TPR, j = tid % TPR;
    if (q0 >= a.seq_q) return;  // packed: past the sequence's rows
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
    float* const partial = reinterpret_cast<float*>(lds);
    partial[tid] = sum;
    rdna_block_sync();
    if (tid < BR && q0 + tid < a.seq_q) {
      float total = 0.f;
      for (int x = 0; x < TPR; ++x) total += partial[tid * TPR + x];
      if (a.dlse) total -= a.dlse[b * a.dlse_stride_b + h * a.dlse_stride_h + q0 + tid];
      a.delta[b * a.delta_stride_b + h * a.delta_stride_h + q0 + tid] = total;
    }
    if (a.dq_accum) {  // the atomic pass's dQ sum of these rows, zeroed
      float* const acc = a.dq_accum + (b * a.delta_stride_b + h * a.delta_stride_h + q0) * D;
      const float zero[4] = {0.f, 0.f, 0.f, 0.f};
      for (int i = tid; i < BR * D / 4 && q0 + 4 * i / D < a.seq_q; i += NT)
        __builtin_memcpy(__builtin_assume_aligned(acc + 4 * i, 16), zero, sizeof(zero));
    }
    return;
  }

  if constexpr (PASS == 4) {  // dQ = scale * the atomic pass's sum, a 16-byte chunk per thread at a time
    const int h = rdna_block_id_y(), q0 = rdna_block_id_x() * BR;
    if (q0 >= a.seq_q) return;  // packed: past the sequence's rows
    const float* const acc = a.dq_accum + (b * a.delta_stride_b + h * a.delta_stride_h + q0) * D;
    half_t* const dq = a.dq + b * a.dq_stride_b + h * a.dq_stride_h;
    for (int i = tid; i < BR * D / 4; i += NT) {
      const int r = 4 * i / D, c = 4 * i % D;
      if (q0 + r < a.seq_q) {
        float g[4];
        __builtin_memcpy(g, __builtin_assume_aligned(acc + 4 * i, 16), sizeof(g));
        fa2_bwd_store4<BF16>(dq + (long long)(q0 + r) * a.dq_stride_s + c, g, a.softmax_scale);
      }
    }
    return;
  }

  // The gradient tile this thread accumulates: rows o0 .. o0 + TK - 1, column chunks cg + CG i.
  const int o0 = TK * (tid / CG), cg = tid % CG;
  const bool owns = TK * (NT / CG) == OUTS || o0 < OUTS;

  if constexpr (PASS == 1 || PASS == 3) {  // dK, dV of one key block (3: and dQ's share of it, by atomics)
    // Workgroups in order of key block, then head (the grid's x and y, relabelled): under a causal
    // mask the first key blocks see the most rows, so the longest workgroups start first.
    // (Packed: the grid spans the longest sequence's keys, args.seq_k; the blocks past this one's return.)
    const int nkb = (args.seq_k + BC - 1) / BC, lin = rdna_block_id_x() + nkb * rdna_block_id_y();
    const int hkv = lin % a.heads_kv, k0 = lin / a.heads_kv * BC;
    const int group = a.heads_q / a.heads_kv;
    if (k0 >= a.seq_k) return;
    float acc[2][TK][4 * NCH] = {};  // dK, dV
    // The query rows that see any key of the block: key >= diag - left and key <= diag + right;
    // the steps walk their row blocks for each query head of the group.
    const int off = mask.offset(), last_key = rdna_min(k0 + BC, a.seq_k) - 1;
    const int q_lo = a.window_right < 0 ? 0 : rdna_max(0, k0 - off - a.window_right);
    const int q_hi = a.window_left < 0 ? a.seq_q : rdna_min(a.seq_q, last_key - off + a.window_left + 1);
    const int q_first = q_lo / BR * BR, nq = q_hi > q_first ? (q_hi - q_first + BR - 1) / BR : 0;
    const int steps = group * nq;
    Fa2BwdRows<D, BC, NT> kr, vr;
    kr.load(a.k + b * a.k_stride_b + hkv * a.k_stride_h, a.k_stride_s, k0, a.seq_k);
    vr.load(a.v + b * a.v_stride_b + hkv * a.v_stride_h, a.v_stride_s, k0, a.seq_k);
    Fa2BwdRows<D, BR, NT> qr, dr;
    float nl = 0.f, nd = 0.f;
    if (steps > 0) fa2_bwd_fetch_rows(a, b, hkv * group, q_first, qr, dr, nl, nd);
    kr.template store<P, RS>(ks);
    vr.template store<P, RS>(vs);
    for (int t = 0; t < steps; ++t) {
      const int q0 = q_first + BR * (t % nq);
      rdna_block_sync();  // the previous step's reads are done
      qr.template store<P, RS>(qs);
      dr.template store<P, RS>(dos);
      if (tid < BR) {
        lse2[tid] = nl;
        dl[tid] = nd;
      }
      rdna_block_sync();
      fa2_bwd_scores<P, D, BR, BC, RS, NT, TM, TN, false>(a, mask, qs, dos, ks, vs, lse2, dl, ps, dss, q0, k0,
                                                       fa2_bwd_slope(a, b, hkv * group + t / nq));
      rdna_block_sync();
      if constexpr (PASS == 3) {  // dQ of the step's rows += dS K, before the next rows' loads take registers
        const int o0q = TKQ * (tid / CG);
        if (TKQ * (NT / CG) == BR || o0q < BR) {
          float dq[TKQ][4 * NCH] = {};
          fa2_bwd_gemm_rows<BC, RS, TKQ, NCH, CG>(dq, dss, ks, o0q, cg);
          float* const sum = a.dq_accum + (b * a.delta_stride_b + (hkv * group + t / nq) * a.delta_stride_h) * D;
#pragma unroll
          for (int k = 0; k < TKQ; ++k)
            if (q0 + o0q + k < a.seq_q)
#pragma unroll
              for (int i = 0; i < NCH; ++i)
                rdna_atomic_add_f32x4(sum + (long long)(q0 + o0q + k) * D + 4 * (cg + CG * i), dq[k] + 4 * i);
        }
      }
      if (t + 1 < steps)
        fa2_bwd_fetch_rows(a, b, hkv * group + (t + 1) / nq, q_first + BR * ((t + 1) % nq), qr, dr, nl, nd);
      if (owns) {
        fa2_bwd_gemm<BR, BC, RS, TK, NCH, CG>(acc[1], ps, dos, o0, cg);   // dV += P^T dO
        fa2_bwd_gemm<BR, BC, RS, TK, NCH, CG>(acc[0], dss, qs, o0, cg);   // dK += dS^T Q
      }
    }
#pragma unroll
    for (int k = 0; k < TK; ++k) {
      if (owns && k0 + o0 + k < a.seq_k) {
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
    // Workgroups from the last row block to the first (the grid's x and y, relabelled): under a causal
    // mask the last rows see the most keys, so the longest workgroups start first.
    const int nqb = (args.seq_q + BR - 1) / BR, lin = rdna_block_id_x() + nqb * rdna_block_id_y();
    const int h = lin % a.heads_q, q0 = (nqb - 1 - lin / a.heads_q) * BR;
    const int hkv = h / (a.heads_q / a.heads_kv);
    if (q0 >= a.seq_q) return;
    const float slope = fa2_bwd_slope(a, b, h);
    float acc[1][TK][4 * NCH] = {};  // dQ
    const int key_lo = mask.key_lo(q0), key_hi = mask.key_hi(rdna_min(a.seq_q, q0 + BR) - 1);
    const int k_first = key_lo / BC * BC;
    const half_t* const kh = a.k + b * a.k_stride_b + hkv * a.k_stride_h;
    const half_t* const vh = a.v + b * a.v_stride_b + hkv * a.v_stride_h;
    Fa2BwdRows<D, BR, NT> qr, dr;
    float nl, nd;
    fa2_bwd_fetch_rows(a, b, h, q0, qr, dr, nl, nd);
    Fa2BwdRows<D, BC, NT> kr, vr;
    if (k_first < key_hi) {
      kr.load(kh, a.k_stride_s, k_first, a.seq_k);
      vr.load(vh, a.v_stride_s, k_first, a.seq_k);
    }
    qr.template store<P, RS>(qs);
    dr.template store<P, RS>(dos);
    if (tid < BR) {
      lse2[tid] = nl;
      dl[tid] = nd;
    }
    for (int k0 = k_first; k0 < key_hi; k0 += BC) {
      rdna_block_sync();  // the previous step's reads are done (and the rows' staging, the first time)
      kr.template store<P, RS>(ks);
      vr.template store<P, RS>(vs);
      rdna_block_sync();
      fa2_bwd_scores<P, D, BR, BC, RS, NT, TM, TN, true>(a, mask, qs, dos, ks, vs, lse2, dl, ps, dss, q0, k0, slope);
      rdna_block_sync();
      if (k0 + BC < key_hi) {
        kr.load(kh, a.k_stride_s, k0 + BC, a.seq_k);
        vr.load(vh, a.v_stride_s, k0 + BC, a.seq_k);
      }
      if (owns) fa2_bwd_gemm<BC, BR, RS, TK, NCH, CG>(acc[0], dss, ks, o0, cg);  // dQ += dS K
    }
#pragma unroll
    for (int k = 0; k < TK; ++k) {
      if (owns && q0 + o0 + k < a.seq_q) {
        half_t* const dq = a.dq + b * a.dq_stride_b + h * a.dq_stride_h + (long long)(q0 + o0 + k) * a.dq_stride_s;
#pragma unroll
        for (int i = 0; i < NCH; ++i) fa2_bwd_store4<BF16>(dq + 4 * (cg + CG * i), acc[0][k] + 4 * i, a.softmax_scale);
      }
    }
  }
}
