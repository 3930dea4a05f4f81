// @generated from templates/fma_peak.hip.j2 for sm_90
// The FP32 FMA peak probe (rdnattention/peak.py): 8 independent FMA chains per thread,
// 32 FMAs each per iteration, long enough to hide the FMA latency. Not a dispatch entry.
#include "prelude.h"

struct RdnaFmaPeakArgs {
  float* out;
  float mul;
  float add;
  int iters;
};

RDNA_KERNEL(256) void rdna_fma_peak(const RdnaFmaPeakArgs a) {
  float x[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) x[i] = rdna_thread_id() * 1e-3f + i;
  for (int it = 0; it < a.iters; ++it) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = rdna_fma(x[i], a.mul, a.add);
    }
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s += x[i];
  if (s == 123456.f) a.out[0] = s;  // never true; keeps the chains alive
}
RDNA_REGISTER(rdna_fma_peak, RdnaFmaPeakArgs, 256)
