// The fp16 family's kernel body: its element policy (pairs of fp16 values) and its argument struct
// (Fa2Args) turned into the policies of the FlashAttention-2 main loop: row blocks (longest first
// under causal-like masks), strided K/V, a sliding-window/causal mask, RoPE, the score transforms
// (softcap, ALiBi, sinks) and the normalising epilogue.
#pragma once

#include "tiles.h"
#include "pairs.h"
#include "pipeline.h"
#include "fa2_policies.h"
#include "fa2_forward.h"

// fp16 Q, K, V through the pairs type P (the target's dot2 lowering or fp32 pairs, pairs.h): both
// products and the softmax in fp32.
template <class P>
struct ForwardF16 : P {
  typedef half_t input_t;
  typedef float acc_t;
  typedef typename P::pack_t pack_t;
  static constexpr int PACK = 2;
  static constexpr int VW = 4;  // value columns per staging item: one run of pairs
  static constexpr bool EXACT_LSE = false;  // the LSE comes from the row sum as stored
  RDNA_DEVICE float exp2(float x) { return rdna_exp2(x); }
  // Two key rows' words (VW fp16 values each) as VW (key, key + 1) pairs, one per column.
  RDNA_DEVICE void pack_columns(const unsigned (&rows)[PACK][VW / 2], pack_t (&out)[VW]) {
#pragma unroll
    for (int e = 0; e < VW; ++e) {
      const half2_t x = __builtin_bit_cast(half2_t, rows[0][e / 2]), y = __builtin_bit_cast(half2_t, rows[1][e / 2]);
      out[e] = P::join(e % 2 ? x.y : x.x, e % 2 ? y.y : y.x);
    }
  }
  // Two keys' probabilities as one pair; l adds them as stored.
  RDNA_DEVICE pack_t probabilities(const float (&e)[PACK], float& l, float&) {
    const pack_t p = P::make(e[0], e[1]);
    l += P::sum(p);
    return p;
  }
};

// bf16 Q, K, V through the bf16 pairs type P (BF16Pairs, or BF16F32Pairs where LDS holds fp32 pairs):
// the same products, softmax and accumulation as fp16's, in fp32.
template <class P>
struct ForwardBF16 : P {
  typedef rdna_bf16 input_t;
  typedef float acc_t;
  typedef typename P::pack_t pack_t;
  static constexpr int PACK = 2;
  static constexpr int VW = 4;
  static constexpr bool EXACT_LSE = false;
  RDNA_DEVICE float exp2(float x) { return rdna_exp2(x); }
  RDNA_DEVICE void pack_columns(const unsigned (&rows)[PACK][VW / 2], pack_t (&out)[VW]) {
#pragma unroll
    for (int e = 0; e < VW; ++e) {
      const int shift = e % 2 * 16;  // the low or the high value of each word
      out[e] = P::join((unsigned short)(rows[0][e / 2] >> shift), (unsigned short)(rows[1][e / 2] >> shift));
    }
  }
  RDNA_DEVICE pack_t probabilities(const float (&e)[PACK], float& l, float&) {
    const pack_t p = P::make(e[0], e[1]);
    l += P::sum(p);
    return p;
  }
};

// The element policy of pairs type P for the input dtype (BF16: bf16, else fp16).
template <class P, bool BF16>
struct Fa2Element {
  typedef ForwardF16<P> type;
};
template <class P>
struct Fa2Element<P, true> {
  typedef ForwardBF16<P> type;
};

// The score transform of score option SCORE (below).
template <int SCORE> struct Fa2F16Score { using type = ScoreTransform<Fa2Args, SCORE == 2, CapFma>; };
template <> struct Fa2F16Score<0> { using type = NoScoreTransform<Fa2Args>; };

// LENGTHS: the kernels of layout len: batch b uses its first seqused_k[b] keys.
// VARLEN: the kernels of layout varlen (packed batches): batch b's query rows start at
// cu_seqlens_q[b] and its keys at cu_seqlens_k[b], as many as the next offsets say (keys: or
// seqused_k[b]), within the total_q and total_k packed rows (fa2_packed_span); row blocks past its
// query rows end at once.
// D: the head_dim the tiles hold, HD padded with zero columns (fa2_forward.h); HD: the inputs'.
// BF16: bf16 inputs and output (the kernels of dtype bf16; P a bf16 pairs type).
// SCORE: the score transforms compiled in (families/f16.py: SCORES): 0, none (the plain kernels: no
// register or branch for them); 1, a logit softcap and sinks (score option xf); 2, ALiBi besides them
// (score option alibi). fa2_policies.h: ScoreTransform, NoScoreTransform.
template <class P, class Pipe, int D, int HD, int G, int BR, int BC, int NT, int TM, int LDS_BYTES, bool LENGTHS,
          bool VARLEN = false, bool BF16 = false, int SCORE = 0>
RDNA_DEVICE void fa2_f16_forward(const Fa2Args& a, unsigned char* lds) {
  const RowBlockSchedule<BR, G> sched(a.seq_q, a.heads_q, a.heads_kv, a.heavy_first);
  const long long b = sched.batch;
  const Fa2Span qs = VARLEN ? fa2_packed_span(a.cu_seqlens_q, b, a.total_q) : Fa2Span{0, a.seq_q};
  const long long q0 = qs.first;
  const int sq = qs.count;
  // The rows past the last sequence: zero, by each head group's first row block of the last batch.
  if (VARLEN && b == a.batch - 1 && sched.block_pos == 0) fa2_zero_rows_past_sequences<HD, NT>(a, sched.head0, G);
  if (VARLEN && sched.block_pos >= sq) return;  // the whole workgroup: past this sequence's rows
  const Fa2Span ks = VARLEN ? fa2_packed_span(a.cu_seqlens_k, b, a.total_k) : Fa2Span{0, a.seq_k};
  const long long key0 = ks.first;
  const int cap = ks.count;
  const int keys = VARLEN ? (a.seqused_k ? fa2_count(a.seqused_k[b], cap) : cap) : LENGTHS ? fa2_keys(a, b) : 0;
  const StridedQ<Fa2Args> q{a, q0};
  const StridedKv<Fa2Args, LENGTHS || VARLEN> kv(a, b, sched.head_kv, keys, key0);
  const WindowMask<Fa2Args, LENGTHS || VARLEN, VARLEN> mask{a, keys, sq};
  const RotaryTables<Fa2Args> rope{a};
  const NormalizeEpilogue<Fa2Args, BF16> epi{a, q0};
  const typename Fa2F16Score<SCORE>::type xf{a};
  fa2_forward<typename Fa2Element<P, BF16>::type, Pipe, D, HD, G, BR, BC, NT, TM, LDS_BYTES>(lds, sched, q, kv, mask, rope,
                                                                                        NoScales{}, xf, epi);
}
