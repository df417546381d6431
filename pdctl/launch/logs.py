"""Reading instance logs: the tail, how a server ended, and the one line that says why.

A vLLM server that fails at start prints a ~40-line traceback whose useful line (pdctl's own refusal, or the
first exception) sits in the middle; `root_cause` finds it so `up`, the supervisor and `status` can show it
first.
"""

from __future__ import annotations

import re
from collections import deque
from pathlib import Path

from pdctl.protocol import CONNECTOR_FAILURE

# vLLM prefixes a child process's lines with "(EngineCore_DP0 pid=123) " and its logger with
# "ERROR 12-02 10:00:00 [file.py:12] "; the exception line is what follows.
_PREFIX = re.compile(r"^(\([\w.\-]+ pid=\d+\)\s*)?((DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*)?")
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)|AssertionError|KeyError)(:\s.*)?$")


def tail(path: str | Path, n: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=n)]
    except OSError:
        return []


def _strip(line: str) -> str:
    return _PREFIX.sub("", line.strip(), count=1).strip()


START_MARK = "--- pdctl: starting "
EXIT_MARK = "--- pdctl guard: server "  # the guard's one line on how the server ended


def this_run(lines: list[str]) -> list[str]:
    """The lines of the instance's latest run (a restarted instance appends to the same log)."""
    starts = [i for i, ln in enumerate(lines) if ln.startswith(START_MARK)]
    return lines[starts[-1]:] if starts else lines


WINDOW = 200  # lines before the end where the failure is told; older errors were survived


def root_cause(lines: list[str]) -> str | None:
    """In the last WINDOW lines: pdctl's own error line if there is one, else the first exception line of the
    first traceback there (vLLM prints the root of a failed start first: the engine core's, then the API
    server's "see root cause above"); None when those lines say nothing of the kind."""
    body = [_strip(ln) for ln in lines[-WINDOW:] if not ln.startswith(EXIT_MARK) and not ln.startswith("--- pdctl")]
    for ln in body:
        if CONNECTOR_FAILURE.search(ln) and (_EXCEPTION.match(ln) or ln.lower().startswith("pdctl")):
            return ln
    for ln in body:
        if CONNECTOR_FAILURE.search(ln):
            return ln[ln.lower().index("pdctl"):]
    starts = [i for i, ln in enumerate(body) if ln.startswith("Traceback (most recent call last)")]
    for ln in body[starts[0] if starts else 0:]:
        if _EXCEPTION.match(ln):
            return ln
    return None


def exit_of(lines: list[str]) -> str | None:
    """The guard's last word on how the server ended ('exited with code 1', 'killed by signal 9 (SIGKILL)')."""
    for ln in reversed(lines):
        if ln.startswith(EXIT_MARK):
            return ln[len(EXIT_MARK):]
    return None
