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

// N pairs from 16-byte aligned LDS, 16 bytes at a time where the size allows.
template <int N>
RDNA_DEVICE void rdna_lds_read(rdna_pair_t (&dst)[N], const rdna_pair_t* src) {
  if constexpr ((N * sizeof(rdna_pair_t)) % 16 == 0) {
#pragma unroll
    for (int i = 0; i < (int)(N * sizeof(rdna_pair_t) / 16); ++i) {
      const u32x4 v = reinterpret_cast<const u32x4*>(src)[i];
      __builtin_memcpy(reinterpret_cast<unsigned char*>(dst) + 16 * i, &v, 16);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = src[i];
  }
}

// Eight consecutive fp16 values of one row (a 16-byte chunk) as four pairs down a column of a
// transposed tile: dst[0], dst[stride], dst[2 * stride], dst[3 * stride].
RDNA_DEVICE void rdna_store_column(rdna_pair_t* dst, int stride, u32x4 chunk) {
  dst[0] = rdna_pair_from_halves(chunk.x);
  dst[stride] = rdna_pair_from_halves(chunk.y);
  dst[2 * stride] = rdna_pair_from_halves(chunk.z);
  dst[3 * stride] = rdna_pair_from_halves(chunk.w);
}

// Eight columns of two consecutive key rows as eight (key, key + 1) pairs, whole pairs at a time.
RDNA_DEVICE void rdna_store_key_pairs(rdna_pair_t* dst, u32x4 row0, u32x4 row1) {
  const unsigned a[4] = {row0.x, row0.y, row0.z, row0.w};
  const unsigned b[4] = {row1.x, row1.y, row1.z, row1.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    dst[2 * w] = rdna_pair_from_halves((a[w] & 0xffffu) | (b[w] << 16));
    dst[2 * w + 1] = rdna_pair_from_halves((a[w] >> 16) | (b[w] & 0xffff0000u));
  }
}

// One output row slice: N fp32 values times `scale`, as fp16, 16 bytes at a time where aligned.
template <int N>
RDNA_DEVICE void rdna_store_row(half_t* out, const float (&o)[N], float scale) {
  if constexpr (N % 8 == 0) {
#pragma unroll
    for (int c = 0; c < N; c += 8) {
      const u32x4 w = {rdna_pack_half2(o[c] * scale, o[c + 1] * scale), rdna_pack_half2(o[c + 2] * scale, o[c + 3] * scale),
                       rdna_pack_half2(o[c + 4] * scale, o[c + 5] * scale), rdna_pack_half2(o[c + 6] * scale, o[c + 7] * scale)};
      *reinterpret_cast<u32x4*>(out + c) = w;
    }
  } else {
#pragma unroll
    for (int c = 0; c < N; c += 2) *reinterpret_cast<unsigned*>(out + c) = rdna_pack_half2(o[c] * scale, o[c + 1] * scale);
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
