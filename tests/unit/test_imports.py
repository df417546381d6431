"""pdctl's modules import each other without a circle: every import counts, at module level and inside functions
(a function-level import hides a circle until the call, it does not remove it); only `if TYPE_CHECKING:` blocks
are left out, since they never run."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pdctl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, here: str, is_package: bool, modules: set[str]) -> set[str]:
    """The pdctl modules a module's code imports (a `from pkg import name` of a submodule counts as that module)."""
    out: set[str] = set()

    def target(name: str) -> str | None:
        # The longest pdctl module that the dotted name starts with.
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            cand = ".".join(parts[:k])
            if cand in modules:
                return cand
        return None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                if (m := target(a.name)) is not None:
                    out.add(m)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = here.split(".") if is_package else here.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            for a in node.names:
                m = target(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else target(base)
                if m is not None:
                    out.add(m)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    out.discard(here)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    modules = set(files)
    return {name: _imports(ast.parse(p.read_text(), str(p)), name, p.name == "__init__.py", modules)
            for name, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (as a path that ends where it starts), or None."""
    color: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def dfs(n: str) -> list[str] | None:
        color[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if color.get(m) == 1:
                return [*stack[stack.index(m):], m]
            if m not in color and (found := dfs(m)):
                return found
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(graph):
        if n not in color and (found := dfs(n)):
            return found
    return None


def test_the_import_graph_is_read():
    g = import_graph()
    assert "pdctl.launch.local" in g["pdctl.launch.cluster"]  # module level
    assert "pdctl.launch.errors" in g["pdctl.launch.slurm_engine"]


def test_no_import_circle_among_pdctl_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_launch_base_modules_import_no_concrete_engine():
    g = import_graph()
    concrete = {"pdctl.launch.local", "pdctl.launch.ray_engine", "pdctl.launch.slurm_engine", "pdctl.launch.run"}
    assert not g["pdctl.launch.engine"] & concrete
    assert not {m for m in g["pdctl.launch.logs"] if m.startswith("pdctl.launch")}
    assert g["pdctl.launch.errors"] <= {"pdctl.launch.logs"}
    for engine in ("pdctl.launch.local", "pdctl.launch.ray_engine", "pdctl.launch.slurm_engine"):
        assert "pdctl.launch.run" not in g[engine], engine


if __name__ == "__main__":
    c = find_cycle(import_graph())
    print("no import circle" if c is None else " -> ".join(c))
