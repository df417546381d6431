"""The unit tier's rules: a unit test waits for nothing, so one whose call takes longer than a few seconds fails.

The limit is LIMIT_S seconds, or PDCTL_UNIT_TEST_LIMIT_S where a slower machine needs more. A test that drives a
real external program with a fixed wait of its own (Prometheus scrapes its first targets 5 s after it starts)
names its own limit and why: @pytest.mark.unit_time_limit(seconds, reason="..."). The time measured is the
call's wall time less the time its thread stood ready to run while other processes had the cores (Linux's
run-queue delay, /proc/thread-self/schedstat): a sleep, a timeout or a slow subprocess counts, a busy machine
(parallel workers, servers built on the same cores) does not. The hooks here apply only to tests under
tests/unit (a conftest's hooks stop at its directory).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

LIMIT_ENV = "PDCTL_UNIT_TEST_LIMIT_S"
LIMIT_S = 5.0
MARKER = "unit_time_limit"
_QUEUED = pytest.StashKey[float]()

# Hypothesis' per-example deadline would fail a property on a busy machine for reasons the property does not
# test; the time guard below bounds the whole test instead.
settings.register_profile("unit", deadline=None, print_blob=True)
settings.load_profile("unit")


def pytest_configure(config):
    config.addinivalue_line("markers", f"{MARKER}(seconds, reason): this unit test's own call-time limit, "
                                       f"instead of {LIMIT_ENV} or {LIMIT_S:g} s")


def limit_for(item) -> tuple[float, str]:
    """(seconds, where the limit comes from) for one test."""
    marker = item.get_closest_marker(MARKER)
    if marker is not None:
        return float(marker.args[0]), f"its own {MARKER}: {marker.kwargs.get('reason', 'no reason given')}"
    raw = os.environ.get(LIMIT_ENV, "").strip()
    if raw:
        return float(raw), LIMIT_ENV
    return LIMIT_S, "the unit tier's limit"


def queued_s() -> float:
    """Seconds this thread has stood ready to run without a core; 0 where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    start = queued_s()
    try:
        return (yield)
    finally:
        item.stash[_QUEUED] = queued_s() - start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A passing call over the limit becomes a failure that names its duration and the limit."""
    report = yield
    if report.when == "call" and report.passed:
        limit, source = limit_for(item)
        queued = min(item.stash.get(_QUEUED, 0.0), report.duration)
        if report.duration - queued > limit:
            busy = f" ({queued:.2f} s of it waiting for a core, not counted)" if queued >= 0.01 else ""
            report.outcome = "failed"
            report.longrepr = (f"{item.nodeid} passed but its call took {report.duration:.2f} s{busy}, over "
                               f"{limit:g} s ({source}): a unit test waits for nothing (fake the clock, inject "
                               "the wait, size the example budget)")
    return report
