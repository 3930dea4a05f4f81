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
  const StridedQ<Fa2Args> q{a};
  const StridedKv<Fa2Args> kv(a, sched.batch, sched.head_kv);
  const WindowMask<Fa2Args> mask{a};
  const RotaryTables<Fa2Args> rope{a};
  const NormalizeEpilogue<Fa2Args> epi{a};
  fa2_forward<P, D, G, BR, BC, NT, TM, LDS_BYTES>(lds, sched, q, kv, mask, rope, epi);
}
