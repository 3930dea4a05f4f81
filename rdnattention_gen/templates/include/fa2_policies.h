// The seams of the FlashAttention-2 forward kernel, as small policies its main loop composes
// (fa2_forward.h), and that the split-KV decode kernel (fa2_decode.h) shares: the mask and the
// online softmax, and the score transforms (softcap, ALiBi, sinks). A new variant replaces one of them.
//
// Policies hold a reference to the kernel's argument struct (Args: a family's struct with the
// fields each policy names) and read an argument where it is used. Kernel arguments live in
// constant memory (NVIDIA) or scalar registers (AMD); copying them into a policy up front keeps
// them in vector registers for the whole kernel instead, which measured 24% slower on the H200.
#pragma once

// Query rows: [batch, heads_q, seq_q, head_dim] with element strides, the last dimension contiguous.
// q0: the batch's first row (packed batches: cu_seqlens_q[b], with a zero batch stride), else 0.
template <class Args>
struct StridedQ {
  const Args& a;
  long long q0 = 0;
  RDNA_METHOD decltype(Args::q) row(long long b, int h, int pos) const {
    return a.q + b * a.q_stride_b + h * a.q_stride_h + (q0 + pos) * a.q_stride_s;
  }
};

// --- work schedule -------------------------------------------------------------------------
// A workgroup owns BR query rows: BR/G consecutive positions of each of the G query heads that
// share one K/V head. Workgroups start in launch order (x fastest, then y); under a causal-like
// mask the row blocks differ in length, so heavy_first renumbers them longest first across all
// heads: a greedy schedule of longest-first jobs leaves almost no tail.
template <int BR, int G>
struct RowBlockSchedule {
  static constexpr int RPH = BR / G;  // rows per head
  int block_pos;  // first query position of the block
  int head0;      // first query head of the group
  int head_kv;
  long long batch;
  int seq_q, heads_q;
  bool heavy_first;

  RDNA_METHOD RowBlockSchedule(int seq_q_, int heads_q_, int heads_kv, bool heavy_first_)
      : seq_q(seq_q_), heads_q(heads_q_), heavy_first(heavy_first_) {
    int row_block = rdna_block_id_x(), head_group = rdna_block_id_y();
    if (heavy_first) {
      const int blocks = (seq_q + RPH - 1) / RPH, groups = heads_q / G;
      const long long order = (long long)head_group * blocks + row_block;
      row_block = blocks - 1 - (int)(order / groups);
      head_group = (int)(order % groups);
    }
    block_pos = row_block * RPH;
    head0 = head_group * G;
    batch = rdna_block_id_z();
    head_kv = head0 / (heads_q / heads_kv);
  }
  // head0 for a kernel's end: where the platform reads the block id anew (RDNA_BLOCK_ID_ANEW, cuda),
  // made again from it; under heavy_first it is a division's remainder, and held through the main
  // loop it cost sm_90's tightest tiles (255 registers) a spill. Elsewhere head0 as it was.
  RDNA_METHOD int head0_anew() const {
#if RDNA_BLOCK_ID_ANEW
    const int x = rdna_block_id_x_anew(), y = rdna_block_id_y_anew();
    if (!heavy_first) return y * G;
    const int blocks = (seq_q + RPH - 1) / RPH, groups = heads_q / G;
    return (int)(((long long)y * blocks + x) % groups) * G;
#else
    return head0;
#endif
  }
};

// --- bounds of the index values ---------------------------------------------------------------
// The runtime does not read the values of index tensors on a GPU (docs/api.md: which checks read
// values), so every row a kernel addresses through one is bounded here: a count within [0, most],
// a packed sequence's offsets within the rows of its tensor (total), a cache row or page within
// the cache (rows; one outside it reads row 0). A call with such values computes nonsense, but
// reads and writes only the tensors it was given.
RDNA_DEVICE int fa2_count(int n, int most) { return rdna_max(0, rdna_min(n, most)); }

struct Fa2Span {
  long long first;  // the sequence's first row
  int count;        // its rows
};

// Sequence b of a packed batch: rows cu[b] .. cu[b + 1] - 1, clamped into [0, total).
RDNA_DEVICE Fa2Span fa2_packed_span(const int* cu, long long b, int total) {
  const int first = fa2_count(cu[b], total);
  return Fa2Span{first, rdna_max(first, rdna_min(cu[b + 1], total)) - first};
}

RDNA_DEVICE int fa2_row(int i, int rows) { return (unsigned)i < (unsigned)rows ? i : 0; }

// Packed batches: the output rows past the last sequence's, [cu_seqlens_q[batch], total_q), which no
// workgroup computes, are zero, written for query heads [h0, h0 + heads) of head_dim HD by the
// workgroup that calls this (one per head group, in the last batch), so the runtime allocates the
// output without a fill launch. Rows before cu_seqlens_q[0] or past a sequence's longest length
// break the call's contract (docs/api.md: which checks read values) and are not written. The
// output's rows and heads start on 16 bytes (the runtime allocates it contiguous, HD a multiple of 8).
template <int HD, int NT, class Args>
RDNA_DEVICE void fa2_zero_rows_past_sequences(const Args& a, int h0, int heads) {
  static_assert(HD % 8 == 0, "16-byte stores");
  constexpr int CH = HD / 8;
  const int first = fa2_count(a.cu_seqlens_q[a.batch], a.total_q);
  const u32x4 zero = {0u, 0u, 0u, 0u};
  const int per_row = heads * CH, rows = rdna_max(1, NT / per_row);  // 16-byte stores per row; rows per pass
  for (int row0 = first; row0 < a.total_q; row0 += rows) {  // none where the sequences cover every row
    for (int i = rdna_thread_id(); i < rows * per_row; i += NT) {
      const int row = row0 + i / per_row, j = i % per_row;
      if (row < a.total_q) {
        half_t* const out = a.o + (long long)(h0 + j / CH) * a.o_stride_h + (long long)row * a.o_stride_s;
        __builtin_memcpy(__builtin_assume_aligned(out + 8 * (j % CH), 16), &zero, sizeof(zero));
      }
    }
  }
}

// --- K/V source ------------------------------------------------------------------------------
// The keys batch b uses: seqused_k[b] where the call gives cache lengths (a preallocated cache
// holds seq_k rows per batch, the first seqused_k[b] of them valid), else seq_k.
template <class Args>
RDNA_DEVICE int fa2_keys(const Args& a, long long b) {
  return a.seqused_k ? fa2_count(a.seqused_k[b], a.seq_k) : a.seq_k;
}

// Keys and values of one (batch, K/V head), addressed by key index through strides. LENGTHS: the
// batch uses n keys (cache lengths, a kernel variant of its own); otherwise seq_k, read from the
// kernel arguments where it is used: a copy would hold a register for the whole kernel, which
// measured 5% slower at head_dim 64 on the H200.
template <class Args, bool LENGTHS = false>
struct StridedKv {
  const Args& a;
  decltype(Args::k) k;  // fp16 or int8 rows
  decltype(Args::v) v;
  int n;

  // key0: the batch's first key row (packed batches: cu_seqlens_k[b], with a zero batch stride).
  RDNA_METHOD StridedKv(const Args& args, long long b, int head_kv, int keys = 0, long long key0 = 0)
      : a(args), k(args.k + b * args.k_stride_b + key0 * args.k_stride_s + head_kv * args.k_stride_h),
        v(args.v + b * args.v_stride_b + key0 * args.v_stride_s + head_kv * args.v_stride_h), n(keys) {}
  RDNA_METHOD int seq_k() const { return LENGTHS ? n : a.seq_k; }
  RDNA_METHOD decltype(Args::k) key(int i) const { return k + (long long)i * a.k_stride_s; }
  RDNA_METHOD decltype(Args::v) value(int i) const { return v + (long long)i * a.v_stride_s; }
  RDNA_METHOD long long value_stride() const { return a.v_stride_s; }
};

// --- score transform and mask ------------------------------------------------------------------
// Scales scores into the log2 domain and hides keys outside the window around each query's
// diagonal (query i sits at key position i + keys - queries; keys: the batch's n with LENGTHS, as in
// StridedKv, else seq_k; queries: the batch's sq with QLENGTHS, packed batches, else seq_q).
// window_right 0 is causal; -1 on either side is unbounded.
template <class Args, bool LENGTHS = false, bool QLENGTHS = false>
struct WindowMask {
  const Args& a;
  int n = 0;
  int sq = 0;

  RDNA_METHOD int seq_q() const { return QLENGTHS ? sq : a.seq_q; }
  RDNA_METHOD int seq_k() const { return LENGTHS ? n : a.seq_k; }
  RDNA_METHOD int offset() const { return seq_k() - seq_q(); }
  RDNA_METHOD int diag(int pos) const { return pos + offset(); }
  // Keys any row in [first, last] may see; tiles outside [key_lo, key_hi) are never visited.
  RDNA_METHOD int key_lo(int first) const {
    return a.window_left < 0 ? 0 : rdna_max(0, first + offset() - a.window_left);
  }
  RDNA_METHOD int key_hi(int last) const {
    return a.window_right < 0 ? seq_k() : rdna_min(seq_k(), last + offset() + a.window_right + 1);
  }
  // A tile every row in [first, last] sees whole skips the per-score tests.
  template <int BC>
  RDNA_METHOD bool whole(int k0, int first, int last) const {
    return k0 + BC <= seq_k() && (a.window_left < 0 || k0 >= last + offset() - a.window_left) &&
           (a.window_right < 0 || k0 + BC - 1 <= first + offset() + a.window_right);
  }
  RDNA_METHOD bool visible(int key, int pos, int diag_pos) const {
    return key < seq_k() && pos < seq_q() && (a.window_left < 0 || key >= diag_pos - a.window_left) &&
           (a.window_right < 0 || key <= diag_pos + a.window_right);
  }
  RDNA_METHOD float scale(float s) const { return s * a.scale_log2; }
};

// --- score transforms: logit softcap, ALiBi, attention sinks ----------------------------------------
// Each visible score s (log2 domain: q.k times softmax_scale times log2(e), as the mask scales it)
// is transformed once, in this order: the softcap, s -> C tanh(s / C) with C = softcap log2(e)
// (flash-attn's softcap * tanh(x / softcap) of the natural-log score x), then ALiBi, s -> s -
// slope log2(e) |key - diag| (flash-attn's bias -slope |i + seqlen_k - seqlen_q - j|, the slope of the
// row's batch and query head). A sink (one logit per query head) joins each row's softmax sum and
// log-sum-exp once, after its keys, and adds no value (fa2_join_sink). All are read from the
// arguments, so the kernels without them take one uniform branch per tile, not a variant each:
// softcap_log2 (C; 0: no cap) and softcap_inv (1 / C), alibi_slopes (fp32, element [b *
// alibi_stride_b + head]; null: none), sinks (fp32 [heads_q], natural log; null: none).
// The softcap C tanh(s / C) (inv = 1 / C) in two forms, equal but for rounding, whose register cost
// differs by kernel (measured: each spilled some tiles the other does not). Both give -C for -inf
// (so masked scores skip them), C for inf and NaN for NaN.
// CapFma, the row-block kernels': C - 2C / (1 + e^(2s/C)), an exponential, a reciprocal and an FMA
// (RDNA2's tightest tiles spilled with CapSymmetric). The exponential may flush below 2^-126: 1 plus
// it is 1 either way.
struct CapFma {
  RDNA_METHOD float operator()(float s, float c, float inv) const {
    return rdna_fma(-2.f * c, rdna_rcp(1.f + rdna_exp2_flush(s * (2.8853900817779268f * inv))), c);
  }
};
// CapSymmetric, the split-KV kernels': C sign(s) (1 - t) / (1 + t), t = e^(-2|s|/C), which loses
// nothing near 0 beyond t's rounding (sm_90's four-row tiles spilled with CapFma). t may flush below
// 2^-126, where (1 - t) / (1 + t) is 1 either way; the sign is copied from x = s / C (a sign bit: 0
// keeps its sign, NaN stays NaN), where comparisons and selects cost four instructions more per
// score. (Copied from s, with 1 / C folded into t's constant, it is one multiply less, but it cost
// AMD's decode tiles a VGPR: some lost a wave.)
struct CapSymmetric {
  RDNA_METHOD float operator()(float s, float c, float inv) const {
    const float x = s * inv;
    const float t = rdna_exp2_flush(-2.8853900817779268f * __builtin_fabsf(x));
    return __builtin_copysignf(c * ((1.f - t) * rdna_rcp(1.f + t)), x);
  }
};

// A compile-time flag passed as a value (a generic lambda's argument picks its copy by it).
template <bool V>
struct rdna_bool {
  static constexpr bool value = V;
};

// Which score transforms a copy of code applies, known at compile time (fa2_forward's row loop has
// one copy per case and picks one per tile): the softcap (CAP) and ALiBi (ALIBI); MASKED: the tile
// may hold masked scores (false: a whole tile, where a softcap needs no select to keep them); FOLD:
// ALiBi alone on a whole tile at or before every row's diagonal, its distances folded into the
// softmax's exponents (fa2_forward.h's AlibiExponent).
template <bool C, bool A, bool M = true, bool F = false>
struct XfCase {
  static_assert(!F || (A && !C && !M), "ALiBi's distances fold only without a softcap, on a whole tile");
  static constexpr bool CAP = C, ALIBI = A, MASKED = M, FOLD = F;
};

// ALIBI: the kernel applies ALiBi (the split-KV kernels of at most FA2_DECODE_ALIBI_ROWS rows, and the
// row-block kernels of score option alibi): its per-row slope and distances cost the plain row-block
// kernels' tightest tiles registers they do not have (GCN's head_dim 64 spilled, RDNA2's lost a wave),
// so they are compiled without it and the runtime sends ALiBi calls to those that have it.
template <class Args, bool ALIBI, class Cap>
struct ScoreTransform {
  const Args& a;
  static constexpr bool ANY = true;  // compiled with score transforms
  static constexpr bool HAS_ALIBI = ALIBI;

  // A softcap or ALiBi slopes (the split-KV kernels' test, once per step). Without ALIBI, slopes never
  // reach the kernel (the runtime's route).
  RDNA_METHOD bool enabled() const { return a.softcap_log2 != 0.f || a.alibi_slopes; }
  // The ALiBi slope of batch b's query head, log2 domain (0 without ALiBi).
  RDNA_METHOD float slope(long long b, int head) const {
    return ALIBI && a.alibi_slopes ? a.alibi_slopes[b * a.alibi_stride_b + head] * 1.4426950408889634f : 0.f;
  }
  // A visible scaled score of the key ``dist`` keys after the row's diagonal (a whole number, as a
  // float: exact below 2^24, and the kernels convert once per row, not per score).
  RDNA_METHOD float apply(float s, float slope, float dist) const {
    if (a.softcap_log2 != 0.f) s = Cap{}(s, a.softcap_log2, a.softcap_inv);
    return ALIBI ? s - slope * __builtin_fabsf(dist) : s;
  }
  // The softcap alone, of a visible score (the caller keeps masked ones).
  RDNA_METHOD float cap(float s) const { return Cap{}(s, a.softcap_log2, a.softcap_inv); }
  // The case (XfCase) the arguments ask for: a softcap; ALiBi slopes (only where the kernel has ALIBI).
  RDNA_METHOD bool capped() const { return a.softcap_log2 != 0.f; }
  RDNA_METHOD bool alibi() const { return ALIBI && a.alibi_slopes; }
  // apply for case (CAP, AL); MASKED: the score may be masked (-inf), and stays so. ALiBi alone
  // keeps it without a select: -inf minus a finite bias is -inf (slopes are finite where checked; a
  // slope that is not makes the row's visible scores NaN or inf, so its output is NaN either way). A
  // softcap maps -inf to -C: it takes a select, but not where no score is masked (a whole tile).
  template <bool CAP, bool AL, bool MASKED = true>
  RDNA_METHOD float apply_case(float s, float slope, float dist) const {
    float t = s;
    if constexpr (CAP) t = Cap{}(t, a.softcap_log2, a.softcap_inv);
    if constexpr (AL) t -= slope * __builtin_fabsf(dist);
    if constexpr (!CAP || !MASKED) return t;
    return s != -__builtin_inff() ? t : s;
  }
  RDNA_METHOD bool sinks() const { return a.sinks; }
  RDNA_METHOD float sink(int head) const { return a.sinks[head] * 1.4426950408889634f; }
};

// No transform (the int8 families): every branch on it folds away.
template <class Args>
struct NoScoreTransform {
  const Args& a;
  static constexpr bool ANY = false;
  static constexpr bool HAS_ALIBI = false;
  RDNA_METHOD constexpr bool enabled() const { return false; }
  RDNA_METHOD float slope(long long, int) const { return 0.f; }
  RDNA_METHOD float apply(float s, float, float) const { return s; }
  RDNA_METHOD float cap(float s) const { return s; }
  RDNA_METHOD constexpr bool capped() const { return false; }
  RDNA_METHOD constexpr bool alibi() const { return false; }
  template <bool, bool, bool = true>
  RDNA_METHOD float apply_case(float s, float, float) const { return s; }
  RDNA_METHOD constexpr bool sinks() const { return false; }
  RDNA_METHOD float sink(int) const { return 0.f; }
};

// A sink of logit ``sink`` (log2 domain) joins a row whose sum and values are against ``ref``:
// ref moves to the larger of the two; returned is the sink's weight against it, and alpha is the
// factor the row's sum and values are to be rescaled by (0 where ref was -inf: no key).
RDNA_DEVICE float fa2_sink_weight(float sink, float& ref, float& alpha) {
  const float m = rdna_fmax(ref, sink);
  alpha = rdna_exp2(ref - m);
  ref = m;
  return rdna_exp2(sink - m);
}

// The sink joined to a row's sum and values: a row that saw no key (sum 0) then has sum 1 against
// the sink, a zero row whose LSE is the sink's.
template <int N>
RDNA_DEVICE void fa2_join_sink(float sink, float& sum, float& ref, float (&vals)[N]) {
  float alpha;
  const float w = fa2_sink_weight(sink, ref, alpha);
  sum = sum * alpha + w;
#pragma unroll
  for (int c = 0; c < N; ++c) vals[c] *= alpha;
}

// --- Q/K transform: RoPE -----------------------------------------------------------------------
// Tables [positions, rotary_dim/2] in fp32 with row stride rotary_stride; rotary_dim 0: no rotation.
template <class Args>
struct RotaryTables {
  const Args& a;

  RDNA_METHOD bool enabled() const { return a.rotary_dim != 0; }

  // In place on a transposed pair tile in LDS (pairs.h): element (r, d) is component d % 2 of the
  // pair at row d / 2, column r (rows of `tile_stride` pairs). Each thread owns
  // whole (x1, x2) pairs and writes single elements. Row r holds position first + r % period and
  // uses table row position + shift; rows at or past `limit` are padding and stay as they are.
  template <typename P, int ROWS, int NT>
  RDNA_METHOD void apply(typename P::pack_t* tile, int tile_stride, int first, int period, int limit,
                         int shift) const {
    const int half_dim = a.rotary_dim / 2;
    for (int i = rdna_thread_id(); i < ROWS * half_dim; i += NT) {
      const int r = i % ROWS, j = i / ROWS;
      const int pos = first + r % period;
      if (pos >= limit || pos + shift < 0) continue;  // below 0: a query before the first key, no table row
      const long long t = (long long)(pos + shift) * a.rotary_stride + j;
      const float c = a.rotary_cos[t], s = a.rotary_sin[t];
      const int d1 = a.rotary_interleaved ? 2 * j : j;
      const int d2 = a.rotary_interleaved ? 2 * j + 1 : j + half_dim;
      typename P::elem_t* const e1 = P::elem(tile, tile_stride, d1 / 2, r, d1 % 2);
      typename P::elem_t* const e2 = P::elem(tile, tile_stride, d2 / 2, r, d2 % 2);
      const float x1 = (float)*e1, x2 = (float)*e2;
      *e1 = (typename P::elem_t)(x1 * c - x2 * s);
      *e2 = (typename P::elem_t)(x2 * c + x1 * s);
    }
  }
};

// No rotation (the int8 family).
struct NoRope {
  RDNA_METHOD bool enabled() const { return false; }
  template <typename P, int ROWS, int NT>
  RDNA_METHOD void apply(typename P::pack_t*, int, int, int, int, int) const {}
};

// --- score and output scales ---------------------------------------------------------------------
// How the products of a tile become log2-domain scores, and what multiplies each output column
// before it is normalised. fp16 products are the raw scores: the mask scales them. The int8
// family's per-token and per-channel scales (fa2_i8.h) replace this policy.
struct NoScales {
  static constexpr bool ENABLED = false;
  template <class Mask>
  RDNA_METHOD float row(const Mask&, long long, int, int) const { return 1.f; }
  RDNA_METHOD float key(int) const { return 1.f; }
  template <class Mask>
  RDNA_METHOD float score(const Mask& mask, float acc, float, float) const { return mask.scale(acc); }
  RDNA_METHOD float value(int) const { return 1.f; }
};

// --- online softmax ------------------------------------------------------------------------------
// One row's running max m and sum l (log2 domain) meet a tile whose max is tile_max: m moves up,
// l and the row's output are rescaled, and the reference the tile's probabilities are taken
// against is returned; alpha is the factor the row's sums were rescaled by. A row that has seen no
// key keeps m = -inf and exponentiates against 0.
// SKIP_UNMOVED: the output is left alone where the maximum did not move (alpha is exactly 1),
// which after the first tiles is most of them (a schedule choice, pipeline.h). DEFER: the output is
// left alone; the caller rescales it by alpha when it adds the tile's products (int8: one FMA each).
template <int TD, bool SKIP_UNMOVED, bool DEFER = false>
RDNA_DEVICE float fa2_softmax_update(float& m, float& l, float (&o)[TD], float tile_max, float& alpha) {
  const float m_new = rdna_fmax(m, tile_max);
  const float m_ref = m_new == -__builtin_inff() ? 0.f : m_new;
  alpha = rdna_exp2(m - m_ref);
  m = m_new;
  l *= alpha;
  if (!DEFER && (!SKIP_UNMOVED || alpha != 1.f)) {
#pragma unroll
    for (int c = 0; c < TD; ++c) o[c] *= alpha;
  }
  return m_ref;
}

// --- epilogue ----------------------------------------------------------------------------------
// The final output: each row divided by its sum l and stored as fp16 (BF16: bf16), and the natural-log
// log-sum-exp of the scaled scores (m and lse_sum, the sum of the unrounded probabilities, live in
// the log2 domain) where asked for.
template <class Args, bool BF16 = false>
struct NormalizeEpilogue {
  const Args& a;
  long long q0 = 0;  // the batch's first row (packed batches), as in StridedQ

  // HD: the output's head_dim; columns past it (padding, fa2_forward.h) are not stored.
  template <int TD, int CD, int TCW, int HD = TD * TCW>
  RDNA_METHOD void store(long long b, int head, int pos, int tx, const float (&row)[TD], float m, float l,
                         float lse_sum) const {
    // A row that saw no key (l == 0) is zero, its LSE -inf; a NaN score made l NaN, and the
    // row and its LSE stay NaN (never mistaken for "no visible key").
    const float inv = l == 0.f ? 0.f : 1.f / l;
    half_t* out = a.o + b * a.o_stride_b + head * a.o_stride_h + (q0 + pos) * a.o_stride_s + tx * CD;
    rdna_store_row<TD, CD, (HD < TD * TCW), BF16>(out, TCW * CD, row, inv, HD - tx * CD);
    if (a.lse && tx == 0) {
      const float ln2 = 0.6931471805599453f;
      a.lse[b * a.lse_stride_b + head * a.lse_stride_h + q0 + pos] =
          lse_sum == 0.f ? -__builtin_inff() : (m + rdna_log2(lse_sum)) * ln2;
    }
  }
};
