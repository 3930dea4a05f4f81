// FlashAttention-2 forward main loop, written once over an element policy E: fp16 pairs with both
// products and the softmax in fp32 (fa2_f16.h), or int8 quads with both products in int32 and
// the per-token and per-channel scales of the Scales policy (fa2_i8.h).
//
// Threads form a (BR/TM) x TCW grid: a thread owns TM consecutive rows, TN keys of each S tile and
// TD columns of the output, so every value it reads from LDS feeds several products (register
// tiles), and a row's statistics stay in the TCW lanes that share it. Keys and columns are dealt
// to the TCW lanes in 16-byte chunks, round robin, so their LDS reads never share a bank.
//
// LDS holds tiles of E's packs (E::PACK values along each product's reduction dimension: pairs or
// quads), laid out as the pipeline says (pipeline.h, pairs.h), as rows of packs:
//   qt  [D/PACK][BR+pad]   Q transposed, staged once (RoPE applied in place)
//   kv  K tile transposed [D/PACK][BC+pad], then the V tile [BC/PACK][D] as packs of keys
//   pt  [BC/PACK][BR+pad]  probabilities, transposed, as packs of keys; rows go two by two, each
//                          two Pipe::P_ROW_PAIR_GAP bytes apart
//   ks  [BC]               the K tile's scales, where the Scales policy has them (int8)
// The family's lds_layout (Python) states the same sizes; LDS_BYTES is checked against them.
//
// D is the head_dim the tiles hold: the inputs' head_dim HD, padded with zero columns up to what the
// thread grid divides (a multiple of 2 * TCW). The padded columns of Q, K and V are never loaded
// (zeros in LDS, so they add nothing to the scores) and those of the output never stored.
//
// What varies between kernels lives in the policies: the element type and what it does to
// scores, probabilities and values (E), what runs ahead and how LDS is laid out (Pipe,
// pipeline.h), and the problem (fa2_policies.h): which rows a workgroup owns (Schedule), where
// queries (Q) and keys and values (Kv) come from, how scores are masked (Mask), the RoPE tables
// (Rope), the scales of quantized inputs (Scales), the score transforms (Xf: softcap, ALiBi, sinks;
// fa2_policies.h) and what is written at the end (Epilogue).
//
// E provides: pack_t, elem_t, input_t (the element type in memory), acc_t (the products'
// accumulator: float, or int for products accumulated apart and then added to the fp32 scores and
// output), PACK, VW (value columns per staging item), from_word, dot, exp2 (for the probabilities),
// pack_columns (PACK key rows' words to one pack per column), probabilities (a pack of
// probabilities, added to the row's sums) and EXACT_LSE (the LSE comes from the unrounded sum).
#pragma once

// How a row's softmax step takes its scores: ScoreExponent, as the scores themselves;
// AlibiExponent, as ALiBi's scores of a tile at or before every row's diagonal less one constant per
// row and lane (bias, added to the lane's maximum and where the probabilities are made): there
// |key - diag| is diag - key, so a score's bias is slope (dist0 + c), c the key's place in the
// lane's share of the tile, one FMA with a constant where the distance costs an add more.
struct ScoreExponent {
  RDNA_METHOD float largest(float s) const { return s; }
  RDNA_METHOD float operator()(float s, float m_ref) const { return s - m_ref; }
};
struct AlibiExponent {
  float bias;
  RDNA_METHOD float largest(float s) const { return s + bias; }
  RDNA_METHOD float operator()(float s, float m_ref) const { return s - (m_ref - bias); }
};

// One row's softmax step over its TN scores s (taken as X says; this thread's share of the row,
// the other TCW lanes holding the rest): the row's maximum m, its sums l (as stored for P.V) and lx
// (unrounded, with E::EXACT_LSE), its output row o rescaled, and its probabilities stored as packs by
// key pack, p[j / PK][i]. Returns the rescale factor (integer products apply it as they are added).
template <class E, int TN, int TD, int TCW, int TM, bool SKIP_UNMOVED, bool INT_ACC, class pack_t,
          class X = ScoreExponent>
RDNA_DEVICE float fa2_row_softmax(float (&s)[TN], float& m, float& l, float& lx, float (&o)[TD],
                                  pack_t (&p)[TN / E::PACK][TM], int i, const X& x = X{}) {
  constexpr int PK = E::PACK;
  float tile_max = -__builtin_inff();
#pragma unroll
  for (int j = 0; j < TN; ++j) tile_max = rdna_fmax(tile_max, s[j]);
  tile_max = x.largest(tile_max);
  for (int w = 1; w < TCW; w <<= 1) tile_max = rdna_fmax(tile_max, rdna_shfl_xor(tile_max, w));
  float alpha;
  const float m_ref = fa2_softmax_update<TD, SKIP_UNMOVED, INT_ACC>(m, l, o, tile_max, alpha);
  if constexpr (E::EXACT_LSE) lx *= alpha;
#pragma unroll
  for (int j = 0; j < TN; j += PK) {
    // The row sum adds the probabilities exactly as stored for P.V, so the weights sum to one.
    // (The exponentials written out, not looped: a loop here costs the fp16 kernels registers.)
    float e[PK];
    e[0] = E::exp2(x(s[j], m_ref));
    e[1] = E::exp2(x(s[j + 1], m_ref));
    if constexpr (PK == 4) {
      e[2] = E::exp2(x(s[j + 2], m_ref));
      e[3] = E::exp2(x(s[j + 3], m_ref));
    }
    p[j / PK][i] = E::probabilities(e, l, lx);
  }
  return alpha;
}

template <class E, class Pipe, int D, int HD, int G, int BR, int BC, int NT, int TM, int LDS_BYTES, class Schedule,
          class Q, class Kv, class Mask, class Rope, class Scales, class Xf, class Epilogue>
RDNA_DEVICE void fa2_forward(unsigned char* lds, const Schedule& sched, const Q& q_rows, const Kv& kv,
                             const Mask& mask, const Rope& rope, const Scales& scales, const Xf& xf,
                             const Epilogue& epi) {
  using P = typename Pipe::template Tile<E>;  // E's packs in the pipeline's LDS layout
  using pack_t = typename E::pack_t;
  using acc_t = typename E::acc_t;
  constexpr int PK = E::PACK;
  static_assert(PK == 2 || PK == 4, "pairs or quads");
  // Integer products (int8) accumulate apart from the fp32 scores and output they become.
  constexpr bool INT_ACC = !__is_same(acc_t, float);
  constexpr int TRW = BR / TM;
  constexpr int TCW = NT / TRW;
  constexpr int TN = BC / TCW;
  constexpr int TD = D / TCW;
  constexpr int RPH = BR / G;
  constexpr int DP = D / PK, BCP = BC / PK;  // packs along head_dim, along the keys of a tile
  constexpr int PAD = P::CHUNK;
  constexpr int QS = BR + PAD, KS = BC + PAD;
  constexpr int Q_PACKS = DP * QS;
  constexpr int KV_PACKS = rdna_max(DP * KS, BCP * D);
  constexpr int P_ROWS2 = 2 * QS + Pipe::P_ROW_PAIR_GAP / (int)sizeof(pack_t);  // packs per two rows of P
  constexpr int P_PACKS = BCP / 2 * P_ROWS2 + BCP % 2 * QS;
  constexpr int KS_BYTES = Scales::ENABLED ? BC * (int)sizeof(float) : 0;
  // A thread's rows, keys (S) and output columns (P.V) come in chunks of CM / CK / CD packs,
  // interleaved with the other TCW threads of its row so that their LDS reads are consecutive.
  constexpr int CM = rdna_chunk<TM, PAD>, CK = rdna_chunk<TN, PAD>, CD = rdna_chunk<TD, PAD>;
  constexpr int VW = E::VW;  // value columns per V staging item
  constexpr int VWORDS = VW * (int)sizeof(typename E::input_t) / 4;  // words of one key row of an item
  // K and V tiles are staged through registers: each tile's global loads are issued one compute
  // step ahead (K during the previous P.V, V during Q.K^T), so their latency is hidden. A K item
  // is 16 bytes (four packs) of one key; a V item VW columns of PACK keys.
  constexpr int CHUNK_VALUES = 4 * PK;  // input values per 16-byte chunk
  constexpr int K_ITEMS = BC * D / CHUNK_VALUES, V_ITEMS = BCP * D / VW;
  constexpr int KI = (K_ITEMS + NT - 1) / NT, VI = (V_ITEMS + NT - 1) / NT, KSI = (BC + NT - 1) / NT;
  static_assert(BR % TM == 0 && NT % TRW == 0 && TCW <= RDNA_WAVE_SIZE && (TCW & (TCW - 1)) == 0, "thread grid");
  static_assert(BC % TCW == 0 && CK % PK == 0 && D % TCW == 0 && TD % 2 == 0 && BR % G == 0, "tile shape");
  static_assert(D % CHUNK_VALUES == 0 && (D / VW) * VW == D && VW % P::CHUNK == 0, "staging items");
  static_assert(HD <= D && HD % CHUNK_VALUES == 0 && HD % VW == 0, "padded head_dim");
  constexpr bool PADDED = HD < D;  // columns HD .. D - 1: zeros, never loaded or stored
  static_assert(LDS_BYTES == (Q_PACKS + KV_PACKS + P_PACKS) * (int)sizeof(pack_t) + KS_BYTES, "LDS layout");

  pack_t* const qt = reinterpret_cast<pack_t*>(lds);
  pack_t* const kvt = qt + Q_PACKS;
  pack_t* const pt = kvt + KV_PACKS;
  float* const ks = reinterpret_cast<float*>(pt + P_PACKS);
  auto p_row = [&](int kp) { return pt + kp / 2 * P_ROWS2 + kp % 2 * QS; };  // a P tile row of QS packs

  const int tid = rdna_thread_id();
  const int ty = tid / TCW, tx = tid % TCW;
  const int row0 = ty * TM;
  const int block_pos = sched.block_pos;
  const int head0 = sched.head0;
  const long long b = sched.batch;

  const int last_pos = rdna_min(mask.seq_q(), block_pos + RPH) - 1;
  const int key_lo = mask.key_lo(block_pos);
  const int key_hi = mask.key_hi(last_pos);
  const u32x4 zero = {0u, 0u, 0u, 0u};

  // Q, transposed: consecutive threads take consecutive rows of one 16-byte chunk.
  for (int i = tid; i < BR * D / CHUNK_VALUES; i += NT) {
    const int r = i % BR, c = i / BR;
    const int pos = block_pos + r % RPH;
    const auto src = q_rows.row(b, head0 + r / RPH, pos);
    const u32x4 chunk[1] = {pos < mask.seq_q() && (!PADDED || c < HD / CHUNK_VALUES) ? rdna_load16(src + CHUNK_VALUES * c)
                                                                                      : zero};
    rdna_store_columns<P, 1>(qt, QS, 4 * c, r, chunk);
  }
  if (rope.enabled()) {
    rdna_block_sync();
    rope.template apply<P, BR, NT>(qt, QS, block_pos, RPH, mask.seq_q(), mask.offset());
  }

  int pos[TM], diag[TM];
  float rs[TM];  // each row's score scale (Scales)
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    pos[i] = block_pos + (row0 + i) % RPH;
    diag[i] = mask.diag(pos[i]);
    rs[i] = pos[i] < mask.seq_q() ? scales.row(mask, b, head0 + (row0 + i) / RPH, pos[i]) : 0.f;
  }
  // l sums the probabilities as stored for P.V (it normalises O, so a row's weights sum to one);
  // with E::EXACT_LSE, lx sums them unrounded for the log-sum-exp.
  float o[TM][TD], m[TM], l[TM], lx[TM];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    m[i] = -__builtin_inff();
    l[i] = 0.f;
    lx[i] = 0.f;
#pragma unroll
    for (int c = 0; c < TD; ++c) o[i][c] = 0.f;
  }

  // A thread stages KG consecutive keys' same 16 bytes and stores them as runs of KG packs: 4
  // with Pipe::K_RUNS (one 16-byte store per pack row and plane) where the tile divides evenly, else 1.
  constexpr int KG = Pipe::K_RUNS && BC % 4 == 0 && K_ITEMS % (4 * NT) == 0 ? 4 : 1;
  constexpr bool K_WHOLE = K_ITEMS % (KG * NT) == 0;  // every thread's items exist
  u32x4 k_stage[KI];
  float ks_stage[KSI];  // the K tile's scales (Scales::ENABLED), loaded with it where Pipe::PREFETCH
  unsigned v_stage[VI][PK][VWORDS];
  auto load_k = [&](int k0) {
#pragma unroll
    for (int t = 0; t < KI; ++t) {
      const int i = tid + t / KG * NT, key = k0 + i % (BC / KG) * KG + t % KG;
      k_stage[t] = (K_WHOLE || i < K_ITEMS / KG) && key < kv.seq_k() && (!PADDED || i / (BC / KG) < HD / CHUNK_VALUES)
                       ? rdna_load16(kv.key(key) + CHUNK_VALUES * (i / (BC / KG)))
                       : zero;
    }
    if constexpr (Scales::ENABLED && Pipe::PREFETCH) {
#pragma unroll
      for (int t = 0; t < KSI; ++t) {
        const int j = tid + t * NT;
        ks_stage[t] = j < BC && k0 + j < kv.seq_k() ? scales.key(k0 + j) : 0.f;
      }
    }
  };
  auto load_v = [&](int k0) {
#pragma unroll
    for (int t = 0; t < VI; ++t) {
      const int i = tid + t * NT, key = k0 + PK * (i / (D / VW));
      const auto row = kv.value(key) + i % (D / VW) * VW;
      const bool col = !PADDED || i % (D / VW) * VW < HD;
      for (int r = 0; r < PK; r += 2)
        rdna_load_key_rows(v_stage[t][r], v_stage[t][r + 1], row + r * kv.value_stride(),
                           row + (r + 1) * kv.value_stride(), i < V_ITEMS && key + r < kv.seq_k() && col,
                           i < V_ITEMS && key + r + 1 < kv.seq_k() && col);
    }
  };

  // ALiBi (Xf::HAS_ALIBI): the slope of a row's batch and query head. Where a thread's TM rows are one
  // head's (RPH a multiple of TM: every tile the matrix builds) it is read once, a register for the
  // whole kernel; otherwise per row and tile.
  constexpr bool ONE_HEAD = RPH % TM == 0;
  const float thread_slope = Xf::HAS_ALIBI && ONE_HEAD ? xf.slope(b, head0 + row0 / RPH) : 0.f;

  const int k_first = key_lo / BC * BC;
  if (k_first < key_hi) load_k(k_first);
  for (int k0 = k_first; k0 < key_hi; k0 += BC) {
    rdna_block_sync();  // the previous tile's V and P reads are done
#pragma unroll
    for (int t = 0; t < KI; t += KG) {
      const int i = tid + t / KG * NT;
      u32x4 keys[KG];
#pragma unroll
      for (int k = 0; k < KG; ++k) keys[k] = k_stage[t + k];
      if (K_WHOLE || i < K_ITEMS / KG) rdna_store_columns<P, KG>(kvt, KS, 4 * (i / (BC / KG)), i % (BC / KG) * KG, keys);
    }
    if constexpr (Scales::ENABLED) {
#pragma unroll
      for (int t = 0; t < KSI; ++t) {
        const int j = tid + t * NT;
        if (j < BC) ks[j] = Pipe::PREFETCH ? ks_stage[t] : k0 + j < kv.seq_k() ? scales.key(k0 + j) : 0.f;
      }
    }
    load_v(k0);
    rdna_block_sync();
    if (rope.enabled()) {
      rope.template apply<P, BC, NT>(kvt, KS, k0, BC, kv.seq_k(), 0);
      rdna_block_sync();
    }

    // S = Q K^T: a TM x TN register tile per thread.
    acc_t sa[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) sa[i][j] = 0;
#pragma unroll 4
    for (int dp = 0; dp < DP; ++dp) {
      pack_t qf[TM], kf[TN];
      rdna_read_packs<P, TM, CM>(qf, qt, QS, dp, row0, CM);
      rdna_read_packs<P, TN, CK>(kf, kvt, KS, dp, tx * CK, TCW * CK);
      rdna_outer_product<P>(sa, qf, kf);
    }
    float kscale[TN] = {};  // the thread's keys' scales (Scales::ENABLED)
    if constexpr (Scales::ENABLED) {
#pragma unroll
      for (int j = 0; j < TN; ++j) kscale[j] = ks[((j / CK) * TCW + tx) * CK + j % CK];
    }

    // Scale and mask in one place (in place where the products are fp32); masked scores are -inf.
    // Where the transforms are not copied per case (!Pipe::XF_CASES: the AMD kernels), a softcap is
    // applied here, to each visible score as it is made: the mask's own select keeps masked scores
    // at -inf (the softcap would map them to -C), a whole tile needs none, and the rows below keep no
    // softcap code of their own.
    float s_int[INT_ACC ? TM : 1][TN];
    auto& s = rdna_pick<INT_ACC>(s_int, sa);
    const bool whole = mask.template whole<BC>(k0, block_pos, last_pos);
    auto make_scores = [&](auto capped) {
      constexpr bool CAP = decltype(capped)::value;
      if (whole) {
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) {
            const float x = scales.score(mask, sa[i][j], rs[i], kscale[j]);
            s[i][j] = CAP ? xf.cap(x) : x;
          }
      } else {
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
          for (int j = 0; j < TN; ++j) {
            const int key = k0 + ((j / CK) * TCW + tx) * CK + j % CK;
            const float x = scales.score(mask, sa[i][j], rs[i], kscale[j]);
            s[i][j] = mask.visible(key, pos[i], diag[i]) ? (CAP ? xf.cap(x) : x) : -__builtin_inff();
          }
      }
    };
    if constexpr (Xf::ANY && !Pipe::XF_CASES) {
      if (xf.capped())
        make_scores(rdna_bool<true>{});
      else
        make_scores(rdna_bool<false>{});
    } else if (whole) {  // (the lambda's uncapped copy, written out: the plain kernels compile as they did)
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) s[i][j] = scales.score(mask, sa[i][j], rs[i], kscale[j]);
    } else {
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          const int key = k0 + ((j / CK) * TCW + tx) * CK + j % CK;
          s[i][j] = mask.visible(key, pos[i], diag[i]) ? scales.score(mask, sa[i][j], rs[i], kscale[j])
                                                       : -__builtin_inff();
        }
    }

    pack_t p[TN / PK][TM];  // by key pack, then row: each key pack's rows are stored in runs
    float o_alpha[INT_ACC ? TM : 1];  // integer products: each row's rescale, applied as they are added
    // Each row's softmax step, its visible scores transformed first (softcap, ALiBi), a row at a time:
    // all rows at once, where the scores are made, they cost the tightest tiles spills.
    if constexpr (Pipe::XF_CASES) {
      // One copy of the rows per case (XfCase), picked once per tile, so each copy's rows are one
      // block the compiler schedules across rows. A branch per row (below) kept them apart and cost
      // sm_90's prefill 19-33% for a softcap and 7-8% for sinks alone, which only the epilogue applies
      // (tuning/results/h200_score.md).
      // A softcap maps a masked score (-inf) to -C, so it keeps such scores by a select; a whole
      // tile holds none, and in the kernels without ALiBi takes a copy of the capped rows without it
      // (picked here, once per tile: a branch per row cost more than the selects it saved).
      // ALiBi alone on a whole tile at or before every row's diagonal (XfCase FOLD) takes a row's
      // distances as one constant per row and lane (AlibiExponent, in the softmax's exponents) and
      // one per score; only in the GQA tiles whose lanes hold at least four of a row's scores: on
      // sm_90 it took head_dim 64's group-2 tiles' ALiBi from +5.8% to +3.5%, but the group-1 tiles'
      // from +2.1% to +5.7% and head_dim 256's group-2 tile's (two scores a lane) from +3.8% to
      // +4.7%, where the row's own constants outweigh what its scores save
      // (tuning/results/h100_score_exponent.md).
      // A row's keys are held in runs of CK by its TCW lanes in turn: lane tx's j-th score is of key
      // k0 + tx * CK + lane_key(j), a constant in the unrolled loops. (The keys above are written
      // out: written through this helper, they moved the AMD kernels' register allocation, and
      // gfx1102's head_dim 80 tiles spilled.)
      const auto lane_key = [](int j) { return (j / CK) * TCW * CK + j % CK; };
      auto softmax_rows = [&](auto which) {
        using Case = decltype(which);
        constexpr bool CAP = Case::CAP, ALIBI = Case::ALIBI, MASKED = Case::MASKED, FOLD = Case::FOLD;
#pragma unroll
        for (int i = 0; i < TM; ++i) {
          float alpha;
          if constexpr (CAP || ALIBI) {
            const float slope = !ALIBI ? 0.f : ONE_HEAD ? thread_slope : xf.slope(b, head0 + (row0 + i) / RPH);
            const float dist0 = (float)(k0 + tx * CK - diag[i]);  // a score's distance: dist0 + lane_key(j)
            if constexpr (FOLD) {  // |distance| = -distance: slope * lane_key(j) here, slope * dist0 in the exponents
#pragma unroll
              for (int j = 0; j < TN; ++j) s[i][j] = rdna_fma(slope, (float)lane_key(j), s[i][j]);
              alpha = fa2_row_softmax<E, TN, TD, TCW, TM, Pipe::SKIP_UNMOVED, INT_ACC>(
                  s[i], m[i], l[i], lx[i], o[i], p, i, AlibiExponent{slope * dist0});
            } else {
#pragma unroll
              for (int j = 0; j < TN; ++j)
                s[i][j] = xf.template apply_case<CAP, ALIBI, MASKED>(s[i][j], slope, dist0 + (float)lane_key(j));
              alpha = fa2_row_softmax<E, TN, TD, TCW, TM, Pipe::SKIP_UNMOVED, INT_ACC>(s[i], m[i], l[i], lx[i], o[i], p, i);
            }
          } else {
            alpha = fa2_row_softmax<E, TN, TD, TCW, TM, Pipe::SKIP_UNMOVED, INT_ACC>(s[i], m[i], l[i], lx[i], o[i], p, i);
          }
          if constexpr (INT_ACC) o_alpha[i] = alpha;
        }
      };
      if (xf.capped()) {
        if (xf.alibi())
          softmax_rows(XfCase<true, true>{});
        else if (!Xf::HAS_ALIBI && whole)  // (in the ALiBi kernels, the copy cost their ALiBi case 2-3 points)
          softmax_rows(XfCase<true, false, false>{});
        else
          softmax_rows(XfCase<true, false>{});
      } else if (G > 1 && TN >= 4 && xf.alibi() && whole && k0 + BC - 1 <= mask.diag(block_pos)) {
        softmax_rows(XfCase<false, true, false, true>{});
      } else if (xf.alibi()) {
        softmax_rows(XfCase<false, true>{});
      } else {
        softmax_rows(XfCase<false, false>{});
      }
    } else {
      // ALiBi under a uniform branch per row: the AMD kernels, as audited (the copies per case
      // spilled GCN's and RDNA2's tightest tiles). The softcap was applied as the scores were made;
      // ALiBi keeps a masked score at -inf without a select (-inf minus a finite bias).
#pragma unroll
      for (int i = 0; i < TM; ++i) {
        if constexpr (Xf::HAS_ALIBI) {
          if (xf.alibi()) {
            const float slope = ONE_HEAD ? thread_slope : xf.slope(b, head0 + (row0 + i) / RPH);
#pragma unroll
            for (int j = 0; j < TN; ++j) {
              const int key = k0 + ((j / CK) * TCW + tx) * CK + j % CK;
              s[i][j] = xf.template apply_case<false, true>(s[i][j], slope, (float)(key - diag[i]));
            }
          }
        }
        const float alpha = fa2_row_softmax<E, TN, TD, TCW, TM, Pipe::SKIP_UNMOVED, INT_ACC>(s[i], m[i], l[i], lx[i], o[i], p, i);
        if constexpr (INT_ACC) o_alpha[i] = alpha;
      }
    }
#pragma unroll
    for (int j = 0; j < TN; j += PK)
#pragma unroll
      for (int c = 0; c < TM / CM; ++c)
        P::template store_run<CM>(p_row((((j / CK) * TCW + tx) * CK + j % CK) / PK), QS, 0, row0 + c * CM,
                                  &p[j / PK][c * CM]);

    rdna_block_sync();  // K reads are done; kvt becomes the V tile
#pragma unroll
    for (int t = 0; t < VI; ++t) {
      const int i = tid + t * NT;
      if (i < V_ITEMS) rdna_store_key_packs<P, VW>(kvt, D, i / (D / VW), i % (D / VW) * VW, v_stage[t]);
    }
    if (k0 + BC < key_hi) load_k(k0 + BC);
    rdna_block_sync();

    // O += P V over key packs: a TM x TD register tile per thread. fp32 products accumulate into the
    // output; integer ones into a tile of their own, added to the output as it is rescaled. With
    // Pipe::PREFETCH each step's fragments are read while the previous step's products run.
    acc_t o_int[INT_ACC ? TM : 1][TD];
    auto& acc = rdna_pick<INT_ACC>(o_int, o);
    if constexpr (INT_ACC) {
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int c = 0; c < TD; ++c) acc[i][c] = 0;
    }
    if constexpr (Pipe::PREFETCH) {
      pack_t pf[TM], vf[TD];
      rdna_read_packs<P, TM, CM>(pf, p_row(0), QS, 0, row0, CM);
      rdna_read_packs<P, TD, CD>(vf, kvt, D, 0, tx * CD, TCW * CD);
#pragma unroll 8
      for (int kp = 1; kp < BCP; ++kp) {
        pack_t pn[TM], vn[TD];
        rdna_read_packs<P, TM, CM>(pn, p_row(kp), QS, 0, row0, CM);
        rdna_read_packs<P, TD, CD>(vn, kvt, D, kp, tx * CD, TCW * CD);
        rdna_outer_product<P>(acc, pf, vf);
#pragma unroll
        for (int i = 0; i < TM; ++i) pf[i] = pn[i];
#pragma unroll
        for (int c = 0; c < TD; ++c) vf[c] = vn[c];
      }
      rdna_outer_product<P>(acc, pf, vf);
    } else {
      for (int kp = 0; kp < BCP; ++kp) {
        pack_t pf[TM], vf[TD];
        rdna_read_packs<P, TM, CM>(pf, p_row(kp), QS, 0, row0, CM);
        rdna_read_packs<P, TD, CD>(vf, kvt, D, kp, tx * CD, TCW * CD);
        rdna_outer_product<P>(acc, pf, vf);
      }
    }
    if constexpr (INT_ACC) {
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int c = 0; c < TD; ++c) o[i][c] = rdna_fma(o[i][c], o_alpha[i], (float)acc[i][c]);
    }
  }

  // head0 again, not held through the loop where the case copies leave no register to spare (the
  // plain kernels hold it: made again, it cost sm_90's head_dim 128 tile 4 registers and 1.4%).
  const int head0_end = Pipe::XF_CASES && Xf::ANY ? sched.head0_anew() : head0;
  float vs[TD] = {};  // the thread's output columns' scales (Scales::ENABLED)
  if constexpr (Scales::ENABLED) {
#pragma unroll
    for (int c = 0; c < TD; ++c) vs[c] = scales.value(((c / CD) * TCW + tx) * CD + c % CD);
  }
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    for (int x = 1; x < TCW; x <<= 1) l[i] += rdna_shfl_xor(l[i], x);
    if constexpr (E::EXACT_LSE)
      for (int x = 1; x < TCW; x <<= 1) lx[i] += rdna_shfl_xor(lx[i], x);
    if (pos[i] >= mask.seq_q()) continue;
    if (xf.sinks()) {  // the row's sink joins its sum (both sums, with E::EXACT_LSE) after its keys
      float alpha;
      const float w = fa2_sink_weight(xf.sink(head0_end + (row0 + i) / RPH), m[i], alpha);
      l[i] = l[i] * alpha + w;
      if constexpr (E::EXACT_LSE) lx[i] = lx[i] * alpha + w;
#pragma unroll
      for (int c = 0; c < TD; ++c) o[i][c] *= alpha;
    }
    if constexpr (Scales::ENABLED) {
#pragma unroll
      for (int c = 0; c < TD; ++c) o[i][c] *= vs[c];
    }
    epi.template store<TD, CD, TCW, HD>(b, head0_end + (row0 + i) / RPH, pos[i], tx, o[i], m[i], l[i],
                                        E::EXACT_LSE ? lx[i] : l[i]);
  }
}
