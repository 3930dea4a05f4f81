// FlashAttention-2 forward, fp16 in and out; softmax and both products accumulate in fp32.
//
// A workgroup owns BR query rows: BR/G consecutive positions of each of the G query heads
// that share one K/V head, so every staged K/V tile serves the whole GQA group. TR = NT/BR
// adjacent threads share a row: for Q.K^T each scores its own key pairs over the full head
// dim; for P.V each owns D/TR output columns.
//
// LDS (sizes match KernelSpec.lds_layout):
//   q    [BR][D+8]   fp16, staged once
//   kv   K tile [BC][D+8] fp16, then reused for the V tile [BC/2][D] as half2 key pairs,
//        so P.V runs on dot2 over two keys with fp32 accumulation
//   p    [BR][BC/2+4] half2 probabilities, written as whole 32-bit pairs
// RoPE, when asked for, rotates Q once and each K tile in LDS, right after staging.
#pragma once

template <int D, int G, int BR, int BC, int NT>
RDNA_DEVICE void fa2_f16_forward(const Fa2Args& a) {
  constexpr int TR = NT / BR;
  constexpr int RPH = BR / G;
  constexpr int DS = D / TR;
  constexpr int PAIRS = BC / 2;
  constexpr int PPT = PAIRS / TR;
  constexpr int QS = D + 8;
  constexpr int PS = PAIRS + 4;
  constexpr int KV_VECS = rdna_max(BC * QS / 8, PAIRS * D / 4);
  static_assert(NT % BR == 0 && (TR & (TR - 1)) == 0 && TR <= RDNA_WAVE_SIZE, "threads per row");
  static_assert(BR % G == 0 && D % 32 == 0 && DS % 4 == 0 && PAIRS % 4 == 0 && PAIRS % TR == 0, "tile shape");

  RDNA_SHARED u32x4 q_lds[BR * QS / 8];
  RDNA_SHARED u32x4 kv_lds[KV_VECS];
  RDNA_SHARED u32x4 p_lds[BR * PS / 4];
  unsigned* const p_words = reinterpret_cast<unsigned*>(p_lds);

  const int tid = rdna_thread_id();
  const int row = tid / TR;
  const int part = tid % TR;
  const int block_pos = rdna_block_id_x() * RPH;
  const int head0 = rdna_block_id_y() * G;
  const long long b = rdna_block_id_z();
  const int head_kv = head0 / (a.heads_q / a.heads_kv);
  const int offset = a.seq_k - a.seq_q;  // query i sits at key position i + offset

  // Keys any row of this block may see; tiles outside [key_lo, key_hi) are never visited.
  const int last_pos = rdna_min(a.seq_q, block_pos + RPH) - 1;
  const int key_lo = a.window_left < 0 ? 0 : rdna_max(0, block_pos + offset - a.window_left);
  const int key_hi = a.window_right < 0 ? a.seq_k
                                        : rdna_min(a.seq_k, last_pos + offset + a.window_right + 1);

  const half_t* q = a.q + b * a.q_stride_b;
  const half_t* k = a.k + b * a.k_stride_b + head_kv * a.k_stride_h;
  const half_t* v = a.v + b * a.v_stride_b + head_kv * a.v_stride_h;
  const u32x4 zero = {0u, 0u, 0u, 0u};

  for (int i = tid; i < BR * D / 8; i += NT) {
    const int r = i / (D / 8), c = i % (D / 8);
    const int pos = block_pos + r % RPH;
    const long long off = (head0 + r / RPH) * a.q_stride_h + (long long)pos * a.q_stride_s + c * 8;
    q_lds[r * QS / 8 + c] = pos < a.seq_q ? rdna_load16(q + off) : zero;
  }
  if (a.rotary_dim) {
    rdna_block_sync();
    rdna_rope_lds<BR, QS, NT>(reinterpret_cast<half_t*>(q_lds), a, block_pos, RPH, a.seq_q, offset);
  }

  const int my_pos = block_pos + row % RPH;
  const int my_diag = my_pos + offset;
  float o[DS];
#pragma unroll
  for (int d = 0; d < DS; ++d) o[d] = 0.f;
  float m = -__builtin_inff();
  float l = 0.f;

  for (int k0 = key_lo / BC * BC; k0 < key_hi; k0 += BC) {
    rdna_block_sync();  // the previous tile's V and P reads are done
    for (int i = tid; i < BC * D / 8; i += NT) {
      const int c = i / (D / 8), d8 = i % (D / 8);
      const int key = k0 + c;
      kv_lds[c * QS / 8 + d8] = key < a.seq_k ? rdna_load16(k + (long long)key * a.k_stride_s + d8 * 8) : zero;
    }
    rdna_block_sync();
    if (a.rotary_dim) {
      rdna_rope_lds<BC, QS, NT>(reinterpret_cast<half_t*>(kv_lds), a, k0, BC, a.seq_k, 0);
      rdna_block_sync();
    }

    // S = Q K^T for this thread's key pairs.
    float s[2 * PPT];
#pragma unroll
    for (int e = 0; e < 2 * PPT; ++e) s[e] = 0.f;
#pragma unroll 2
    for (int c = 0; c < D / 8; ++c) {
      const u32x4 qv = q_lds[row * QS / 8 + c];
#pragma unroll
      for (int i = 0; i < PPT; ++i) {
        const int pair = part + i * TR;
        s[2 * i] = rdna_dot8(qv, kv_lds[(2 * pair) * QS / 8 + c], s[2 * i]);
        s[2 * i + 1] = rdna_dot8(qv, kv_lds[(2 * pair + 1) * QS / 8 + c], s[2 * i + 1]);
      }
    }

    // Scale and mask in one place; masked scores are -inf.
    float tile_max = -__builtin_inff();
#pragma unroll
    for (int e = 0; e < 2 * PPT; ++e) {
      const int key = k0 + 2 * (part + (e / 2) * TR) + e % 2;
      const bool visible = key < a.seq_k && my_pos < a.seq_q &&
                           (a.window_left < 0 || key >= my_diag - a.window_left) &&
                           (a.window_right < 0 || key <= my_diag + a.window_right);
      s[e] = visible ? s[e] * a.scale_log2 : -__builtin_inff();
      tile_max = rdna_max(tile_max, s[e]);
    }
    for (int x = 1; x < TR; x <<= 1) tile_max = rdna_max(tile_max, rdna_shfl_xor(tile_max, x));

    // Online softmax. A row that has seen no key keeps m = -inf and exponentiates against 0.
    const float m_new = rdna_max(m, tile_max);
    const float m_ref = m_new == -__builtin_inff() ? 0.f : m_new;
    const float alpha = rdna_exp2(m - m_ref);
    m = m_new;
    l *= alpha;
#pragma unroll
    for (int d = 0; d < DS; ++d) o[d] *= alpha;
#pragma unroll
    for (int i = 0; i < PPT; ++i) {
      // The row sum uses the fp16 probabilities P.V multiplies, so the weights sum to one.
      const half_t p0 = (half_t)rdna_exp2(s[2 * i] - m_ref);
      const half_t p1 = (half_t)rdna_exp2(s[2 * i + 1] - m_ref);
      l += (float)p0 + (float)p1;
      p_words[row * PS + part + i * TR] = rdna_pack_half2(p0, p1);
    }

    rdna_block_sync();  // K reads are done; kv becomes the V tile
    for (int i = tid; i < PAIRS * D / 8; i += NT) {
      const int pair = i / (D / 8), d8 = i % (D / 8);
      const int key = k0 + 2 * pair;
      const u32x4 v0 = key < a.seq_k ? rdna_load16(v + (long long)key * a.v_stride_s + d8 * 8) : zero;
      const u32x4 v1 = key + 1 < a.seq_k ? rdna_load16(v + (long long)(key + 1) * a.v_stride_s + d8 * 8) : zero;
      const u32x4 lo = {rdna_interleave_lo(v0.x, v1.x), rdna_interleave_hi(v0.x, v1.x),
                        rdna_interleave_lo(v0.y, v1.y), rdna_interleave_hi(v0.y, v1.y)};
      const u32x4 hi = {rdna_interleave_lo(v0.z, v1.z), rdna_interleave_hi(v0.z, v1.z),
                        rdna_interleave_lo(v0.w, v1.w), rdna_interleave_hi(v0.w, v1.w)};
      kv_lds[(pair * D + d8 * 8) / 4] = lo;
      kv_lds[(pair * D + d8 * 8) / 4 + 1] = hi;
    }
    rdna_block_sync();

    // O += P V over key pairs: one dot2 per (pair, column).
    for (int pc = 0; pc < PAIRS / 4; ++pc) {
      const u32x4 pv = p_lds[row * PS / 4 + pc];
      const unsigned pw[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const half2_t pp = rdna_h2(pw[e]);
        const int base = ((pc * 4 + e) * D + part * DS) / 4;
#pragma unroll
        for (int dc = 0; dc < DS / 4; ++dc) {
          const u32x4 vv = kv_lds[base + dc];
          o[dc * 4 + 0] = rdna_dot2(pp, rdna_h2(vv.x), o[dc * 4 + 0]);
          o[dc * 4 + 1] = rdna_dot2(pp, rdna_h2(vv.y), o[dc * 4 + 1]);
          o[dc * 4 + 2] = rdna_dot2(pp, rdna_h2(vv.z), o[dc * 4 + 2]);
          o[dc * 4 + 3] = rdna_dot2(pp, rdna_h2(vv.w), o[dc * 4 + 3]);
        }
      }
    }
  }

  for (int x = 1; x < TR; x <<= 1) l += rdna_shfl_xor(l, x);
  if (my_pos >= a.seq_q) return;
  const int head = head0 + row / RPH;
  const float inv = l > 0.f ? 1.f / l : 0.f;  // a row that saw no key is zero
  half_t* out = a.o + b * a.o_stride_b + head * a.o_stride_h + (long long)my_pos * a.o_stride_s + part * DS;
#pragma unroll
  for (int dc = 0; dc < DS / 4; ++dc) {
    u32x2 w;
    w.x = rdna_pack_half2((half_t)(o[dc * 4 + 0] * inv), (half_t)(o[dc * 4 + 1] * inv));
    w.y = rdna_pack_half2((half_t)(o[dc * 4 + 2] * inv), (half_t)(o[dc * 4 + 3] * inv));
    rdna_store8(out + dc * 4, w);
  }
  if (a.lse && part == 0) {
    // Natural-log LSE of the scaled scores; m and l live in the log2 domain.
    const float ln2 = 0.6931471805599453f;
    a.lse[b * a.lse_stride_b + head * a.lse_stride_h + my_pos] = l > 0.f ? (m + rdna_log2(l)) * ln2 : -__builtin_inff();
  }
}
