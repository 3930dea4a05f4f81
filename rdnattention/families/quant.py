"""The INT8 family's quantization, runtime side: one launch that quantizes up to three tensors
symmetrically to int8, in place of the torch operations that did it (int8.py keeps them where no
quant kernel is built, and where torch traces).

Two jobs share the launch's one-dimensional grid, each optional:
- per token (q and k of ``flash_attn_int8qk_quantized``, ``quantize_per_token``): each
  [batch, heads, seq, head_dim] row's head_dim values get one scale; a wave per row.
- per channel (v, ``quantize_per_channel``): each (batch, head, feature) column over seq gets one
  scale; a workgroup per (batch, head, one wave's width of features), its waves splitting the rows,
  then an LDS reduction across them.

Each job reads any strides, in fp32, fp16 or bf16 (the dtype a launch argument), and writes
contiguous int8 and fp32 scales. The numbers are the torch formula's bit for bit (int8.py
``_quantize``): amax exactly; scale = amax / 127 (IEEE division, at least float32's smallest normal;
1 for an all-zero vector); value = x / scale rounded to nearest even, clamped to [-127, 127]. A
vector holding a NaN or an infinity gets a NaN scale and zeros (int8.py raises where it reads the
scales). head_dim is a launch argument (at most the kernels' ``head_dim``, 512): one kernel per target."""

from __future__ import annotations

from ..abi import ArgStruct
from ..names import NameField, NameSchema
from ..plan import Launch
from ..table import TargetTable

NAME = "quant"
LAYOUTS: dict[str, str] = {}
DTYPES: dict[str, str] = {}
# The head_dim the kernels take at most (the launch passes the call's).
HEAD_DIM_MAX = 512
NAMES = NameSchema("fa2_quant", (
    NameField("head_dim", "_upto{}", r"\d+"),
    NameField("tile.threads", "_nt{}", r"\d+"),
    NameField("wave_size", "_w{}", r"32|64"),
))

# Input dtypes (the launch's x_dtype).
INPUT_DTYPES = {"torch.float32": 0, "torch.float16": 1, "torch.bfloat16": 2}

# Pointer fields named as the INT8 attention's launch names the same tensors (q, k, v: the int8
# values; q_scale, k_scale, v_scale), so that a replay of both launches rewrites each once.
ARGS = ArgStruct("Fa2QuantArgs", (
    ("q_src", "const float*"),  # per-token job 0: [batch, heads_q, seq_q, head_dim] of x_dtype; null: none
    ("k_src", "const float*"),  # per-token job 1: [batch, heads_k, seq_k, head_dim]; null: none
    ("v_src", "const float*"),  # per-channel job: [batch, heads_v, seq_v, head_dim]; null: none
    ("q", "signed char*"),      # contiguous int8, each its source's shape
    ("k", "signed char*"),
    ("v", "signed char*"),
    ("q_scale", "float*"),      # [batch, heads_q, seq_q]
    ("k_scale", "float*"),      # [batch, heads_k, seq_k]
    ("v_scale", "float*"),      # [batch, heads_v, head_dim]
    ("qs_stride_b", "long long"), ("qs_stride_h", "long long"), ("qs_stride_s", "long long"),
    ("qs_stride_d", "long long"),
    ("ks_stride_b", "long long"), ("ks_stride_h", "long long"), ("ks_stride_s", "long long"),
    ("ks_stride_d", "long long"),
    ("vs_stride_b", "long long"), ("vs_stride_h", "long long"), ("vs_stride_s", "long long"),
    ("vs_stride_d", "long long"),
    ("q_rows", "long long"),    # batch * heads_q * seq_q
    ("k_rows", "long long"),
    ("q_blocks", "long long"),  # workgroups of each job, in grid order: q, k, v
    ("k_blocks", "long long"),
    ("v_blocks", "long long"),
    ("heads_q", "int"), ("seq_q", "int"),
    ("heads_k", "int"), ("seq_k", "int"),
    ("heads_v", "int"), ("seq_v", "int"),
    ("head_dim", "int"),
    ("x_dtype", "int"),         # INPUT_DTYPES, every source's
))
Fa2QuantArgs = ARGS.ctype


def lds_layout(threads: int) -> dict[str, int]:
    return {"amax": 4 * threads}  # one float per thread: the per-channel job's reduction across waves


def lds_bytes(facts: dict[str, object]) -> int:
    return sum(lds_layout(facts["tile.threads"]).values())


def select(table: TargetTable):
    """The quant kernel of ``table`` (UnsupportedError where none is built)."""
    return table.select(NAME, head_dim=HEAD_DIM_MAX, heads_per_kv=1, causal=False, seq_q=1)


def launch(table: TargetTable, *, q=None, k=None, v=None, q_out=None, k_out=None, v_out=None,
           q_scale=None, k_scale=None, v_scale=None) -> Launch:
    """The launch that quantizes ``q`` and ``k`` per token and ``v`` per channel (each optional,
    4-D, one dtype of INPUT_DTYPES, one head_dim of at most HEAD_DIM_MAX, none empty: int8.py
    checks) into the contiguous int8 ``*_out`` and fp32 ``*_scale`` tensors it allocated."""
    entry = select(table)
    threads, wave = entry.threads, NAMES.parse(entry.name)["wave_size"]
    per_block = threads // wave  # token rows per workgroup: a wave each
    first = next(t for t in (q, k, v) if t is not None)
    fields = dict(head_dim=first.shape[3], x_dtype=INPUT_DTYPES[str(first.dtype)])
    blocks = {}
    for name, x, out, scale in (("q", q, q_out, q_scale), ("k", k, k_out, k_scale), ("v", v, v_out, v_scale)):
        if x is None:
            blocks[name] = 0
            continue
        batch, heads, seq, head_dim = x.shape
        fields.update({f"{name}_src": x.data_ptr(), name: out.data_ptr(), f"{name}_scale": scale.data_ptr(),
                       f"heads_{name}": heads, f"seq_{name}": seq})
        for axis, stride in zip("bhsd", x.stride()):
            fields[f"{name}s_stride_{axis}"] = stride
        if name == "v":
            blocks[name] = batch * heads * -(-head_dim // wave)
        else:
            fields[f"{name}_rows"] = rows = batch * heads * seq
            blocks[name] = -(-rows // per_block)
    fields.update(q_blocks=blocks["q"], k_blocks=blocks["k"], v_blocks=blocks["v"])
    return Launch(kernel=entry, grid=(sum(blocks.values()), 1, 1), block=threads,
                  shared_bytes=table.shared_bytes(entry), args=Fa2QuantArgs(**fields))
