"""The Python floor: pyproject's requires-python, the floor docs/install.md states for the servers pdctl's connector
runs in (Intel's Gaudi images among them), and the code the connector imports inside a vLLM server, which must parse
on that Python (ast's grammar of the floor version): a newer syntax in any of it is caught here, whatever Python
runs the tests."""

from __future__ import annotations

import ast
import re
import tomllib

import pytest

from tests.conftest import REPO
from tests.unit.test_imports import PKG, import_graph

# What a vLLM server imports of pdctl: the connector (kv_connector_module_path) and the general plugin.
SERVER_ENTRIES = ("pdctl.connector.nixl", "pdctl.vllm_plugin")


def floor() -> tuple[int, int]:
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    major, minor = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec).groups()
    return int(major), int(minor)


def server_closure() -> set[str]:
    graph, seen, todo = import_graph(), set(), list(SERVER_ENTRIES)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


def module_path(name: str):
    rel = name.split(".")[1:]
    path = PKG.joinpath(*rel).with_suffix(".py")
    return path if path.exists() else PKG.joinpath(*rel, "__init__.py")


def parse_at(source: str, version: tuple[int, int]) -> None:
    ast.parse(source, feature_version=version)


def test_the_docs_state_the_floor_pyproject_holds():
    major, minor = floor()
    text = (REPO / "docs" / "install.md").read_text()
    assert f"Python >= {major}.{minor}" in text
    assert "Ubuntu 24.04" in text and "3.12" in text  # Intel's current Gaudi images, above the floor


def test_the_code_a_server_imports_parses_at_the_floor():
    closure = server_closure()
    assert {"pdctl.kv.receive", "pdctl.kv.reads", "pdctl.protocol", "pdctl.connector.seam"} <= closure
    for name in sorted(closure):
        parse_at(module_path(name).read_text(), floor())


def test_a_newer_syntax_is_refused_at_the_floor():
    # Negative control: PEP 695's type statement (3.12) in a module the server imports.
    with pytest.raises(SyntaxError):
        parse_at(module_path("pdctl.protocol").read_text() + "\ntype Pages = list[int]\n", (3, 11))
