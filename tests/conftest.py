import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
CONFIGS = REPO / "configs"
TINY = REPO / ".pdctl" / "models" / "tiny"
TINY_HYBRID = REPO / ".pdctl" / "models" / "tiny-hybrid"  # `pdctl model tiny DIR --hybrid` (window 96)


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


def wait_for(cond, timeout: float, interval: float = 0.1) -> bool:
    """Poll `cond` until it holds (True) or `timeout` seconds passed (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(interval)
    return False


def processes_with_arg(text: str) -> list[int]:
    """Live processes whose command line holds `text` (e.g. a state dir): what a teardown left behind."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if text in cmd and stat[stat.rindex(")") + 2] not in "ZX":
                out.append(int(d.name))
    return out


def sample(text: str, metric: str, /, **labels: str) -> float | None:
    """The value of one Prometheus sample (exactly these labels), parsed with prometheus_client's own parser;
    None when absent. Label order and number formatting are the exposition library's business, not the test's."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == metric and s.labels == labels:
                return s.value
    return None
