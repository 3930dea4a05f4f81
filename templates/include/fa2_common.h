// Helpers shared by the attention kernels; written against the intrinsics layer only.
#pragma once

template <typename T>
RDNA_DEVICE constexpr T rdna_min(T a, T b) { return a < b ? a : b; }
template <typename T>
RDNA_DEVICE constexpr T rdna_max(T a, T b) { return a < b ? b : a; }

// 16-byte global loads; the runtime guarantees 16-byte aligned rows.
RDNA_DEVICE u32x4 rdna_load16(const half_t* p) { return *reinterpret_cast<const u32x4*>(p); }

RDNA_DEVICE unsigned rdna_pack_half2(float lo, float hi) {
  return __builtin_bit_cast(unsigned short, (half_t)lo) |
         ((unsigned)__builtin_bit_cast(unsigned short, (half_t)hi) << 16);
}

// Pairs per lane per LDS access: the largest power of two that divides N and fits 16 bytes.
template <int N, int C = 16 / (int)sizeof(rdna_pair_t)>
constexpr int rdna_chunk = N % C == 0 ? C : rdna_chunk<N, C / 2>;
template <int N>
constexpr int rdna_chunk<N, 1> = 1;

// N pairs in chunks of C (one access each): chunk c at src + c * stride. With src = base + lane * C
// and stride = lanes * C, the lanes of a wave read consecutive addresses: no bank conflicts.
template <int N, int C>
RDNA_DEVICE void rdna_lds_read(rdna_pair_t (&dst)[N], const rdna_pair_t* src, int stride) {
#pragma unroll
  for (int c = 0; c < N / C; ++c) {
    const void* chunk = __builtin_assume_aligned(src + c * stride, C * sizeof(rdna_pair_t));
    __builtin_memcpy(&dst[c * C], chunk, C * sizeof(rdna_pair_t));
  }
}

// acc[i][j] += a[i] . b[j]: one register tile step, every loaded pair used M or N times.
template <int M, int N>
RDNA_DEVICE void rdna_outer_product(float (&acc)[M][N], const rdna_pair_t (&a)[M], const rdna_pair_t (&b)[N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) acc[i][j] = rdna_pair_dot(a[i], b[j], acc[i][j]);
}

// Eight consecutive fp16 values of one row (a 16-byte chunk) as four pairs down a column of a
// transposed tile: dst[0], dst[stride], dst[2 * stride], dst[3 * stride].
RDNA_DEVICE void rdna_store_column(rdna_pair_t* dst, int stride, u32x4 chunk) {
  dst[0] = rdna_pair_from_halves(chunk.x);
  dst[stride] = rdna_pair_from_halves(chunk.y);
  dst[2 * stride] = rdna_pair_from_halves(chunk.z);
  dst[3 * stride] = rdna_pair_from_halves(chunk.w);
}

// V staging, split so the global loads of a tile can be in flight while the previous step
// computes: columns [d, d + N) of key rows `key` and `key + 1` (zero past seq_k) ...
template <int N>
RDNA_DEVICE void rdna_load_key_rows(half_t (&a)[N], half_t (&b)[N], const half_t* row0, const half_t* row1,
                                    bool has0, bool has1) {
#pragma unroll
  for (int e = 0; e < N; ++e) a[e] = b[e] = (half_t)0.f;
  if (has0) __builtin_memcpy(a, __builtin_assume_aligned(row0, N * sizeof(half_t)), N * sizeof(half_t));
  if (has1) __builtin_memcpy(b, __builtin_assume_aligned(row1, N * sizeof(half_t)), N * sizeof(half_t));
}

// ... then stored as N (key, key + 1) pairs in one LDS store. N = 16 bytes / pair size, so
// consecutive lanes taking consecutive column groups store to consecutive addresses.
template <int N>
RDNA_DEVICE void rdna_store_key_pairs(rdna_pair_t* dst, const half_t (&a)[N], const half_t (&b)[N]) {
  rdna_pair_t pairs[N];
#pragma unroll
  for (int e = 0; e < N; ++e) pairs[e] = rdna_pair_from_halves(rdna_pack_half2((float)a[e], (float)b[e]));
  __builtin_memcpy(__builtin_assume_aligned(dst, 16), pairs, sizeof(pairs));
}

// One output row slice held in chunks of C columns: chunk c covers columns [c * stride, c * stride + C)
// of `out`. Values are scaled by `scale` and stored as fp16, one store per chunk.
template <int N, int C>
RDNA_DEVICE void rdna_store_row(half_t* out, int stride, const float (&o)[N], float scale) {
#pragma unroll
  for (int c = 0; c < N / C; ++c) {
    unsigned words[C / 2];
#pragma unroll
    for (int w = 0; w < C / 2; ++w) words[w] = rdna_pack_half2(o[c * C + 2 * w] * scale, o[c * C + 2 * w + 1] * scale);
    __builtin_memcpy(__builtin_assume_aligned(out + c * stride, C * sizeof(half_t)), words, sizeof(words));
  }
}

// RoPE on a transposed tile in LDS, in place: element (r, d) of pair array `tile` (row stride
// `stride` pairs) is component d % 2 of tile[(d / 2) * stride + r]. Each thread owns whole
// (x1, x2) pairs and writes single elements. Row r holds position first + r % period and uses
// table row position + shift; rows at or past `limit` are padding and stay as they are.
template <int ROWS, int NT>
RDNA_DEVICE void rdna_rope_lds(rdna_pair_t* tile, int stride, const Fa2Args& a, int first, int period, int limit,
                               int shift) {
  rdna_elem_t* const elems = reinterpret_cast<rdna_elem_t*>(tile);
  const int half_dim = a.rotary_dim / 2;
  for (int i = rdna_thread_id(); i < ROWS * half_dim; i += NT) {
    const int r = i % ROWS, j = i / ROWS;
    const int pos = first + r % period;
    if (pos >= limit) continue;
    const long long t = (long long)(pos + shift) * a.rotary_stride + j;
    const float c = a.rotary_cos[t], s = a.rotary_sin[t];
    const int d1 = a.rotary_interleaved ? 2 * j : j;
    const int d2 = a.rotary_interleaved ? 2 * j + 1 : j + half_dim;
    rdna_elem_t* const e1 = elems + 2 * ((d1 / 2) * stride + r) + d1 % 2;
    rdna_elem_t* const e2 = elems + 2 * ((d2 / 2) * stride + r) + d2 % 2;
    const float x1 = (float)*e1, x2 = (float)*e2;
    *e1 = (rdna_elem_t)(x1 * c - x2 * s);
    *e2 = (rdna_elem_t)(x2 * c + x1 * s);
  }
}
