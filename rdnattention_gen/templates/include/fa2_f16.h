// The fp16 family's kernel body: its argument struct (Fa2Args) turned into the policies of the
// FlashAttention-2 main loop: row blocks (longest first under causal-like masks), strided K/V, a
// sliding-window/causal mask, RoPE, and the normalising epilogue.
#pragma once

#include "tiles.h"
#include "pairs.h"
#include "fa2_policies.h"
#include "fa2_forward.h"

// LENGTHS: the cache-length variant (family f16len): batch b uses its first seqused_k[b] keys.
template <class P, int D, int G, int BR, int BC, int NT, int TM, int LDS_BYTES, bool LENGTHS>
RDNA_DEVICE void fa2_f16_forward(const Fa2Args& a, unsigned char* lds) {
  const RowBlockSchedule<BR, G> sched(a.seq_q, a.heads_q, a.heads_kv, a.heavy_first);
  const StridedQ<Fa2Args> q{a};
  const int keys = LENGTHS ? fa2_keys(a, sched.batch) : 0;
  const StridedKv<Fa2Args, LENGTHS> kv(a, sched.batch, sched.head_kv, keys);
  const WindowMask<Fa2Args, LENGTHS> mask{a, keys};
  const RotaryTables<Fa2Args> rope{a};
  const NormalizeEpilogue<Fa2Args> epi{a};
  fa2_forward<P, D, G, BR, BC, NT, TM, LDS_BYTES>(lds, sched, q, kv, mask, rope, epi);
}
