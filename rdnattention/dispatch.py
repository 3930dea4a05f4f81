"""Where built kernels are and how their tables are loaded: the kernel directories searched in
order, each target's ``dispatch.json`` read and checked against this runtime (format, argument
layouts, kernel names, the code object's size and hash), and the table that serves a target. What
a loaded table is and how it chooses a kernel: table.py."""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from dataclasses import dataclass, fields
from pathlib import Path

from .errors import IncompatibleKernelsError, KernelsNotBuiltError, StaleKernelsError
from .families import FAMILIES
from .table import ALTERNATE, Constraints, KernelEntry, TargetTable

_PACKAGE = Path(__file__).resolve().parent
_CHECKOUT = _PACKAGE.parent
# The oldest ROCm whose HIP loads each AMD code object version: hipModuleLoadData first asks comgr
# for the code object's ISA, and comgr 5.2.x reads v3 and v4 only (v5 from ROCm 5.3, though ROCr's
# own loader took v5 from 5.2); v6 (generic targets) from ROCm 6.2. The generator builds v4. This is
# the one statement of the floor: docs/hardware.md and `rdnattention info` print rocm_floor().
ROCM_LOADS = {4: (4, 1), 5: (5, 3), 6: (6, 2)}
# AMD code-object versions a table may record that this runtime launches (None: not an AMD code object).
LOADABLE_CODE_OBJECT_VERSIONS = (None, 4, 5)
TABLE_FORMAT = 6  # 3: the code object's size and SHA-256 are recorded; 4: entries name their layout option;
# 5: and their dtype option; 6: and their score option


def rocm_floor(version: int) -> str:
    """Which ROCm loads AMD code object ``version``, as one phrase."""
    return (f"AMD code object v{version} loads on ROCm {_rocm(version)} and later"
            + (", every 6.x included" if ROCM_LOADS[version] < (6, 0) else ""))


def _rocm(version: int) -> str:
    return ".".join(map(str, ROCM_LOADS[version]))


BUILD_DIR_ENV = "RDNATTENTION_BUILD_DIR"
ENTRY_POINT_GROUP = "rdnattention.kernels"  # kernel distributions: name = package holding <target>/ dirs


def user_kernel_dir() -> Path:
    """Where `rdnattention-gen build --user` writes: $XDG_DATA_HOME/rdnattention/kernels (default
    ~/.local/share/rdnattention/kernels). A relative XDG_DATA_HOME is ignored, as the XDG base
    directory specification says: kernels (native code on the host) are never looked for relative
    to the current directory."""
    base = os.environ.get("XDG_DATA_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "rdnattention" / "kernels"


@dataclass(frozen=True)
class KernelRoot:
    path: Path    # holds <target>/dispatch.json and the code object beside it
    source: str   # where it comes from, for messages and `rdnattention info`


def _in_checkout() -> bool:
    """Whether this runtime is imported from a source checkout (not from an installed wheel)."""
    return (_CHECKOUT / "rdnattention_gen" / "variants.yaml").is_file() and (_CHECKOUT / "pyproject.toml").is_file()


def kernel_roots() -> list[KernelRoot]:
    """Every place built kernels are looked for, in order: $RDNATTENTION_BUILD_DIR; the source
    checkout's build/ (only when this runtime is imported from a checkout); the per-user directory;
    each installed kernel distribution (entry-point group ``rdnattention.kernels``); the package."""
    roots = []
    if os.environ.get(BUILD_DIR_ENV):
        roots.append(KernelRoot(Path(os.environ[BUILD_DIR_ENV]), BUILD_DIR_ENV))
    if _in_checkout():
        roots.append(KernelRoot(_CHECKOUT / "build", "source checkout"))
    roots.append(KernelRoot(user_kernel_dir(), "user directory (rdnattention-gen build --user)"))
    roots += _distributions()
    roots.append(KernelRoot(_PACKAGE / "lib", "rdnattention package"))
    return roots


_skipped: set[str] = set()


def _skip(what: str, e: BaseException) -> None:
    """A search-path entry that cannot be read is skipped, with one warning per entry."""
    message = f"{what} skipped: {type(e).__name__}: {e}"
    if message not in _skipped:
        _skipped.add(message)
        warnings.warn(f"rdnattention: {message}", RuntimeWarning, stacklevel=3)


def _distributions() -> list[KernelRoot]:
    """Installed kernel distributions, by name. One whose package cannot be found is skipped (it is
    reported by `rdnattention info`), and one that cannot be read (its package raises on import, its
    metadata is broken) is skipped with a warning: it never stops the others."""
    from importlib.metadata import entry_points
    from importlib.util import find_spec

    try:
        eps = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
    except Exception as e:  # noqa: BLE001 - broken metadata of some distribution
        _skip(f"kernel distributions (entry points {ENTRY_POINT_GROUP})", e)
        return []
    roots = []
    for ep in eps:
        try:
            spec = find_spec(ep.value)
            if spec is None or not spec.submodule_search_locations:
                continue
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else ep.name
            roots.append(KernelRoot(Path(list(spec.submodule_search_locations)[0]), f"distribution {dist}"))
        except (ImportError, ValueError):
            continue
        except Exception as e:  # noqa: BLE001 - a package whose import raises must not stop the others
            _skip(f"kernel distribution {ep.name!r} ({ep.value})", e)
    return roots


def search_path() -> list[Path]:
    """The directories of kernel_roots(), in order."""
    return [r.path for r in kernel_roots()]


_INT_FIELDS = tuple(f.name for f in fields(KernelEntry) if f.type == "int")
_STR_FIELDS = tuple(f.name for f in fields(KernelEntry) if f.type == "str")


def _entry(e: dict, i: int) -> KernelEntry:
    """One table entry, its fields typed (a wrong type is a ValueError naming entry and field)."""
    if not isinstance(e, dict):
        raise ValueError(f"kernels[{i}] is not an object")
    missing = [key for key in _INT_FIELDS + _STR_FIELDS if key not in e]
    if missing:
        raise ValueError(f"kernels[{i}] has no {', '.join(missing)}")
    for key in _INT_FIELDS:
        if type(e.get(key)) is not int or e[key] < (ALTERNATE if key == "priority" else 0):
            what = "an integer of at least -1 (an alternate)" if key == "priority" else "a non-negative integer"
            raise ValueError(f"kernels[{i}].{key} = {e.get(key)!r} is not {what}")
    for key in _STR_FIELDS:
        if type(e.get(key)) is not str:
            raise ValueError(f"kernels[{i}].{key} = {e.get(key)!r} is not a string")
    when = e.get("when", {})
    if not isinstance(when, dict):
        raise ValueError(f"kernels[{i}].when is not an object")
    layout = e.get("layout")
    if layout is not None and type(layout) is not str:
        raise ValueError(f"kernels[{i}].layout = {layout!r} is not a string or null")
    dtype = e.get("dtype")
    if dtype is not None and type(dtype) is not str:
        raise ValueError(f"kernels[{i}].dtype = {dtype!r} is not a string or null")
    score = e.get("score")
    if score is not None and type(score) is not str:
        raise ValueError(f"kernels[{i}].score = {score!r} is not a string or null")
    return KernelEntry(
        name=e["name"], family=e["family"], head_dim=e["head_dim"], gqa_group=e["gqa_group"], tier=e["tier"],
        threads=e["threads"], br=e["br"], bc=e["bc"], tm=e["tm"], lds_bytes=e["lds_bytes"],
        priority=e["priority"], when=Constraints.from_json(when), provenance=e["provenance"],
        args_digest=e["args_digest"], layout=layout, dtype=dtype, score=score)


def _check_entry(path: Path, i: int, e: KernelEntry, wave_size: object, rebuild: str) -> None:
    """The entry says what its kernel's name says (a kernel launched with another tile or head_dim
    than it was compiled for reads and writes out of bounds), and its arguments are ours."""
    fam = FAMILIES[e.family]
    facts = fam.NAMES.parse(e.name)
    if facts is None:
        raise IncompatibleKernelsError(f"{path}: kernels[{i}].name {e.name!r} is not a {e.family} kernel name; "
                                       f"{rebuild}")
    if e.gqa_group < 1 or e.threads < 1 or e.br < 1 or e.bc < 1 or e.tm < 1 or e.br % e.gqa_group:
        raise IncompatibleKernelsError(f"{path}: kernels[{i}] ({e.name}) has an impossible tile: group "
                                       f"{e.gqa_group}, br {e.br}, bc {e.bc}, threads {e.threads}, tm {e.tm}; "
                                       f"{rebuild}")
    layouts = getattr(fam, "LAYOUTS", {})
    if e.layout is not None and e.layout not in layouts:
        raise IncompatibleKernelsError(f"{path}: kernels[{i}].layout {e.layout!r} is not a layout of family "
                                       f"{e.family} (it has {', '.join(sorted(layouts)) or 'none'}); {rebuild}")
    if e.layout != facts.get("options.layout"):
        raise IncompatibleKernelsError(f"{path}: kernels[{i}].layout is {e.layout!r} but kernel {e.name} was built "
                                       f"for {facts.get('options.layout')!r}; {rebuild}")
    if e.dtype != facts.get("options.dtype"):
        raise IncompatibleKernelsError(f"{path}: kernels[{i}].dtype is {e.dtype!r} but kernel {e.name} was built "
                                       f"for {facts.get('options.dtype')!r}; {rebuild}")
    if e.score != facts.get("options.score"):
        raise IncompatibleKernelsError(f"{path}: kernels[{i}].score is {e.score!r} but kernel {e.name} was built "
                                       f"for {facts.get('options.score')!r}; {rebuild}")
    for key, value in facts.items():
        field = key.rsplit(".", 1)[-1]
        recorded = wave_size if field == "wave_size" else getattr(e, field, value)
        if recorded != value:
            where = "wave_size" if field == "wave_size" else f"kernels[{i}].{field}"
            raise IncompatibleKernelsError(f"{path}: {where} is {recorded!r} but kernel {e.name} was built for "
                                           f"{value!r}; {rebuild}")
    needed = fam.lds_bytes(facts)
    if e.lds_bytes != needed:
        raise IncompatibleKernelsError(f"{path}: kernels[{i}].lds_bytes is {e.lds_bytes} but kernel {e.name} uses "
                                       f"{needed}; {rebuild}")
    if e.args_digest != fam.ARGS.digest:
        raise StaleKernelsError(
            f"{path}: kernel {e.name} was built for argument layout {e.args_digest}, this runtime's "
            f"{fam.ARGS.name} is {fam.ARGS.digest}; {rebuild}")


def load_table(path: Path | str) -> TargetTable:
    """Reads one dispatch.json; refuses a table this runtime cannot launch, saying why and naming
    the file and field."""
    path = Path(path)
    rebuild = f"rebuild with: rdnattention-gen build --targets {path.parent.name}"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("format") != TABLE_FORMAT:
            raise StaleKernelsError(f"{path}: table format {data.get('format')!r}, this runtime reads "
                                           f"format {TABLE_FORMAT}; {rebuild}")
        entries = data["kernels"]
        if not isinstance(entries, list):
            raise ValueError("kernels is not a list")
        kernels = tuple(_entry(e, i) for i, e in enumerate(entries))
        platform, code_object = data["platform"], data["code_object"]
        if not isinstance(code_object, str) or Path(code_object).name != code_object or code_object in ("", ".", ".."):
            raise ValueError(f"code_object {code_object!r} is not a file name beside the table")
        size, sha = data["code_object_bytes"], data["code_object_sha256"]
        if type(size) is not int or not isinstance(sha, str):
            raise ValueError("code_object_bytes / code_object_sha256 have the wrong types")
        isa_targets = data.get("isa_targets", [])
        if not isinstance(isa_targets, list) or not all(isinstance(t, str) for t in isa_targets):
            raise ValueError("isa_targets is not a list of target names")
        decode_alibi_rows = data.get("decode_alibi_rows", 2)
        if type(decode_alibi_rows) is not int or decode_alibi_rows < 1:
            raise ValueError(f"decode_alibi_rows {decode_alibi_rows!r} is not a positive integer")
        code_object_version = data.get("code_object_version")
        if code_object_version is not None and type(code_object_version) is not int:
            raise ValueError(f"code_object_version {code_object_version!r} is not an integer or null")
        if code_object_version not in LOADABLE_CODE_OBJECT_VERSIONS:
            loads = (f" (loads on ROCm {_rocm(code_object_version)} and later)"
                     if code_object_version in ROCM_LOADS else "")
            ours = " and ".join(f"v{v} (ROCm {_rocm(v)} and later)" for v in LOADABLE_CODE_OBJECT_VERSIONS if v)
            raise StaleKernelsError(f"{path}: AMD code object v{code_object_version}{loads}; this runtime launches "
                                    f"{ours}; {rebuild}")
        table = TargetTable(target=path.parent.name, platform=str(platform), code_object=path.parent / code_object,
                            dynamic_lds=bool(data["dynamic_lds"]),
                            kernels=tuple(e for e in kernels if e.family in FAMILIES),
                            isa_targets=tuple(isa_targets), code_object_bytes=size, code_object_sha256=sha,
                            code_object_version=code_object_version, decode_alibi_rows=decode_alibi_rows)
    except (OSError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, StaleKernelsError):
            raise
        raise IncompatibleKernelsError(f"{path}: unreadable dispatch table ({type(e).__name__}: {e}); {rebuild}") from None
    for i, e in enumerate(kernels):
        if e.family in FAMILIES:
            _check_entry(path, i, e, data.get("wave_size"), rebuild)
    return table


def built_tables() -> list[Path]:
    """Every dispatch.json on the search path, in search order (a directory that cannot be listed is
    skipped with a warning)."""
    found = []
    for root in search_path():
        try:
            if root.is_dir():
                found += sorted(root.glob("*/dispatch.json"))
        except OSError as e:
            _skip(f"kernel directory {root}", e)
    return found


def fallback_chain(target: str) -> list[Path]:
    """The tables that could serve ``target``, best first: its own, in search order. Never another
    target's, not even one of the same instruction set (gfx1030's for a gfx1034): HIP runs a code
    object only on a GPU that reports the exact ISA it names (ROCclr's Isa::isCompatible, ROCr's
    agent check). Such tables are named in the error instead (same_isa_tables)."""
    return [root / target / "dispatch.json" for root in search_path() if (root / target / "dispatch.json").is_file()]


def same_isa_tables(target: str) -> list[Path]:
    """Other targets' AMD tables built for ``target``'s instruction set (their ``isa_targets`` list it):
    a GPU of ``target`` runs them when HSA_OVERRIDE_GFX_VERSION makes it report their target."""
    found = []
    for path in built_tables():
        if path.parent.name == target:
            continue
        try:
            data = json.loads(path.read_text())
            isa_targets = data.get("isa_targets") or ()
            if data.get("platform") == "amdgcn" and isinstance(isa_targets, list) and target in isa_targets:
                found.append(path)
        except (OSError, ValueError, AttributeError, TypeError):
            continue  # a hint only: an unreadable table is reported when it is the one chosen
    return found


def hsa_override_value(target: str) -> str:
    """The HSA_OVERRIDE_GFX_VERSION that makes a GPU report ``target``: gfx1030 -> 10.3.0, gfx90c -> 9.0.12
    (the inverse of drivers.hip.override_arch)."""
    m = re.fullmatch(r"gfx(\d+)([0-9a-f])([0-9a-f])", target)
    if not m:
        raise ValueError(f"{target!r} is not a gfx target")
    return f"{int(m[1])}.{int(m[2], 16)}.{int(m[3], 16)}"


def _table_for(target: str, device_name: str | None = None) -> TargetTable:
    """The first table on the search path that serves ``target`` and that this runtime can use.
    Tables of another version (StaleKernelsError) are skipped with a warning; a damaged or
    inconsistent table or code object is an error, never skipped."""
    stale: list[str] = []
    for path in fallback_chain(target):
        try:
            table = load_table(path)
        except StaleKernelsError as e:
            stale.append(str(e))
            continue
        if table.code_object.is_file():
            table.verify_code_object()
            if stale:
                warnings.warn("skipped kernels this runtime cannot use: " + " | ".join(stale) +
                              f"; using {path}", RuntimeWarning, stacklevel=2)
            return table
    if stale:
        raise StaleKernelsError(" | ".join(stale))
    built = sorted({p.parent.name for p in built_tables()})
    gpu = f"{device_name} ({target})" if device_name else f"target {target!r}"
    looked = ", ".join(str(p) for p in search_path())
    if _in_checkout():
        how = f"build them with: rdnattention-gen build --targets {target}"
    elif target.startswith("host"):  # the emulator is built on the machine that runs it
        how = f"build them with clang-22 and rdnattention[gen]: rdnattention-gen build --user --targets {target}"
    else:  # an installed runtime: a kernel wheel, or the per-user directory
        how = (f"install the rdnattention-kernels wheel that carries {target} (docs/hardware.md), or build them "
               f"with clang-22 and rdnattention[gen]: rdnattention-gen build --user --targets {target}")
    same_isa = sorted({p.parent.name for p in same_isa_tables(target)})
    if same_isa:
        how += (f"; or run {same_isa[0]}'s kernels (the same instruction set) by making the GPU report "
                f"{same_isa[0]}: HSA_OVERRIDE_GFX_VERSION={hsa_override_value(same_isa[0])} (HIP loads a code object "
                "only on a GPU that reports the exact ISA it was built for)")
    raise KernelsNotBuiltError(
        f"no kernels built for {gpu} (looked in {looked}; built targets there: {', '.join(built) or 'none'}); {how}")


class _Tables:
    """table_for's memo, by target (and device name): clearing it (``table_for.cache_clear()``)
    also moves ``generation`` on, so that the tables route.device_table keeps per device are looked
    up again."""

    def __init__(self, load):
        self._load = functools.lru_cache(maxsize=None)(load)
        self.generation = 0
        functools.update_wrapper(self, load)

    def __call__(self, target: str, device_name: str | None = None) -> TargetTable:
        return self._load(target, device_name)

    def cache_clear(self) -> None:
        self.generation += 1
        self._load.cache_clear()


table_for = _Tables(_table_for)
