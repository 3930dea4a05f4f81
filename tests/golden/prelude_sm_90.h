// @generated from templates/prelude_cuda.h.j2 for sm_90
// Intrinsics layer for NVIDIA GPUs: clang CUDA builtins only, no CUDA headers.
#pragma once

#define RDNA_WAVE_SIZE 32
#define RDNA_DEVICE static __attribute__((device)) __attribute__((always_inline)) inline
// Dynamic shared memory: blocks may then use more than the 48 KiB a static array allows.
#define RDNA_LDS(name, bytes) \
  static_assert((bytes) > 0, "LDS size"); \
  extern __attribute__((shared)) __attribute__((aligned(16))) unsigned char name[]
#define RDNA_KERNEL(threads) extern "C" __attribute__((global)) __attribute__((launch_bounds(threads, 1)))
#define RDNA_REGISTER(name, args_type, threads)

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


RDNA_DEVICE int rdna_thread_id() { return __nvvm_read_ptx_sreg_tid_x(); }
RDNA_DEVICE int rdna_block_id_x() { return __nvvm_read_ptx_sreg_ctaid_x(); }
RDNA_DEVICE int rdna_block_id_y() { return __nvvm_read_ptx_sreg_ctaid_y(); }
RDNA_DEVICE int rdna_block_id_z() { return __nvvm_read_ptx_sreg_ctaid_z(); }
RDNA_DEVICE void rdna_block_sync() { __nvvm_barrier_sync(0); }

RDNA_DEVICE float rdna_shfl_xor(float v, int mask) {
  return __nvvm_shfl_sync_bfly_f32(0xffffffffu, v, mask, 0x1f);
}

RDNA_DEVICE float rdna_exp2(float x) { return __nvvm_ex2_approx_f(x); }
RDNA_DEVICE float rdna_fmax(float a, float b) { return __builtin_fmaxf(a, b); }
RDNA_DEVICE float rdna_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
RDNA_DEVICE float rdna_log2(float x) { return __nvvm_lg2_approx_f(x); }

// Tier: cvt_fma. No mixed-precision FMA on NVIDIA: convert, then fp32 FMA.
RDNA_DEVICE float rdna_dot2(half2_t a, half2_t b, float acc) {
  return rdna_fma((float)a.y, (float)b.y, rdna_fma((float)a.x, (float)b.x, acc));
}

// LDS staging precision: f32. The kernels move "pairs" of values along each
// product's reduction dimension; rdna_pair_dot multiplies two pairs into an fp32 accumulator.
// fp32 pairs: every fp16 value is converted once, when its tile is staged.
typedef float rdna_elem_t;
typedef float rdna_pair_t __attribute__((ext_vector_type(2)));
RDNA_DEVICE float rdna_pair_dot(rdna_pair_t a, rdna_pair_t b, float acc) {
  return rdna_fma(a.y, b.y, rdna_fma(a.x, b.x, acc));
}
RDNA_DEVICE rdna_pair_t rdna_pair_from_halves(unsigned w) {
  const half2_t h = __builtin_bit_cast(half2_t, w);
  return rdna_pair_t{(float)h.x, (float)h.y};
}
RDNA_DEVICE rdna_pair_t rdna_make_pair(float x, float y) { return rdna_pair_t{x, y}; }
RDNA_DEVICE float rdna_pair_sum(rdna_pair_t p) { return (float)p.x + (float)p.y; }


#include "fa2_common.h"
