// FlashAttention-2 forward, fp16 in and out; softmax and both products accumulate in fp32.
//
// A workgroup owns BR query rows: BR/G consecutive positions of each of the G query heads that
// share one K/V head, so every staged K/V tile serves the whole GQA group. Threads form a
// (BR/TM) x TCW grid: a thread owns TM consecutive rows, TN keys of each S tile and TD columns
// of the output, so every value it reads from LDS feeds several products (register tiles), and
// a row's statistics stay in the TCW lanes that share it. Keys and columns are dealt to the
// TCW lanes in 16-byte chunks, round robin, so their LDS reads never share a bank.
//
// LDS holds "pairs" along each product's reduction dimension (rdna_pair_t, set by the target):
// fp16 pairs feed the dot2 and mixed-FMA instructions directly; fp32 pairs are converted once
// at staging, for targets that would otherwise convert before every FMA.
//   qt  [D/2][BR+pad]   Q transposed, staged once (RoPE applied in place)
//   kv  K tile transposed [D/2][BC+pad], then the V tile [BC/2][D] as key pairs
//   pt  [BC/2][BR+pad]  probabilities, transposed, as key pairs
// Sizes match KernelSpec.lds_layout.
#pragma once

template <int D, int G, int BR, int BC, int NT, int TM>
RDNA_DEVICE void fa2_f16_forward(const Fa2Args& a) {
  using pair_t = rdna_pair_t;
  constexpr int TRW = BR / TM;
  constexpr int TCW = NT / TRW;
  constexpr int TN = BC / TCW;
  constexpr int TD = D / TCW;
  constexpr int RPH = BR / G;
  constexpr int D2 = D / 2, BC2 = BC / 2;
  constexpr int PAD = 16 / (int)sizeof(pair_t);
  constexpr int QS = BR + PAD, KS = BC + PAD;
  constexpr int Q_PAIRS = D2 * QS;
  constexpr int KV_PAIRS = rdna_max(D2 * KS, BC2 * D);
  constexpr int P_PAIRS = BC2 * QS;
  // A thread's keys (S) and output columns (P.V) come in chunks of CK / CD pairs, interleaved
  // with the other TCW threads of its row so that their LDS reads are consecutive.
  constexpr int CK = rdna_chunk<TN>, CD = rdna_chunk<TD>;
  constexpr int VW = 16 / (int)sizeof(pair_t);  // columns per V staging store
  // K and V tiles are staged through registers: each tile's global loads are issued one compute
  // step ahead (K during the previous P.V, V during Q.K^T), so their latency is hidden.
  constexpr int K_ITEMS = BC * D / 8, V_ITEMS = BC2 * D / VW;
  constexpr int KI = (K_ITEMS + NT - 1) / NT, VI = (V_ITEMS + NT - 1) / NT;
  static_assert(BR % TM == 0 && NT % TRW == 0 && TCW <= RDNA_WAVE_SIZE && (TCW & (TCW - 1)) == 0, "thread grid");
  static_assert(BC % TCW == 0 && TN % 2 == 0 && D % TCW == 0 && TD % 2 == 0 && BR % G == 0, "tile shape");

  RDNA_LDS(lds, (Q_PAIRS + KV_PAIRS + P_PAIRS) * sizeof(pair_t));
  pair_t* const qt = reinterpret_cast<pair_t*>(lds);
  pair_t* const kv = qt + Q_PAIRS;
  pair_t* const pt = kv + KV_PAIRS;

  const int tid = rdna_thread_id();
  const int ty = tid / TCW, tx = tid % TCW;
  const int row0 = ty * TM;
  // Workgroups start in launch order (x fastest, then y). Under a causal-like mask the row
  // blocks differ in length, so heavy_first renumbers them longest first across all heads:
  // a greedy schedule of longest-first jobs leaves almost no tail.
  int row_block = rdna_block_id_x(), head_group = rdna_block_id_y();
  if (a.heavy_first) {
    const int blocks = (a.seq_q + RPH - 1) / RPH, groups = a.heads_q / G;
    const long long order = (long long)head_group * blocks + row_block;
    row_block = blocks - 1 - (int)(order / groups);
    head_group = (int)(order % groups);
  }
  const int block_pos = row_block * RPH;
  const int head0 = head_group * G;
  const long long b = rdna_block_id_z();
  const int head_kv = head0 / (a.heads_q / a.heads_kv);
  const int offset = a.seq_k - a.seq_q;  // query i sits at key position i + offset

  // Keys any row of this block may see; tiles outside [key_lo, key_hi) are never visited.
  const int last_pos = rdna_min(a.seq_q, block_pos + RPH) - 1;
  const int key_lo = a.window_left < 0 ? 0 : rdna_max(0, block_pos + offset - a.window_left);
  const int key_hi = a.window_right < 0 ? a.seq_k
                                        : rdna_min(a.seq_k, last_pos + offset + a.window_right + 1);

  const half_t* k = a.k + b * a.k_stride_b + head_kv * a.k_stride_h;
  const half_t* v = a.v + b * a.v_stride_b + head_kv * a.v_stride_h;
  const u32x4 zero = {0u, 0u, 0u, 0u};

  // Q, transposed: consecutive threads take consecutive rows of one 8-element chunk.
  for (int i = tid; i < BR * D / 8; i += NT) {
    const int r = i % BR, c = i / BR;
    const int pos = block_pos + r % RPH;
    const half_t* src = a.q + b * a.q_stride_b + (head0 + r / RPH) * a.q_stride_h + (long long)pos * a.q_stride_s;
    rdna_store_column(qt + 4 * c * QS + r, QS, pos < a.seq_q ? rdna_load16(src + 8 * c) : zero);
  }
  if (a.rotary_dim) {
    rdna_block_sync();
    rdna_rope_lds<BR, NT>(qt, QS, a, block_pos, RPH, a.seq_q, offset);
  }

  int pos[TM], diag[TM];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    pos[i] = block_pos + (row0 + i) % RPH;
    diag[i] = pos[i] + offset;
  }
  float o[TM][TD], m[TM], l[TM];
#pragma unroll
  for (int i = 0; i < TM; ++i) {
    m[i] = -__builtin_inff();
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < TD; ++c) o[i][c] = 0.f;
  }

  u32x4 k_stage[KI];
  half_t v_stage0[VI][VW], v_stage1[VI][VW];
  auto load_k = [&](int k0) {
#pragma unroll
    for (int t = 0; t < KI; ++t) {
      const int i = tid + t * NT, key = k0 + i % BC;
      k_stage[t] = i < K_ITEMS && key < a.seq_k ? rdna_load16(k + (long long)key * a.k_stride_s + 8 * (i / BC)) : zero;
    }
  };
  auto load_v = [&](int k0) {
#pragma unroll
    for (int t = 0; t < VI; ++t) {
      const int i = tid + t * NT, key = k0 + 2 * (i / (D / VW));
      const half_t* row = v + (long long)key * a.v_stride_s + i % (D / VW) * VW;
      rdna_load_key_rows<VW>(v_stage0[t], v_stage1[t], row, row + a.v_stride_s, i < V_ITEMS && key < a.seq_k,
                             i < V_ITEMS && key + 1 < a.seq_k);
    }
  };

  const int k_first = key_lo / BC * BC;
  if (k_first < key_hi) load_k(k_first);
  for (int k0 = k_first; k0 < key_hi; k0 += BC) {
    rdna_block_sync();  // the previous tile's V and P reads are done
#pragma unroll
    for (int t = 0; t < KI; ++t) {
      const int i = tid + t * NT;
      if (i < K_ITEMS) rdna_store_column(kv + 4 * (i / BC) * KS + i % BC, KS, k_stage[t]);
    }
    load_v(k0);
    rdna_block_sync();
    if (a.rotary_dim) {
      rdna_rope_lds<BC, NT>(kv, KS, a, k0, BC, a.seq_k, 0);
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
      rdna_lds_read<TM, rdna_chunk<TM>>(qf, qt + d2 * QS + row0, rdna_chunk<TM>);
      rdna_lds_read<TN, CK>(kf, kv + d2 * KS + tx * CK, TCW * CK);
      rdna_outer_product(s, qf, kf);
    }

    // Scale and mask in one place; masked scores are -inf. A tile every row of the block sees
    // whole (all of a non-causal sequence but its end) skips the per-score tests.
    const bool whole = k0 + BC <= a.seq_k &&
                       (a.window_left < 0 || k0 >= last_pos + offset - a.window_left) &&
                       (a.window_right < 0 || k0 + BC - 1 <= block_pos + offset + a.window_right);
    if (whole) {
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) s[i][j] *= a.scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j) {
          const int key = k0 + ((j / CK) * TCW + tx) * CK + j % CK;
          const bool visible = key < a.seq_k && pos[i] < a.seq_q &&
                               (a.window_left < 0 || key >= diag[i] - a.window_left) &&
                               (a.window_right < 0 || key <= diag[i] + a.window_right);
          s[i][j] = visible ? s[i][j] * a.scale_log2 : -__builtin_inff();
        }
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
      float tile_max = -__builtin_inff();
#pragma unroll
      for (int j = 0; j < TN; ++j) tile_max = rdna_fmax(tile_max, s[i][j]);
      for (int x = 1; x < TCW; x <<= 1) tile_max = rdna_fmax(tile_max, rdna_shfl_xor(tile_max, x));

      // Online softmax. A row that has seen no key keeps m = -inf and exponentiates against 0.
      const float m_new = rdna_fmax(m[i], tile_max);
      const float m_ref = m_new == -__builtin_inff() ? 0.f : m_new;
      const float alpha = rdna_exp2(m[i] - m_ref);
      m[i] = m_new;
      l[i] *= alpha;
#pragma unroll
      for (int c = 0; c < TD; ++c) o[i][c] *= alpha;
#pragma unroll
      for (int j = 0; j < TN; j += 2) {
        // The row sum adds the probabilities exactly as stored for P.V, so the weights sum to one.
        const pair_t p = rdna_make_pair(rdna_exp2(s[i][j] - m_ref), rdna_exp2(s[i][j + 1] - m_ref));
        l[i] += rdna_pair_sum(p);
        pt[((((j / CK) * TCW + tx) * CK + j % CK) / 2) * QS + row0 + i] = p;
      }
    }

    rdna_block_sync();  // K reads are done; kv becomes the V tile
#pragma unroll
    for (int t = 0; t < VI; ++t) {
      const int i = tid + t * NT;
      if (i < V_ITEMS) rdna_store_key_pairs<VW>(kv + (i / (D / VW)) * D + i % (D / VW) * VW, v_stage0[t], v_stage1[t]);
    }
    if (k0 + BC < key_hi) load_k(k0 + BC);
    rdna_block_sync();

    // O += P V over key pairs: a TM x TD register tile per thread.
    for (int kp = 0; kp < BC2; ++kp) {
      pair_t pf[TM], vf[TD];
      rdna_lds_read<TM, rdna_chunk<TM>>(pf, pt + kp * QS + row0, rdna_chunk<TM>);
      rdna_lds_read<TD, CD>(vf, kv + kp * D + tx * CD, TCW * CD);
      rdna_outer_product(o, pf, vf);
    }
  }

#pragma unroll
  for (int i = 0; i < TM; ++i) {
    for (int x = 1; x < TCW; x <<= 1) l[i] += rdna_shfl_xor(l[i], x);
    if (pos[i] >= a.seq_q) continue;
    const int head = head0 + (row0 + i) / RPH;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;  // a row that saw no key is zero
    half_t* out = a.o + b * a.o_stride_b + head * a.o_stride_h + (long long)pos[i] * a.o_stride_s + tx * CD;
    rdna_store_row<TD, CD>(out, TCW * CD, o[i], inv);
    if (a.lse && tx == 0) {
      // Natural-log LSE of the scaled scores; m and l live in the log2 domain.
      const float ln2 = 0.6931471805599453f;
      a.lse[b * a.lse_stride_b + head * a.lse_stride_h + pos[i]] =
          l[i] > 0.f ? (m[i] + rdna_log2(l[i])) * ln2 : -__builtin_inff();
    }
  }
}
