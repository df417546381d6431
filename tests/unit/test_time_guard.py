"""The unit tier's time guard (tests/unit/conftest.py) fails a passing test that ran too long, and only that."""

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

from tests.conftest import REPO
from tests.unit import conftest as guard

TESTS = '''
import time

import pytest


def test_quick():
    pass


def test_slow():
    time.sleep(0.3)


@pytest.mark.unit_time_limit(5, reason="a test that names its own limit")
def test_slow_with_its_own_limit():
    time.sleep(0.3)


def test_slow_and_failing():
    time.sleep(0.3)
    assert 1 == 2


def test_slow_but_waiting_for_a_core():
    """As if 0.28 s of its 0.3 s the thread had waited for a core: the kernel's run-queue delay, made up."""
    import tests.unit.conftest as guard

    real = guard.queued_s

    def once():
        guard.queued_s = real
        return real() + 0.28

    guard.queued_s = once
    time.sleep(0.3)
'''


def test_a_passing_test_over_the_limit_fails_naming_its_duration_and_the_limit(tmp_path):
    """A sub-run under the guard with a 0.1 s limit: the test that sleeps 0.3 s fails; one with its own limit, one
    that mostly waited for a core and one that failed anyway keep their own outcome."""
    (tmp_path / "conftest.py").write_text("from tests.unit.conftest import pytest_configure, "
                                          "pytest_runtest_call, pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_sub.py").write_text(TESTS)
    env = {**os.environ, guard.LIMIT_ENV: "0.1", "PYTHONPATH": str(REPO), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                          f"--junitxml={tmp_path / 'r.xml'}", str(tmp_path / "test_sub.py")],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "r.xml").getroot().iter("testcase")}
    failed = {name for name, c in cases.items() if c.find("failure") is not None}
    assert set(cases) == {"test_quick", "test_slow", "test_slow_with_its_own_limit", "test_slow_and_failing",
                          "test_slow_but_waiting_for_a_core"}, out
    assert failed == {"test_slow", "test_slow_and_failing"}, out.stdout[-3000:]
    failure = cases["test_slow"].find("failure")
    why = (failure.get("message") or "") + (failure.text or "")
    took = re.search(r"test_sub\.py::test_slow passed but its call took (\d+\.\d+) s(?: \([^)]*\))?, over 0\.1 s",
                     why)
    assert took and float(took.group(1)) >= 0.29, why
    assert guard.LIMIT_ENV in why
    assert "assert 1 == 2" in cases["test_slow_and_failing"].find("failure").text  # its own failure, unchanged
    assert out.returncode == 1
