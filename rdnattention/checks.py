"""Checks of the tensors a call passes: dtype, rank and layout, the memory behind them, index
tensors and their values, page pools. Each raises InvalidArgumentError naming the tensor, what it
is and what is accepted; none modifies its argument.

Which values are read (``RDNATTENTION_CHECK``, read at first use): unset, the values of CPU
tensors (free to read) and not those of GPU tensors, whose reading would synchronise the host
with the device on every call; ``1``, every tensor's (one device read per call); ``0``, none. A
value that is not read is the caller's contract, and the kernels (and the cache append) bound
every address they form from it, so that a bad one computes nonsense but never reads or writes
outside the tensors a call was given (docs/api.md: which checks read values)."""

from __future__ import annotations

import os

import torch

from .errors import InvalidArgumentError

NATIVE = "[batch, heads, seq, head_dim]"
TOKEN_MAJOR = "[batch, seq, heads, head_dim]"


# The dtypes of q, k, v the fp16 kernel families read (bfloat16 through their bf16 kernels); the
# output has the inputs' dtype.
FLOAT_DTYPES = (torch.float16, torch.bfloat16)
FLOAT_NAMES = "float16 or bfloat16"


def check_dtype(name: str, t: torch.Tensor) -> None:
    """``t`` is a dense (strided, not nested) float16 or bfloat16 tensor."""
    check_dense(name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(f"{name} must be {FLOAT_NAMES}, got {t.dtype}")


def check_dense(name: str, t: torch.Tensor) -> None:
    """``t`` has a shape and strides: not nested, sparse or opaque (the kernels read strided memory)."""
    if t.is_nested:
        raise InvalidArgumentError(f"{name} is a nested tensor: the kernels read dense strided tensors (sequences of "
                                   "several lengths run packed, through flash_attn_varlen_func)")
    if t.layout is not torch.strided:
        raise InvalidArgumentError(f"{name} is of layout {t.layout}: the kernels read dense strided tensors (pass "
                                   f"{name}.to_dense())")


def check_same_dtype(*named: tuple[str, torch.Tensor]) -> None:
    """Every tensor has the first one's dtype: the kernels read one dtype (no mixed inputs)."""
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.dtype != first.dtype:
            raise InvalidArgumentError(f"{name} is {t.dtype} but {first_name} is {first.dtype}: "
                                       f"{', '.join(n for n, _ in named)} must share one dtype")


def check_fp16(name: str, t: object, layout: str) -> torch.Tensor:
    """A float16 or bfloat16 tensor of four dimensions; ``layout`` names them in the message."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_dtype(name, t)
    if t.dim() != 4:
        raise InvalidArgumentError(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}")
    return t


def check_rows(name: str, t: torch.Tensor) -> None:
    """The kernel's view [batch, heads, seq, head_dim]: contiguous rows on 16-byte multiples."""
    stride = t.stride()
    per16 = 16 // t.element_size()
    if stride[3] != 1 and t.shape[3] > 1:
        raise InvalidArgumentError(f"{name} must be contiguous in its last dimension, got strides {stride}")
    if stride[0] % per16 or stride[1] % per16 or stride[2] % per16:
        raise InvalidArgumentError(
            f"{name} rows must start on 16-byte boundaries: strides {stride[:3]} must be multiples of {per16} "
            f"elements and the data pointer 16-byte aligned")


def reach(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last, by its shape and strides."""
    shape, stride = t.shape, t.stride()
    if len(shape) == 4:  # the kernels' tensors, every call (memory checks, replays): unrolled, half the time
        a, b, c, d = shape
        w, x, y, z = stride
        return ((a - 1) * w + (b - 1) * x + (c - 1) * y + (d - 1) * z + 1) * t.element_size()
    return (sum((n - 1) * s for n, s in zip(shape, stride)) + 1) * t.element_size()


def check_memory(name: str, t: torch.Tensor) -> None:
    """The tensor has memory the kernel can read: a real pointer, a storage covering every element
    its shape and strides reach, no lazy negation or conjugation."""
    if t.is_neg() or t.is_conj():
        raise InvalidArgumentError(f"{name} is a lazily negated or conjugated view; pass {name}.resolve_neg() "
                                   "(or .resolve_conj())")
    if t.numel() == 0:
        return
    if t.data_ptr() == 0:
        raise InvalidArgumentError(f"{name} has no memory behind it (null data pointer: a freed or resized-away "
                                   "storage, or a meta tensor)")
    extent = t.storage_offset() * t.element_size() + reach(t)
    if extent > t.untyped_storage().nbytes():
        raise InvalidArgumentError(f"{name}'s shape {tuple(t.shape)} and strides {t.stride()} reach {extent} bytes "
                                   f"but its storage holds {t.untyped_storage().nbytes()}")


def can_read(t: torch.Tensor) -> bool:
    """Whether ``t``'s values can be read at all: not while torch.compile traces (a data-dependent
    branch breaks the graph) nor while a CUDA graph is captured (a device read is not allowed)."""
    return not (torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing()))


CHECK_ENV = "RDNATTENTION_CHECK"
_MODES = {"": "auto", "1": "always", "0": "never"}
_mode: str | None = None  # read from the environment at first use


def check_mode() -> str:
    """``auto`` (RDNATTENTION_CHECK unset or empty: CPU tensors' values are read, GPU tensors' are
    not), ``always`` (1) or ``never`` (0)."""
    global _mode
    if _mode is None:
        text = os.environ.get(CHECK_ENV, "").strip()
        if text not in _MODES:
            raise InvalidArgumentError(f"{CHECK_ENV}={text!r} must be 1 (read every index and scale value), 0 (read "
                                       "none) or unset (read those of CPU tensors only)")
        _mode = _MODES[text]
    return _mode


def reads(t: torch.Tensor) -> bool:
    """Whether the value checks of a call read ``t``'s values (check_mode), where they can be read."""
    mode = _mode or check_mode()
    if mode == "never":
        return False
    return (mode == "always" or t.device.type == "cpu") and can_read(t)


def check_int32(name: str, t: object, shape: tuple[int, ...] | int, device: torch.device) -> torch.Tensor:
    """An int32 tensor of ``shape`` (an int: its number of dimensions) on ``device``, contiguous rows."""
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    want = f"{shape}-D" if isinstance(shape, int) else str(tuple(shape))
    if t.dtype != torch.int32 or (t.dim() != shape if isinstance(shape, int) else tuple(t.shape) != tuple(shape)):
        raise InvalidArgumentError(f"{name} must be int32 {want}, got {t.dtype} {tuple(t.shape)}")
    if t.device != device:
        raise InvalidArgumentError(f"{name} is on {t.device}, q on {device}")
    if t.numel() > 1 and t.stride(-1) != 1:
        raise InvalidArgumentError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    return t


def _shown(t: torch.Tensor) -> str:
    """A refused index tensor's values for a message (read once more: the call fails anyway)."""
    return str(t.tolist()) if t.numel() <= 16 else f"{int(t.min())}..{int(t.max())}"


class Values:
    """Checks of the values of index and scale tensors, gathered, then read at once by
    :meth:`check`: the one place a call reads its arguments' values (every other check reads
    shapes, strides, dtypes and devices only). Only the values :func:`reads` allows are read (one
    read of a GPU tensor's would cost a device synchronisation); :meth:`check` says whether every
    value was. Each check method adds its reductions and returns self."""

    def __init__(self) -> None:
        self._scalars: list[torch.Tensor] = []
        self._tests: list[tuple[int, int, object]] = []
        self.unread = False  # a check skipped a tensor whose values were not read

    def _add(self, name: str, t: torch.Tensor, scalars: list[torch.Tensor], test) -> Values:
        check_memory(name, t)
        self._tests.append((len(self._scalars), len(scalars), test))
        self._scalars += [s.to(torch.float64).reshape(()) for s in scalars]
        return self

    def _readable(self, t: torch.Tensor | None) -> bool:
        if t is None or t.numel() == 0:
            return False
        if reads(t):
            return True
        self.unread = True
        return False

    def within(self, name: str, t: torch.Tensor | None, lo: int, hi: int, hi_name: str = "",
               rule: str | None = None) -> Values:
        """Every value in [lo, hi] (compared in Python: no integer wraps); ``hi_name`` names the
        upper bound in the message, ``rule`` replaces its statement of the bounds."""
        if not self._readable(t):
            return self

        def test(v: list[float]) -> None:
            if v[0] < lo or v[1] > hi:
                bound = f"{hi_name} = {hi}" if hi_name else str(hi)
                said = rule or f"{name} values must lie in [{lo}, {bound}]"
                got = f"{name} {_shown(t)}" if rule else _shown(t)
                raise InvalidArgumentError(f"{said}, got {got}")
        return self._add(name, t, [t.min(), t.max()], test)

    def offsets(self, name: str, cu: torch.Tensor | None, total: int, longest: int, longest_name: str) -> Values:
        """Offsets of packed sequences: they start at 0, never decrease, end within the ``total``
        packed rows, and no sequence is longer than ``longest`` (named ``longest_name``)."""
        if not self._readable(cu):
            return self
        wide = cu.long()
        steps = wide[1:] - wide[:-1]
        scalars = [wide[0], wide[-1]] + ([steps.min(), steps.max()] if steps.numel() else [])

        def test(v: list[float]) -> None:
            first, last = int(v[0]), int(v[1])
            least, most = (int(v[2]), int(v[3])) if len(v) > 2 else (0, 0)
            if first != 0 or least < 0:
                raise InvalidArgumentError(f"{name} must start at 0 and never decrease")
            if last > total:
                raise InvalidArgumentError(f"{name} ends at {last}, past the {total} packed rows")
            if most > longest:
                raise InvalidArgumentError(f"a sequence of {most} rows in {name} is longer than {longest_name} = "
                                           f"{longest}")
        return self._add(name, cu, scalars, test)

    def at_most(self, name: str, t: torch.Tensor | None, bound: torch.Tensor, what: str) -> Values:
        """``t`` at most ``bound`` (a tensor of its shape), element by element."""
        if not self._readable(t):
            return self

        def test(v: list[float]) -> None:
            if v[0] > 0:
                raise InvalidArgumentError(f"{name} must not exceed {what}")
        return self._add(name, t, [(t.long() - bound.long()).max()], test)

    def positive(self, name: str, t: torch.Tensor | None) -> Values:
        """Every value positive and finite (scales): the least above 0 (a NaN makes it NaN) and the
        greatest below infinity."""
        if not self._readable(t):
            return self

        def test(v: list[float]) -> None:
            if not (v[0] > 0 and v[1] < float("inf")):
                raise InvalidArgumentError(f"{name} must hold positive finite scales; it has a zero, negative, NaN "
                                           "or infinite value")
        return self._add(name, t, [t.min(), t.max()], test)

    def finite(self, name: str, t: torch.Tensor | None) -> Values:
        """Every value finite (ALiBi slopes, sinks): the least above -inf and the greatest below
        inf (a NaN makes both NaN)."""
        if not self._readable(t):
            return self

        def test(v: list[float]) -> None:
            if not (v[0] > -float("inf") and v[1] < float("inf")):
                raise InvalidArgumentError(f"{name} must hold finite values; it has a NaN or infinite value")
        return self._add(name, t, [t.min(), t.max()], test)

    def check(self) -> bool:
        """Reads every gathered reduction in one read and raises the first failed check's
        InvalidArgumentError (in the order the checks were added); returns whether every value the
        checks were given was read (none skipped by :func:`reads`)."""
        if self._scalars:
            values = torch.stack(self._scalars).tolist()
            for start, count, test in self._tests:
                test(values[start:start + count])
        return not self.unread


def check_values(name: str, t: torch.Tensor | None, lo: int, hi: int) -> None:
    """Values in [lo, hi] (where they are read: see reads), in one read."""
    Values().within(name, t, lo, hi).check()


def check_paged(k: torch.Tensor, v: torch.Tensor, block_table: object, batch: int, k_name: str,
                v_name: str) -> torch.Tensor:
    """A page pool [pages, page_size, heads_kv, head_dim] (page_size a power of two, K and V with one
    layout) and its int32 [batch, pages per sequence] table. Its values (pages of the pool) are
    checked where the call is run (Values)."""
    table = check_int32("block_table", block_table, 2, k.device)
    if table.shape[0] != batch:
        raise InvalidArgumentError(f"block_table has {table.shape[0]} rows; there are {batch} sequences")
    page = k.shape[1]
    if page < 1 or page & (page - 1):
        raise InvalidArgumentError(f"the page size ({k_name}.shape[1] = {page}) must be a power of two; "
                                   "16 to 256 are the sizes tested")
    if k.stride() != v.stride():
        raise InvalidArgumentError(f"paged {k_name} and {v_name} must share one layout, got strides {k.stride()} "
                                   f"and {v.stride()}")
    return table
