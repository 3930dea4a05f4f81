"""YAML loading that remembers where every key came from.

Mappings load as :class:`Node` objects: a dict that also knows the file, the line of each
key and its own path (``targets.gfx1030``). Readers ``pop`` the keys they understand and
call :meth:`Node.finish`, so an unknown key is an error that points at its line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, TypeVar

import yaml

T = TypeVar("T")

# Nodes that aliases may add to a file, counting an alias as everything its anchor expands to.
# variants.yaml adds about 1,300 (to 530 written); nested aliases ("billion laughs") would add
# billions, in minutes and gigabytes, before any validation could refuse them.
MAX_ALIASED_NODES = 100_000


class VariantsError(ValueError):
    """A problem in variants.yaml, reported as ``FILE:LINE: key.path: problem``."""


class Node(dict):
    file: str
    line: int
    path: str
    key_lines: dict[str, int]

    def where(self, key: str | None = None) -> str:
        line = self.key_lines.get(key, self.line) if key is not None else self.line
        path = f"{self.path}.{key}" if key is not None and self.path else (key or self.path)
        return f"{self.file}:{line}: {path}"

    def fail(self, key: str | None, problem: str) -> VariantsError:
        return VariantsError(f"{self.where(key)}: {problem}")

    def child(self, key: str) -> "Node":
        value = self.pop(key) if key in self else None
        if not isinstance(value, Node):
            raise self.fail(key, "expected a mapping" if key in self.key_lines else "is missing")
        return value

    def take(self, key: str, kind: type[T] | tuple[type, ...], default: Any = ...) -> T:
        """Pop ``key`` and check its type; ``bool`` never passes for ``int``."""
        if key not in self:
            if default is ...:
                raise self.fail(key, "is missing")
            return default
        value = self.pop(key)
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if isinstance(value, bool) and bool not in kinds:
            ok = False
        else:
            ok = isinstance(value, kinds)
        if not ok:
            names = " or ".join(k.__name__ for k in kinds)
            raise self.fail(key, f"expected {names}, got {value!r}")
        return value

    def choice(self, key: str, allowed: tuple[str, ...], default: Any = ...) -> str:
        value = self.take(key, str, default)
        if value not in allowed:
            raise self.fail(key, f"{value!r} is not one of {', '.join(allowed)}")
        return value

    def check(self, key: str, ok: bool, problem: str) -> None:
        if not ok:
            raise self.fail(key, problem)

    def int_list(self, key: str) -> tuple[int, ...]:
        """A non-empty list of distinct positive integers, sorted."""
        values = self.take(key, list)
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
            raise self.fail(key, f"expected a non-empty list of positive integers, got {values!r}")
        if len(set(values)) != len(values):
            raise self.fail(key, f"has duplicates: {values!r}")
        return tuple(sorted(values))

    def finish(self) -> None:
        """Fail on the first key nobody consumed."""
        for key in sorted(self, key=lambda k: self.key_lines.get(k, 0)):
            raise self.fail(key, "unknown key")

    def items_in(self, fn: Callable[[str, Any], T]) -> list[T]:
        """Consume every entry, in file order, through ``fn(key, value)``."""
        keys = sorted(self, key=lambda k: self.key_lines.get(k, 0))
        out = [fn(k, self[k]) for k in keys]
        self.clear()
        return out


def _loader(file: str) -> type[yaml.SafeLoader]:
    class Loader(yaml.SafeLoader):
        def __init__(self, stream: str):
            super().__init__(stream)
            self.expanded: dict[int, int] = {}  # id(node) -> nodes it stands for, aliases expanded
            self.aliased = 0

        def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
            if not self.check_event(yaml.AliasEvent):
                node = super().compose_node(parent, index)
                if isinstance(node, yaml.MappingNode):
                    children = [n for pair in node.value for n in pair]
                else:
                    children = node.value if isinstance(node, yaml.SequenceNode) else []
                self.expanded[id(node)] = 1 + sum(self.expanded[id(c)] for c in children)
                return node
            event = self.peek_event()
            node = super().compose_node(parent, index)
            where = f"{file}:{event.start_mark.line + 1}: alias *{event.anchor}"
            if id(node) not in self.expanded:
                raise VariantsError(f"{where}: refers to the node that contains it")
            self.aliased += self.expanded[id(node)]
            if self.aliased > MAX_ALIASED_NODES:
                raise VariantsError(f"{where}: the aliases of this file expand to more than "
                                    f"{MAX_ALIASED_NODES} nodes (nested aliases?)")
            return node

    def construct_mapping(loader: Loader, node: yaml.MappingNode) -> Node:
        explicit: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = loader.construct_object(key_node, deep=True)
            if key in explicit:
                raise VariantsError(
                    f"{file}:{key_node.start_mark.line + 1}: duplicate key {key!r} "
                    f"(first at line {explicit[key]})")
            explicit[key] = key_node.start_mark.line + 1
        loader.flatten_mapping(node)
        result = Node()
        result.file, result.line, result.path = file, node.start_mark.line + 1, ""
        result.key_lines = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise VariantsError(f"{file}:{key_node.start_mark.line + 1}: key {key!r} must be a string or integer")
            result[str(key)] = loader.construct_object(value_node, deep=True)
            # A merged key reports the line of the anchor it came from; an explicit key its own.
            result.key_lines[str(key)] = explicit.get(key, key_node.start_mark.line + 1)
        return result

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return Loader


def _set_paths(value: Any, path: str) -> None:
    # Anchored values are shared objects: each is copied so every path owns its own.
    if isinstance(value, Node):
        value.path = path
        for key, child in value.items():
            if isinstance(child, Node):
                child = _copy(child)
                child.line = value.key_lines[key]  # a missing key is reported at its parent's key
            elif isinstance(child, list):
                child = list(child)
            value[key] = child
            _set_paths(child, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, Node):
                item = value[i] = _copy(item)
            _set_paths(item, f"{path}[{i}]")


def _copy(node: Node) -> Node:
    out = Node(node)
    out.file, out.line, out.path, out.key_lines = node.file, node.line, node.path, dict(node.key_lines)
    return out


def load(path: Path, display_name: str | None = None) -> Node:
    """Load ``path`` strictly; errors are prefixed with ``display_name`` (default: the file name)."""
    name = display_name or Path(path).name
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise VariantsError(f"{name}: cannot read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line, column = raw.count(b"\n", 0, e.start) + 1, e.start - raw.rfind(b"\n", 0, e.start)
        raise VariantsError(f"{name}:{line}: not UTF-8: byte 0x{raw[e.start]:02x} at column {column}") from None
    try:
        data = yaml.load(text, Loader=_loader(name))  # noqa: S506 - SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        line = mark.line + 1 if mark else 0
        raise VariantsError(f"{name}:{line}: {e.problem}") from None
    except yaml.reader.ReaderError as e:  # a character YAML does not allow, such as a control code
        line = text.count("\n", 0, e.position) + 1
        raise VariantsError(f"{name}:{line}: {e.reason}: character U+{e.character:04X}") from None
    if not isinstance(data, Node):
        raise VariantsError(f"{name}:1: the top level must be a mapping")
    _set_paths(data, "")
    return data
