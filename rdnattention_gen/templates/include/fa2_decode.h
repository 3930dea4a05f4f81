// Split-KV decode (flash-decoding): few query rows against many keys, read at memory speed.
//
// A workgroup owns up to R query rows of one K/V head (the query heads of its GQA group times the
// query positions, in that order) and one slice of the keys; the grid is (key slices x row chunks,
// K/V heads, batch), the chunks of one slice side by side (x = slice * chunks + chunk), so that a
// slice read by several chunks is read from memory once and from the L2 cache after. Nothing is
// staged in LDS: each key is read from memory straight into the registers of a group of L lanes,
// 16 bytes of K and 16 bytes of V per lane, and the L lanes reduce its score with shuffles. L is
// D/8 rounded up to a power of two: where D/8 is not one, the lanes past D/8 are padding. Their
// query and keys are zeros, so they add nothing to the scores, and they store nothing; they load
// the last lane's 16 bytes (their values unused), so that no load waits on a condition (predicated
// loads a step ahead cost sm_90's one-row kernels spills).
// The NG = NT/L lane groups take keys round robin, T of them per step (BC = NG * T keys per
// workgroup step), and each keeps its own online softmax over the keys it saw; at the end the
// groups of a wave merge by shuffles and the waves meet once, in LDS. With one slice the workgroup
// writes the output; with several it writes a normalised fp32 partial output and its log2-domain
// LSE per row and slice, and the last slice of its row chunk to finish merges them into the
// output (a count per chunk in ``counters``): one launch either way. The score transforms
// (softcap, ALiBi) apply to each score as the prefill's do; a sink joins each row once, where the
// row is written.
//
// The K/V source covers three layouts: strided [batch, keys, heads, dim] tensors (cache rows picked
// by cache_batch_idx where given), packed variable-length batches (cu_seqlens_k) and a paged cache
// (block_table: key i of batch b in page block_table[b][i / page], row i % page). Query rows are
// strided or packed (cu_seqlens_q) the same way. cu_seqlens_q[b] and cu_seqlens_k[b] are where
// batch b's rows start; their counts are the next offset's distance unless seqused_q / seqused_k
// give them (so a padded batch is described by start offsets and lengths).
#pragma once

#include "tiles.h"
#include "pairs.h"
#include "fa2_policies.h"
#include "fa2_append.h"

// Key rows of one (batch, K/V head) in any of the three layouts. Offsets in elements. PAGED: the
// kernels of layout paged, compiled apart so that the others hold no page state.
template <class Args, bool PAGED>
struct DecodeKv {
  const Args& a;
  decltype(Args::k) k;  // fp16 or int8 rows
  decltype(Args::v) v;
  const int* pages;  // the batch's row of the block table; null: not paged

  RDNA_METHOD DecodeKv(const Args& args, long long b, long long key0, int head_kv)
      : a(args), pages(PAGED ? args.block_table + b * args.block_table_stride : nullptr) {
    const long long kb = PAGED ? 0 : b * args.k_stride_b + key0 * args.k_stride_s;
    const long long vb = PAGED ? 0 : b * args.v_stride_b + key0 * args.v_stride_s;
    k = args.k + kb + head_kv * args.k_stride_h;
    v = args.v + vb + head_kv * args.v_stride_h;
  }
  // Paged: the batch stride is the page stride, and K and V share their strides (the runtime
  // checks), so one offset serves both. The page of key i is read apart from the key (page(i)),
  // a step ahead of the key's own load, so the two reads do not follow each other.
  RDNA_METHOD int page(int i) const { return PAGED ? fa2_row(pages[i >> a.page_shift], a.kv_rows) : 0; }
  RDNA_METHOD long long paged_offset(int i, int pg) const {
    return pg * a.k_stride_b + (long long)(i & ((1 << a.page_shift) - 1)) * a.k_stride_s;
  }
  RDNA_METHOD decltype(Args::k) key(int i, int pg) const {
    return k + (PAGED ? paged_offset(i, pg) : (long long)i * a.k_stride_s);
  }
  RDNA_METHOD decltype(Args::v) value(int i, int pg) const {
    return v + (PAGED ? paged_offset(i, pg) : (long long)i * a.v_stride_s);
  }
};

// Query rows of batch b: where they start (packed: cu_seqlens_q[b], within the total_q rows) and
// how many: seqused_q[b] where given (the rest of its rows are padding), else the packed
// sequence's length, else seq_q; never more than seq_q (the rows the grid and the partial outputs
// are laid out for) nor than the packed rows left.
template <class Args>
RDNA_DEVICE Fa2Span fa2_query_rows(const Args& a, long long b) {
  Fa2Span s = a.cu_seqlens_q ? fa2_packed_span(a.cu_seqlens_q, b, a.total_q) : Fa2Span{0, a.seq_q};
  if (a.seqused_q) s.count = a.cu_seqlens_q ? rdna_min(a.seqused_q[b], a.total_q - (int)s.first) : a.seqused_q[b];
  s.count = rdna_min(s.count, a.seq_q);
  return s;
}

// What a lane holds of each key: 16 bytes of K and of V. E::CPL values per lane (8 fp16, 16 int8);
// the score of a key is the lanes' partial dot products summed; E's scales are 1 for fp16.
// fp16 keys through the pairs policy P (the target's dot2 lowering or fp32 pairs).
template <class P>
struct DecodeF16 {
  static constexpr int CPL = 8;
  static constexpr bool LAYOUTS = true;  // packed batches, cache lengths, cache rows: read from the arguments
  static constexpr bool BF16 = false;    // the output's dtype: fp16
  template <class Args, bool ALIBI>
  using Transform = ScoreTransform<Args, ALIBI, CapSymmetric>;  // softcap, ALiBi, sinks (fa2_policies.h)
  struct Q {
    typename P::pack_t p[4];
  };
  RDNA_DEVICE Q query(u32x4 c) {
    return Q{{P::from_word(c.x), P::from_word(c.y), P::from_word(c.z), P::from_word(c.w)}};
  }
  struct K {
    typename P::pack_t p[4];
  };
  RDNA_DEVICE K key(u32x4 c) { return K{{P::from_word(c.x), P::from_word(c.y), P::from_word(c.z), P::from_word(c.w)}}; }
  RDNA_DEVICE float dot(const Q& q, const K& k) {
    return P::dot(q.p[3], k.p[3], P::dot(q.p[2], k.p[2], P::dot(q.p[1], k.p[1], P::dot(q.p[0], k.p[0], 0.f))));
  }
  RDNA_DEVICE void values(u32x4 c, float (&v)[CPL]) {
    const half_t* h = reinterpret_cast<const half_t*>(&c);
#pragma unroll
    for (int e = 0; e < CPL; ++e) v[e] = (float)h[e];
  }
  template <class Args>
  RDNA_DEVICE float query_scale(const Args&, long long, int, long long) { return 1.f; }
  // The scales of one (batch, K/V head): per key and per channel.
  struct Scales {
    RDNA_METHOD float key(int) const { return 1.f; }
    RDNA_METHOD float value(int) const { return 1.f; }
  };
  template <class Args>
  RDNA_DEVICE Scales scales(const Args&, long long, int) { return Scales{}; }
};

// bf16 keys and values through the bf16 pairs policy P (BF16Pairs or BF16F32Pairs): each value
// widened to fp32 by a shift; the output bf16.
template <class P>
struct DecodeBF16 : DecodeF16<P> {
  static constexpr bool BF16 = true;
  RDNA_DEVICE void values(u32x4 c, float (&v)[DecodeF16<P>::CPL]) {
#pragma unroll
    for (int w = 0; w < 4; ++w) v[2 * w] = rdna_bf16_lo(c[w]), v[2 * w + 1] = rdna_bf16_hi(c[w]);
  }
};

// A row's reference (the value its probabilities are exponentiated against) need not be its exact
// running maximum: any reference at or below it gives the same sums and outputs but for rounding,
// with probabilities up to 2^(maximum - reference). The decode loop moves a row's reference only
// where a score passes it by more than FA2_RESCALE_SLACK (log2 domain): probabilities stay at most
// 2^8 = 256, which fp32 sums hold without loss that matters, and the rescale of the values, which
// a step of few keys otherwise pays at most steps (a lane rescales all of its R rows where any one's
// maximum grew), is paid a few times per row. A reference at -inf (no key yet) moves to the first
// score that is not -inf; a NaN score moves nothing (it makes the row's sum NaN either way).
#define FA2_RESCALE_SLACK 8.f
RDNA_DEVICE bool fa2_reference_moves(float ref, float tile_max) { return tile_max > ref + FA2_RESCALE_SLACK; }

// Merging partial results of one row (the decode kernel's waves, the merge's thread groups): n
// (maximum, sum) pairs at stat[0], stat[step], ... (log2 domain; maximum -inf: no key, sum 0) and
// their values at vals[0], vals[vstep], ..., each against its own maximum. acc receives the values
// against the common maximum, ``ref``; the merged sum is returned. A NaN sum stays NaN.
template <int N>
RDNA_DEVICE float fa2_merge_partials(const float* stat, int step, const float* vals, int vstep, int n, float (&acc)[N],
                                     float& ref) {
  float mx = -__builtin_inff();
  for (int g = 0; g < n; ++g) mx = rdna_fmax(mx, stat[g * step]);
  ref = mx == -__builtin_inff() ? 0.f : mx;
  float sum = 0.f;
#pragma unroll
  for (int c = 0; c < N; ++c) acc[c] = 0.f;
  for (int g = 0; g < n; ++g) {
    const float w = rdna_exp2(stat[g * step] - ref);  // 0 for a part that saw no key
    sum += stat[g * step + 1] * w;
#pragma unroll
    for (int c = 0; c < N; ++c) acc[c] = rdna_fma(vals[g * vstep + c], w, acc[c]);
  }
  return sum;
}

// A merged row's normalising factor and log2-domain LSE: no visible key (sum 0) gives a zero row
// and LSE -inf; a NaN score made the sum NaN, and NaN they stay.
RDNA_DEVICE float fa2_row_scale(float sum) { return sum == 0.f ? 0.f : 1.f / sum; }
RDNA_DEVICE float fa2_row_lse2(float sum, float ref) { return sum == 0.f ? -__builtin_inff() : ref + rdna_log2(sum); }

// The final fp16 (BF16: bf16) row (acc / sum) of query head ``head`` at row ``pos`` of batch b, lanes'
// columns from c0, and its natural-log LSE where asked for.
template <int N, bool BF16 = false, class Args>
RDNA_DEVICE void fa2_store_final_row(const Args& a, long long b, int head, long long pos, int c0, const float (&acc)[N],
                                     float sum, float ref) {
  rdna_store_row<N, 8, false, BF16>(a.o + b * a.o_stride_b + head * a.o_stride_h + pos * a.o_stride_s + c0, 8, acc, fa2_row_scale(sum));
  if (a.lse && c0 == 0) a.lse[b * a.lse_stride_b + head * a.lse_stride_h + pos] = fa2_row_lse2(sum, ref) * 0.6931471805599453f;
}

// Packed batches: the rows past the last sequence are zero (fa2_zero_rows_past_sequences), written by
// the first slice of the first row chunk of each K/V head in the last batch, once its own rows are
// done (or at once where it has none): at the end, nothing of it is held through the main loop. Not
// by the paged kernels (PAGED): its arguments cost GCN's paged kernels two SGPRs they spilled
// (gfx906), so the runtime fills a paged packed call's output before the launch (decode.allocate).
template <class E, int D, int NT, bool PAGED, class Args>
RDNA_DEVICE void fa2_decode_zero_rows_past_sequences(const Args& a) {
  if constexpr (E::LAYOUTS && !PAGED) {
    if (a.cu_seqlens_q && rdna_block_id_z() == a.batch - 1 && rdna_block_id_x() == 0) {
      const int group = a.heads_q / a.heads_kv;
      fa2_zero_rows_past_sequences<D, NT>(a, rdna_block_id_y() * group, group);
    }
  }
}

// New keys per sequence that the launch appends (DecodeF16's kernels: append_rows; int8: none).
template <class E, class Args>
RDNA_DEVICE int fa2_decode_appended(const Args& a) {
  if constexpr (E::LAYOUTS)
    return a.append_rows;
  else
    return 0;
}

// flash_attn_with_kvcache's append, done by the decode launch that reads it (rdnattention/kvcache.py
// fuses the two where the attention is one split-KV launch and the new keys are few): every
// workgroup writes the new keys and values of its K/V head and sequence b into the cache at positions
// [len, n) before it reads any key, so that no workgroup waits for another; a key written by several
// workgroups gets the same bits from each. With RoPE tables (a.rope: 1 pairs, 2 halves; kernels
// of head_dim FA2_DECODE_ROPE_MIN_D and up), k is rotated on its way into the cache and the workgroup's own query rows (those of its row chunk) are
// rotated from q_src into q, the buffer its loads read, as the append kernel rotates them
// (fa2_append.h): the chunk's other key slices write the same bits there. Bounded as the append
// kernel bounds them: the length within [0, seq_k - new], cache rows and pages clamped into the
// cache, table rows into the tables. Only bad values make the keys one sequence writes another's to
// read (the kernels read row 0 for a row or page outside the cache); such a read sees them before or
// after the write.
// It runs first, before the kernel holds anything, and reads its arguments into vector registers
// (RDNA_ARGS_VARYING), its lengths included: GCN's decode tiles have no scalar register to spare.
// The runtime fuses only calls of neither packed queries nor packed keys.
// The least head_dim whose kernels rotate (rdnattention/families/dec.py's ROPE_MIN_HEAD_DIM, which
// the runtime reads): the float64 rotation's registers cost the head_dim 8 and 16 tiles, whose own
// are few, waves on every AMD target (GCN's head_dim 16 tile an SGPR spill); their calls with RoPE
// tables run the append kernel's launch first.
constexpr int FA2_DECODE_ROPE_MIN_D = 24;

template <int D, int R, int NT, bool PAGED, bool BF16, class Args>
RDNA_DEVICE void fa2_decode_append(const Args& args) {
  RDNA_ARGS_VARYING(Args, ap, args);
  const Args& a = *ap;
  const int head_kv = rdna_block_id_y();
  const long long b = rdna_block_id_z();
  const int len = fa2_count(a.seqused_k[b], a.seq_k - a.append_rows);
  const int rope = D >= FA2_DECODE_ROPE_MIN_D ? a.rope : 0;
  // The values of the new keys (e < keys: value e of key e / D, written with its value's), then,
  // with tables, those of this workgroup's query rows r0 + i (i < R, r0 + i < rows): head head_kv *
  // group + r / seq_q, position r % seq_q. One rotation per value, whichever it is.
  const int keys = a.append_rows * D;
  int r0 = 0, count = 0;
  if (rope) {
    const int rows = a.heads_q / a.heads_kv * a.seq_q;
    r0 = rdna_block_id_x() % ((rows + R - 1) / R) * R, count = rdna_min(R, rows - r0);
  }
#pragma unroll 1
  for (int e = rdna_thread_id(); e < keys + count * D; e += NT) {
    const unsigned short* src;
    unsigned short* dst;
    int d, pos;  // the feature, and the RoPE tables' row (clamped into them)
    if (e < keys) {
      const int i = e / D, p = len + i;
      d = e - i * D;
      long long row, at;  // the cache row or page clamped into the cache, and the position in it
      if (PAGED) {
        row = rdna_min(rdna_max(a.block_table[b * a.block_table_stride + (p >> a.page_shift)], 0), a.kv_rows - 1);
        at = p & ((1 << a.page_shift) - 1);
      } else {
        row = a.cache_batch_idx ? rdna_min(rdna_max(a.cache_batch_idx[b], 0), a.kv_rows - 1) : b;
        at = p;
      }
      src = reinterpret_cast<const unsigned short*>(a.k_new) + b * a.kn_stride_b + i * a.kn_stride_s +
            head_kv * a.kn_stride_h;
      const unsigned short* const vn =
          reinterpret_cast<const unsigned short*>(a.v_new) + b * a.vn_stride_b + i * a.vn_stride_s + head_kv * a.vn_stride_h;
      dst = reinterpret_cast<unsigned short*>(const_cast<half_t*>(a.k)) + row * a.k_stride_b + at * a.k_stride_s +
            head_kv * a.k_stride_h;
      unsigned short* const vc = reinterpret_cast<unsigned short*>(const_cast<half_t*>(a.v)) + row * a.v_stride_b +
                                 at * a.v_stride_s + head_kv * a.v_stride_h;
      vc[d] = vn[d];
      pos = p;
    } else {
      const int i = (e - keys) / D, r = r0 + i, head = head_kv * (a.heads_q / a.heads_kv) + r / a.seq_q,
                p = r % a.seq_q;
      d = e - keys - i * D;
      src = reinterpret_cast<const unsigned short*>(a.q_src) + b * a.qs_stride_b + head * a.qs_stride_h +
            p * a.qs_stride_s;
      dst = reinterpret_cast<unsigned short*>(const_cast<half_t*>(a.q)) + b * a.q_stride_b + head * a.q_stride_h +
            p * a.q_stride_s;
      pos = len + (a.q_local ? p : 0);
    }
    dst[d] = rope ? fa2_append_rotate<BF16>(a, src, d, rdna_min(pos, a.positions - 1), rope == 1) : src[d];
  }
  rdna_fence_release();  // the new keys and rotated queries, visible to this workgroup's loads
  rdna_block_sync();
  rdna_fence_acquire();
}

// FA2_DECODE_ALIBI_ROWS, the most rows a decode tile may hold to apply ALiBi, and FA2_DECODE_XF_CASES
// are the target's (variants.yaml's decode_alibi_rows and decode_xf_cases, in its prelude); the
// dispatch table carries the first to the runtime (families/_splitkv.py: alibi_rows).
#if !defined(FA2_DECODE_ALIBI_ROWS) || !defined(FA2_DECODE_XF_CASES)
#error "the platform's prelude defines FA2_DECODE_ALIBI_ROWS and FA2_DECODE_XF_CASES"
#endif

// The type T where C, else F.
template <bool C, class T, class F> struct rdna_if { using type = T; };
template <class T, class F> struct rdna_if<false, T, F> { using type = F; };

// XF: the score transforms' code compiled in (else the kernel serves calls without a softcap, ALiBi
// slopes or sinks alone: fa2_decode_kernel picks the copy).
template <class E, int D, int R, int BC, int NT, int LDS_BYTES, bool PAGED, bool XF = true, class Args>
RDNA_DEVICE void fa2_decode(const Args& a, unsigned char* lds) {
  constexpr int CPL = E::CPL;
  constexpr int LD = D / CPL;               // lanes holding values of a key: 16 bytes of its K and V each
  constexpr int L = rdna_pow2_ceil(LD);     // lanes per key, the last L - LD of them padding
  constexpr int NG = NT / L;  // lane groups
  constexpr int T = BC / NG;  // keys per group per step
  static_assert(D % CPL == 0 && L <= RDNA_WAVE_SIZE && (L & (L - 1)) == 0 && NT % L == 0 && BC % NG == 0, "lane groups");
  static_assert(LDS_BYTES == NT / RDNA_WAVE_SIZE * R * (D + 2) * (int)sizeof(float), "LDS layout");
  static_assert(R >= 1 && R <= L && (R & (R - 1)) == 0, "rows: a power of two, at most the lanes per key");

  // flash_attn_with_kvcache's append where this launch does it: first, while nothing else is held.
  if constexpr (E::LAYOUTS && XF) {  // (the copy without transforms is entered after it: fa2_decode_kernel)
    if (a.append_rows) fa2_decode_append<D, R, NT, PAGED, E::BF16>(a);
  }
  const int tid = rdna_thread_id(), grp = tid / L, lane = tid % L;
  const bool holds = LD == L || lane < LD;  // the lane holds values (not padding)
  const int at = holds ? lane : LD - 1;      // the 16 bytes of each row the lane loads
  const int group = a.heads_q / a.heads_kv;
  const int chunks = (group * a.seq_q + R - 1) / R;
  const int split = rdna_block_id_x() / chunks, r0 = rdna_block_id_x() % chunks * R;
  const int head_kv = rdna_block_id_y();
  const long long b = rdna_block_id_z();

  // The batch's query rows and keys: packed (cu_seqlens), cache lengths, or the whole tensors.
  const Fa2Span qs = E::LAYOUTS ? fa2_query_rows(a, b) : Fa2Span{0, a.seq_q};
  const long long q0 = qs.first;
  const int sq = qs.count;
  const int rows = group * sq;
  if (r0 >= rows) {  // a short sequence of a packed batch: no row here, in any slice (none counts)
    fa2_decode_zero_rows_past_sequences<E, D, NT, PAGED>(a);
    return;
  }
  // A paged cache is addressed through the block table alone (no packed keys, no batch indices).
  const bool packed_keys = E::LAYOUTS && !PAGED && a.cu_seqlens_k;
  const Fa2Span keys = packed_keys ? fa2_packed_span(a.cu_seqlens_k, b, a.total_k) : Fa2Span{0, a.seq_k};
  const long long key0 = keys.first;
  const int cap = keys.count;
  // flash_attn_with_kvcache's append in this launch (E::LAYOUTS kernels, append_rows new keys per
  // sequence): seqused_k holds cache_seqlens, bounded so that the new keys fit, and the keys are
  // those plus the new ones (fa2_decode_append writes them).
  const int appended = fa2_decode_appended<E>(a);
  const int n = E::LAYOUTS && a.seqused_k ? fa2_count(a.seqused_k[b], cap - appended) + appended : cap;
  const DecodeKv<Args, PAGED> kv(a, E::LAYOUTS && !PAGED && a.cache_batch_idx ? fa2_row(a.cache_batch_idx[b], a.kv_rows) : b,
                                 key0, head_kv);
  const WindowMask<Args, true, true> mask{a, n, sq};
  const typename E::Scales scales = E::scales(a, b, head_kv);
  // ALiBi's per-row slope and distances only where a workgroup holds at most FA2_DECODE_ALIBI_ROWS
  // rows: on AMD and Pascal targets they cost the four-row tiles a wave, and the runtime gives ALiBi
  // calls smaller tiles there.
  using Xf = typename E::template Transform<Args, (R <= FA2_DECODE_ALIBI_ROWS)>;
  const typename rdna_if<XF, Xf, NoScoreTransform<Args>>::type xf{a};

  // This workgroup's rows: query head head_kv * group + r / sq at position r % sq. Rows past the
  // last (a short final chunk) repeat it; they are computed and never written.
  int first = sq, last = -1;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = rdna_min(r0 + i, rows - 1);
    if (r0 + i < rows) first = rdna_min(first, r % sq), last = rdna_max(last, r % sq);
  }
  const int live = rdna_min(R, rows - r0);  // rows i < live exist (the same in every lane)

  // Each key's R partial scores are reduced over the L lanes by halving: a lane keeps half of its
  // rows and adds its partner's half of them, until it holds one row's score ("its own" row: the
  // top log2(R) bits of its lane number), then sums that one over the remaining lanes. R - 1 +
  // log2(L / R) shuffles per key rather than R log2(L), and one row's softmax per lane. Each lane
  // keeps its rows in its own order, slot d holding row own ^ d, so that every exchange is a
  // butterfly with a lane-independent mask: slot d of lane x ^ (d * L / R) is its own row.
  constexpr int SPAN = L / R;  // lanes per row once reduced
  const int own = lane / SPAN;
  const int own_r = rdna_min(r0 + own, rows - 1);
  const int own_pos = own_r % sq;
  const float own_qs = E::query_scale(a, b, head_kv * group + own_r / sq, q0 + own_pos);

  // Each lane's CPL values of each row of Q, in the lane's order.
  typename E::Q qf[R];
#pragma unroll
  for (int d = 0; d < R; ++d) {
    const int r = rdna_min(r0 + (own ^ d), rows - 1), head = head_kv * group + r / sq;
    const auto* src = a.q + b * a.q_stride_b + head * a.q_stride_h + (q0 + r % sq) * a.q_stride_s;
    qf[d] = E::query(holds ? rdna_load16(src + CPL * lane) : u32x4{0u, 0u, 0u, 0u});
  }

  // This slice of the keys the rows can see.
  const int lo = mask.key_lo(first), hi = mask.key_hi(last);
  const int per = ((rdna_max(hi - lo, 0) + a.splits - 1) / a.splits + BC - 1) / BC * BC;
  const int s_lo = lo + split * per, s_hi = rdna_min(hi, s_lo + per);

  float m = -__builtin_inff(), l = 0.f, o[R][CPL];  // m, l: the own row's; o: slot order
#pragma unroll
  for (int d = 0; d < R; ++d) {
#pragma unroll
    for (int c = 0; c < CPL; ++c) o[d][c] = 0.f;
  }

  const u32x4 zero = {0u, 0u, 0u, 0u};
  // Each step's loads are issued one step ahead, so their latency overlaps the previous step; a
  // paged cache's page numbers (pg) one step before those.
  u32x4 kc[T], vc[T];
  float ks[T];
  int pg[T];
  auto pages_of = [&](int k0) {
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int key = k0 + t * NG + grp;
      pg[t] = PAGED && key < s_hi ? kv.page(key) : 0;
    }
  };
  auto load = [&](int k0, u32x4 (&kd)[T], u32x4 (&vd)[T], float (&sd)[T]) {
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const int key = k0 + t * NG + grp;
      kd[t] = key < s_hi ? rdna_load16(kv.key(key, pg[t]) + CPL * at) : zero;
      vd[t] = key < s_hi ? rdna_load16(kv.value(key, pg[t]) + CPL * at) : zero;
      sd[t] = key < s_hi ? scales.key(key) : 1.f;  // 1: folds away for fp16
    }
  };
  if (s_lo < s_hi) {
    pages_of(s_lo);
    load(s_lo, kc, vc, ks);
    pages_of(s_lo + BC);
  }
#pragma unroll 1
  for (int k0 = s_lo; k0 < s_hi; k0 += BC) {
    u32x4 kn[T], vn[T];
    float ksn[T];
    if (k0 + BC < s_hi) {
      load(k0 + BC, kn, vn, ksn);
      pages_of(k0 + 2 * BC);
    }
    const bool whole = k0 + BC <= s_hi && mask.template whole<BC>(k0, first, last);
    // The own row's score of each key (each key's K converted once for every row).
    float s[T];
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const typename E::K kf = E::key(holds ? kc[t] : zero);  // a padding lane's keys: zeros
      float acc[R];
#pragma unroll
      for (int d = 0; d < R; ++d) acc[d] = E::dot(qf[d], kf);
#pragma unroll
      for (int n = R, x = L / 2; n > 1; n >>= 1, x >>= 1) {
#pragma unroll
        for (int d = 0; d < n / 2; ++d) acc[d] += rdna_shfl_xor(acc[d + n / 2], x);
      }
#pragma unroll
      for (int x = SPAN / 2; x >= 1; x >>= 1) acc[0] += rdna_shfl_xor(acc[0], x);
      const int key = k0 + t * NG + grp;
      const float score = acc[0] * (own_qs * ks[t]);
      s[t] = whole || (key < s_hi && mask.visible(key, own_pos, mask.diag(own_pos))) ? mask.scale(score)
                                                                                      : -__builtin_inff();
    }
    // The score transforms of the own row's visible scores. With FA2_DECODE_XF_CASES (the target's)
    // in one copy per case, picked by uniform branches: ALiBi or not (a softcap alone computes no
    // slope or distance), and a step whose keys every row sees (no masked score to keep at -inf) or
    // not. Without, one copy for all (GCN's one-row tiles spilled SGPRs with the copies).
    if (xf.enabled()) {
      auto transform = [&](auto alibi, auto checked) {
        constexpr bool AL = decltype(alibi)::value, CHECKED = decltype(checked)::value;
        const float slope = AL ? xf.slope(b, head_kv * group + own_r / sq) : 0.f;
        const float dist0 = AL ? (float)(k0 + grp - mask.diag(own_pos)) : 0.f;  // the distances: dist0 plus a constant
#pragma unroll
        for (int t = 0; t < T; ++t)
          if (!CHECKED || s[t] != -__builtin_inff()) s[t] = xf.apply(s[t], slope, AL ? dist0 + (float)(t * NG) : 0.f);
      };
      if constexpr (!FA2_DECODE_XF_CASES) {
        transform(rdna_bool<true>{}, rdna_bool<true>{});  // the slope is 0 without ALiBi
      } else if (xf.alibi()) {
        if (whole)
          transform(rdna_bool<true>{}, rdna_bool<false>{});
        else
          transform(rdna_bool<true>{}, rdna_bool<true>{});
      } else if (whole) {
        transform(rdna_bool<false>{}, rdna_bool<false>{});
      } else {
        transform(rdna_bool<false>{}, rdna_bool<true>{});
      }
    }
    // The own row's softmax step; every slot's rescale factor and probabilities come from the
    // lanes that own those rows. The reference m moves only where a score passes it by more than
    // FA2_RESCALE_SLACK (fa2_reference_moves); a reference that did not move rescales by exactly 1:
    // skipped.
    float tile_max = -__builtin_inff();
#pragma unroll
    for (int t = 0; t < T; ++t) tile_max = rdna_fmax(tile_max, s[t]);
    const float m_new = fa2_reference_moves(m, tile_max) ? tile_max : m;
    const float m_ref = m_new == -__builtin_inff() ? 0.f : m_new;
    float alpha[R];
    alpha[0] = rdna_exp2(m - m_ref);
    m = m_new;
#pragma unroll
    for (int d = 1; d < R; ++d) alpha[d] = rdna_shfl_xor(alpha[0], d * SPAN);
    bool grew = false;
#pragma unroll
    for (int d = 0; d < R; ++d) grew |= alpha[d] != 1.f;
    if (grew) {
#pragma unroll
      for (int d = 0; d < R; ++d) {
#pragma unroll
        for (int c = 0; c < CPL; ++c) o[d][c] *= alpha[d];
      }
    }
    l *= alpha[0];
#pragma unroll
    for (int t = 0; t < T; ++t) {
      float vf[CPL];
      E::values(vc[t], vf);
      float p[R];
      p[0] = rdna_exp2(s[t] - m_ref);
      l += p[0];
#pragma unroll
      for (int d = 1; d < R; ++d) p[d] = rdna_shfl_xor(p[0], d * SPAN);
#pragma unroll
      for (int d = 0; d < R; ++d) {
#pragma unroll
        for (int c = 0; c < CPL; ++c) o[d][c] = rdna_fma(p[d], vf[c], o[d][c]);
      }
    }
#pragma unroll
    for (int t = 0; t < T; ++t) kc[t] = kn[t], vc[t] = vn[t], ks[t] = ksn[t];
  }

  // The lane groups of one wave merge first, by shuffles (the lane x ^ L of the next group holds
  // the same rows in the same slots), so that LDS holds one (o, m, l) per wave: an LDS footprint
  // per wave, not per lane group, keeps wave64 targets at the occupancy their registers allow.
  constexpr int GW = RDNA_WAVE_SIZE / L;  // lane groups per wave
  static_assert(NT % RDNA_WAVE_SIZE == 0, "whole waves");
#pragma unroll
  for (int x = L; x < L * GW; x <<= 1) {
    const float m_o = rdna_shfl_xor(m, x), l_o = rdna_shfl_xor(l, x);
    const float m_new = rdna_fmax(m, m_o);
    const float ref = m_new == -__builtin_inff() ? 0.f : m_new;
    float mine[R], theirs[R];
    mine[0] = rdna_exp2(m - ref);
    theirs[0] = rdna_exp2(m_o - ref);
#pragma unroll
    for (int d = 1; d < R; ++d) mine[d] = rdna_shfl_xor(mine[0], d * SPAN), theirs[d] = rdna_shfl_xor(theirs[0], d * SPAN);
    m = m_new;
    l = l * mine[0] + l_o * theirs[0];
#pragma unroll
    for (int d = 0; d < R; ++d) {
#pragma unroll
      for (int c = 0; c < CPL; ++c) o[d][c] = rdna_fma(rdna_shfl_xor(o[d][c], x), theirs[d], o[d][c] * mine[d]);
    }
  }

  // The waves meet in LDS: o [NW][R][D], then (m, l) [NW][R].
  constexpr int NW = NT / RDNA_WAVE_SIZE;
  const int wave = tid / RDNA_WAVE_SIZE;
  float* const ol = reinterpret_cast<float*>(lds);
  float* const ml = ol + NW * R * D;
  if (grp % GW == 0) {
#pragma unroll
    for (int d = 0; d < R; ++d)
      if (holds) __builtin_memcpy(__builtin_assume_aligned(ol + (wave * R + (own ^ d)) * D + CPL * lane, 16), o[d], sizeof(o[d]));
    if (lane % SPAN == 0) ml[2 * (wave * R + own)] = m, ml[2 * (wave * R + own) + 1] = l;
  }
  rdna_block_sync();
  for (int item = tid; item < live * LD; item += NT) {
    const int i = item / LD, c0 = item % LD * CPL, r = r0 + i;
    const int head = head_kv * group + r / sq, p = r % sq;
    float ref, acc[CPL];
    float sum = fa2_merge_partials(ml + 2 * i, 2 * R, ol + i * D + c0, R * D, NW, acc, ref);
#pragma unroll
    for (int c = 0; c < CPL; ++c) acc[c] *= scales.value(c0 + c);
    // Unsplit, the row's sink joins here; split, where the slices are merged (below), once.
    if (!a.part_o && xf.sinks()) fa2_join_sink(xf.sink(head), sum, ref, acc);
    if (a.part_o) {  // one slice of several: the normalised partial row and its log2-domain LSE
      const long long row = ((split * a.batch + b) * a.heads_q + head) * (long long)a.seq_q + p;
      const float inv = fa2_row_scale(sum);
#pragma unroll
      for (int c = 0; c < CPL; ++c) acc[c] *= inv;
      __builtin_memcpy(__builtin_assume_aligned(a.part_o + row * D + c0, 16), acc, sizeof(acc));
      if (c0 == 0) a.part_lse[row] = fa2_row_lse2(sum, ref);
    } else {
      fa2_store_final_row<CPL, E::BF16>(a, b, head, q0 + p, c0, acc, sum, ref);
    }
  }
  fa2_decode_zero_rows_past_sequences<E, D, NT, PAGED>(a);
  if (!a.part_o) return;

  // Split: the last slice of this (row chunk, K/V head, batch) to finish merges every slice's
  // partial rows into the output. Each workgroup counts itself in counters[chunk, K/V head,
  // batch] once its partial rows are visible to the device; the one that counts last (it sees
  // splits - 1) resets the count to 0 for the next launch and merges. Its threads form GM groups of
  // R * LD (row, 16-byte column) items; group g merges slices g, g + GM, ... against its own
  // running maximum, several slices' loads in flight at once, and the groups meet in LDS as the
  // waves did above (GM <= NW, so the same regions hold them).
  rdna_fence_release();  // this thread's partial rows, visible to every workgroup
  rdna_block_sync();     // every thread's
  // The fields only the merge reads, read again here (RDNA_ARGS_AGAIN), so that they are not held in
  // scalar registers across the key loop: GCN's tightest tiles spilled scalar registers otherwise.
  RDNA_ARGS_AGAIN(Args, ap, a);
  unsigned* const last_flag = reinterpret_cast<unsigned*>(lds);
  if (tid == 0) {
    unsigned* const count = ap->counters + (b * ap->heads_kv + head_kv) * chunks + r0 / R;
    const unsigned last = rdna_atomic_add(count, 1u) == (unsigned)ap->splits - 1u;
    if (last) *count = 0u;  // every slice has counted
    *last_flag = last;
  }
  rdna_block_sync();
  if (!*last_flag) return;
  rdna_fence_acquire();  // the other slices' partial rows
  constexpr int ITEMS = R * LD;
  constexpr int GM = ITEMS >= NT ? 1 : rdna_min(NT / ITEMS, NW);
  const int g = tid / ITEMS, item = tid % ITEMS, i = item / LD, c0 = item % LD * CPL;
  const bool merges = g < GM && i < live;
  const long long total = (long long)ap->batch * ap->heads_q * ap->seq_q;
  const int r = r0 + rdna_min(i, live - 1), head = head_kv * group + r / sq, p = r % sq;
  const long long row = (b * ap->heads_q + head) * (long long)ap->seq_q + p;
  float mx = -__builtin_inff(), sum = 0.f, acc[CPL];
#pragma unroll
  for (int c = 0; c < CPL; ++c) acc[c] = 0.f;
  // Slices that saw no key (LSE -inf) weigh nothing; a NaN LSE makes the row NaN.
#pragma unroll 4
  for (int s = g; merges && s < ap->splits; s += GM) {
    const float lse = ap->part_lse[s * total + row];
    float part[CPL];
    __builtin_memcpy(part, __builtin_assume_aligned(ap->part_o + (s * total + row) * D + c0, 16), sizeof(part));
    const float m_new = rdna_fmax(mx, lse);
    const float ref = m_new == -__builtin_inff() ? 0.f : m_new;
    const float keep = rdna_exp2(mx - ref), w = rdna_exp2(lse - ref);
    mx = m_new;
    sum = sum * keep + w;
#pragma unroll
    for (int c = 0; c < CPL; ++c) acc[c] = rdna_fma(part[c], w, acc[c] * keep);
  }
  if (GM > 1) {  // the groups meet: values [GM][R][D], then (maximum, sum) [GM][R]
    rdna_block_sync();  // the flag read
    if (merges) {
      __builtin_memcpy(__builtin_assume_aligned(ol + (g * R + i) * D + c0, 16), acc, sizeof(acc));
      if (c0 == 0) ml[2 * (g * R + i)] = mx, ml[2 * (g * R + i) + 1] = sum;
    }
    rdna_block_sync();
    if (g != 0 || !merges) return;
    float ref;
    sum = fa2_merge_partials(ml + 2 * i, 2 * R, ol + i * D + c0, R * D, GM, acc, ref);
    mx = ref;
  }
  if (!merges) return;
  float ref = mx == -__builtin_inff() ? 0.f : mx;
  if (xf.sinks()) fa2_join_sink(xf.sink(head), sum, ref, acc);  // the row's sink, once
  fa2_store_final_row<CPL, E::BF16>(a, b, head, q0 + p, c0, acc, sum, ref);
}

// A decode kernel's body. With FA2_DECODE_XF_CASES (the target's), in two copies picked once per
// launch by a uniform branch: one for calls with a softcap, ALiBi slopes or sinks, and one compiled
// without any transform code for the calls without (most calls). Measured on sm_90
// (tuning/results/h200_decode.md): in the one copy, the transforms' code, unused, cost plain calls
// of the four-row tiles 15-19% (GQA 32/8 at batch 8: 88.6 against 74.7 us), its one-row tiles
// nothing. Where the cases are not split (the AMD and Pascal targets, whose timing is not measured
// here), one copy serves every call, as the audit has it.
template <class E, int D, int R, int BC, int NT, int LDS_BYTES, bool PAGED, class Args>
RDNA_DEVICE void fa2_decode_kernel(const Args& a, unsigned char* lds) {
  if constexpr (FA2_DECODE_XF_CASES && E::template Transform<Args, false>::ANY) {
    if (a.softcap_log2 != 0.f || a.alibi_slopes || a.sinks) {
      fa2_decode<E, D, R, BC, NT, LDS_BYTES, PAGED, true>(a, lds);
    } else {
      if constexpr (E::LAYOUTS) {
        if (a.append_rows) fa2_decode_append<D, R, NT, PAGED, E::BF16>(a);
      }
      fa2_decode<E, D, R, BC, NT, LDS_BYTES, PAGED, false>(a, lds);
    }
  } else {
    fa2_decode<E, D, R, BC, NT, LDS_BYTES, PAGED, true>(a, lds);
  }
}
