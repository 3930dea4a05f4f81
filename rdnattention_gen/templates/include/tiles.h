// Tile helpers shared by the attention kernels: 16-byte global and LDS moves, register-tile
// products. Written against the intrinsics layer and a tile policy P (an element type in an LDS
// layout, pairs.h) only.
#pragma once

template <typename T>
RDNA_DEVICE constexpr T rdna_min(T a, T b) { return a < b ? a : b; }
template <typename T>
RDNA_DEVICE constexpr T rdna_max(T a, T b) { return a < b ? b : a; }

// 16-byte global loads; the runtime guarantees 16-byte aligned rows.
RDNA_DEVICE u32x4 rdna_load16(const half_t* p) { return *reinterpret_cast<const u32x4*>(p); }
RDNA_DEVICE u32x4 rdna_load16(const signed char* p) { return *reinterpret_cast<const u32x4*>(p); }

// bf16 values: the top 16 bits of an fp32 value, in integer operations only (no target here has a
// bf16 instruction the kernels use, and the host has no runtime for the compilers' bf16 type).
// Widening one is a 16-bit shift, or a mask for the upper value of a word; narrowing rounds to
// nearest even, a NaN staying a (quiet) NaN.
RDNA_DEVICE unsigned rdna_bf16_bits(float x) {
  const unsigned u = __builtin_bit_cast(unsigned, x);
  return (x != x ? u | 0x400000u : u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
RDNA_DEVICE float rdna_bf16_lo(unsigned w) { return __builtin_bit_cast(float, w << 16); }
RDNA_DEVICE float rdna_bf16_hi(unsigned w) { return __builtin_bit_cast(float, w & 0xffff0000u); }
RDNA_DEVICE unsigned rdna_pack_bf16x2(float lo, float hi) { return rdna_bf16_bits(lo) | (rdna_bf16_bits(hi) << 16); }

// One bf16 value in memory (an element of a bf16 pair tile: RoPE reads and writes it as a float).
struct rdna_bf16 {
  unsigned short bits;
  rdna_bf16() = default;
  RDNA_METHOD rdna_bf16(float x) : bits((unsigned short)rdna_bf16_bits(x)) {}
  RDNA_METHOD operator float() const { return rdna_bf16_lo(bits); }
};

RDNA_DEVICE unsigned rdna_pack_half2(float lo, float hi) {
  return __builtin_bit_cast(unsigned short, (half_t)lo) |
         ((unsigned)__builtin_bit_cast(unsigned short, (half_t)hi) << 16);
}

// a where A, else b: one name for either of two arrays of different types.
template <bool A, typename X, typename Y>
RDNA_DEVICE auto& rdna_pick(X& a, Y& b) {
  if constexpr (A)
    return a;
  else
    return b;
}

// Items per lane per access: the largest power of two up to C that divides N (C items = 16 bytes).
template <int N, int C>
constexpr int rdna_chunk = N % C == 0 ? C : rdna_chunk<N, C / 2>;
template <int N>
constexpr int rdna_chunk<N, 1> = 1;

// The least power of two at or above n (n >= 1).
RDNA_DEVICE constexpr int rdna_pow2_ceil(int n) { return n <= 1 ? 1 : 2 * rdna_pow2_ceil((n + 1) / 2); }

// acc[i][j] = a[i] . b[j] + acc[i][j]: one register tile step, every loaded pack used M or N times.
template <typename P, int M, int N, typename Acc>
RDNA_DEVICE void rdna_outer_product(Acc (&acc)[M][N], const typename P::pack_t (&a)[M],
                                    const typename P::pack_t (&b)[N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) acc[i][j] = P::dot(a[i], b[j], acc[i][j]);
}

// A 16-byte chunk (four packs) of each of K consecutive rows, transposed into four rows of a pack
// tile (pairs.h): rows row .. row + 3, columns [col, col + K), one run per row.
template <typename P, int K>
RDNA_DEVICE void rdna_store_columns(typename P::pack_t* tile, int S, int row, int col, const u32x4 (&chunks)[K]) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    typename P::pack_t run[K];
#pragma unroll
    for (int k = 0; k < K; ++k) run[k] = P::from_word(chunks[k][w]);
    P::template store_run<K>(tile, S, row + w, col, run);
  }
}

// N packs of tile row `row` (pairs.h) in runs of C: run c at columns [col + c * col_stride, + C).
// With col = lane * C and col_stride = lanes * C, the lanes of a wave read consecutive addresses.
template <typename P, int N, int C>
RDNA_DEVICE void rdna_read_packs(typename P::pack_t (&dst)[N], const typename P::pack_t* tile, int S, int row, int col,
                                 int col_stride) {
#pragma unroll
  for (int c = 0; c < N / C; ++c) P::template load_run<C>(&dst[c * C], tile, S, row, col + c * col_stride);
}

// Value staging, two key rows at a time, split so the global loads of a tile can be in flight while
// the previous step computes: the W words of key rows `row0` and `row1`, zero where a row is absent.
// The words stay as loaded until the store: splitting them into their values here would wait for
// the loads.
template <int W, typename T>
RDNA_DEVICE void rdna_load_key_rows(unsigned (&a)[W], unsigned (&b)[W], const T* row0, const T* row1, bool has0,
                                    bool has1) {
#pragma unroll
  for (int w = 0; w < W; ++w) a[w] = b[w] = 0u;
  if (has0) __builtin_memcpy(a, __builtin_assume_aligned(row0, 4 * W), 4 * W);
  if (has1) __builtin_memcpy(b, __builtin_assume_aligned(row1, 4 * W), 4 * W);
}

// ... then the R = PACK rows' words stored as N packs (one per column, its values from the R rows)
// at columns [col, col + N) of pack-tile row `row`, in runs of the layout's CHUNK, so consecutive
// lanes taking consecutive column groups store to consecutive addresses.
template <typename P, int N, int R, int W>
RDNA_DEVICE void rdna_store_key_packs(typename P::pack_t* tile, int S, int row, int col,
                                      const unsigned (&words)[R][W]) {
  constexpr int C = P::CHUNK;
  typename P::pack_t packs[N];
  P::pack_columns(words, packs);
#pragma unroll
  for (int c = 0; c < N / C; ++c) P::template store_run<C>(tile, S, row, col + c * C, packs + c * C);
}

// One output row slice held in chunks of C columns: chunk c covers columns [c * stride, c * stride + C)
// of `out`. Values are scaled by `scale` and stored as fp16 (BF16: as bf16, in the same 16-bit
// words), one store per chunk. LIMITED: only the chunks that start before column `avail` (the rest
// are padding).
template <int N, int C, bool LIMITED = false, bool BF16 = false>
RDNA_DEVICE void rdna_store_row(half_t* out, int stride, const float (&o)[N], float scale, int avail = 0) {
#pragma unroll
  for (int c = 0; c < N / C; ++c) {
    if (LIMITED && c * stride >= avail) break;
    unsigned words[C / 2];
#pragma unroll
    for (int w = 0; w < C / 2; ++w)
      words[w] = BF16 ? rdna_pack_bf16x2(o[c * C + 2 * w] * scale, o[c * C + 2 * w + 1] * scale)
                      : rdna_pack_half2(o[c * C + 2 * w] * scale, o[c * C + 2 * w + 1] * scale);
    __builtin_memcpy(__builtin_assume_aligned(out + c * stride, C * sizeof(half_t)), words, sizeof(words));
  }
}
