"""The CLI (pdctl/cli/) parses, calls one function of pdctl's API and renders: no process handling, no file writes,
no plan surgery. Checked on its source (imports and calls), so a regression fails here, not in review."""

import ast
import subprocess
import sys

from tests.conftest import REPO

CLI = sorted((REPO / "pdctl" / "cli").glob("*.py"))
ALLOWED = {"functools", "inspect", "json", "sys", "pathlib", "typing", "typer", "rich.console",
           "pdctl", "pdctl.api", "pdctl.render", "pdctl.topology",
           "pdctl.cli", "pdctl.cli.common"}


def _imports(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add(node.module or "")
    return out


def test_cli_imports_only_the_api_the_renderers_and_its_toolkit():
    assert len(CLI) >= 5
    for path in CLI:
        tree = ast.parse(path.read_text())
        assert _imports(tree) <= ALLOWED, (path.name, _imports(tree) - ALLOWED)


def test_cli_writes_no_files_starts_no_processes_and_builds_no_plans():
    called = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
              for path in CLI for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)}
    assert not called & {"open", "write_text", "write_bytes", "mkdir", "Popen", "run", "kill", "killpg", "signal",
                         "Plan", "build_plan", "with_processes", "with_hosts", "reference_spec"}, called


def test_cli_stays_thin():
    # a command is its options, its help with examples and one API call; orchestration creeping back shows here
    lines = {path.name: len(path.read_text().splitlines()) for path in CLI}
    assert max(lines.values()) <= 250 and sum(lines.values()) <= 780, lines


def test_the_negative_control_sees_a_forbidden_import(tmp_path):
    bad = ast.parse("import subprocess\nfrom pdctl.launch import run\n")
    assert _imports(bad) - ALLOWED == {"subprocess", "pdctl.launch"}


def test_importing_pdctl_and_its_pytest_plugin_is_light():
    """The plugin loads in every pytest run of the environment, `import pdctl` in every command and the proxy."""
    code = ("import sys, pdctl, pdctl.pytest_plugin; heavy = [m for m in ('torch', 'vllm', 'lm_eval', 'pdctl.api', "
            "'pdctl.launch.run', 'aiohttp') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    code = "import sys, pdctl; pdctl.load; print([m for m in ('torch', 'vllm', 'lm_eval') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
