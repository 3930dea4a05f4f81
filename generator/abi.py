"""The kernel-argument struct, in one place: rendered into C by the preludes and mirrored
by the runtime as a ctypes.Structure. A new feature adds a field here, nowhere else."""

from __future__ import annotations

# (name, C type). Strides are in elements; the last dimension is contiguous.
FA2_ARGS: tuple[tuple[str, str], ...] = (
    ("q", "const half_t*"),
    ("k", "const half_t*"),
    ("v", "const half_t*"),
    ("o", "half_t*"),
    ("q_stride_b", "long long"), ("q_stride_h", "long long"), ("q_stride_s", "long long"),
    ("k_stride_b", "long long"), ("k_stride_h", "long long"), ("k_stride_s", "long long"),
    ("v_stride_b", "long long"), ("v_stride_h", "long long"), ("v_stride_s", "long long"),
    ("o_stride_b", "long long"), ("o_stride_h", "long long"), ("o_stride_s", "long long"),
    ("batch", "int"),
    ("heads_q", "int"),
    ("heads_kv", "int"),
    ("seq_q", "int"),
    ("seq_k", "int"),
    ("window_left", "int"),   # keys visible before the query's diagonal; -1: unbounded
    ("window_right", "int"),  # keys visible after it; -1: unbounded, 0: causal
    ("scale_log2", "float"),  # softmax scale times log2(e)
    # Log-sum-exp per query row (natural log), fp32 [batch, heads_q, seq_q]; null: not written.
    ("lse", "float*"),
    ("lse_stride_b", "long long"), ("lse_stride_h", "long long"),
    # RoPE tables [positions, rotary_dim/2] in fp32; rotary_dim 0: no rotation.
    ("rotary_cos", "const float*"),
    ("rotary_sin", "const float*"),
    ("rotary_stride", "long long"),
    ("rotary_dim", "int"),
    ("rotary_interleaved", "int"),  # 1: rotate pairs (2i, 2i+1); 0: rotate halves (i, i + rotary_dim/2)
    ("heavy_first", "int"),  # 1: workgroups take row blocks longest first (causal-like masks)
)
