"""A target's dispatch table in memory and how it chooses a kernel within a family.

A table (built as ``<target>/dispatch.json``, found and loaded by dispatch.py) lists entries: a
kernel, the key it serves (family, the layout option it is compiled for, head_dim, GQA group),
optional constraints (``when``), a priority and where it came from. :meth:`TargetTable.select` answers both which entry of a family
runs a call and, when none can, why not. Which family serves a call is route.py's choice."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .errors import IncompatibleKernelsError, UnsupportedError

# Priority of an alternate: a kernel built beside the table's own (a host mirror of a GPU target's
# tile, a tuning candidate) that runs only when a call names it.
ALTERNATE = -1


def _range_covers(outer: tuple | None, inner: tuple | None) -> bool:
    if outer is None:
        return True
    if inner is None:
        return False
    (lo, hi), (ilo, ihi) = outer, inner
    return lo <= ilo and (hi is None or (ihi is not None and ihi <= hi))


def _range_overlaps(a: tuple | None, b: tuple | None) -> bool:
    if a is None or b is None:
        return True
    (lo, hi), (blo, bhi) = a, b
    return (hi is None or blo <= hi) and (bhi is None or lo <= bhi)


def _range_admits(r: tuple | None, value: int) -> bool:
    return r is None or (value >= r[0] and (r[1] is None or value <= r[1]))


@dataclass(frozen=True)
class Constraints:
    """When an entry applies. ``causal``: the call's mask hides keys after the query (a causal
    or causal-like window) or not; ``seq_q``: query length within [min, max] (max None: open);
    ``rows``: query rows per K/V head (query heads per K/V head times seq_q) within [min, max]."""

    causal: bool | None = None
    seq_q: tuple[int, int | None] | None = None
    rows: tuple[int, int | None] | None = None

    @classmethod
    def from_json(cls, data: dict) -> "Constraints":
        seq_q, rows = data.get("seq_q"), data.get("rows")
        return cls(causal=data.get("causal"), seq_q=tuple(seq_q) if seq_q is not None else None,
                   rows=tuple(rows) if rows is not None else None)

    def to_json(self) -> dict:
        out: dict = {}
        if self.causal is not None:
            out["causal"] = self.causal
        if self.seq_q is not None:
            out["seq_q"] = list(self.seq_q)
        if self.rows is not None:
            out["rows"] = list(self.rows)
        return out

    def covers(self, other: "Constraints") -> bool:
        """Whether every call ``other`` admits is admitted by this one too."""
        if self.causal is not None and self.causal != other.causal:
            return False
        return _range_covers(self.seq_q, other.seq_q) and _range_covers(self.rows, other.rows)

    def overlaps(self, other: "Constraints") -> bool:
        """Whether some call is admitted by both."""
        if self.causal is not None and other.causal is not None and self.causal != other.causal:
            return False
        return _range_overlaps(self.seq_q, other.seq_q) and _range_overlaps(self.rows, other.rows)

    def admits(self, *, causal: bool, seq_q: int, rows: int | None = None) -> bool:
        """``rows`` defaults to seq_q (one query head per K/V head)."""
        if self.causal is not None and self.causal != causal:
            return False
        return _range_admits(self.seq_q, seq_q) and _range_admits(self.rows, seq_q if rows is None else rows)

    def __str__(self) -> str:
        parts = []
        if self.causal is not None:
            parts.append("causal" if self.causal else "not causal")
        for name, r in (("seq_q", self.seq_q), ("rows", self.rows)):
            if r is not None:
                lo, hi = r
                parts.append(f"{name} {lo}..{'' if hi is None else hi}")
        return ", ".join(parts) or "always"


@dataclass(frozen=True)
class KernelEntry:
    name: str
    family: str
    head_dim: int
    gqa_group: int
    tier: str
    threads: int
    br: int
    bc: int
    tm: int
    lds_bytes: int
    priority: int
    when: Constraints
    provenance: str
    args_digest: str
    # The family's layout option the kernel is compiled for (a key of the family's LAYOUTS: f16's
    # len and varlen, dec's paged); None: the plain kernels.
    layout: str | None = None
    # The family's input dtype option the kernel is compiled for (a key of the family's DTYPES:
    # bf16); None: the family's own, fp16.
    dtype: str | None = None
    # The family's score-transform option the kernel is compiled with (a key of the family's SCORES:
    # f16's alibi); None: the kernels without one.
    score: str | None = None

    @property
    def kind(self) -> str:
        """The family, its layout, its dtype and its score option where the kernel has them, as
        messages say it: ``dec paged``, ``f16 len bf16``, ``f16 varlen alibi``."""
        return kind(self.family, self.layout, self.dtype, self.score)


def kind(family: str, layout: str | None, dtype: str | None = None, score: str | None = None) -> str:
    return " ".join(x for x in (family, layout, dtype, score) if x is not None)


@dataclass(frozen=True)
class TargetTable:
    target: str
    platform: str
    code_object: Path
    dynamic_lds: bool  # LDS is sized at launch (cuda) rather than in the code object
    kernels: tuple[KernelEntry, ...]
    # Targets of the same instruction set; their GPUs run this code object only when they report
    # ``target`` (HSA_OVERRIDE_GFX_VERSION), since HIP matches the exact ISA.
    isa_targets: tuple[str, ...] = ()
    # The most query rows a split-KV tile of this target applies ALiBi in (its build's
    # FA2_DECODE_ALIBI_ROWS); a table without it: 2, which every build's tiles of two rows apply.
    decode_alibi_rows: int = 2
    code_object_bytes: int | None = None   # recorded at build time; None: not checked (tables made in code)
    code_object_sha256: str | None = None
    code_object_version: int | None = None  # the AMD code object ABI it is built for; None: not pinned

    def __post_init__(self) -> None:
        by_key: dict[tuple[str, str | None, str | None, str | None, int], list[KernelEntry]] = {}
        for e in self.kernels:
            by_key.setdefault((e.family, e.layout, e.dtype, e.score, e.head_dim), []).append(e)
        object.__setattr__(self, "_by_key", {k: tuple(v) for k, v in by_key.items()})

    def shared_bytes(self, entry: KernelEntry) -> int:
        """The dynamic LDS a launch of ``entry`` asks for: its layout's bytes where LDS is sized at
        launch, 0 where the code object allocates it."""
        return entry.lds_bytes if self.dynamic_lds else 0

    def entries(self, family: str, head_dim: int, layout: str | None = None,
                dtype: str | None = None, score: str | None = None) -> tuple[KernelEntry, ...]:
        """Every entry of ``family`` compiled for ``layout``, ``dtype`` (None: fp16) and ``score``
        (None: no score option) at ``head_dim`` (alternates included): whether those kernels are
        built there."""
        return self._by_key.get((family, layout, dtype, score, head_dim), ())

    def head_dims(self, family: str, layout: str | None = None, dtype: str | None = None,
                  score: str | None = None) -> list[int]:
        """The head_dims ``family``'s kernels compiled for ``layout``, ``dtype`` and ``score`` are
        built for."""
        return sorted({e.head_dim for e in self.kernels
                       if e.family == family and e.layout == layout and e.dtype == dtype and e.score == score})

    def named(self, name: str) -> KernelEntry | None:
        """The entry of kernel ``name``, or None when the table has no such kernel."""
        return next((e for e in self.kernels if e.name == name), None)

    def select(self, family: str, *, head_dim: int, heads_per_kv: int, causal: bool, seq_q: int,
               kernel: str | None = None, rows: int | None = None, layout: str | None = None,
               dtype: str | None = None, score: str | None = None) -> KernelEntry:
        """The entry that serves a call: among those of the family compiled for ``layout``, ``dtype``
        (None: fp16) and ``score`` (None: no score option) at head_dim whose GQA group divides the query heads per K/V head and whose constraints admit
        the call, the largest group, then the highest priority. ``kernel`` forces one entry by name (it must fit); entries
        of negative priority (alternates: host mirrors of GPU tiles, tuning candidates) run only so."""
        same = self._by_key.get((family, layout, dtype, score, head_dim), ())
        if not same:
            raise UnsupportedError(f"no {kind(family, layout, dtype, score)} kernel for head_dim {head_dim} on "
                                   f"{self.target}; built head_dims: {self.head_dims(family, layout, dtype, score)}")
        if rows is None:
            rows = heads_per_kv * seq_q
        fits = [e for e in same
                if heads_per_kv % e.gqa_group == 0 and e.when.admits(causal=causal, seq_q=seq_q, rows=rows)]
        if kernel is not None:
            forced = [e for e in fits if e.name == kernel]
            if not forced:
                names = sorted({e.name for e in fits})
                raise UnsupportedError(f"kernel {kernel!r} does not serve this call on {self.target}; "
                                       f"kernels that do: {', '.join(names) or 'none'}")
            return forced[0]
        fits = [e for e in fits if e.priority > ALTERNATE]  # alternates serve only calls that name them
        if not fits:
            offered = "; ".join(f"{e.name} (group {e.gqa_group}, {e.when})" for e in same)
            raise UnsupportedError(f"no {kind(family, layout, dtype, score)} kernel on {self.target} serves head_dim "
                                   f"{head_dim} "
                                   f"with {heads_per_kv} query heads per K/V head, causal={causal}, seq_q={seq_q}; "
                                   f"built: {offered}")
        return max(fits, key=lambda e: (e.gqa_group, e.priority))

    def verify_code_object(self) -> None:
        """The code object is the file the table was built with: same size, same SHA-256. Loading
        a truncated or replaced one would crash the process (SIGBUS) or run the wrong kernels."""
        if self.code_object_bytes is None:
            return
        rebuild = f"rebuild with: rdnattention-gen build --targets {self.target}"
        try:
            data = self.code_object.read_bytes()
        except OSError as e:
            raise IncompatibleKernelsError(f"{self.code_object}: cannot be read ({e.strerror}); {rebuild}") from None
        if len(data) != self.code_object_bytes:
            raise IncompatibleKernelsError(f"{self.code_object}: {len(data)} bytes, its dispatch table records "
                                           f"{self.code_object_bytes} (truncated or replaced); {rebuild}")
        if hashlib.sha256(data).hexdigest() != self.code_object_sha256:
            raise IncompatibleKernelsError(f"{self.code_object}: SHA-256 differs from the one its dispatch table "
                                           f"records (modified or replaced); {rebuild}")
