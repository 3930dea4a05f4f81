"""The kernel matrix: targets, tile tables and kernel families, loaded and validated from
variants.yaml (and tuned/<target>.yaml overlays), expanded into dispatch entries per target."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable

from rdnattention.table import ALTERNATE, Constraints, kind  # ALTERNATE: the priority of an alternate entry

from . import DEFAULT_VARIANTS, TUNED_DIR
from .families import FAMILIES, family
from .platforms import PLATFORMS
from .spec import KernelSpec, Tile
from .strict_yaml import Node, VariantsError, load
from .target import MIXED_FMAS, STAGES, STATUSES, Target
from .tuned import TunedEntry, load_tuned
from .when import constraints

_TARGET_RE = re.compile(r"gfx[0-9a-f]{3,4}|sm_[0-9]{2,3}|host(_[a-z0-9]+)?")
_TABLE_RE = re.compile(r"[a-z][a-z0-9_]*")


_ANY = object()  # an alternate for the kernels of every dtype and score option


@dataclass(frozen=True)
class TileChoice:
    """One tile a table assigns to (family, head_dim), optionally only under constraints."""

    tile: Tile
    when: Constraints
    where: str        # "variants.yaml:LINE: tiles.lds64k.f16.128[1]", for error messages
    provenance: str   # what the dispatch table records: the file it came from


@dataclass(frozen=True)
class TileTable:
    name: str
    inherit: str | None
    # family (or "<family>_<option>": its kernels of that dtype or score option, where they differ) ->
    # head_dim (or "default") -> choices
    choices: dict[str, dict[int | str, tuple[TileChoice, ...]]]




@dataclass(frozen=True)
class Variant:
    """One dispatch entry of a target: a kernel and when it serves a call."""

    spec: KernelSpec
    when: Constraints
    priority: int
    provenance: str
    where: str


@dataclass(frozen=True)
class Matrix:
    source: Path
    targets: tuple[Target, ...]
    tile_tables: dict[str, TileTable]
    kernels: dict[str, dict]  # family name -> its axes, as the family parsed them
    tuned: dict[str, tuple[TunedEntry, ...]]  # target -> tuned entries
    # target -> (family, head_dim, tile) built as alternates beside the target's own entries (tuning
    # candidates); every GQA group of the family gets one.
    alternates: dict[str, tuple[tuple[str, int, Tile], ...]] = field(default_factory=dict)

    def with_alternates(self, target: str, alternates: list[tuple[str, int, Tile]]) -> "Matrix":
        return replace(self, alternates={**self.alternates, target: tuple(alternates)})

    def narrowed(self, keep: Iterable[int], names: Iterable[str] | None = None) -> "Matrix":
        """This matrix with the targets ``names`` (every one: None) building only the head_dims in
        ``keep`` of those each builds of each family; the families whose kernels take the head_dim at
        launch (Family.head_dim_at_launch) stay whole. Tile tables and tuned tiles stay as they are
        (those of the head_dims left out are unused). Raises VariantsError for a head_dim of ``keep``
        that none of a target's families builds."""
        keep = frozenset(keep)
        chosen = None if names is None else frozenset(names)
        targets = []
        for t in self.targets:
            if chosen is not None and t.name not in chosen:
                targets.append(t)
                continue
            own = dict(t.head_dims)
            head_dims, built = [], set()
            for fam, axes in self.kernels.items():
                if family(fam).head_dim_at_launch:
                    if fam in own:
                        head_dims.append((fam, own[fam]))
                    continue
                dims = own.get(fam, axes["head_dims"])
                head_dims.append((fam, tuple(h for h in dims if h in keep)))
                built.update(dims)
            missing = sorted(keep - built)
            if missing:
                raise VariantsError(f"head_dim {', '.join(map(str, missing))}: {t.name} builds none of its kernels "
                                    f"there; it builds head_dims {sorted(built)}")
            targets.append(replace(t, head_dims=tuple(head_dims)))
        return replace(self, targets=tuple(targets))

    def target(self, name: str) -> Target:
        for t in self.targets:
            if t.name == name:
                return t
        raise KeyError(name)

    def tile_choices(self, table: str, family: str, head_dim: int, dtype: str | None = None,
                     score: str | None = None) -> tuple[TileChoice, ...]:
        """The choices of (family, head_dim): the nearest table in the inheritance chain that lists
        the head_dim, else the nearest one with a ``default``. The kernels of a score option take
        the nearest ``<family>_<dtype>_<score>`` entry of the head_dim first (those of a dtype option
        too), then the nearest ``<family>_<score>`` one; the kernels of a dtype option then the
        nearest ``<family>_<dtype>`` one, where a table has them."""
        chain = []
        name: str | None = table
        while name is not None:
            chain.append(self.tile_tables[name])
            name = self.tile_tables[name].inherit
        options = [f"{dtype}_{score}"] if dtype is not None and score is not None else []
        for option in options + [o for o in (score, dtype) if o is not None]:
            for t in chain:
                if head_dim in t.choices.get(f"{family}_{option}", {}):
                    return t.choices[f"{family}_{option}"][head_dim]
        for key in (head_dim, "default"):
            for t in chain:
                if key in t.choices.get(family, {}):
                    return t.choices[family][key]
        raise VariantsError(f"{self.source.name}: tiles.{table}: no tile for {family} head_dim {head_dim} "
                            "and no default in its inheritance chain")

    def variants_for(self, target: Target) -> list[Variant]:
        """Every dispatch entry of ``target``: the matrix's tiles, then tuned ones, which replace
        any matrix entry they cover."""
        out: list[Variant] = []
        for fam_name, axes in self.kernels.items():
            fam = family(fam_name)
            if fam.tier(target) is None:
                continue
            for point in fam.points(axes):
                hd, group = point["head_dim"], point["gqa_group"]
                if not target.builds(fam_name, hd) or not fam.builds_point(target, point):
                    continue
                # (tile, when, priority, provenance, where): the tile table's choices (priority 0,
                # with `when` 1), then the tuned ones (2, with `when` 3), for every layout the
                # family's kernels are compiled for.
                choices = [(c.tile, c.when, 1 if c.when.to_json() else 0, c.provenance, c.where)
                           for c in self.tile_choices(target.tiles, fam_name, hd,
                                                      point.get("dtype"), point.get("score"))]
                tuned = [t for t in self.tuned.get(target.name, ())
                         if t.head_dim == hd and t.gqa_group in (None, group)]
                choices += [(t.tile, t.when, 3 if t.when.to_json() else 2, t.provenance, t.where) for t in tuned
                            if t.family == fam_name]
                entries = []
                for tile, when, priority, provenance, where in choices:
                    spec = fam.spec(target, point, tile)
                    if not fam.tile_constraints:  # one entry per kernel, serving every call (bwd, append)
                        if not any(e.spec == spec for e in entries):
                            entries.append(Variant(spec, Constraints(), 0, provenance, where))
                        continue
                    entries.append(Variant(spec, when, priority, provenance, where))
                # A tuned entry replaces every lower-priority entry it covers.
                out += [v for v in entries
                        if not any(o.priority >= 2 > v.priority and o.when.covers(v.when) for o in entries)]
        out += self._alternates(target, out)
        return sorted(out, key=lambda v: (v.spec.family, v.spec.head_dim, -v.spec.gqa_group, v.priority, v.spec.name))

    def _alternates(self, target: Target, entries: list[Variant]) -> list[Variant]:
        """The mirrored targets' tiles and the candidates, as alternates, where no entry has the tile."""
        # (family, head_dim, GQA group or None for every group, (dtype, score) options (ANY: every
        # one), tile, provenance, where)
        wanted: list[tuple[str, int, int | None, object, Tile, str, str]] = []
        for name in target.mirrors:
            for v in self.variants_for(self.target(name)):
                wanted.append((v.spec.family, v.spec.head_dim, v.spec.gqa_group,
                               (v.spec.option("dtype"), v.spec.option("score")), v.spec.tile, f"mirrors {name}", v.where))
        for fam_name, hd, tile in self.alternates.get(target.name, ()):
            wanted.append((fam_name, hd, None, _ANY, tile, "candidate", f"candidate {fam_name} head_dim {hd} {tile}"))
        have = {(v.spec.family, v.spec.option("layout"), v.spec.option("dtype"), v.spec.option("score"),
                 v.spec.head_dim, v.spec.gqa_group, v.spec.tile) for v in entries}
        out = []
        for fam_name, hd, group, options, tile, provenance, where in wanted:
            fam = family(fam_name)
            if fam_name not in self.kernels or fam.tier(target) is None:
                continue
            for point in fam.points(self.kernels[fam_name]):
                key = (fam_name, point.get("layout"), point.get("dtype"), point.get("score"), point["head_dim"],
                       point["gqa_group"], tile)
                if (point["head_dim"] != hd or group not in (None, point["gqa_group"]) or key in have
                        or options not in (_ANY, (point.get("dtype"), point.get("score")))
                        or not target.builds(fam_name, hd) or not fam.builds_point(target, point)):
                    continue
                have.add(key)
                out.append(Variant(fam.spec(target, point, tile), Constraints(), ALTERNATE, provenance, where))
        return out

    def specs_for(self, target: Target) -> list[KernelSpec]:
        return sorted({v.spec for v in self.variants_for(target)}, key=lambda s: s.name)

    def select(self, selector: str) -> list[Target]:
        """A comma list of target names and the groups ``default`` and ``all`` (every GPU target)."""
        groups = {"default": [t.name for t in self.targets if t.default],
                  "all": [t.name for t in self.targets if t.platform != "host"]}
        names = []
        for item in (s.strip() for s in selector.split(",")):
            names += groups.get(item, [item] if item else [])
        known = {t.name for t in self.targets}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise VariantsError(
                f"{self.source.name}: unknown target(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))} (add an entry under targets: to build a new one)")
        return [self.target(n) for n in dict.fromkeys(names)]


# --------------------------------------------------------------------------- loading

def _positive(node: Node, key: str) -> int:
    value = node.take(key, int)
    node.check(key, value > 0, f"must be positive, got {value}")
    return value


def _target(name: str, node: object, parent: Node) -> Target:
    if not _TARGET_RE.fullmatch(name):
        raise parent.fail(name, "target names are gfxNNN[N] (lower-case hex), sm_NN, or host[_suffix]")
    if not isinstance(node, Node):
        raise parent.fail(name, "expected a mapping")
    platform = node.choice("platform", tuple(PLATFORMS))
    plat = PLATFORMS[platform]
    wave = node.take("wave_size", int)
    node.check("wave_size", wave in (32, 64), f"must be 32 or 64, got {wave}")
    fields = dict(
        name=name, platform=platform, family=node.take("family", str), parts=node.take("parts", str),
        wave_size=wave, lds_bytes=_positive(node, "lds_bytes"), lds_per_cu=_positive(node, "lds_per_cu"),
        vgprs_per_simd=_positive(node, "vgprs_per_simd"), vgpr_granule=_positive(node, "vgpr_granule"),
        max_waves_per_simd=_positive(node, "max_waves_per_simd"), simds_per_cu=_positive(node, "simds_per_cu"),
        # the cost model's rates; optional: a wave instruction per clock, 128 B of LDS per clock
        valu_lanes=_positive(node, "valu_lanes") if "valu_lanes" in node else wave,
        lds_bytes_per_clock=_positive(node, "lds_bytes_per_clock") if "lds_bytes_per_clock" in node else 128,
        fdot2=node.take("fdot2", bool),
        int8_dot=node.choice("int8_dot", plat.int8_dots), mixed_fma=node.choice("mixed_fma", MIXED_FMAS),
        hw_tier=node.take("hw_tier", int), default=node.take("default", bool),
        status=node.choice("status", STATUSES), stage=node.choice("stage", STAGES),
        tiles=node.take("tiles", str), isa=node.take("isa", str, name),
        mirrors=tuple(node.take("mirrors", list, [])),
        head_dims=_head_dims(node),
        bf16_dot=node.take("bf16_dot", bool, False),
        decode_alibi_rows=node.take("decode_alibi_rows", int, 2),
        decode_xf_cases=node.take("decode_xf_cases", bool, False),
    )
    if fields["decode_alibi_rows"] not in (1, 2, 4, 8):
        raise node.fail("decode_alibi_rows", f"must be 1, 2, 4 or 8 (a decode tile's rows), got {fields['decode_alibi_rows']}")
    if fields["hw_tier"] not in (1, 2):
        raise node.fail("hw_tier", f"must be 1 or 2, got {fields['hw_tier']}")
    if fields["bf16_dot"] and platform != "amdgcn":
        raise node.fail("bf16_dot", "v_dot2_f32_bf16 is an AMD instruction (gfx11+); only amdgcn targets have it")
    if fields["lds_bytes"] > fields["lds_per_cu"]:
        raise node.fail("lds_bytes", "must not exceed lds_per_cu")
    plat.validate_target(name, fields, node)
    node.finish()
    return Target(**fields)


def _head_dims(node: Node) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """``head_dims: {<family>: [head_dims]}`` (optional): the head_dims the target builds of each
    family listed (checked against the families' once they are loaded)."""
    if "head_dims" not in node:
        return ()
    per = node.child("head_dims")
    out = tuple((fam, per.int_list(fam)) for fam in sorted(per, key=lambda k: per.key_lines.get(k, 0)))
    per.finish()
    return out


def _tile(item: object, parent: Node, key: str) -> tuple[Tile, Constraints]:
    if not isinstance(item, Node):
        raise parent.fail(key, "expected a mapping with br, bc, threads, tm (and optionally waves, when), or a list of them")
    tile = Tile(br=_positive(item, "br"), bc=_positive(item, "bc"), threads=_positive(item, "threads"),
                tm=_positive(item, "tm"), waves=_positive(item, "waves") if "waves" in item else 0)
    when = Constraints()
    if "when" in item:
        when = constraints(item.child("when"))
    item.finish()
    return tile, when


def tile_choices(value: object, parent: Node, key: str, provenance: str) -> tuple[TileChoice, ...]:
    """A tile, or a list of them: exactly one without ``when`` (the fallback), the others constrained."""
    items = value if isinstance(value, list) else [value]
    path = f"{parent.path}.{key}" if parent.path else key
    out = []
    for i, item in enumerate(items):
        tile, when = _tile(item, parent, key)
        line = item.line if isinstance(item, Node) else parent.key_lines.get(key, parent.line)
        where = f"{parent.file}:{line}: {path}" + (f"[{i}]" if isinstance(value, list) else "")
        out.append(TileChoice(tile=tile, when=when, where=where, provenance=provenance))
    if sum(1 for c in out if not c.when.to_json()) != 1:
        raise parent.fail(key, "needs exactly one tile without `when:` (the one every other call uses)")
    return tuple(out)


def _tile_table(name: str, node: object, parent: Node, kernels: dict[str, dict], provenance: str) -> TileTable:
    if not _TABLE_RE.fullmatch(name):
        raise parent.fail(name, "tile table names are lower-case identifiers")
    if not isinstance(node, Node):
        raise parent.fail(name, "expected a mapping")
    inherit = node.take("inherit", str, None)
    if inherit is not None and inherit not in parent.key_lines:
        raise node.fail("inherit", f"no tile table {inherit!r}; tables: {', '.join(sorted(parent.key_lines))}")
    families = set(kernels)
    choices: dict[str, dict[int | str, tuple[TileChoice, ...]]] = {}
    for fam in sorted(node, key=lambda k: node.key_lines[k]):
        # "<family>_<option>": the tiles of the family's kernels of that dtype or score option (or
        # "<dtype>_<score>": of both), at the head_dims listed (the others take the family's).
        base, _, option = fam.partition("_")
        built = {}
        if base in families:
            dtypes, scores = kernels[base].get("dtypes", {}), kernels[base].get("scores", {})
            built = {**dtypes, **scores, **{f"{d}_{s}": [h for h in dtypes[d] if h in scores[s]]
                                            for d in dtypes for s in scores}}
        if base not in families or (option and option not in built):
            options = [f"{f}_{d}" for f in sorted(families)
                       for d in (*kernels[f].get("dtypes", {}), *kernels[f].get("scores", {}))]
            raise node.fail(fam, f"not a kernel family under kernels: ({', '.join(sorted(families))}), nor a family's "
                                 f"dtype or score option ({', '.join(options) or 'none'}), nor both")
        dims = built[option] if option else kernels[base]["head_dims"]
        dtype = option
        fam_node = node.child(fam)
        per: dict[int | str, tuple[TileChoice, ...]] = {}
        for key in sorted(fam_node, key=lambda k: fam_node.key_lines[k]):
            if key != "default" and not key.isdigit():
                raise fam_node.fail(key, "keys are head_dims or `default`")
            if key == "default" and dtype:
                raise fam_node.fail(key, f"an option's tiles are head_dims only (the others take {base}'s)")
            if key.isdigit() and int(key) not in dims:
                raise fam_node.fail(key, f"is not one of {fam}'s head_dims {list(dims)}")
            per[key if key == "default" else int(key)] = tile_choices(fam_node.pop(key), fam_node, key, provenance)
        choices[fam] = per
    node.finish()
    return TileTable(name=name, inherit=inherit, choices=choices)


def load_matrix(path: Path | str = DEFAULT_VARIANTS, tuned_dir: Path | str | None = TUNED_DIR) -> Matrix:
    """Load and validate a variants file and the tuned overlays in ``tuned_dir`` (None: none);
    every error names the file, line and key path."""
    path = Path(path)
    root = load(path)
    kernels_node = root.child("kernels")
    kernels = {}
    for fam in sorted(kernels_node, key=lambda k: kernels_node.key_lines[k]):
        if fam not in FAMILIES:
            raise kernels_node.fail(fam, f"unknown kernel family; known: {', '.join(sorted(FAMILIES))}")
        kernels[fam] = FAMILIES[fam].axes(kernels_node.child(fam))
    tiles_node = root.child("tiles")
    tile_tables = {t.name: t for t in tiles_node.items_in(
        lambda k, v: _tile_table(k, v, tiles_node, kernels, path.name))}
    for t in tile_tables.values():
        seen = [t.name]
        while t.inherit is not None:
            if t.inherit in seen:
                raise VariantsError(f"{path.name}: tiles.{seen[0]}: inheritance loop {' -> '.join(seen + [t.inherit])}")
            seen.append(t.inherit)
            t = tile_tables[t.inherit]
    targets_node = root.child("targets")
    target_lines = dict(targets_node.key_lines)
    targets = tuple(targets_node.items_in(lambda k, v: _target(k, v, targets_node)))
    by_name = {t.name: t for t in targets}
    for t in targets:
        anchor = by_name.get(t.isa)
        if anchor is None or anchor.isa != anchor.name or (anchor.platform, anchor.wave_size) != (t.platform, t.wave_size):
            raise VariantsError(f"{path.name}:{target_lines[t.name]}: targets.{t.name}.isa: {t.isa!r} must name a "
                                "target of the same platform and wave size whose isa is itself")
        for m in t.mirrors:
            mirrored = by_name.get(m) if isinstance(m, str) else None
            if mirrored is None or mirrored.platform == "host" or mirrored.stage != t.stage:
                raise VariantsError(f"{path.name}:{target_lines[t.name]}: targets.{t.name}.mirrors: {m!r} must "
                                    f"name a GPU target that stages in {t.stage} as {t.name} does")
        for fam, dims in t.head_dims:
            where = f"{path.name}:{target_lines[t.name]}: targets.{t.name}.head_dims.{fam}"
            if fam not in kernels:
                raise VariantsError(f"{where}: not a kernel family under kernels: ({', '.join(sorted(kernels))})")
            extra = sorted(set(dims) - set(kernels[fam]["head_dims"]))
            if extra:
                raise VariantsError(f"{where}: {extra} are not {fam}'s head_dims")
        if t.tiles not in tile_tables:
            raise VariantsError(f"{path.name}:{target_lines[t.name]}: targets.{t.name}.tiles: no tile table "
                                f"{t.tiles!r}; tables: {', '.join(sorted(tile_tables))}")
    root.finish()
    tuned = {}
    if tuned_dir is not None and Path(tuned_dir).is_dir():
        names = {t.name for t in targets}
        for file in sorted(Path(tuned_dir).glob("*.yaml")):
            target, entries = load_tuned(file, names, kernels)
            tuned[target] = entries
    matrix = Matrix(source=path, targets=targets, tile_tables=tile_tables, kernels=kernels, tuned=tuned)
    check_matrix(matrix, target_lines)
    return matrix


def check_matrix(matrix: Matrix, target_lines: dict[str, int]) -> None:
    """Every entry of every target must be generable, fit the target, and be reachable."""
    path = matrix.source
    for target in matrix.targets:
        variants = matrix.variants_for(target)
        for v in sorted(variants, key=lambda v: v.spec.name):
            problems = family(v.spec.family).problems(v.spec, target)
            if problems:
                raise VariantsError(f"{v.where}: kernel {v.spec.name} for {target.name}: {'; '.join(problems)}")
        problems = check_entries(variants)
        if problems:
            raise VariantsError(f"{path.name}:{target_lines[target.name]}: targets.{target.name}: "
                                + "; ".join(problems))


def check_entries(variants: list[Variant]) -> list[str]:
    """Entries no call can reach (a higher-priority entry of the same key admits every call they
    admit), entries of equal priority that some call could match both (the choice would depend
    on order), keys without an unconstrained entry, and (family, head_dim) pairs with no group-1
    kernel to fall back on. Alternates (negative priority) serve only calls that name them."""
    problems = []
    keys: dict[tuple, list[Variant]] = {}
    for v in variants:
        if v.priority < 0:  # an alternate: chosen only by name
            continue
        keys.setdefault((kind(v.spec.family, v.spec.option("layout"), v.spec.option("dtype"), v.spec.option("score")),
                         v.spec.head_dim,
                         v.spec.gqa_group), []).append(v)
    for key, entries in sorted(keys.items()):
        for i, v in enumerate(entries):
            for o in entries[i + 1:]:
                if o.priority == v.priority and o.when.overlaps(v.when):
                    problems.append(f"{v.spec.name} ({v.where}) and {o.spec.name} ({o.where}) both serve some calls "
                                    "at the same priority; give them disjoint `when:`")
            for o in entries:
                if o.priority > v.priority and o.when.covers(v.when):
                    problems.append(f"{v.spec.name} ({v.where}) is never chosen: {o.spec.name} ({o.where}) "
                                    "serves every call it would")
                    break
        if not any(not v.when.to_json() for v in entries):
            problems.append(f"{key[0]} head_dim {key[1]} group {key[2]} has no entry without `when:`")
    for fam, hd in sorted({(k[0], k[1]) for k in keys}):
        if (fam, hd, 1) not in keys:
            problems.append(f"{fam} head_dim {hd} has no gqa_group 1 kernel to fall back on")
    return problems
