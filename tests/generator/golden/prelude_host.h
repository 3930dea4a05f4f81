// @generated from templates/prelude_host.h.j2 for host
// Intrinsics layer for the CPU emulator: each GPU thread is a fiber (see rdna_host.h).
#pragma once
#include <cmath>

#include "rdna_host.h"

#define RDNA_WAVE_SIZE 32
#define RDNA_DEVICE static inline
#define RDNA_METHOD inline
#define RDNA_LDS_BYTES 65536
// LDS is the running workgroup's buffer (rdna_host::shared_memory). The never-touched .bss array
// beside it costs no memory: its symbol, "<kernel>::lds_extent", records the size for the audit.
#define RDNA_LDS(name, bytes) \
  static_assert((bytes) <= RDNA_LDS_BYTES, "LDS over the target's budget"); \
  [[gnu::used]] static unsigned char name##_extent[bytes]; \
  unsigned char* const name = rdna_host::shared_memory()
#define RDNA_KERNEL(threads) extern "C"
#define RDNA_KERNEL_WAVES(threads, waves) extern "C"
#define RDNA_REGISTER(name, args_type, threads) \
  static const rdna_host::Registrar name##_registrar( \
      #name, threads, sizeof(args_type), [](const void* a) { name(*static_cast<const args_type*>(a)); });

// Types every platform shares.
typedef _Float16 half_t;
typedef _Float16 half2_t __attribute__((ext_vector_type(2)));
typedef unsigned int u32x2 __attribute__((ext_vector_type(2)));
typedef unsigned int u32x4 __attribute__((ext_vector_type(4)));


RDNA_DEVICE int rdna_thread_id() { return rdna_host::thread_id(); }
RDNA_DEVICE int rdna_block_id_x() { return rdna_host::block_id(0); }
RDNA_DEVICE int rdna_block_id_y() { return rdna_host::block_id(1); }
RDNA_DEVICE int rdna_block_id_z() { return rdna_host::block_id(2); }
// As cuda's (RDNA_BLOCK_ID_ANEW): host_f32's kernels make head0 again at their end as sm_90's do,
// so that the emulator runs that arithmetic too.
#define RDNA_BLOCK_ID_ANEW 1
#define RDNA_DUAL_ISSUE 0  // no dual-issue words (the AMD prelude's)
RDNA_DEVICE float rdna_opaque(float x) { return x; }
// The split-KV decode's score transforms (fa2_decode.h), variants.yaml's decode_alibi_rows and
// decode_xf_cases for host: the most query rows a tile applies ALiBi in (its tiles of
// more rows are compiled without it; the dispatch table tells the runtime), and whether the
// transforms come in a copy of code per case. Both cost registers, which AMD's and Pascal's
// four-row and one-row tiles do not have to spare (a wave, or SGPR spills); sm_90's do.
#define FA2_DECODE_ALIBI_ROWS 2
#define FA2_DECODE_XF_CASES 0
RDNA_DEVICE int rdna_block_id_x_anew() { return rdna_host::block_id(0); }
RDNA_DEVICE int rdna_block_id_y_anew() { return rdna_host::block_id(1); }
RDNA_DEVICE void rdna_block_sync() { rdna_host::block_sync(); }
// Between workgroups (the split-KV slices' merge; workgroups run on several threads at once).
RDNA_DEVICE void rdna_fence_release() { __atomic_thread_fence(__ATOMIC_RELEASE); }
RDNA_DEVICE void rdna_fence_acquire() { __atomic_thread_fence(__ATOMIC_ACQUIRE); }
RDNA_DEVICE unsigned rdna_atomic_add(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
// Four fp32 values added into memory other workgroups (other threads) add into too: a
// compare-and-swap loop on each value's bits.
RDNA_DEVICE void rdna_atomic_add_f32x4(float* p, const float* v) {
  for (int e = 0; e < 4; ++e) {
    unsigned* const bits = reinterpret_cast<unsigned*>(p + e);
    unsigned seen = __atomic_load_n(bits, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(bits, &seen, __builtin_bit_cast(unsigned, __builtin_bit_cast(float, seen) + v[e]),
                                        true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
  }
}
// The kernel's argument struct where the AMD prelude reads it again (there, scalar registers): here `args` itself.
#define RDNA_ARGS_AGAIN(type, name, args) const type* const name = &(args)
#define RDNA_ARGS_VARYING(type, name, args) const type* const name = &(args)
RDNA_DEVICE float rdna_shfl_xor(float v, int mask) { return rdna_host::shfl_xor(v, mask); }
RDNA_DEVICE float rdna_exp2(float x) { return std::exp2(x); }
RDNA_DEVICE float rdna_exp2_flush(float x) { return std::exp2(x); }  // exp2 where a result below 2^-126 may be 0
RDNA_DEVICE float rdna_rcp(float x) { return 1.f / x; }  // 1 / x to about an ulp (no IEEE division's slow path)
RDNA_DEVICE float rdna_fmax(float a, float b) { return std::fmax(a, b); }
RDNA_DEVICE float rdna_fma(float a, float b, float c) { return std::fma(a, b, c); }
RDNA_DEVICE float rdna_log2(float x) { return std::log2(x); }

// Tier: cvt_fma (the portable lowering; fp16 products are exact in fp32).
RDNA_DEVICE float rdna_dot2(half2_t a, half2_t b, float acc) {
  return rdna_fma((float)a.y, (float)b.y, rdna_fma((float)a.x, (float)b.x, acc));
}

// Four signed int8 products accumulated into an int32, wrapping as the GPU instructions do.
RDNA_DEVICE int rdna_dot4_i8(int a, int b, int acc) {
  unsigned sum = (unsigned)acc;
  for (int i = 0; i < 4; ++i) sum += (unsigned)((int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i)));
  return (int)sum;
}
