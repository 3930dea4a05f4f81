// @generated from templates/prelude_amdgcn.h.j2 for gfx900
// Intrinsics layer for AMD GPUs: builtins only, no HIP headers.
#pragma once

#define RDNA_WAVE_SIZE 64
#define RDNA_DEVICE static __attribute__((device)) __attribute__((always_inline)) inline
#define RDNA_METHOD __attribute__((device)) __attribute__((always_inline)) inline
#define RDNA_LDS(name, bytes) __attribute__((shared)) __attribute__((aligned(16))) unsigned char name[bytes]
#define RDNA_KERNEL(threads) \
  extern "C" __attribute__((global)) __attribute__((amdgpu_flat_work_group_size(threads, threads)))
// A kernel that needs `waves` waves per SIMD resident (latency-bound kernels): the register
// budget follows from it.
#define RDNA_KERNEL_WAVES(threads, waves)                                                        \
  extern "C" __attribute__((global)) __attribute__((amdgpu_flat_work_group_size(threads, threads))) \
  __attribute__((amdgpu_waves_per_eu(waves)))
#define RDNA_REGISTER(name, args_type, threads)

// Types every platform shares.
typedef _Float16 half_t;
typedef _Float16 half2_t __attribute__((ext_vector_type(2)));
typedef unsigned int u32x2 __attribute__((ext_vector_type(2)));
typedef unsigned int u32x4 __attribute__((ext_vector_type(4)));


RDNA_DEVICE int rdna_thread_id() { return (int)__builtin_amdgcn_workitem_id_x(); }
RDNA_DEVICE int rdna_block_id_x() { return (int)__builtin_amdgcn_workgroup_id_x(); }
RDNA_DEVICE int rdna_block_id_y() { return (int)__builtin_amdgcn_workgroup_id_y(); }
RDNA_DEVICE int rdna_block_id_z() { return (int)__builtin_amdgcn_workgroup_id_z(); }
// Values made from the block id are uniform and stay in SGPRs, which the main loop does not run
// short of: nothing is made again at a kernel's end (cuda's RDNA_BLOCK_ID_ANEW).
#define RDNA_BLOCK_ID_ANEW 0
// Whether the VALU pairs two fp32 FMAs into one dual-issue word (VOPD: RDNA3 and later), where a
// v_fma_mix_f32, which has no dual-issue form, takes a word to itself.
#define RDNA_DUAL_ISSUE 0
// x as computed, held in a register the compiler cannot see into: its uses cannot fold how it was
// made (an fp16 value's widening into v_fma_mix_f32).
RDNA_DEVICE float rdna_opaque(float x) {
  asm("" : "+v"(x));
  return x;
}
// The split-KV decode's score transforms (fa2_decode.h), variants.yaml's decode_alibi_rows and
// decode_xf_cases for gfx900: the most query rows a tile applies ALiBi in (its tiles of
// more rows are compiled without it; the dispatch table tells the runtime), and whether the
// transforms come in a copy of code per case. Both cost registers, which AMD's and Pascal's
// four-row and one-row tiles do not have to spare (a wave, or SGPR spills); sm_90's do.
#define FA2_DECODE_ALIBI_ROWS 2
#define FA2_DECODE_XF_CASES 0

RDNA_DEVICE void rdna_block_sync() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

// Between workgroups (the split-KV slices' merge): a release fence makes this thread's writes
// visible to the whole device before a later atomic; an acquire fence after one makes the other
// workgroups' released writes visible to this thread's reads (invalidating its caches' stale lines).
RDNA_DEVICE void rdna_fence_release() { __builtin_amdgcn_fence(__ATOMIC_RELEASE, "agent"); }
RDNA_DEVICE void rdna_fence_acquire() { __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "agent"); }
RDNA_DEVICE unsigned rdna_atomic_add(unsigned* p, unsigned v) {
  return __hip_atomic_fetch_add(p, v, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
// Four fp32 values added into memory other workgroups add into too (the backward's dQ), relaxed,
// at the device's scope: one instruction each where the target adds floats in memory, else a
// compare-and-swap loop the compiler makes.
RDNA_DEVICE void rdna_atomic_add_f32x4(float* p, const float* v) {
#pragma unroll
  for (int e = 0; e < 4; ++e) __hip_atomic_fetch_add(p + e, v[e], __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}

// `name`: a pointer to the kernel's argument struct `args` (of type `type`, the kernel's only
// parameter, at offset 0 of the kernarg segment) that the compiler cannot see through, so that
// the fields read through it are loaded where they are read, never earlier: scalar loads after a
// long loop rather than scalar registers held across it.
#define RDNA_ARGS_AGAIN(type, name, args)                                                      \
  auto name##_segment = __builtin_amdgcn_kernarg_segment_ptr();                                \
  asm volatile("" : "+s"(name##_segment));                                                     \
  const __attribute__((address_space(4))) type* const name =                                  \
      (const __attribute__((address_space(4))) type*)(name##_segment)

// `name`: a pointer to `args` held in vector registers, so that the fields read through it are
// loaded into vector registers: for code that runs once, outside the loops, whose uniform values
// would otherwise take scalar registers from the ones the loops hold.
#define RDNA_ARGS_VARYING(type, name, args)                                                    \
  auto name##_segment = __builtin_amdgcn_kernarg_segment_ptr();                                \
  asm volatile("" : "+v"(name##_segment));                                                     \
  const type* const name = (const type*)(const __attribute__((address_space(4))) type*)(name##_segment)

RDNA_DEVICE float rdna_shfl_xor(float v, int mask) {
  const int lane = rdna_thread_id() & (RDNA_WAVE_SIZE - 1);
  return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute((lane ^ mask) << 2, __builtin_bit_cast(int, v)));
}

RDNA_DEVICE float rdna_exp2(float x) { return __builtin_amdgcn_exp2f(x); }
// exp2 where a result below 2^-126 may be 0: here the same v_exp_f32 as rdna_exp2
RDNA_DEVICE float rdna_exp2_flush(float x) { return __builtin_amdgcn_exp2f(x); }
RDNA_DEVICE float rdna_rcp(float x) { return __builtin_amdgcn_rcpf(x); }  // 1 / x to about an ulp (no IEEE division's slow path)
RDNA_DEVICE float rdna_fmax(float a, float b) { return __builtin_fmaxf(a, b); }
RDNA_DEVICE float rdna_fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
RDNA_DEVICE float rdna_log2(float x) { return __builtin_amdgcn_logf(x); }

// fp16 pair product accumulated in fp32: acc + a.x*b.x + a.y*b.y. Tier: mad_mix.
RDNA_DEVICE float rdna_dot2(half2_t a, half2_t b, float acc) {
  // The compiler never selects v_mad_mix_f32; op_sel picks the half, op_sel_hi marks fp16 sources.
  float r;
  asm("v_mad_mix_f32 %0, %1, %2, %3 op_sel_hi:[1,1,0]" : "=v"(r) : "v"(a), "v"(b), "v"(acc));
  asm("v_mad_mix_f32 %0, %1, %2, %3 op_sel:[1,1,0] op_sel_hi:[1,1,0]" : "=v"(r) : "v"(a), "v"(b), "v"(r));
  return r;
}
