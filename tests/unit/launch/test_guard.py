"""The guard: when its parent dies, nothing of its process group survives (a parent-death signal alone stops
only the direct child; vLLM's EngineCore was seen to outlive its API server)."""

import errno
import os
import shlex
import subprocess
import sys

from pdctl.launch.local import group_members, guarded
from tests.conftest import wait_for


def test_parent_death_stops_the_whole_group():
    # parent -> guard -> sh -> two sleeps that ignore nothing; the parent is then killed with SIGKILL.
    code = ("import subprocess, sys, time\n"
            f"p = subprocess.Popen({guarded(['sh', '-c', 'sleep 300 & sleep 300 & wait'])!r}, start_new_session=True)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(300)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        guard = int(parent.stdout.readline())
        assert wait_for(lambda: len(group_members(guard)) >= 4, 20), group_members(guard)  # guard, sh, 2 sleeps
        parent.kill()
        parent.wait(5)
        assert wait_for(lambda: not group_members(guard), 15), group_members(guard)
    finally:
        parent.kill()


def test_exit_code_of_the_command_is_the_guards():
    assert subprocess.run(guarded(["sh", "-c", "exit 3"]), timeout=30).returncode == 3


def test_sigterm_to_the_guard_stops_the_group():
    p = subprocess.Popen(guarded(["sh", "-c", "sleep 300 & sleep 300 & wait"]), start_new_session=True)
    try:
        assert wait_for(lambda: len(group_members(p.pid)) >= 4, 20)
        p.terminate()
        assert p.wait(15) != 0
        assert wait_for(lambda: not group_members(p.pid), 15), group_members(p.pid)
    finally:
        p.kill()


def test_detached_guard_stops_the_group_when_the_watched_owner_dies():
    owner = subprocess.Popen(["sleep", "300"])
    try:
        launcher = subprocess.Popen(guarded(["sh", "-c", "sleep 300 & sleep 300 & wait"], watch=owner.pid),
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        guard = int(launcher.stdout.readline())  # the launcher printed the detached guard's pid and exits
        assert launcher.wait(10) == 0
        assert wait_for(lambda: len(group_members(guard)) >= 4, 20), group_members(guard)
        owner.kill()
        owner.wait(5)
        assert wait_for(lambda: not group_members(guard), 15), group_members(guard)
    finally:
        owner.kill()


NICENESS = ("import os, threading\n"
            "seen = [os.nice(0)]\n"
            "t = threading.Thread(target=lambda: seen.append(os.nice(0)))\n"
            "t.start(); t.join()\n"
            "print(*seen)\n")


def test_nice_is_added_to_the_server_and_everything_it_starts():
    # guard -> sh -> python (a grandchild, as vLLM's engine core is) and a thread of it: all at base + nice.
    base = os.nice(0)
    cmd = ["sh", "-c", f"{sys.executable} -c {shlex.quote(NICENESS)}"]
    got = subprocess.run(guarded(cmd, nice=7), capture_output=True, text=True, timeout=30)
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == [str(min(19, base + 7))] * 2
    plain = subprocess.run(guarded(cmd), capture_output=True, text=True, timeout=30)
    assert plain.stdout.split() == [str(base)] * 2  # negative control: no --nice, no change
    assert "--nice" not in guarded(cmd)


def test_a_niceness_the_host_refuses_starts_nothing_and_says_why(monkeypatch, capsys, tmp_path):
    from pdctl.launch import guard

    def refuse(_n):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(guard.os, "nice", refuse)
    marker = tmp_path / "ran"
    assert guard.main(["--orphan", "--nice", "-5", "--", "touch", str(marker)]) == 1
    err = capsys.readouterr().err
    assert "not started: cannot add -5 to the niceness (Operation not permitted)" in err and "CAP_SYS_NICE" in err
    assert not marker.exists()
