// @generated from templates/fa2_f16.hip.j2 for fa2_f16_hd128_g2_br128_bc16_nt256_tm2_wv6_w32_dot2_sf16
#include "prelude.h"
#include "args_f16.h"
#include "fa2_f16.h"

RDNA_KERNEL_WAVES(256, 6) void fa2_f16_hd128_g2_br128_bc16_nt256_tm2_wv6_w32_dot2_sf16(const Fa2Args args) {
  RDNA_LDS(lds, 43136);
  fa2_f16_forward<F16Pairs, LeanPipeline, 128, 128, 2, 128, 16, 256, 2, 43136, false, false>(args, lds);
}
RDNA_REGISTER(fa2_f16_hd128_g2_br128_bc16_nt256_tm2_wv6_w32_dot2_sf16, Fa2Args, 256)
