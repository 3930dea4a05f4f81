// @generated from templates/fa2_f16.hip.j2 for fa2_f16_hd128_g2_br128_bc32_nt256_tm8_w32_dot2_sf16
#include "prelude.h"
#include "args_f16.h"
#include "fa2_f16.h"

RDNA_KERNEL(256) void fa2_f16_hd128_g2_br128_bc32_nt256_tm8_w32_dot2_sf16(const Fa2Args args) {
  RDNA_LDS(lds, 51456);
  fa2_f16_forward<F16Pairs, 128, 2, 128, 32, 256, 8, 51456, false, false>(args, lds);
}
RDNA_REGISTER(fa2_f16_hd128_g2_br128_bc32_nt256_tm8_w32_dot2_sf16, Fa2Args, 256)
