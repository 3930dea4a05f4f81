"""Find the built kernels for a target and choose one per call, from the build-time tables.

A table (``<target>/dispatch.json``) lists entries: a kernel, the key it serves (family,
head_dim, GQA group), optional constraints (``when``), a priority and where it came from. One
chooser, :meth:`TargetTable.select`, answers both which kernel runs a call and, when none can,
why not."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import IncompatibleKernelsError, KernelsNotBuiltError, UnsupportedError

_PACKAGE = Path(__file__).resolve().parent
_CHECKOUT = _PACKAGE.parent
TABLE_FORMAT = 2


@dataclass(frozen=True)
class Constraints:
    """When an entry applies. ``causal``: the call's mask hides keys after the query (a causal
    or causal-like window) or not; ``seq_q``: query length within [min, max] (max None: open)."""

    causal: bool | None = None
    seq_q: tuple[int, int | None] | None = None

    @classmethod
    def from_json(cls, data: dict) -> "Constraints":
        seq_q = data.get("seq_q")
        return cls(causal=data.get("causal"), seq_q=tuple(seq_q) if seq_q is not None else None)

    def to_json(self) -> dict:
        out: dict = {}
        if self.causal is not None:
            out["causal"] = self.causal
        if self.seq_q is not None:
            out["seq_q"] = list(self.seq_q)
        return out

    def covers(self, other: "Constraints") -> bool:
        """Whether every call ``other`` admits is admitted by this one too."""
        if self.causal is not None and self.causal != other.causal:
            return False
        if self.seq_q is None:
            return True
        if other.seq_q is None:
            return False
        (lo, hi), (olo, ohi) = self.seq_q, other.seq_q
        return lo <= olo and (hi is None or (ohi is not None and ohi <= hi))

    def overlaps(self, other: "Constraints") -> bool:
        """Whether some call is admitted by both."""
        if self.causal is not None and other.causal is not None and self.causal != other.causal:
            return False
        if self.seq_q is None or other.seq_q is None:
            return True
        (lo, hi), (olo, ohi) = self.seq_q, other.seq_q
        return (hi is None or olo <= hi) and (ohi is None or lo <= ohi)

    def admits(self, *, causal: bool, seq_q: int) -> bool:
        if self.causal is not None and self.causal != causal:
            return False
        if self.seq_q is not None:
            lo, hi = self.seq_q
            return seq_q >= lo and (hi is None or seq_q <= hi)
        return True

    def __str__(self) -> str:
        parts = []
        if self.causal is not None:
            parts.append("causal" if self.causal else "not causal")
        if self.seq_q is not None:
            lo, hi = self.seq_q
            parts.append(f"seq_q {lo}..{'' if hi is None else hi}")
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


@dataclass(frozen=True)
class TargetTable:
    target: str
    platform: str
    code_object: Path
    dynamic_lds: bool  # LDS is sized at launch (cuda) rather than in the code object
    kernels: tuple[KernelEntry, ...]
    isa_targets: tuple[str, ...] = ()  # targets whose GPUs run this code object unchanged

    def __post_init__(self) -> None:
        by_key: dict[tuple[str, int], list[KernelEntry]] = {}
        for e in self.kernels:
            by_key.setdefault((e.family, e.head_dim), []).append(e)
        object.__setattr__(self, "_by_key", {k: tuple(v) for k, v in by_key.items()})

    def select(self, family: str, *, head_dim: int, heads_per_kv: int, causal: bool, seq_q: int,
               kernel: str | None = None) -> KernelEntry:
        """The entry that serves a call: among those of the family and head_dim whose GQA group
        divides the query heads per K/V head and whose constraints admit the call, the largest
        group, then the highest priority. ``kernel`` forces one entry by name (it must fit)."""
        same = self._by_key.get((family, head_dim), ())
        if not same:
            dims = sorted({e.head_dim for e in self.kernels if e.family == family})
            raise UnsupportedError(f"no {family} kernel for head_dim {head_dim} on {self.target}; "
                                   f"built head_dims: {dims}")
        fits = [e for e in same if heads_per_kv % e.gqa_group == 0 and e.when.admits(causal=causal, seq_q=seq_q)]
        if kernel is not None:
            forced = [e for e in fits if e.name == kernel]
            if not forced:
                names = sorted({e.name for e in fits})
                raise UnsupportedError(f"kernel {kernel!r} does not serve this call on {self.target}; "
                                       f"kernels that do: {', '.join(names) or 'none'}")
            return forced[0]
        if not fits:
            offered = "; ".join(f"{e.name} (group {e.gqa_group}, {e.when})" for e in same)
            raise UnsupportedError(f"no {family} kernel on {self.target} serves head_dim {head_dim} with "
                                   f"{heads_per_kv} query heads per K/V head, causal={causal}, seq_q={seq_q}; "
                                   f"built: {offered}")
        return max(fits, key=lambda e: (e.gqa_group, e.priority))


def search_path() -> list[Path]:
    """Where built kernels are looked for: $RDNATTENTION_BUILD_DIR, the checkout's build/ (only when
    this runtime is imported from a source checkout), the package."""
    paths = []
    if os.environ.get("RDNATTENTION_BUILD_DIR"):
        paths.append(Path(os.environ["RDNATTENTION_BUILD_DIR"]))
    if (_CHECKOUT / "rdnattention_gen" / "variants.yaml").is_file():
        paths.append(_CHECKOUT / "build")
    paths.append(_PACKAGE / "lib")
    return paths


def _entry(e: dict) -> KernelEntry:
    return KernelEntry(
        name=e["name"], family=e["family"], head_dim=e["head_dim"], gqa_group=e["gqa_group"], tier=e["tier"],
        threads=e["threads"], br=e["br"], bc=e["bc"], tm=e["tm"], lds_bytes=e["lds_bytes"],
        priority=e["priority"], when=Constraints.from_json(e.get("when", {})), provenance=e["provenance"],
        args_digest=e["args_digest"])


def load_table(path: Path) -> TargetTable:
    """Reads one dispatch.json; refuses a table this runtime cannot launch, saying why."""
    from .families import FAMILIES

    rebuild = f"rebuild with: rdnattention-gen build --targets {path.parent.name}"
    try:
        data = json.loads(path.read_text())
        if data.get("format") != TABLE_FORMAT:
            raise IncompatibleKernelsError(f"{path}: table format {data.get('format')!r}, this runtime reads "
                                           f"format {TABLE_FORMAT}; {rebuild}")
        kernels = tuple(_entry(e) for e in data["kernels"] if e["family"] in FAMILIES)
        platform, code_object = data["platform"], path.parent / data["code_object"]
        dynamic_lds = bool(data["dynamic_lds"])
        isa_targets = tuple(data.get("isa_targets", ()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, IncompatibleKernelsError):
            raise
        raise IncompatibleKernelsError(f"{path}: unreadable dispatch table ({type(e).__name__}: {e}); {rebuild}") from None
    for e in kernels:
        ours = FAMILIES[e.family].ARGS.digest
        if e.args_digest != ours:
            raise IncompatibleKernelsError(
                f"{path}: kernel {e.name} was built for argument layout {e.args_digest}, this runtime's "
                f"{FAMILIES[e.family].ARGS.name} is {ours}; {rebuild}")
    return TargetTable(target=path.parent.name, platform=platform, code_object=code_object,
                       dynamic_lds=dynamic_lds, kernels=kernels, isa_targets=isa_targets)


def built_tables() -> list[Path]:
    """Every dispatch.json on the search path, in search order."""
    return [p for root in search_path() if root.is_dir() for p in sorted(root.glob("*/dispatch.json"))]


def fallback_chain(target: str) -> list[Path]:
    """The tables that could serve ``target``, best first: its own (by search order), then those of
    ISA-identical targets that list it (documented per target in docs/hardware.md)."""
    own = [root / target / "dispatch.json" for root in search_path() if (root / target / "dispatch.json").is_file()]
    others = []
    for path in built_tables():
        if path in own:
            continue
        try:
            if target in json.loads(path.read_text()).get("isa_targets", ()):
                others.append(path)
        except (OSError, ValueError, AttributeError):
            continue  # an unreadable table is reported when it is the one chosen
    return own + others


@functools.lru_cache(maxsize=None)
def table_for(target: str, device_name: str | None = None) -> TargetTable:
    for path in fallback_chain(target):
        table = load_table(path)
        if table.code_object.is_file():
            return table
    built = sorted({p.parent.name for p in built_tables()})
    gpu = f"{device_name} ({target})" if device_name else f"target {target!r}"
    looked = ", ".join(str(p) for p in search_path())
    raise KernelsNotBuiltError(
        f"no kernels built for {gpu} (looked in {looked}; built targets there: {', '.join(built) or 'none'}); "
        f"build them with: rdnattention-gen build --targets {target}")
