"""YAML loading that remembers where every key came from, so errors can name file:line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

Path_ = tuple[str | int, ...]


class YamlSourceError(Exception):
    def __init__(self, line: int | None, message: str):
        super().__init__(message)
        self.line = line
        self.message = message


@dataclass
class Located:
    """Parsed YAML data plus the 1-based line of every key (and list item) by its path."""

    data: Any
    lines: dict[Path_, int] = field(default_factory=dict)

    def line_of(self, path: Path_) -> int | None:
        # An error on a missing or nested field is reported at its closest existing ancestor.
        for n in range(len(path), 0, -1):
            if path[:n] in self.lines:
                return self.lines[path[:n]]
        return None


def load(text: str) -> Located:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise YamlSourceError(mark.line + 1 if mark else None, f"invalid YAML: {e.problem or e}") from None
    except yaml.YAMLError as e:
        raise YamlSourceError(None, f"invalid YAML: {e}") from None
    located = Located(data=None)
    if node is None:
        located.data = {}
        return located
    constructor = yaml.SafeLoader("")
    located.data = _build(node, (), located.lines, constructor)
    return located


def _build(node: yaml.Node, path: Path_, lines: dict[Path_, int], ctor: yaml.SafeLoader) -> Any:
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            key = ctor.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int)):
                raise YamlSourceError(key_node.start_mark.line + 1, f"unsupported key {key!r}")
            if key in out:
                raise YamlSourceError(key_node.start_mark.line + 1, f"duplicate key {key!r}")
            lines[path + (key,)] = key_node.start_mark.line + 1
            out[key] = _build(value_node, path + (key,), lines, ctor)
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            items.append(_build(item, path + (i,), lines, ctor))
        return items
    return ctor.construct_object(node, deep=True)
