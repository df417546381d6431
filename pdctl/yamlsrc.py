"""YAML loading that remembers where every key came from, so errors can name file:line."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import Any

import yaml

Path_ = tuple[str | int, ...]

MAX_BYTES = 2**20  # a topology is a few KiB; a larger file is the wrong one (and takes PyYAML seconds)
MAX_DEPTH = 64  # nesting levels (a topology has about 5); keeps PyYAML's recursive composer far from the limit
MAX_NODES = 20_000  # values, counting what aliases repeat ("billion laughs" is refused, not expanded)


class YamlSourceError(Exception):
    def __init__(self, line: int | None, message: str):
        super().__init__(message)
        self.line = line
        self.message = message


class YamlLimitError(YamlSourceError):
    """The document breaks a bound (depth, size, alias expansion): refused whatever it is used for."""


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
    """Parse one YAML document; YamlSourceError (with the line where known) for anything that is not one.

    Bounded whatever the input: nesting deeper than MAX_DEPTH, more than MAX_NODES values (counting what aliases
    repeat: a "billion laughs" document is refused after MAX_NODES, never expanded) and recursive aliases are
    refused with a message, as are tags that construct nothing plain."""
    try:
        loader = _Loader(text)  # its reader refuses unprintable characters here already
        try:
            node = loader.get_single_node()
        finally:
            loader.dispose()
    except YamlSourceError:
        raise
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise YamlSourceError(mark.line + 1 if mark else None, f"invalid YAML: {e.problem or e}") from None
    except yaml.reader.ReaderError as e:
        line = text.count("\n", 0, e.position) + 1 if isinstance(e.position, int) else None
        char = f"#x{e.character:04x}" if isinstance(e.character, int) else repr(e.character)
        raise YamlSourceError(line, f"invalid YAML: {e.reason} (character {char})") from None
    except yaml.YAMLError as e:
        raise YamlSourceError(None, f"invalid YAML: {e}") from None
    except RecursionError:  # a safety net: the depth limit comes first
        raise YamlSourceError(None, f"invalid YAML: nested too deeply (at most {MAX_DEPTH} levels)") from None
    located = Located(data=None)
    if node is None:
        located.data = {}
        return located
    located.data = _Builder(located.lines).build(node, (), 1)
    return located


def load_file(path: str | os.PathLike, what: str = "the file") -> Any:
    """A YAML file's plain data ({} when empty), with read_file's and load's bounds; YamlSourceError otherwise.
    For any YAML a user hands pdctl (yaml.safe_load expands alias bombs and recurses without a bound)."""
    return load(read_file(path, what)).data


def parse_value(text: str) -> Any:
    """One YAML value (a command-line override): None for an empty document, the same limits as load."""
    if not text.strip():
        return None
    return load(text).data


def read_file(path: str | os.PathLike, what: str = "the file", max_bytes: int = MAX_BYTES) -> str:
    """A YAML file's text: YamlSourceError with a message when it cannot be read, is not a file, is larger than
    max_bytes (refused before it is read) or is not UTF-8 (or UTF-16/32 with a byte-order mark).

    A FIFO or a pipe (`pdctl validate <(...)`) is read as it comes, up to max_bytes; one nobody writes to reads
    as empty instead of blocking forever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the name
        raise YamlSourceError(None, f"cannot read {what}: {_reason(e)}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise YamlSourceError(None, f"cannot read {what}: it is a directory")
        if stat.S_ISREG(st.st_mode) and st.st_size > max_bytes:
            raise YamlSourceError(None, f"{what} is {_size(st.st_size)}, more than the {_size(max_bytes)} a YAML "
                                  "file may have here; refusing to parse it (is it the right file?)")
        os.set_blocking(fd, True)
        chunks: list[bytes] = []
        total = 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise YamlSourceError(None, f"cannot read {what}: {_reason(e)}") from None
    finally:
        os.close(fd)
    if total > max_bytes:
        raise YamlSourceError(None, f"{what} is more than {_size(max_bytes)}; refusing to parse it "
                              "(is it the right file?)")
    return decode(b"".join(chunks), what)


def decode(raw: bytes, what: str = "the file") -> str:
    """UTF-8 (a BOM allowed), or UTF-16/32 with a BOM as YAML allows; YamlSourceError naming the first bad byte."""
    for bom, codec in ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
                       (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16")):
        if raw.startswith(bom):
            try:
                return raw.decode(codec)
            except UnicodeDecodeError:
                raise YamlSourceError(None, f"{what} starts with a {codec.upper()} byte-order mark but is not "
                                      f"{codec.upper()} text") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise YamlSourceError(line, f"{what} is not UTF-8 text: byte 0x{raw[e.start]:02x} at line {line}, column "
                              f"{col}") from None


def _reason(e: Exception) -> str:
    return (e.strerror if isinstance(e, OSError) and e.strerror else str(e)) or type(e).__name__


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}".replace(".0 ", " ")
    return f"{n} bytes"


def short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Loader(yaml.SafeLoader):
    """SafeLoader's composer with a bound on nesting and on the number of nodes, checked as events arrive (so a
    deep or huge document is refused before it is composed, and the composer's recursion stays shallow)."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > MAX_DEPTH or self._nodes > MAX_NODES:
                mark = self.peek_event().start_mark
                raise YamlLimitError(mark.line + 1 if mark else None,
                                     _too_deep() if self._depth > MAX_DEPTH else _too_many())
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _too_deep() -> str:
    return f"nested more than {MAX_DEPTH} levels deep; a topology needs a handful"


def _too_many() -> str:
    return (f"more than {MAX_NODES} values (counting every repetition an alias makes); a topology has a few "
            "hundred. A document built to expand (aliases of aliases) is refused")


_COLLECTION_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("map", "seq", "set", "omap", "pairs")}


class _Builder:
    """Plain data from the composed node graph. Aliases are expanded as the YAML means them, but every value
    counts against MAX_NODES and MAX_DEPTH, and an alias inside the collection it names is refused."""

    def __init__(self, lines: dict[Path_, int]):
        self.lines = lines
        self.count = 0
        self.open: set[int] = set()  # collections being built (an alias to one of them is a cycle)
        self.ctor = yaml.SafeLoader("")

    def build(self, node: yaml.Node, path: Path_, depth: int) -> Any:
        line = node.start_mark.line + 1 if node.start_mark else None
        self.count += 1
        if self.count > MAX_NODES:
            raise YamlLimitError(line, _too_many())
        if depth > MAX_DEPTH:
            raise YamlLimitError(line, _too_deep() + " (once aliases are expanded)")
        if isinstance(node, yaml.ScalarNode):
            return self.scalar(node)
        if node.tag not in _COLLECTION_TAGS:  # SafeLoader would refuse !!python/... and !custom tags too
            raise YamlSourceError(line, f"invalid YAML: could not determine a constructor for the tag {node.tag!r}")
        if id(node) in self.open:
            raise YamlLimitError(line, "an alias refers to a collection that contains it (a recursive "
                                 "structure); a topology is a tree")
        self.open.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                out: dict[Any, Any] = {}
                for key_node, value_node in node.value:
                    key_line = key_node.start_mark.line + 1 if key_node.start_mark else None
                    if not isinstance(key_node, yaml.ScalarNode):
                        raise YamlSourceError(key_line, "unsupported key: a list or mapping used as a key")
                    key = self.scalar(key_node)
                    if not isinstance(key, (str, int)):
                        raise YamlSourceError(key_line, f"unsupported key {short(key)}")
                    if key in out:
                        raise YamlSourceError(key_line, f"duplicate key {short(key)}")
                    self.lines[path + (key,)] = key_line
                    out[key] = self.build(value_node, path + (key,), depth + 1)
                return out
            items = []
            for i, item in enumerate(node.value):
                self.lines[path + (i,)] = item.start_mark.line + 1 if item.start_mark else line
                items.append(self.build(item, path + (i,), depth + 1))
            return items
        finally:
            self.open.discard(id(node))

    def scalar(self, node: yaml.ScalarNode) -> Any:
        line = node.start_mark.line + 1 if node.start_mark else None
        try:
            return self.ctor.construct_object(node, deep=True)
        except yaml.MarkedYAMLError as e:
            raise YamlSourceError(line, f"invalid YAML: {e.problem or e}") from None
        except Exception as e:  # !!int abc, !!bool maybe, an int of 5000 digits, ...
            kind = node.tag.rsplit(":", 1)[-1]
            raise YamlSourceError(line, f"invalid YAML: {short(node.value)} is no valid {kind} "
                                  f"({type(e).__name__}: {short(str(e), 80)})") from None
