"""Which torch this runtime needs, and what to tell a user whose environment lacks it. torch is not
an install requirement (pip would replace a ROCm torch with a CUDA build from the index), so it is
checked here, once, when the API is first touched."""

from __future__ import annotations

import re

MINIMUM = (2, 4)
_HOW = ("install the torch build for your GPU first: ROCm (AMD): pip install torch --index-url "
        "https://download.pytorch.org/whl/rocm6.4 (or your distribution's ROCm torch); NVIDIA: pip install torch; "
        "CPU only (the host emulator): pip install torch --index-url https://download.pytorch.org/whl/cpu")


def problem() -> str | None:
    """None when a usable torch is importable; otherwise what is wrong and what to install."""
    try:
        import torch
    except ImportError as e:
        return f"rdnattention needs PyTorch >= {MINIMUM[0]}.{MINIMUM[1]}, and it cannot be imported ({e}); {_HOW}"

    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    if m is None or (int(m[1]), int(m[2])) < MINIMUM:
        return (f"rdnattention needs PyTorch >= {MINIMUM[0]}.{MINIMUM[1]}, found {torch.__version__} "
                f"(at {torch.__file__}); {_HOW}")
    return None
