// @generated from templates/fa2_f16.hip.j2 for fa2_f16_hd128_g2_br128_bc32_nt256_w32_dot2
#include "prelude.h"
#include "fa2_f16.h"

RDNA_KERNEL(256) void fa2_f16_hd128_g2_br128_bc32_nt256_w32_dot2(const Fa2Args args) {
  fa2_f16_forward<128, 2, 128, 32, 256>(args);
}
RDNA_REGISTER(fa2_f16_hd128_g2_br128_bc32_nt256_w32_dot2, Fa2Args, 256)
