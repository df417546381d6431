"""The guard: when its parent dies, nothing of its process group survives (a parent-death signal alone stops
only the direct child; vLLM's EngineCore was seen to outlive its API server)."""

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
