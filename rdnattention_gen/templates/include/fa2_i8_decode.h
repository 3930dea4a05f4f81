// The split-KV decode kernel over int8 Q, K, V (family i8dec): fa2_decode.h with this element policy.
#pragma once

#include "fa2_decode.h"

// int8 keys (the i8dec family): products through the target's dot4, then the per-token scales of
// the query row and the key; V's per-channel scale applied once, at the end.
struct DecodeI8 {
  static constexpr int CPL = 16;
  static constexpr bool LAYOUTS = false;  // [batch, heads, seq, head_dim] tensors only (flash_attn_int8qk)
  static constexpr bool BF16 = false;     // the output's dtype: fp16
  template <class Args, bool>
  using Transform = NoScoreTransform<Args>;  // no score transforms
  typedef u32x4 Q;
  typedef u32x4 K;
  RDNA_DEVICE Q query(u32x4 c) { return c; }
  RDNA_DEVICE K key(u32x4 c) { return c; }
  RDNA_DEVICE float dot(const Q& q, const K& k) {
    return (float)rdna_dot4_i8((int)q.w, (int)k.w, rdna_dot4_i8((int)q.z, (int)k.z,
           rdna_dot4_i8((int)q.y, (int)k.y, rdna_dot4_i8((int)q.x, (int)k.x, 0))));
  }
  RDNA_DEVICE void values(u32x4 c, float (&v)[CPL]) {
    const signed char* x = reinterpret_cast<const signed char*>(&c);
#pragma unroll
    for (int e = 0; e < CPL; ++e) v[e] = (float)x[e];
  }
  template <class Args>
  RDNA_DEVICE float query_scale(const Args& a, long long b, int head, long long row) {
    return a.q_scale[b * a.q_scale_stride_b + head * a.q_scale_stride_h + row];
  }
  struct Scales {
    const float* k;  // the (batch, K/V head)'s per-token K scales
    const float* v;  // and per-channel V scales
    RDNA_METHOD float key(int i) const { return k[i]; }
    RDNA_METHOD float value(int c) const { return v[c]; }
  };
  template <class Args>
  RDNA_DEVICE Scales scales(const Args& a, long long b, int head_kv) {
    return Scales{a.k_scale + b * a.k_scale_stride_b + head_kv * a.k_scale_stride_h,
                  a.v_scale + b * a.v_scale_stride_b + head_kv * a.v_scale_stride_h};
  }
};
