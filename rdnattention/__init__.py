"""rdnattention: FlashAttention-2 forward kernels for GPUs without matrix cores."""

from . import ops  # noqa: F401  (registers rdnattention::flash_attn_fwd)
from .api import flash_attn, flash_attn_func, plan_flash_attn, rotary_tables, scaled_dot_product_attention
from .drivers.host import set_shuffle as set_host_shuffle
from .errors import (IncompatibleKernelsError, InvalidArgumentError, KernelsNotBuiltError, LaunchError,
                     RdnaAttentionError, UnsupportedError)
from .reference import attention_reference

__all__ = [
    "flash_attn",
    "flash_attn_func",
    "scaled_dot_product_attention",
    "plan_flash_attn",
    "attention_reference",
    "rotary_tables",
    "set_host_shuffle",
    "RdnaAttentionError",
    "InvalidArgumentError",
    "UnsupportedError",
    "KernelsNotBuiltError",
    "IncompatibleKernelsError",
    "LaunchError",
]
__version__ = "0.1.0"
