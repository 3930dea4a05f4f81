// FlashAttention-2 forward main loop: fp16 Q, K, V; softmax and both products accumulate in fp32.
//
// Threads form a (BR/TM) x TCW grid: a thread owns TM consecutive rows, TN keys of each S tile and
// TD columns of the output, so every value it reads from LDS feeds several products (register
// tiles), and a row's statistics stay in the TCW lanes that share it. Keys and columns are dealt
// to the TCW lanes in 16-byte chunks, round robin, so their LDS reads never share a bank.
//
// LDS holds pair tiles of the precision policy P (pairs.h) along each product's reduction
// dimension, as rows of pairs:
//   qt  [D/2][BR+pad]   Q transposed, staged once (RoPE applied in place)
//   kv  K tile transposed [D/2][BC+pad], then the V tile [BC/2][D] as key pairs
//   pt  [BC/2][BR+pad]  probabilities, transposed, as key pairs; rows go two by two, each two
//                       P::P_ROW_PAIR_GAP bytes apart (pairs.h)
// The family's lds_layout (Python) states the same sizes; LDS_BYTES is checked against them.
//
// What varies between kernels lives in the policies (fa2_policies.h): which rows a workgroup
// owns (Schedule), where queries (Q) and keys and values (Kv) come from, how scores are scaled
// and masked (Mask), the RoPE tables (Rope), and what is written at the end (Epilogue).
#pragma once

template <class P, int D, int G, int BR, int BC, int NT, int TM, int LDS_BYTES, class Schedule, class Q, class Kv,
          class Mask, class Rope, class Epilogue>
RDNA_DEVICE void fa2_forward(unsigned char* lds, const Schedule& sched, const Q& q_rows, const Kv& kv,
                             const Mask& mask, const Rope& rope, const Epilogue& epi) {
  using pair_t = typename P::pair_t;
  constexpr int TRW = BR / TM;
  constexpr int TCW = NT / TRW;
  constexpr int TN = BC / TCW;
  constexpr int TD = D / TCW;
  constexpr int RPH = BR / G;
  constexpr int D2 = D / 2, BC2 = BC / 2;
  constexpr int PAD = P::CHUNK;
  constexpr int QS = BR + PAD, KS = BC + PAD;
  constexpr int Q_PAIRS = D2 * QS;
  constexpr int KV_PAIRS = rdna_max(D2 * KS, BC2 * D);
  constexpr int P_ROWS2 = 2 * QS + P::P_ROW_PAIR_GAP / (int)sizeof(pair_t);  // pairs per two rows of P
  constexpr int P_PAIRS = BC2 / 2 * P_ROWS2 + BC2 % 2 * QS;
  // A thread's rows, keys (S) and output columns (P.V) come in chunks of CM / CK / CD pairs,
  // interleaved with the other TCW threads of its row so that their LDS reads are consecutive.
  constexpr int CM = rdna_chunk<TM, PAD>, CK = rdna_chunk<TN, PAD>, CD = rdna_chunk<TD, PAD>;
  constexpr int VW = P::CHUNK;  // columns per V staging store
  // K and V tiles are staged through registers: each tile's global loads are issued one compute
  // step ahead (K during the previous P.V, V during Q.K^T), so their latency is hidden.
  constexpr int K_ITEMS = BC * D / 8, V_ITEMS = BC2 * D / VW;
  constexpr int KI = (K_ITEMS + NT - 1) / NT, VI = (V_ITEMS + NT - 1) / NT;
  static_assert(BR % TM == 0 && NT % TRW == 0 && TCW <= RDNA_WAVE_SIZE && (TCW & (TCW - 1)) == 0, "thread grid");
  static_assert(BC % TCW == 0 && TN % 2 == 0 && D % TCW == 0 && TD % 2 == 0 && BR % G == 0, "tile shape");
  static_assert(LDS_BYTES == (Q_PAIRS + KV_PAIRS + P_PAIRS) * (int)sizeof(pair_t), "LDS layout");

  pair_t* const qt = reinterpret_cast<pair_t*>(lds);
  pair_t* const kvt = qt + Q_PAIRS;
  pair_t* const pt = kvt + KV_PAIRS;
  auto p_row = [&](int kp) { return pt + kp / 2 * P_ROWS2 + kp % 2 * QS; };  // a P tile row of QS pairs

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

  // Q, transposed: consecutive threads take consecutive rows of one 8-element chunk.
  for (int i = tid; i < BR * D / 8; i += NT) {
    const int r = i % BR, c = i / BR;
    const int pos = block_pos + r % RPH;
    const half_t* src = q_rows.row(b, head0 + r / RPH, pos);
    const u32x4 chunk[1] = {pos < mask.seq_q() ? rdna_load16(src + 8 * c) : zero};
    rdna_store_columns<P, 1>(qt, QS, 4 * c, r, chunk);
  }
  if (rope.enabled()) {
    rdna_block_sync();
    rope.template apply<P, BR, NT>(qt, QS, block_pos, RPH, mask.seq_q(), mask.offset());
  }

  int pos[TM], diag[TM];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    pos[i] = block_pos + (row0 + i) % RPH;
    diag[i] = mask.diag(pos[i]);
  }
  float o[TM][TD], m[TM], l[TM];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    m[i] = -__builtin_inff();
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < TD; ++c) o[i][c] = 0.f;
  }

  // A thread stages KG consecutive keys' same 8 columns and stores them as runs of KG pairs: 4
  // with P::K_RUNS (one 16-byte store per pair row and plane) where the tile divides evenly, else 1.
  constexpr int KG = P::K_RUNS && BC % 4 == 0 && K_ITEMS % (4 * NT) == 0 ? 4 : 1;
  constexpr bool K_WHOLE = K_ITEMS % (KG * NT) == 0;  // every thread's items exist
  u32x4 k_stage[KI];
  unsigned v_stage0[VI][VW / 2], v_stage1[VI][VW / 2];
  auto load_k = [&](int k0) {
#pragma unroll
    for (int t = 0; t < KI; ++t) {
      const int i = tid + t / KG * NT, key = k0 + i % (BC / KG) * KG + t % KG;
      k_stage[t] = (K_WHOLE || i < K_ITEMS / KG) && key < kv.seq_k() ? rdna_load16(kv.key(key) + 8 * (i / (BC / KG)))
                                                                      : zero;
    }
  };
  auto load_v = [&](int k0) {
#pragma unroll
    for (int t = 0; t < VI; ++t) {
      const int i = tid + t * NT, key = k0 + 2 * (i / (D / VW));
      const half_t* row = kv.value(key) + i % (D / VW) * VW;
      rdna_load_key_rows<VW>(v_stage0[t], v_stage1[t], row, row + kv.value_stride(), i < V_ITEMS && key < kv.seq_k(),
                             i < V_ITEMS && key + 1 < kv.seq_k());
    }
  };

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
    load_v(k0);
    rdna_block_sync();
    if (rope.enabled()) {
      rope.template apply<P, BC, NT>(kvt, KS, k0, BC, kv.seq_k(), 0);
      rdna_block_sync();
    }

    // S = Q K^T: a TM x TN register tile per thread.
    float s[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
      for (int j = 0; j < TN; ++j) s[i][j] = 0.f;
#pragma unroll 4
    for (int d2 = 0; d2 < D2; ++d2) {
      pair_t qf[TM], kf[TN];
      rdna_read_pairs<P, TM, CM>(qf, qt, QS, d2, row0, CM);
      rdna_read_pairs<P, TN, CK>(kf, kvt, KS, d2, tx * CK, TCW * CK);
      rdna_outer_product<P>(s, qf, kf);
    }

    // Scale and mask in one place; masked scores are -inf.
    if (mask.template whole<BC>(k0, block_pos, last_pos)) {
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) s[i][j] = mask.scale(s[i][j]);
    } else {
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          const int key = k0 + ((j / CK) * TCW + tx) * CK + j % CK;
          s[i][j] = mask.visible(key, pos[i], diag[i]) ? mask.scale(s[i][j]) : -__builtin_inff();
        }
    }

    pair_t p[TN / 2][TM];  // by key pair, then row: each key pair's rows are stored in runs
#pragma unroll
    for (int i = 0; i < TM; ++i) {
      float tile_max = -__builtin_inff();
#pragma unroll
      for (int j = 0; j < TN; ++j) tile_max = rdna_fmax(tile_max, s[i][j]);
      for (int x = 1; x < TCW; x <<= 1) tile_max = rdna_fmax(tile_max, rdna_shfl_xor(tile_max, x));
      const float m_ref = fa2_softmax_update<TD, P::SKIP_UNMOVED>(m[i], l[i], o[i], tile_max);
#pragma unroll
      for (int j = 0; j < TN; j += 2) {
        // The row sum adds the probabilities exactly as stored for P.V, so the weights sum to one.
        p[j / 2][i] = P::make(rdna_exp2(s[i][j] - m_ref), rdna_exp2(s[i][j + 1] - m_ref));
        l[i] += P::sum(p[j / 2][i]);
      }
    }
#pragma unroll
    for (int j = 0; j < TN; j += 2)
#pragma unroll
      for (int c = 0; c < TM / CM; ++c)
        P::template store_run<CM>(p_row((((j / CK) * TCW + tx) * CK + j % CK) / 2), QS, 0, row0 + c * CM, &p[j / 2][c * CM]);

    rdna_block_sync();  // K reads are done; kvt becomes the V tile
#pragma unroll
    for (int t = 0; t < VI; ++t) {
      const int i = tid + t * NT;
      if (i < V_ITEMS) rdna_store_key_pairs<P, VW>(kvt, D, i / (D / VW), i % (D / VW) * VW, v_stage0[t], v_stage1[t]);
    }
    if (k0 + BC < key_hi) load_k(k0 + BC);
    rdna_block_sync();

    // O += P V over key pairs: a TM x TD register tile per thread. With P::PREFETCH each step's
    // fragments are read while the previous step's products run (pairs.h says where).
    if constexpr (P::PREFETCH) {
      pair_t pf[TM], vf[TD];
      rdna_read_pairs<P, TM, CM>(pf, p_row(0), QS, 0, row0, CM);
      rdna_read_pairs<P, TD, CD>(vf, kvt, D, 0, tx * CD, TCW * CD);
#pragma unroll 8
      for (int kp = 1; kp < BC2; ++kp) {
        pair_t pn[TM], vn[TD];
        rdna_read_pairs<P, TM, CM>(pn, p_row(kp), QS, 0, row0, CM);
        rdna_read_pairs<P, TD, CD>(vn, kvt, D, kp, tx * CD, TCW * CD);
        rdna_outer_product<P>(o, pf, vf);
#pragma unroll
        for (int i = 0; i < TM; ++i) pf[i] = pn[i];
#pragma unroll
        for (int c = 0; c < TD; ++c) vf[c] = vn[c];
      }
      rdna_outer_product<P>(o, pf, vf);
    } else {
      for (int kp = 0; kp < BC2; ++kp) {
        pair_t pf[TM], vf[TD];
        rdna_read_pairs<P, TM, CM>(pf, p_row(kp), QS, 0, row0, CM);
        rdna_read_pairs<P, TD, CD>(vf, kvt, D, kp, tx * CD, TCW * CD);
        rdna_outer_product<P>(o, pf, vf);
      }
    }
  }

#pragma unroll
  for (int i = 0; i < TM; ++i) {
    for (int x = 1; x < TCW; x <<= 1) l[i] += rdna_shfl_xor(l[i], x);
    if (pos[i] >= mask.seq_q()) continue;
    epi.template store<TD, CD, TCW>(b, head0 + (row0 + i) / RPH, pos[i], tx, o[i], m[i], l[i]);
  }
}
