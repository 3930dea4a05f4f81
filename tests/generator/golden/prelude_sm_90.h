// @generated from templates/prelude_cuda.h.j2 for sm_90
// Intrinsics layer for NVIDIA GPUs: clang CUDA builtins only, no CUDA headers.
#pragma once

#define RDNA_WAVE_SIZE 32
#define RDNA_DEVICE static __attribute__((device)) __attribute__((always_inline)) inline
#define RDNA_METHOD __attribute__((device)) __attribute__((always_inline)) inline
// Dynamic shared memory: blocks may then use more than the 48 KiB a static array allows.
#define RDNA_LDS(name, bytes) \
  static_assert((bytes) > 0, "LDS size"); \
  extern __attribute__((shared)) __attribute__((aligned(16))) unsigned char name[]
#define RDNA_KERNEL(threads) extern "C" __attribute__((global)) __attribute__((launch_bounds(threads, 1)))
// A kernel that needs `waves` warps per SM sub-partition resident (latency-bound kernels): the
// register budget follows from it.
#define RDNA_KERNEL_WAVES(threads, waves) \
  extern "C" __attribute__((global)) \
  __attribute__((launch_bounds(threads, rdna_blocks_per_sm(threads, waves))))
// Blocks per SM that keep `waves` warps per sub-partition resident (at least one).
#define rdna_blocks_per_sm(threads, waves) \
  ((waves) * 4 * RDNA_WAVE_SIZE >= (threads) ? (waves) * 4 * RDNA_WAVE_SIZE / (threads) : 1)
#define RDNA_REGISTER(name, args_type, threads)

// Types every platform shares.
typedef _Float16 half_t;
typedef _Float16 half2_t __attribute__((ext_vector_type(2)));
typedef unsigned int u32x2 __attribute__((ext_vector_type(2)));
typedef unsigned int u32x4 __attribute__((ext_vector_type(4)));


RDNA_DEVICE int rdna_thread_id() { return __nvvm_read_ptx_sreg_tid_x(); }
RDNA_DEVICE int rdna_block_id_x() { return __nvvm_read_ptx_sreg_ctaid_x(); }
RDNA_DEVICE int rdna_block_id_y() { return __nvvm_read_ptx_sreg_ctaid_y(); }
RDNA_DEVICE int rdna_block_id_z() { return __nvvm_read_ptx_sreg_ctaid_z(); }
// The block id read anew, not merged with the reads before: a value made from it can be made again
// at a kernel's end instead of held in a register through its main loop (RowBlockSchedule::head0_anew).
#define RDNA_BLOCK_ID_ANEW 1
#define RDNA_DUAL_ISSUE 0  // no dual-issue words (the AMD prelude's)
RDNA_DEVICE float rdna_opaque(float x) { return x; }
// The split-KV decode's score transforms (fa2_decode.h), variants.yaml's decode_alibi_rows and
// decode_xf_cases for sm_90: the most query rows a tile applies ALiBi in (its tiles of
// more rows are compiled without it; the dispatch table tells the runtime), and whether the
// transforms come in a copy of code per case. Both cost registers, which AMD's and Pascal's
// four-row and one-row tiles do not have to spare (a wave, or SGPR spills); sm_90's do.
#define FA2_DECODE_ALIBI_ROWS 4
#define FA2_DECODE_XF_CASES 1
RDNA_DEVICE int rdna_block_id_x_anew() { int x; asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(x)); return x; }
RDNA_DEVICE int rdna_block_id_y_anew() { int y; asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(y)); return y; }
RDNA_DEVICE void rdna_block_sync() { __nvvm_barrier_sync(0); }

// Between blocks (the split-KV slices' merge): fences at the scope of the GPU around a relaxed
// atomic, as __threadfence() is.
RDNA_DEVICE void rdna_fence_release() { __nvvm_membar_gl(); }
RDNA_DEVICE void rdna_fence_acquire() { __nvvm_membar_gl(); }
RDNA_DEVICE unsigned rdna_atomic_add(unsigned* p, unsigned v) {
  return (unsigned)__nvvm_atom_add_gen_i(reinterpret_cast<int*>(p), (int)v);
}
// Four fp32 values added into memory other blocks add into too (the backward's dQ), relaxed:
// one vector reduction on sm_90 and later, else four.
RDNA_DEVICE void rdna_atomic_add_f32x4(float* p, const float* v) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
               :: "l"(p), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]) : "memory");
#else
#pragma unroll
  for (int e = 0; e < 4; ++e) __nvvm_atom_add_gen_f(p + e, v[e]);
#endif
}
// The kernel's argument struct where the AMD prelude reads it again (there, scalar registers): here `args` itself.
#define RDNA_ARGS_AGAIN(type, name, args) const type* const name = &(args)
#define RDNA_ARGS_VARYING(type, name, args) const type* const name = &(args)

RDNA_DEVICE float rdna_shfl_xor(float v, int mask) {
  return __nvvm_shfl_sync_bfly_f32(0xffffffffu, v, mask, 0x1f);
}

RDNA_DEVICE float rdna_exp2(float x) { return __nvvm_ex2_approx_f(x); }
// exp2 where a result below 2^-126 may be 0: one MUFU.EX2, without the three instructions that
// scale a denormal result.
RDNA_DEVICE float rdna_exp2_flush(float x) { return __nvvm_ex2_approx_ftz_f(x); }
RDNA_DEVICE float rdna_rcp(float x) { return __nvvm_rcp_approx_ftz_f(x); }  // 1 / x to about an ulp (no IEEE division's slow path)
RDNA_DEVICE float rdna_fmax(float a, float b) { return __builtin_fmaxf(a, b); }
RDNA_DEVICE float rdna_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
RDNA_DEVICE float rdna_log2(float x) { return __nvvm_lg2_approx_f(x); }

// Tier: cvt_fma. No mixed-precision FMA on NVIDIA: convert, then fp32 FMA.
RDNA_DEVICE float rdna_dot2(half2_t a, half2_t b, float acc) {
  return rdna_fma((float)a.y, (float)b.y, rdna_fma((float)a.x, (float)b.x, acc));
}

// Four signed int8 products accumulated into an int32 (no saturation): dp4a (sm_61 and later).
RDNA_DEVICE int rdna_dot4_i8(int a, int b, int acc) {
  int r;
  asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(acc));
  return r;
}
