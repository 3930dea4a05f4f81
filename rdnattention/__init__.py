"""rdnattention: FlashAttention-2 forward kernels for GPUs without matrix cores.

Where torch is already imported, importing the package loads the API (and registers the custom
op), raising ImportError if that torch is too old. Otherwise the API is loaded on first use, so
the generator reads the kernel-argument layouts and names from this package without importing
torch. torch is not an install requirement (see _torch.py); without a usable one, every API name
raises ImportError saying which torch to install."""

from __future__ import annotations

import os as _os
import sys as _sys

__version__ = "0.1.0"
__all__ = [
    "flash_attn",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_with_kvcache",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "varlen_attn",
    "flash_attn_int8qk",
    "flash_attn_int8qk_quantized",
    "plan_flash_attn_int8qk",
    "quantize_per_token",
    "quantize_per_channel",
    "scaled_dot_product_attention",
    "patch_sdpa",
    "unpatch_sdpa",
    "sdpa_patched",
    "stats",
    "plan_flash_attn",
    "attention_reference",
    "attention_gradients",
    "rotary_tables",
    "set_host_shuffle",
    "RdnaAttentionError",
    "InvalidArgumentError",
    "UnsupportedError",
    "KernelsNotBuiltError",
    "IncompatibleKernelsError",
    "StaleKernelsError",
    "LaunchError",
]


def _load_api() -> None:
    from ._torch import problem

    why = problem()
    if why:
        raise ImportError(why)
    from . import decode, ops  # noqa: F401  (register the rdnattention:: custom ops; int8 below registers its own)
    from .api import (flash_attn, flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, plan_flash_attn,
                      rotary_tables, scaled_dot_product_attention)
    from .drivers.host import set_shuffle as set_host_shuffle
    from .errors import (IncompatibleKernelsError, InvalidArgumentError, KernelsNotBuiltError, LaunchError,
                         RdnaAttentionError, StaleKernelsError, UnsupportedError)
    from .integrations.sdpa import patch_sdpa, sdpa_patched, stats, unpatch_sdpa
    from .int8 import (flash_attn_int8qk, flash_attn_int8qk_quantized, plan_flash_attn_int8qk, quantize_per_channel,
                       quantize_per_token)
    from .kvcache import flash_attn_with_kvcache
    from .varlen import (flash_attn_varlen_func, flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func,
                         varlen_attn)
    from .reference import attention_gradients, attention_reference

    globals().update({name: value for name, value in locals().items() if name in __all__})


def __getattr__(name: str):
    if name in __all__:
        _load_api()
        return globals()[name]
    raise AttributeError(f"module 'rdnattention' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if _sys.modules.get("torch") is not None:  # torch already imported: load the API now
    _load_api()

# $RDNATTENTION_PATCH_SDPA (integrations/sdpa.py: patch_from_env) patches torch's SDPA on import.
if _os.environ.get("RDNATTENTION_PATCH_SDPA", "").strip().lower() not in ("", "0", "false", "no", "off"):
    from ._torch import problem as _problem

    if _problem() is None:
        _load_api()
        from .integrations.sdpa import patch_from_env as _patch_from_env

        _patch_from_env()
