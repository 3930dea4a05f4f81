"""Kernel names: one name per kernel is its file stem, symbol and dispatch id, and it parses back
into the facts it encodes. Each family owns its name schema; the generator spells names with it
and the runtime checks dispatch tables against it. Optional fields appear in a name only when
set, so adding one leaves every existing name unchanged."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class NameField:
    key: str                    # the fact's key: "head_dim", "tile.br", "options.split"
    text: str                   # how it is spelled, "{}" for the value: "_hd{}"
    pattern: str                # regular expression of the value
    convert: Callable[[str], object] = int
    optional: bool = False      # spelled only when set (truthy)


class NameSchema:
    """``prefix`` then each field in order; parse() inverts name()."""

    def __init__(self, prefix: str, fields: tuple[NameField, ...]):
        self.prefix, self.fields = prefix, fields
        parts = [re.escape(prefix)]
        for i, f in enumerate(fields):
            before, after = (re.escape(x) for x in f.text.split("{}"))
            group = f"{before}(?P<f{i}>{f.pattern}){after}"
            parts.append(f"(?:{group})?" if f.optional else group)
        self._regex = re.compile("".join(parts))

    def name(self, value: Callable[[str], object]) -> str:
        """The name of the kernel whose fact ``key`` is ``value(key)``."""
        out = [self.prefix]
        for f in self.fields:
            v = value(f.key)
            if f.optional and not v:
                continue
            out.append(f.text.format(v))
        return "".join(out)

    def parse(self, name: str) -> dict[str, object] | None:
        """The facts a name encodes, by key; None when it is not a name of this schema."""
        m = self._regex.fullmatch(name)
        if not m:
            return None
        return {f.key: f.convert(m[f"f{i}"]) for i, f in enumerate(self.fields) if m[f"f{i}"] is not None}
