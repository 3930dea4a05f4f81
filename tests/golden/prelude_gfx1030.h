// @generated from templates/prelude_amdgcn.h.j2 for gfx1030
// Intrinsics layer for AMD GPUs: builtins only, no HIP headers.
#pragma once

#define RDNA_WAVE_SIZE 32
#define RDNA_DEVICE static __attribute__((device)) __attribute__((always_inline)) inline
#define RDNA_LDS(name, bytes) __attribute__((shared)) __attribute__((aligned(16))) unsigned char name[bytes]
#define RDNA_KERNEL(threads) \
  extern "C" __attribute__((global)) __attribute__((amdgpu_flat_work_group_size(threads, threads)))
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


RDNA_DEVICE int rdna_thread_id() { return (int)__builtin_amdgcn_workitem_id_x(); }
RDNA_DEVICE int rdna_block_id_x() { return (int)__builtin_amdgcn_workgroup_id_x(); }
RDNA_DEVICE int rdna_block_id_y() { return (int)__builtin_amdgcn_workgroup_id_y(); }
RDNA_DEVICE int rdna_block_id_z() { return (int)__builtin_amdgcn_workgroup_id_z(); }

RDNA_DEVICE void rdna_block_sync() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

RDNA_DEVICE float rdna_shfl_xor(float v, int mask) {
  const int lane = rdna_thread_id() & (RDNA_WAVE_SIZE - 1);
  return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute((lane ^ mask) << 2, __builtin_bit_cast(int, v)));
}

RDNA_DEVICE float rdna_exp2(float x) { return __builtin_amdgcn_exp2f(x); }
RDNA_DEVICE float rdna_fmax(float a, float b) { return __builtin_fmaxf(a, b); }
RDNA_DEVICE float rdna_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
RDNA_DEVICE float rdna_log2(float x) { return __builtin_amdgcn_logf(x); }

// fp16 pair product accumulated in fp32: acc + a.x*b.x + a.y*b.y. Tier: dot2.
RDNA_DEVICE float rdna_dot2(half2_t a, half2_t b, float acc) {
  return __builtin_amdgcn_fdot2(a, b, acc, false);
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
