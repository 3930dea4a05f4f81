// @generated from templates/prelude_host.h.j2 for host
// Intrinsics layer for the CPU emulator: each GPU thread is a fiber (see rdna_host.h).
#pragma once
#include <cmath>

#include "rdna_host.h"

#define RDNA_WAVE_SIZE 32
#define RDNA_DEVICE static inline
// One workgroup runs at a time per OS thread, so a thread-local static is its LDS.
#define RDNA_LDS(name, bytes) alignas(16) static thread_local unsigned char name[bytes]
#define RDNA_KERNEL(threads) extern "C"
#define RDNA_REGISTER(name, args_type, threads) \
  static const rdna_host::Registrar name##_registrar( \
      #name, threads, sizeof(args_type), [](const void* a) { name(*static_cast<const args_type*>(a)); });

// Types shared by every platform, and the kernel arguments (mirrors generator/abi.py).
typedef _Float16 half_t;
typedef _Float16 half2_t __attribute__((ext_vector_type(2)));
typedef unsigned int u32x2 __attribute__((ext_vector_type(2)));
typedef unsigned int u32x4 __attribute__((ext_vector_type(4)));

struct Fa2Args {
  const half_t* q;
  const half_t* k;
  const half_t* v;
  half_t* o;
  long long q_stride_b;
  long long q_stride_h;
  long long q_stride_s;
  long long k_stride_b;
  long long k_stride_h;
  long long k_stride_s;
  long long v_stride_b;
  long long v_stride_h;
  long long v_stride_s;
  long long o_stride_b;
  long long o_stride_h;
  long long o_stride_s;
  int batch;
  int heads_q;
  int heads_kv;
  int seq_q;
  int seq_k;
  int window_left;
  int window_right;
  float scale_log2;
  float* lse;
  long long lse_stride_b;
  long long lse_stride_h;
  const float* rotary_cos;
  const float* rotary_sin;
  long long rotary_stride;
  int rotary_dim;
  int rotary_interleaved;
  int heavy_first;
};


RDNA_DEVICE int rdna_thread_id() { return rdna_host::thread_id(); }
RDNA_DEVICE int rdna_block_id_x() { return rdna_host::block_id(0); }
RDNA_DEVICE int rdna_block_id_y() { return rdna_host::block_id(1); }
RDNA_DEVICE int rdna_block_id_z() { return rdna_host::block_id(2); }
RDNA_DEVICE void rdna_block_sync() { rdna_host::block_sync(); }
RDNA_DEVICE float rdna_shfl_xor(float v, int mask) { return rdna_host::shfl_xor(v, mask); }
RDNA_DEVICE float rdna_exp2(float x) { return std::exp2(x); }
RDNA_DEVICE float rdna_fmax(float a, float b) { return std::fmax(a, b); }
RDNA_DEVICE float rdna_fma(float a, float b, float c) { return std::fma(a, b, c); }
RDNA_DEVICE float rdna_log2(float x) { return std::log2(x); }

// Tier: cvt_fma (the portable lowering; fp16 products are exact in fp32).
RDNA_DEVICE float rdna_dot2(half2_t a, half2_t b, float acc) {
  return rdna_fma((float)a.y, (float)b.y, rdna_fma((float)a.x, (float)b.x, acc));
}

// LDS staging precision: f16. The kernels move "pairs" of values along each
// product's reduction dimension; rdna_pair_dot multiplies two pairs into an fp32 accumulator.
// fp16 pairs, fed to the tier's dot2 lowering as they are.
typedef half_t rdna_elem_t;
typedef half2_t rdna_pair_t;
RDNA_DEVICE float rdna_pair_dot(rdna_pair_t a, rdna_pair_t b, float acc) { return rdna_dot2(a, b, acc); }
RDNA_DEVICE rdna_pair_t rdna_pair_from_halves(unsigned w) { return __builtin_bit_cast(half2_t, w); }
RDNA_DEVICE rdna_pair_t rdna_make_pair(float x, float y) { return rdna_pair_t{(half_t)x, (half_t)y}; }
RDNA_DEVICE float rdna_pair_sum(rdna_pair_t p) { return (float)p.x + (float)p.y; }


#include "fa2_common.h"
