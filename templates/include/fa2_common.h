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
RDNA_DEVICE void rdna_store16(half_t* p, u32x4 v) { *reinterpret_cast<u32x4*>(p) = v; }

RDNA_DEVICE unsigned rdna_pack_half2(half_t lo, half_t hi) {
  return __builtin_bit_cast(unsigned short, lo) | ((unsigned)__builtin_bit_cast(unsigned short, hi) << 16);
}

// Low halves of a and b as one pair, then the high halves: two keys' values for one column.
RDNA_DEVICE unsigned rdna_interleave_lo(unsigned a, unsigned b) { return (a & 0xffffu) | (b << 16); }
RDNA_DEVICE unsigned rdna_interleave_hi(unsigned a, unsigned b) { return (a >> 16) | (b & 0xffff0000u); }
