// The fp16 family's kernel body: its argument struct (Fa2Args) turned into the policies of the
// FlashAttention-2 main loop: row blocks (longest first under causal-like masks), strided K/V, a
// sliding-window/causal mask, RoPE, and the normalising epilogue.
#pragma once

#include "tiles.h"
#include "pairs.h"
#include "fa2_policies.h"
#include "fa2_forward.h"

template <class P, int D, int G, int BR, int BC, int NT, int TM, int LDS_BYTES>
RDNA_DEVICE void fa2_f16_forward(const Fa2Args& a, unsigned char* lds) {
  const RowBlockSchedule<BR, G> sched(a.seq_q, a.heads_q, a.heads_kv, a.heavy_first);
  const StridedRows q{a.q, a.q_stride_b, a.q_stride_h, a.q_stride_s};
  const StridedKv kv{a.k + sched.batch * a.k_stride_b + sched.head_kv * a.k_stride_h,
                     a.v + sched.batch * a.v_stride_b + sched.head_kv * a.v_stride_h,
                     a.k_stride_s, a.v_stride_s, a.seq_k};
  const WindowMask mask{a.seq_q, a.seq_k, a.window_left, a.window_right, a.seq_k - a.seq_q, a.scale_log2};
  const RotaryTables rope{a.rotary_cos, a.rotary_sin, a.rotary_stride, a.rotary_dim, a.rotary_interleaved};
  const NormalizeEpilogue epi{a.o, a.o_stride_b, a.o_stride_h, a.o_stride_s, a.lse, a.lse_stride_b, a.lse_stride_h};
  fa2_forward<P, D, G, BR, BC, NT, TM, LDS_BYTES>(lds, q, sched, kv, mask, rope, epi);
}
