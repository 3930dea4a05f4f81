// Tile helpers shared by the attention kernels: 16-byte global and LDS moves, register-tile
// products. Written against the intrinsics layer and a pairs policy P (pairs.h) only.
#pragma once

template <typename T>
RDNA_DEVICE constexpr T rdna_min(T a, T b) { return a < b ? a : b; }
template <typename T>
RDNA_DEVICE constexpr T rdna_max(T a, T b) { return a < b ? b : a; }

// 16-byte global loads; the runtime guarantees 16-byte aligned rows.
RDNA_DEVICE u32x4 rdna_load16(const half_t* p) { return *reinterpret_cast<const u32x4*>(p); }
RDNA_DEVICE u32x4 rdna_load16(const signed char* p) { return *reinterpret_cast<const u32x4*>(p); }

RDNA_DEVICE unsigned rdna_pack_half2(float lo, float hi) {
  return __builtin_bit_cast(unsigned short, (half_t)lo) |
         ((unsigned)__builtin_bit_cast(unsigned short, (half_t)hi) << 16);
}

// Items per lane per access: the largest power of two up to C that divides N (C items = 16 bytes).
template <int N, int C>
constexpr int rdna_chunk = N % C == 0 ? C : rdna_chunk<N, C / 2>;
template <int N>
constexpr int rdna_chunk<N, 1> = 1;

// N pairs in chunks of C (one access each): chunk c at src + c * stride. With src = base + lane * C
// and stride = lanes * C, the lanes of a wave read consecutive addresses: no bank conflicts.
template <int N, int C, typename T>
RDNA_DEVICE void rdna_lds_read(T (&dst)[N], const T* src, int stride) {
#pragma unroll
  for (int c = 0; c < N / C; ++c) {
    const void* chunk = __builtin_assume_aligned(src + c * stride, C * sizeof(T));
    __builtin_memcpy(&dst[c * C], chunk, C * sizeof(T));
  }
}

// acc[i][j] += a[i] . b[j]: one register tile step, every loaded pair used M or N times.
template <typename P, int M, int N>
RDNA_DEVICE void rdna_outer_product(float (&acc)[M][N], const typename P::pair_t (&a)[M],
                                    const typename P::pair_t (&b)[N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) acc[i][j] = P::dot(a[i], b[j], acc[i][j]);
}

// Eight consecutive fp16 values (a 16-byte chunk) of each of K consecutive rows, transposed into
// four rows of a pair tile (pairs.h): rows row .. row + 3, columns [col, col + K), one run per row.
template <typename P, int K>
RDNA_DEVICE void rdna_store_columns(typename P::pair_t* tile, int S, int row, int col, const u32x4 (&chunks)[K]) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    typename P::pair_t run[K];
#pragma unroll
    for (int k = 0; k < K; ++k) run[k] = P::from_halves(chunks[k][w]);
    P::template store_run<K>(tile, S, row + w, col, run);
  }
}

// N pairs of tile row `row` (pairs.h) in runs of C: run c at columns [col + c * col_stride, + C).
// With col = lane * C and col_stride = lanes * C, the lanes of a wave read consecutive addresses.
template <typename P, int N, int C>
RDNA_DEVICE void rdna_read_pairs(typename P::pair_t (&dst)[N], const typename P::pair_t* tile, int S, int row, int col,
                                 int col_stride) {
#pragma unroll
  for (int c = 0; c < N / C; ++c) P::template load_run<C>(&dst[c * C], tile, S, row, col + c * col_stride);
}

// Two-row staging, split so the global loads of a tile can be in flight while the previous step
// computes: N fp16 values (N / 2 words) of key rows `key` and `key + 1`, zero where a row is absent.
// The words stay as loaded until the store: splitting them into halves here would wait for the loads.
template <int N>
RDNA_DEVICE void rdna_load_key_rows(unsigned (&a)[N / 2], unsigned (&b)[N / 2], const half_t* row0, const half_t* row1,
                                    bool has0, bool has1) {
#pragma unroll
  for (int w = 0; w < N / 2; ++w) a[w] = b[w] = 0u;
  if (has0) __builtin_memcpy(a, __builtin_assume_aligned(row0, N * sizeof(half_t)), N * sizeof(half_t));
  if (has1) __builtin_memcpy(b, __builtin_assume_aligned(row1, N * sizeof(half_t)), N * sizeof(half_t));
}

// ... then stored as N (key, key + 1) pairs at columns [col, col + N) of pair-tile row `row`, one
// run (N = the policy's CHUNK), so consecutive lanes taking consecutive column groups store to
// consecutive addresses.
template <typename P, int N>
RDNA_DEVICE void rdna_store_key_pairs(typename P::pair_t* tile, int S, int row, int col, const unsigned (&a)[N / 2],
                                      const unsigned (&b)[N / 2]) {
  typename P::pair_t pairs[N];
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const half2_t x = __builtin_bit_cast(half2_t, a[e / 2]), y = __builtin_bit_cast(half2_t, b[e / 2]);
    pairs[e] = P::join(e % 2 ? x.y : x.x, e % 2 ? y.y : y.x);
  }
  P::template store_run<N>(tile, S, row, col, pairs);
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
