import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
CONFIGS = REPO / "configs"
TINY = REPO / ".pdctl" / "models" / "tiny"


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """Run pdctl's real entry point in-process; returns (exit code, stdout, stderr)."""
    from pdctl import cli

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["pdctl", *map(str, args)])
        code = 0
        try:
            cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
