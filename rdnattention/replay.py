"""The eager fast path of every entry point: a call of a geometry already validated and planned
replays that plan's launches with its own pointers, skipping validation and planning.

An entry point keys its calls (:func:`key`): everything validation and planning read, which is
the target's table, the shapes, strides, dtypes and devices of its tensors, and its options with
their types (so that True and 1 stay different keys). A call whose key was seen runs the
remembered :class:`Replay`: per call it checks only what can change between calls of one key,
the data pointers and the memory behind them (:func:`pointers`; anything wrong sends the call
down the full path, which raises the error), and the index values where they are read
(checks.reads); then it allocates its outputs and launches. Each launch's argument struct is a
copy of the planned one with its pointer fields rewritten: the entry point supplies each tensor
by the field it fills (q, k, v, o, lse, seqused_k, ...; :func:`remember` keeps a plan only where
every pointer field is one the entry point supplies), and a split-KV call's part_o, part_lse
and counters point into its stream's workspace (workspace.py). Kernel handles are the drivers' (loaded once
per code object and device). Entry points whose calls repeat one geometry (transformers' attention
function, the SDPA patch) run a replay that its own guard recognises through :func:`express`: the
same checks and the launch, in one frame."""

from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass
from types import ModuleType

import torch

from . import checks, drivers, route, workspace
from .drivers import module_api
from .errors import RdnaAttentionError
from .plan import Launch, Plan
from .plan import _check_grid as check_grid
from .table import TargetTable

CACHE_LIMIT = 1024
SCRATCH_FIELDS = ("part_o", "part_lse", "counters")


# Step and Replay are never written once made, but not frozen: relength makes one of each at every
# new length of a growing cache, and a frozen dataclass costs five times as much to make (a named
# tuple, half as much, but each field read costs twice as much, on every replayed call).
@dataclass(eq=False, slots=True)
class Step:
    """One launch of a replay: its kernel, grid and planned arguments, and the pointer fields each
    call rewrites."""

    name: str
    grid: tuple[int, int, int]
    block: int
    shared_bytes: int
    args: ctypes.Structure  # copied per call, never written
    fields: tuple[str, ...]
    function: object = None  # the kernel's handle on a GPU (the driver's function), loaded when kept
    index: int = 0  # the GPU it was loaded on
    go: object = None  # on a GPU, the handle's launch over this grid (the driver's bound): go(args, stream)


@dataclass(eq=False, slots=True)
class Replay:
    """A plan kept for the calls of one key: everything but the pointers."""

    table: TargetTable  # kept alive, so that the id() in the key is never reused
    driver: ModuleType
    steps: tuple[Step, ...]
    scratch_bytes: int  # split-KV scratch of one call; 0: none
    scratch_lse: int
    counters: int  # split-KV counters of one call (workspace.scratch)
    reach: tuple[tuple[int, int], ...]  # (bytes spanned, element size) of each checked tensor (pointers)
    extra: object = None  # what the entry point keeps beside: what validation made of the options
    lengths: object = None  # how its launches follow the keys' length (Plan.lengths), or None
    like: tuple = ()  # stand-ins of a call's outputs (stand_in), made by the entry point at the first replay
    guard: Guard | bool | None = None  # made at its key's second call in a row (key()); False: none can be
    express: object = None  # express()'s function, made once


# Calls already validated and planned, by key().
cache: dict[tuple, Replay] = {}


@dataclass(eq=False, slots=True)
class Following:
    """The replays of calls that differ only in the keys' length (and the K/V strides that follow it),
    by_length's entry for their length_free key: a decode step on a cache that grows by a key per
    step (transformers' DynamicCache in generate()) is a new key at every step, and would otherwise
    be validated and planned at every step. ``last`` is the key of the call last served and its
    replay, one tuple replaced whole (so that threads read a consistent pair): the other layers of
    that step (the same key) replay it as it is, and the next length derives its own from it
    (relength). Only the last is kept: replays of lengths that pass are freed as they go, rather
    than piling up as objects the garbage collector scans."""

    free: tuple  # the length_free key
    last: tuple[tuple, Replay]
    positions: tuple[int, int]  # K's and V's places among the key's tensors (4-dimensional)
    seq_dim: int  # their length's dimension in the key's layout
    per16: int  # their elements in 16 bytes
    residues: tuple[int, ...]  # the first three strides of K, then of V, modulo per16 (length_free)
    aligned16: bool  # every residue 0: each of those strides a whole number of 16 bytes
    guard: Guard | bool | None = None  # recognises the entry's calls at any length (key()); False: none can be
    express: tuple | None = None  # (express()'s arguments, _follower's function), made once

    @classmethod
    def of(cls, free: tuple, key: tuple, r: Replay, positions: tuple[int, int], seq_dim: int) -> Following:
        """The entry of ``free`` (length_free's key of ``key``, the call ``r`` was planned for): its
        residues are those ``free`` keeps of K and V, which follow() checks inline."""
        k, v = free[2 + positions[0]], free[2 + positions[1]]  # (rest, last stride, residues..., dtype, device)
        residues = (*k[2:5], *v[2:5])
        return cls(free, (key, r), positions, seq_dim, 16 // k[5].itemsize, residues, not any(residues))


# By length_free(key); replaced whole past CACHE_LIMIT entries, as the cache is.
by_length: dict[tuple, Following] = {}


# torch.jit.is_tracing() outside TorchScript (where this module never runs), without its Python frame
_is_tracing = getattr(torch._C, "_is_tracing", None) or torch.jit.is_tracing
_Tensor = torch.Tensor


def tracing() -> bool:
    return torch.compiler.is_compiling() or _is_tracing()


# Whether autocast is on for any device type, in one call (asking about one device costs its device
# object, its type and the per-type query): the replays that run before their entry point's autocast
# handling test it first. True where torch lacks it, so that the per-type query decides.
autocast_on = getattr(torch._C, "_is_any_autocast_enabled", None) or (lambda: True)


CONTIGUOUS = torch.contiguous_format


def stand_in(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape``, ``dtype`` and ``device`` with one element of memory (expanded), whose
    ``torch.empty_like(stand_in, memory_format=CONTIGUOUS)`` is a new contiguous tensor like it: the
    cheapest allocation of a replayed call's outputs (half what torch.empty or Tensor.new_empty cost,
    which parse their arguments per call). A replay keeps its outputs' (Replay.like)."""
    return torch.empty((), dtype=dtype, device=device).expand(shape)


def keep_stand_ins(r: Replay, device: torch.device, *outputs: tuple | None) -> tuple:
    """Makes and keeps ``r``'s stand-ins (Replay.like), one per output, given as (shape, dtype) on
    ``device`` (None stays None), and returns them: an entry point's first replay of ``r`` calls it,
    as ``r.like or keep_stand_ins(r, ...)``, so that the shapes are computed only then."""
    r.like = tuple(None if o is None else stand_in(o[0], o[1], device) for o in outputs)
    return r.like


def key(kind: str, device: torch.device, tensors: tuple, options: tuple) -> tuple | None:
    """The key of a call of entry point ``kind`` on ``device`` with ``tensors`` (None where absent)
    and ``options`` (hashable, with their types where validation distinguishes them), or None
    where it may not replay: tensor subclasses, gradients, tracing, a device without kernels.
    A call like the one before it (the layers of a decode step) is recognised by that key's
    :class:`Guard`, without reading its tensors' attributes one by one; a call of the length_free
    key last followed, at any length, by that entry's (Following.guard)."""
    if torch.compiler.is_compiling() or _is_tracing():
        return None
    g = _guard
    if g is not None and g.options == options and g.kind == kind and g.matches(tensors):
        try:
            if id(route.device_table(g.device)) == g.table:
                return g.key
        except RdnaAttentionError:
            return None  # the full path raises it
    f = _following
    if f is not None:
        try:
            k = _following_key(f, kind, tensors, options)
        except RdnaAttentionError:
            return None  # (the device's table) the full path raises it
        if k is not None:
            return k
    grad = torch.is_grad_enabled()
    parts: list = [kind, options]
    add = parts.append
    try:
        for t in tensors:
            if t is None:
                add(None)
            elif type(t) is _Tensor and not (grad and t.requires_grad) and not t.is_neg():
                add((t.shape, t.stride(), t.dtype, t.device))
            else:
                return None  # (a lazily negated view: the full path refuses it; a guard refuses it too)
    except RuntimeError:  # a nested tensor has no shape or strides: the full path names it
        return None
    try:
        table = route.device_table(device)
    except RdnaAttentionError:
        return None  # the full path raises it
    add(id(table))
    k = tuple(parts)
    kept, last, r = _last
    if r is not None and kept is cache and (k == last) and _TensorGuards is not None:
        # the second call in a row of a replayed key: its guard, made once per replay, is the next
        # call's (lookup makes a replay's guard the current one as it finds the replay)
        if r.guard is None:
            r.guard = Guard.of(kind, options, last, tensors, device, id(table)) or False
        if r.guard and r.guard.key is last:
            _set_guard(r.guard)
    return k


def recognised(kind: str, tensors: tuple) -> bool:
    """Whether _guard's or _following's guard recognises ``tensors`` as those of a call of entry point
    ``kind``: plain dense tensors, like a kept call's (its options aside)."""
    g = _guard
    if g is not None and g.kind == kind and g.matches(tensors):
        return True
    f = _following
    return f is not None and f.guard.kind == kind and f.guard.matches(tensors)


def _following_key(f: Following, kind: str, tensors: tuple, options: tuple) -> tuple | None:
    """The key of a call ``f``'s guard recognises (of its length_free key, K's and V's length and
    strides left free), where the device's table is the guard's: its last call's where K and V are
    those of that call, else the guard's with K's and V's; else None."""
    g = f.guard
    if (g.options != options or g.kind != kind or not g.matches(tensors)
            or id(route.device_table(g.device)) != g.table):
        return None
    return _length_key(f, tensors)


def _length_key(f: Following, tensors: tuple) -> tuple:
    """The key of a call whose tensors ``f``'s guard recognised: its last call's where K and V are
    those of that call, else the guard's with K's and V's."""
    global _followed
    g = f.guard
    last = f.last[0]
    i, j = f.positions
    a, b = tensors[i], tensors[j]
    sa, sb = a.shape, b.shape
    ka, kb = last[2 + i], last[2 + j]
    if sa == ka[0] and sb == kb[0] and a.stride() == ka[1] and b.stride() == kb[1]:
        k = last  # the last call's length (the next layer of a decode step)
    else:
        parts = list(g.key)
        parts[2 + i], parts[2 + j] = (sa, a.stride(), a.dtype, a.device), (sb, b.stride(), b.dtype, b.device)
        k = tuple(parts)
    _followed = (k, f)
    return k


# torch's check of many tensors against recorded ones in one call, in C++ (what the functions
# torch.compile makes run on their inputs): Python type, dispatch keys (the device type and the
# negation bit among them), dtype, device index, requires_grad, sizes and strides. None where this
# torch has none (every call then reads its tensors' attributes: key()).
_TensorGuards = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None), "TensorGuards", None)


@dataclass(eq=False, slots=True)
class Guard:
    """What recognises a call of one replayed key from its tensors in one check: the key's entry
    point, options, device and table, which of its tensors are absent, and torch's TensorGuards
    over the others as the key saw them (plain tensors not requiring grad: key() gives a call with
    one that differs a key of its own, or None). Made under the dispatch state (inference mode,
    ...) of that call; a call under another fails the check and computes its key."""

    kind: str
    options: tuple
    key: tuple
    device: torch.device
    table: int
    absent: tuple[int, ...]
    same: tuple[tuple[int, int], ...]  # (position, earlier position of the same tensor)
    take: object  # the present tensors out of a call's tensors, as a tuple
    check: object  # TensorGuards(...).check

    @classmethod
    def of(cls, kind: str, options: tuple, key: tuple, tensors: tuple, device: torch.device,
           table: int, free: dict[int, int] | None = None) -> Guard | None:
        """The guard of ``key`` from the tensors of one of its calls (one given twice, such as
        cu_seqlens for the queries and the keys, is checked once and must be given twice by the
        calls it recognises: TensorGuards refuses aliases), or None where a tensor requires grad.
        ``free``: {position: dimension} of tensors whose size along that dimension, and every
        stride but the last, the guard leaves unchecked (Following.guard)."""
        first: dict[int, int] = {}
        present, same = [], []
        for i, t in enumerate(tensors):
            if t is None:
                continue
            if t.requires_grad:
                return None
            if id(t) in first:
                same.append((i, first[id(t)]))
            else:
                first[id(t)] = i
                present.append(i)
        given = [tensors[i] for i in present]
        sizes = strides = None  # every size and stride as the tensor has it, read in C++ (a fifth of the
        # time of passing them as lists)
        if free:
            if any(i not in present for i in free):
                return None
            sizes = [[None if free.get(i) == d else n for d, n in enumerate(tensors[i].shape)] for i in present]
            strides = [list(tensors[i].stride()) if i not in free else
                       [None] * (tensors[i].dim() - 1) + [tensors[i].stride(-1)] for i in present]
        try:
            guards = _TensorGuards(*given, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
        except Exception:  # noqa: BLE001 - a torch whose TensorGuards takes other arguments: no guard
            return None
        if not present:
            take = lambda tensors: ()  # noqa: E731
        elif len(present) == 1:
            i = present[0]
            take = lambda tensors: (tensors[i],)  # noqa: E731
        else:
            take = operator.itemgetter(*present)
        absent = tuple(i for i, t in enumerate(tensors) if t is None)
        return cls(kind, options, key, device, table, absent, tuple(same), take, guards.check)

    def matches(self, tensors: tuple) -> bool:
        """Whether ``tensors`` are absent where the key's were, one tensor where the key's were one,
        and like them elsewhere."""
        for i in self.absent:
            if tensors[i] is not None:
                return False
        for i, j in self.same:
            if tensors[i] is not tensors[j]:
                return False
        try:
            taken = self.take(tensors)
        except IndexError:  # fewer tensors
            return False
        for t in taken:  # TensorGuards reads the sizes and strides of each before its type: a nested
            # tensor (of type Tensor) has none, and its error would end the process
            if type(t) is not _Tensor or t.is_nested:
                return False
        try:
            return self.check(*taken)
        except TypeError:  # another number of tensors
            return False


# The guard of the replay last found (or None): key() tries it first.
_guard: Guard | None = None


def _set_guard(g: Guard | None) -> None:
    global _guard
    _guard = g


# The by_length entry last followed whose guard is made (key() tries it after _guard), and the key
# key() last made from it with the entry, one tuple replaced whole: the entry point's replayed()
# finds that call's entry by it (``_followed[0] is key``), without looking the key up.
_following: Following | None = None
_followed: tuple = (None, None)


def length_free(key: tuple | None, positions: tuple[int, ...], seq_dim: int) -> tuple | None:
    """``key`` (of key()) without the length along ``seq_dim`` of the tensors at ``positions`` (among
    its tensors) and the strides that follow it: of those it keeps what validation reads (the other
    dimensions, whether the length is 0, the last stride, the others modulo 16 bytes), so that every
    call of one length-free key passes validation and plans to the same kernels alike."""
    if key is None:
        return None
    parts = list(key)
    for i in positions:
        if parts[2 + i] is None:
            return None
        shape, stride, dtype, device = parts[2 + i]
        per16 = 16 // dtype.itemsize
        if len(shape) == 4 and seq_dim in (1, 2):  # every caller's K and V: unrolled, a fifth of the time
            a, b, c, d = shape
            w, x, y, z = stride
            rest = (a, c, d, b > 0) if seq_dim == 1 else (a, b, d, c > 0)
            parts[2 + i] = (rest, z, w % per16, x % per16, y % per16, dtype, device)
        else:
            parts[2 + i] = (shape[:seq_dim] + shape[seq_dim + 1:], shape[seq_dim] > 0, stride[-1],
                            tuple(s % per16 for s in stride[:-1]), dtype, device)
    return tuple(parts)


def pointers(tensors: tuple, reach: tuple[tuple[int, int], ...], aligned: int) -> list[int] | None:
    """Each tensor's data pointer (0 where absent), in ``tensors``' order, where every tensor has
    memory behind it (a non-null pointer, a storage covering the bytes its shape and strides reach)
    and the first ``aligned`` of them start on 16 bytes: what checks.check_memory and the planners
    check, per call; None where one has not (the full path raises the error). One pass, each
    pointer read once: the entry points launch with these. Lazily negated views have no key (key(),
    the guard), so ``tensors`` (those of the call's key, or made by the entry point) are none."""
    found = [0] * len(tensors)
    for i, t in enumerate(tensors):
        if t is not None:
            p = found[i] = t.data_ptr()
            span, size = reach[i]
            if span and (not p or (i < aligned and p & 15)
                         or t.storage_offset() * size + span > t.untyped_storage().nbytes()):
                return None
    return found


def remember(key: tuple | None, plan: Plan, tensors: tuple, roles: frozenset[str],
             extra: object = None, before: tuple[Launch, ...] = (), free: tuple | None = None) -> Replay | None:
    """Keeps ``plan`` for later calls of ``key`` (``tensors``: those pointers() checks per call, in
    the order the entry point passes them; ``extra``: kept beside; ``before``: launches of the
    same table that run ahead of the plan's, such as flash_attn_with_kvcache's append) where every
    pointer field of its launches is one of ``roles`` or the scratch; returns the replay, or None
    where it is not kept. A plan that follows the keys' length (Plan.lengths) with nothing before it
    is kept under ``free`` too: (length_free(key), K's and V's places among ``tensors``, the
    dimension of their length)."""
    if key is None or not plan.launches:
        return None
    steps = []
    driver = drivers.for_platform(plan.table.platform)
    index = None
    if hasattr(driver, "function"):  # a GPU's driver: kernels launched through their handles
        index = plan.device.index if plan.device.index is not None else module_api.current_device()
    for launch in (*before, *plan.launches):
        args = launch.args
        fields = tuple(name for name, ctype in type(args)._fields_ if ctype is ctypes.c_void_p
                       and (getattr(args, name) or (plan.scratch_bytes and name in SCRATCH_FIELDS)))
        if not all(f in roles or (plan.scratch_bytes and f in SCRATCH_FIELDS) for f in fields):
            return None
        function = go = None
        if index is not None:  # a GPU's: its handle, loaded once, and its launch bound
            function = driver.function(plan.table.code_object, index, launch.kernel.name, launch.shared_bytes)
            go = driver.DRIVER.bound(function, launch.kernel.name, launch.grid, launch.block, launch.shared_bytes)
        steps.append(Step(name=launch.kernel.name, grid=launch.grid, block=launch.block,
                          shared_bytes=launch.shared_bytes, args=type(args).from_buffer_copy(args), fields=fields,
                          function=function, index=index or 0, go=go))
    lengths = plan.lengths if free is not None and not before else None
    r = Replay(table=plan.table, driver=driver, steps=tuple(steps),
               scratch_bytes=plan.scratch_bytes, scratch_lse=plan.scratch_lse, counters=plan.counters,
               reach=tuple((checks.reach(t), t.element_size()) if t is not None and t.numel() else (0, 0)
                           for t in tensors), extra=extra, lengths=lengths)
    keep(key, r)
    if lengths is not None:
        if len(by_length) >= CACHE_LIMIT:
            _clear_following()
        by_length[free[0]] = Following.of(free[0], key, r, free[1], free[2])
    return r


def express(key: tuple, device: torch.device, roles: tuple[str, ...], aligned: int,
            aliases: tuple[tuple[str, int], ...] = (), regions: tuple | None = None):
    """The replay of ``key`` (where its guard is the current one: current()) as one function of a
    call's tensors, for entry points whose calls repeat one geometry (the layers of a decode step).
    Given the first len(``roles``) of the key's tensors (None where the key's are absent; its others
    are absent), ``roles`` the pointer fields they fill and ``aliases`` (field, position) fields
    that take one of them too, the function launches and returns the output (field "o"); or
    returns None, leaving the call to the entry point's own path, where the replay's guard does
    not recognise the tensors, where that guard is no longer the current one (a call of another
    key since, or clear()), or where pointers() finds their memory wanting (the first ``aligned``
    on 16 bytes). ``regions``: launch()'s, the same at every call. It checks what key(),
    the entry point's replay and launch() check for such a call, in one frame: between a model's
    other operations, a call pays for each object it reads being out of the processor's caches.
    What the key holds besides its tensors (options, how a length is given) and value checks are
    the entry point's to compare before it calls. A call served by following its keys' length
    (followed(): a cache that grows by a key per decode step) gets _follower's function, which
    serves that entry's next lengths too, where it makes one; its replay's own guard otherwise.
    None where the replay has no guard, or one of other tensors (one given twice), launches with
    pointer fields other than these, the output, the split-KV scratch and the regions, or no
    stand-ins of its outputs yet (Replay.like, made at the entry point's first replay; a first
    None: torch.empty_like of the first tensor, as ops.replayed allocates). Made once per replay."""
    f = followed(key)
    if f is not None:  # served by following its length: the express follows the next lengths too
        run = _follower(f, device, roles, aligned, aliases, regions)
        if run is not None:
            return run
    r = current(key)
    if r is None:
        return None
    if r.express is not None:
        return r.express
    g, n = r.guard, len(roles)
    gaps = tuple(i for i in g.absent if i < n) if g else ()  # given as None
    trailing = len(g.absent) - len(gaps) if g else 0
    if (not g or g.same or g.absent[len(gaps):] != tuple(range(n, n + trailing))
            or not _expressible(r, roles, aliases, regions)):
        return None
    table_for = route.dispatch.table_for
    environment = drivers.environment_token
    env, generation = environment(), table_for.generation  # while both stay, device_table(device) is the table
    try:
        if id(route.device_table(device)) != g.table:
            return None
    except RdnaAttentionError:
        return None
    take = g.take if gaps else None
    like = r.like[0]
    tensor, compiling, empty_like = _Tensor, torch.compiler.is_compiling, torch.empty_like
    check, reach = g.check, r.reach[:n]
    launch_it = _launcher(r, roles, aliases, regions, device, _fields_of(r, roles, aliases, regions))

    def run(*tensors):
        if compiling() or _is_tracing():  # first: nothing after this is for torch.compile to trace
            return None
        if _guard is not g:
            return None
        try:
            if take is None:
                given = tensors
            else:
                for i in gaps:
                    if tensors[i] is not None:
                        return None
                given = take(tensors)
            for t in given:
                if type(t) is not tensor or t.is_nested:
                    return None
            if environment() != env or table_for.generation != generation:
                return None
            if not check(*given):
                return None
        except (TypeError, IndexError):  # another number of tensors
            return None
        found = pointers(tensors, reach, aligned)
        if found is None:
            return None
        out = empty_like(tensors[0]) if like is None else empty_like(like, memory_format=CONTIGUOUS)
        launch_it(found, out)
        return out

    r.express = run
    return run


class LastExpress:
    """An entry point's express function (express(), its first tensors filling ``roles``, q, k and v
    unless given) of the geometry it served last, with the call options it was made under, tried
    before the entry point's own checks: run(options, *tensors) calls it where ``options`` equal
    those (None where they differ, or where it does not recognise the tensors: then it is dropped
    until made again, so another geometry tries it once, not at every call); remember(options, key,
    device) makes it from the replay of ``key`` where that may have one. The options and the function
    are one tuple, replaced whole: a thread never pairs one call's options with another's function.
    The options must hold only values that compare as plain data (bools, ints, floats, None, tuples
    of them)."""

    __slots__ = ("_made", "roles")

    def __init__(self, roles: tuple[str, ...] = ("q", "k", "v")) -> None:
        self._made: tuple = (None, None)
        self.roles = roles

    @property
    def made(self) -> bool:
        """Whether it holds a function."""
        return self._made[1] is not None

    @property
    def function(self):
        """The function it holds (express()'s), or None."""
        return self._made[1]

    def run(self, options: tuple, *tensors) -> torch.Tensor | None:
        made_for, run = self._made
        if run is None or made_for != options:
            return None
        out = run(*tensors)
        if out is None:
            self._made = (None, None)
        return out

    def remember(self, options: tuple, key: tuple, device: torch.device, roles: tuple[str, ...] | None = None,
                 aliases: tuple[tuple[str, int], ...] = (), regions: tuple | None = None) -> None:
        """express()'s arguments past the key: ``roles`` (default: its own), ``aliases`` and
        ``regions`` where the replay's launches take them (flash_attn_with_kvcache's)."""
        if expressible(key):
            run = express(key, device, self.roles if roles is None else roles, 3, aliases, regions)
            if run is not None:
                self._made = (options, run)


def followed(key: tuple) -> Following | None:
    """The by_length entry whose last call was of ``key`` (a key key() or the entry point made) where
    its length-free guard is the one key() tries: that call was served by following its length."""
    f = _following
    return f if f is not None and f.last[0] is key and f.guard else None


def expressible(key: tuple) -> bool:
    """Whether express() may make a function of the replay of ``key``: its guard is the current one,
    or its call was served by following the length of a cache that grows (followed)."""
    return guarded(key) or followed(key) is not None


def _follower(f: Following, device: torch.device, roles: tuple[str, ...], aligned: int,
              aliases: tuple[tuple[str, int], ...], regions: tuple | None):
    """express()'s function for the calls ``f``'s length-free guard recognises, at any length of the
    keys (a cache one key longer at every decode step, one layer or several a step): per call the
    guard's one check, then K's and V's shapes and strides against the length served last; a new
    length's launch is derived from the last one's (_relength_of: the checks follow()'s derivation
    makes), with no key, guard or replay kept per length. Made once per entry, express() arguments,
    environment and table generation; None where express() would make none of its last replay."""
    _, r = f.last
    g, n = f.guard, len(roles)
    table_for = route.dispatch.table_for
    environment = drivers.environment_token
    env, generation = environment(), table_for.generation  # while both stay, device_table(device) is the table
    made = f.express
    if made is not None and made[0] == (roles, aligned, aliases, regions, env, generation):
        return made[1]
    i, j = f.positions
    gaps = tuple(x for x in g.absent if x < n)
    trailing = len(g.absent) - len(gaps)
    if (g.same or g.absent[len(gaps):] != tuple(range(n, n + trailing)) or j >= n or i in gaps or j in gaps
            or not _expressible(r, roles, aliases, regions)):
        return None
    try:
        if id(route.device_table(device)) != g.table:
            return None
    except RdnaAttentionError:
        return None
    check, take = g.check, (g.take if gaps else None)
    like = r.like[0]
    tensor, compiling, empty_like = _Tensor, torch.compiler.is_compiling, torch.empty_like
    fields = _fields_of(r, roles, aliases, regions)  # (every length's)
    key = f.last[0]
    k, v = key[2 + i], key[2 + j]
    # the length served last: K's and V's shapes and strides, the memory each tensor reaches, the
    # launch, the replay the next length is derived from and the launch's arguments (that replay's,
    # or derived from them for a length of the same key slices); replaced whole
    now = (k[0], k[1], v[0], v[1], r.reach[:n], _launcher(r, roles, aliases, regions, device, fields), r,
           r.steps[0].args)
    lengths = r.lengths

    def run(*tensors):
        nonlocal now
        if compiling() or _is_tracing():  # first: nothing after this is for torch.compile to trace
            return None
        if _following is not f:
            return None
        try:
            if take is None:
                given = tensors
            else:
                for x in gaps:
                    if tensors[x] is not None:
                        return None
                given = take(tensors)
            for t in given:
                if type(t) is not tensor or t.is_nested:
                    return None
            if environment() != env or table_for.generation != generation:
                return None
            if not check(*given):
                return None
            a, b = tensors[i], tensors[j]
        except (TypeError, IndexError):  # another number of tensors
            return None
        sa, ta, sb, tb = a.shape, a.stride(), b.shape, b.stride()
        served = now
        if sa != served[0] or ta != served[1] or sb != served[2] or tb != served[3]:
            base, args = served[6], served[7]
            lengthed = _lengthed(f, base, sa, ta, sb, tb)
            if lengthed is None:
                return None
            seq_k, ks, vs, reach = lengthed
            if seq_k < 2**31 and lengths.splits(seq_k) == args.splits:  # relength's, its launch kept
                served = now = (sa, ta, sb, tb, reach[:n], served[5], base, _lengthened(args, seq_k, ks, vs))
            else:
                r = relength(base, seq_k, ks, vs, reach)
                if r is None:
                    return None
                served = now = (sa, ta, sb, tb, r.reach[:n], _launcher(r, roles, aliases, regions, device, fields),
                                r, r.steps[0].args)
        found = pointers(tensors, served[4], aligned)
        if found is None:
            return None
        out = empty_like(tensors[0]) if like is None else empty_like(like, memory_format=CONTIGUOUS)
        served[5](found, out, served[7])
        return out

    f.express = ((roles, aligned, aliases, regions, env, generation), run)
    return run


def _expressible(r: Replay, roles: tuple[str, ...], aliases: tuple[tuple[str, int], ...] = (),
                 regions: tuple | None = None) -> bool:
    """Whether express() may launch ``r`` given the tensors of ``roles``: it has its outputs'
    stand-ins, and its launches' pointer fields are those, the aliases, the output, the split-KV
    scratch and the regions."""
    allowed = {*roles, *(field for field, _ in aliases), "o", *SCRATCH_FIELDS,
               *(field for field, _ in (regions[1] if regions else ()))}
    return bool(r.like) and all(allowed.issuperset(step.fields) for step in r.steps)


def _fields_of(r: Replay, roles: tuple[str, ...], aliases: tuple[tuple[str, int], ...],
               regions: tuple | None) -> tuple:
    """What of _launcher's launch follows from ``r``'s launch fields alone, the same at every length
    of a cache it follows (relength keeps the fields, and whether there is scratch): each pointer
    field's source among a call's pointers (-1: the output), each scratch or region field's place
    among the workspace's addresses (SCRATCH_FIELDS', then the regions'), the regions' offsets."""
    step = r.steps[0]
    placed = dict(regions[1]) if regions else {}
    aliased = dict(aliases)
    sources = tuple((f, roles.index(f) if f in roles else aliased.get(f, -1)) for f in step.fields
                    if f not in SCRATCH_FIELDS and f not in placed)
    scratch = tuple((f, SCRATCH_FIELDS.index(f)) for f in step.fields if f in SCRATCH_FIELDS and r.scratch_bytes)
    scratch += tuple((f, len(SCRATCH_FIELDS) + i) for i, f in enumerate(placed) if f in step.fields)
    return sources, scratch, tuple(placed.values())


def _launcher(r: Replay, roles: tuple[str, ...], aliases: tuple[tuple[str, int], ...], regions: tuple | None,
              device: torch.device, fields: tuple):
    """express()'s launch of ``r``: a function of the call's pointers (in ``roles``' order, 0 where
    absent), its output and, for a plan of one launch, the argument struct whose pointer fields it
    sets (a copy of it; by default the planned one; _follower's for a length of the same key slices).
    One launch goes through the GPU driver's bound launch or the host emulator's, each pointer
    field's source found once; several through launch(). ``fields``: _fields_of's for ``r``, which
    _follower makes once for all the lengths of a cache it follows."""
    step = r.steps[0]
    if len(r.steps) > 1:
        def launch_it(found, out, planned=None):  # several launches: launch() itself (with their own args)
            given = {role: p for role, p in zip(roles, found) if p}
            for field, i in aliases:
                given[field] = found[i]
            given["o"] = out.data_ptr()
            launch(r, given, device, regions)
        return launch_it
    # one launch: launch()'s work for it, each field's source found once
    index, go, planned, counters = step.index, step.go, step.args, r.counters
    copy, lse_at, start = type(planned).from_buffer_copy, r.scratch_lse, workspace.align(r.scratch_bytes)
    total = start + regions[0] if regions else r.scratch_bytes
    sources, scratch, placed = fields
    offsets = tuple([start + offset for offset in placed]) if placed else ()
    if go is None:  # the host emulator: its launch returns when done, on this thread's workspace
        driver, code_object, host_scratch = r.driver, r.table.code_object, workspace.host_scratch
        name, grid, block, shared = step.name, step.grid, step.block, step.shared_bytes

        def launch_on_host(found, out, planned=planned):
            args = copy(planned)
            for field, i in sources:
                setattr(args, field, found[i] if i >= 0 else out.data_ptr())
            if total:
                buffer, count = host_scratch(device, total, counters)
                base = buffer.data_ptr()
                at = (base, base + lse_at, count.data_ptr(), *(base + offset for offset in offsets))
                for field, i in scratch:
                    setattr(args, field, at[i])
            driver.launch_kernel(code_object, name, grid, block, args, device, shared)
        return launch_on_host
    stream_of, device_now, gpu = module_api.current_stream_handle, module_api.current_device, device.type != "cpu"
    stream_scratch, scratch_of = workspace.stream_scratch, workspace.scratch

    def launch_it(found, out, planned=planned):
        stream = stream_of(index)
        args = copy(planned)
        for field, i in sources:
            setattr(args, field, found[i] if i >= 0 else out.data_ptr())
        buffer = count = None
        if total:  # held until the launch is enqueued (CPU tensors through a GPU's driver, as the RDNA3
            # emulator's stand-in serves them: the host's workspace, as launch() takes)
            buffer, count = (stream_scratch(index, stream, total, counters) if gpu
                             else scratch_of(device, total, counters))
            base = buffer.data_ptr()
            # SCRATCH_FIELDS' order, then the regions', as _place places them
            at = (base, base + lse_at, count.data_ptr(), *(base + offset for offset in offsets))
            for field, i in scratch:
                setattr(args, field, at[i])
        if index != device_now():
            with torch.cuda.device(index):
                go(args, stream)
        else:
            go(args, stream)
        del buffer, count
    return launch_it


def launch(r: Replay, pointers: dict[str, int], device: torch.device,
           regions: tuple[int, tuple[tuple[str, int], ...]] | None = None) -> None:
    """Runs ``r``'s launches with ``pointers`` (by field), on the scratch and counters of ``device``'s
    current stream: on a GPU through the kernel handles kept with the steps, on the host emulator
    through its launch_kernel. ``regions`` (bytes, ((field, offset), ...)): intermediates that only
    the launches read (the INT8 entry's quantized inputs, the lengths and rotated queries
    flash_attn_with_kvcache's append writes for its attention), placed in the stream's workspace
    after the split-KV scratch, each field pointed at its offset there."""
    extra = regions[0] if regions else 0
    steps = r.steps
    if steps[0].go is None:  # the host emulator: launches return when done, on this thread's workspace
        if r.scratch_bytes or extra:
            start = workspace.align(r.scratch_bytes)
            buffer, count = workspace.host_scratch(device, start + extra, r.counters)
            _place(r, pointers, buffer.data_ptr(), count, start, regions)
        driver, code_object = r.driver, r.table.code_object
        for step in steps:
            args = type(step.args).from_buffer_copy(step.args)
            for field in step.fields:
                setattr(args, field, pointers[field])
            driver.launch_kernel(code_object, step.name, step.grid, step.block, args, device, step.shared_bytes)
        return
    index = steps[0].index  # the stream is looked up once, for the workspace and every launch
    stream = module_api.current_stream_handle(index)
    buffer = count = None
    if r.scratch_bytes or extra:  # held until the launches are enqueued
        start = workspace.align(r.scratch_bytes)
        if device.type != "cpu":  # (the RDNA3 emulator's stand-in serves CPU tensors through a GPU driver)
            buffer, count = workspace.stream_scratch(index, stream, start + extra, r.counters)
        else:
            buffer, count = workspace.scratch(device, start + extra, r.counters)
        _place(r, pointers, buffer.data_ptr(), count, start, regions)
    if index != module_api.current_device():  # the launches go to the context of the tensors' device
        with torch.cuda.device(index):
            _launch_steps(steps, pointers, stream)
    else:
        _launch_steps(steps, pointers, stream)
    del buffer, count


def _place(r: Replay, pointers: dict[str, int], base: int, count: torch.Tensor, start: int,
           regions: tuple[int, tuple[tuple[str, int], ...]] | None) -> None:
    """Points the split-KV scratch fields and ``regions``' fields into a workspace at ``base``
    (``count``: its counters)."""
    if r.scratch_bytes:
        pointers["part_o"], pointers["part_lse"], pointers["counters"] = base, base + r.scratch_lse, count.data_ptr()
    if regions:
        for field, offset in regions[1]:
            pointers[field] = base + start + offset


def _launch_steps(steps: tuple[Step, ...], pointers: dict[str, int], stream: int) -> None:
    for step in steps:
        args = type(step.args).from_buffer_copy(step.args)
        for field in step.fields:
            setattr(args, field, pointers[field])
        step.go(args, stream)


def _lengthened(args: ctypes.Structure, seq_k: int, k_strides: tuple[int, int, int],
                v_strides: tuple[int, int, int]) -> ctypes.Structure:
    """A copy of a split-KV launch's ``args`` for ``seq_k`` keys of these K/V strides (batch, head,
    row): its seq_k and stride fields rewritten, the rest (the key slices among them) kept."""
    args = type(args).from_buffer_copy(args)
    (args.k_stride_b, args.k_stride_h, args.k_stride_s), (args.v_stride_b, args.v_stride_h, args.v_stride_s) = \
        k_strides, v_strides
    args.seq_k = seq_k
    return args


def relength(r: Replay, seq_k: int, k_strides: tuple[int, int, int], v_strides: tuple[int, int, int],
             reach: tuple[tuple[int, int], ...]) -> Replay | None:
    """``r`` (a replay that follows the keys' length, by_length) for ``seq_k`` keys of K/V strides
    ``k_strides`` and ``v_strides`` (batch, head, row; the kernels' view) and memory ``reach``: the
    key slices, and with them the launch's grid and the scratch, as the planner chooses them
    (_splitkv.Lengths), its seq_k, splits and K/V stride fields rewritten. None where the plan
    would differ otherwise (one slice where ``r`` has several, or the other way round) or seq_k
    does not fit the kernels' 32-bit field: the full path plans such a call."""
    lengths = r.lengths
    if seq_k >= 2**31:
        return None
    splits = lengths.splits(seq_k)
    (step,) = r.steps  # a split-KV plan: one launch
    args = _lengthened(step.args, seq_k, k_strides, v_strides)
    if splits == step.args.splits:  # r's slices (a cache that grows changes them rarely): its grid, launch, scratch
        step = Step(step.name, step.grid, step.block, step.shared_bytes, args, step.fields, step.function, step.index,
                    step.go)
        return Replay(r.table, r.driver, (step,), r.scratch_bytes, r.scratch_lse, r.counters, reach, r.extra, lengths,
                      r.like)
    if (splits > 1) != (r.scratch_bytes > 0):
        return None
    args.splits = splits
    grid = (lengths.chunks * splits, step.grid[1], step.grid[2])
    check_grid(step.name, grid, step.block)
    scratch_bytes, scratch_lse = lengths.scratch(splits)
    go = None if step.go is None else r.driver.DRIVER.bound(step.function, step.name, grid, step.block,
                                                             step.shared_bytes)
    step = Step(step.name, grid, step.block, step.shared_bytes, args, step.fields, step.function, step.index, go)
    return Replay(r.table, r.driver, (step,), scratch_bytes, scratch_lse, r.counters, reach, r.extra, lengths, r.like)


# The key last found in the cache and its replay, with the cache it belongs to, one tuple replaced
# whole (so that threads read a consistent triple): the layers of a decode step call with one key,
# and comparing a key with it costs half the cache's lookup (its hash and the same comparison).
_last: tuple = (None, None, None)


def lookup(key: tuple | None) -> Replay | None:
    """The plan kept for ``key``, or None: for None, and for a key holding an option that is not
    hashable, such as a list given for a number (the full path names it)."""
    global _last
    if key is None:
        return None
    kept, last, r = _last
    if kept is cache and key == last:
        return r
    try:
        r = cache.get(key)
    except TypeError:
        return None
    if r is not None:
        _last = (cache, key, r)
        _set_guard(r.guard or None)
    return r


def guarded(key: tuple) -> bool:
    """Whether ``key`` (a key key() returned) is the current guard's: its replay is current()'s."""
    g = _guard
    return g is not None and g.key is key


def current(key: tuple) -> Replay | None:
    """The replay of ``key`` (a key key() returned) where its guard is the current one, the one the
    next call tries first; else None."""
    g = _guard
    if g is None or g.key is not key:
        return None
    _, last, r = _last
    if (last is key or last == key) and r.guard is g:  # (equal: the key another entry point's call of the
        # same geometry made first, which lookup keeps, where the guard holds the one it was made with)
        return r
    f = _followed[1]
    if f is not None and f.last[0] is key and f.last[1].guard is g:
        return f.last[1]
    return None


def keep(key: tuple, r: Replay) -> None:
    """Keeps ``r`` for later calls of ``key``."""
    global _last
    if len(cache) >= CACHE_LIMIT:
        cache.clear()
        _last = (None, None, None)
        _set_guard(None)
    cache[key] = r


def follow(f: Following, key: tuple, tensors: tuple, device: torch.device) -> Replay | None:
    """The replay of the call ``key`` (of ``tensors`` on ``device``), one of ``f``'s length_free key:
    ``f``'s last as it is where the last call was this one's key (the next layer of a decode step),
    else derived for this call's length from it (relength) and made ``f``'s last; None where the
    full path must plan it. Makes ``f`` the entry key() tries, its guard made at its first follow."""
    global _following
    last_key, r = f.last
    if key is last_key:  # the last call's key again (key() found it by a guard): from its second call on,
        # the replay's own guard is tried first (key()), as a planned replay's is from its third
        if r.guard is None:
            r.guard = _TensorGuards is not None and Guard.of(key[0], key[1], key, tensors, device, key[-1]) or False
        if r.guard and _guard is not r.guard:
            _set_guard(r.guard)
        return r
    i, j = f.positions
    if key[2 + i] != last_key[2 + i] or key[2 + j] != last_key[2 + j]:
        r = _relength_of(f, r, key[2 + i][0], key[2 + i][1], key[2 + j][0], key[2 + j][1])
        if r is None:
            return None
        f.last = (key, r)
    if f.guard is None:
        f.guard = _TensorGuards is not None and Guard.of(
            key[0], key[1], key, tensors, device, key[-1], dict.fromkeys(f.positions, f.seq_dim)) or False
    if f.guard:
        _following = f
    return r


def _relength_of(f: Following, r: Replay, k_shape, k_stride, v_shape, v_stride) -> Replay | None:
    """``r`` (a replay of ``f``'s entry) for a call whose K and V have these shapes and strides
    (4-dimensional, in the key's layout) and which ``f``'s length-free guard recognised (its other
    dimensions, dtypes and devices): relength's, or None where the full path must plan or refuse it."""
    lengthed = _lengthed(f, r, k_shape, k_stride, v_shape, v_stride)
    return None if lengthed is None else relength(r, *lengthed)


def _lengthed(f: Following, r: Replay, k_shape, k_stride, v_shape, v_stride) -> tuple | None:
    """_relength_of's checks of the call, and relength's arguments after ``r``: (seq_k, K's and V's
    strides as the kernels take them, the memory each tensor reaches); None where the full path
    must plan or refuse the call. Where V's shape and strides are K's (a cache's K and V are
    alike), what follows from them is computed once."""
    alike = k_shape == v_shape and k_stride == v_stride
    (ka, kb, kc, kd), ks = k_shape, k_stride
    vs = ks if alike else v_stride
    seq_k = kb if f.seq_dim == 1 else kc
    # V's length, which the guard leaves free as it does K's: one unlike K's is refused by the full
    # path (the kernels would read past V)
    if not alike and seq_k != v_shape[f.seq_dim]:
        return None
    # what length_free keeps of K's and V's length and strides, which the guard leaves free: whether
    # there are keys, the strides modulo 16 bytes (its rule, inline: calling it for K and V cost
    # 0.5-1 us more per new length; per16 is a power of two, so where every residue is 0, one test
    # of the strides' bits)
    n = f.per16
    if not seq_k or (((ks[0] | ks[1] | ks[2] | vs[0] | vs[1] | vs[2]) & (n - 1)) if f.aligned16 else
                     (ks[0] % n, ks[1] % n, ks[2] % n, vs[0] % n, vs[1] % n, vs[2] % n) != f.residues):
        return None
    i, j = f.positions
    reach = list(r.reach)  # (checks.reach of each, unrolled)
    size = reach[i][1]
    reach[i] = ((ka - 1) * ks[0] + (kb - 1) * ks[1] + (kc - 1) * ks[2] + (kd - 1) * ks[3] + 1) * size, size
    if alike:
        reach[j] = reach[i]
    else:
        va, vb, vc, vd = v_shape
        reach[j] = ((va - 1) * vs[0] + (vb - 1) * vs[1] + (vc - 1) * vs[2] + (vd - 1) * vs[3] + 1) * size, size
    # the kernels' (batch, head, row) strides: [batch, seq, heads, head_dim] where seq_dim is 1
    ks = (ks[0], ks[2], ks[1]) if f.seq_dim == 1 else ks[:3]
    vs = ks if alike else (vs[0], vs[2], vs[1]) if f.seq_dim == 1 else vs[:3]
    return seq_k, ks, vs, tuple(reach)


def _clear_following() -> None:
    global _following, _followed
    by_length.clear()
    _following, _followed = None, (None, None)


def clear() -> None:
    """Drops every replay kept (the next call of each key is validated and planned again)."""
    global _last
    cache.clear()
    _clear_following()
    _last = (None, None, None)
    _set_guard(None)


def run(plan: Plan, key: tuple | None = None, tensors: tuple = (), roles: frozenset[str] = frozenset(),
        extra: object = None, before: tuple[Launch, ...] = (), free: tuple | None = None) -> None:
    """Runs a plan made for an eager call, after the launches ``before`` (remember): kept under
    ``key`` (and ``free``, where it follows the keys' length) where it can be, and launched on the
    stream's workspace; a plan that is not kept runs on its own scratch (Plan.run), after ``before``."""
    r = remember(key, plan, tensors, roles, extra, before, free)
    if r is None:
        driver = drivers.for_platform(plan.table.platform)
        for first in before:
            driver.launch(plan.table.code_object, first, plan.device)
        plan.run()
        return
    pointers = {}
    for step, planned in zip(r.steps, (*before, *plan.launches)):  # the plan's own pointers
        for field in step.fields:
            if field not in SCRATCH_FIELDS:
                pointers[field] = getattr(planned.args, field)
    launch(r, pointers, plan.device)
