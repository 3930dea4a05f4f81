// Helpers shared by the attention kernels; written against the intrinsics layer only.
#pragma once

template <typename T>
RDNA_DEVICE constexpr T rdna_min(T a, T b) { return a < b ? a : b; }
template <typename T>
RDNA_DEVICE constexpr T rdna_max(T a, T b) { return a < b ? b : a; }

RDNA_DEVICE half2_t rdna_h2(unsigned w) { return __builtin_bit_cast(half2_t, w); }

// Eight fp16 products (one 16-byte chunk of each operand) into an fp32 accumulator.
RDNA_DEVICE float rdna_dot8(u32x4 a, u32x4 b, float acc) {
  acc = rdna_dot2(rdna_h2(a.x), rdna_h2(b.x), acc);
  acc = rdna_dot2(rdna_h2(a.y), rdna_h2(b.y), acc);
  acc = rdna_dot2(rdna_h2(a.z), rdna_h2(b.z), acc);
  return rdna_dot2(rdna_h2(a.w), rdna_h2(b.w), acc);
}

// 16-byte global accesses; the runtime guarantees 16-byte aligned rows.
RDNA_DEVICE u32x4 rdna_load16(const half_t* p) { return *reinterpret_cast<const u32x4*>(p); }
RDNA_DEVICE void rdna_store8(half_t* p, u32x2 v) { *reinterpret_cast<u32x2*>(p) = v; }

RDNA_DEVICE unsigned rdna_pack_half2(half_t lo, half_t hi) {
  return __builtin_bit_cast(unsigned short, lo) | ((unsigned)__builtin_bit_cast(unsigned short, hi) << 16);
}

// Low halves of a and b as one pair, then the high halves: two keys' values for one column.
RDNA_DEVICE unsigned rdna_interleave_lo(unsigned a, unsigned b) { return (a & 0xffffu) | (b << 16); }
RDNA_DEVICE unsigned rdna_interleave_hi(unsigned a, unsigned b) { return (a >> 16) | (b & 0xffff0000u); }

// RoPE on rows staged in LDS, in place: each thread owns whole (x1, x2) pairs. Row r holds
// position first + r % period and uses table row position + shift; rows at or past `limit` are
// padding and stay as they are.
template <int ROWS, int STRIDE, int NT>
RDNA_DEVICE void rdna_rope_lds(half_t* rows, const Fa2Args& a, int first, int period, int limit, int shift) {
  const int half_dim = a.rotary_dim / 2;
  for (int i = rdna_thread_id(); i < ROWS * half_dim; i += NT) {
    const int r = i / half_dim, j = i % half_dim;
    const int pos = first + r % period;
    if (pos >= limit) continue;
    const long long t = (long long)(pos + shift) * a.rotary_stride + j;
    const float c = a.rotary_cos[t], s = a.rotary_sin[t];
    half_t* row = rows + r * STRIDE;
    const int i1 = a.rotary_interleaved ? 2 * j : j;
    const int i2 = a.rotary_interleaved ? 2 * j + 1 : j + half_dim;
    const float x1 = (float)row[i1], x2 = (float)row[i2];
    row[i1] = (half_t)(x1 * c - x2 * s);
    row[i2] = (half_t)(x2 * c + x1 * s);
  }
}
