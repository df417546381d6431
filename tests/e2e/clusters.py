"""Real two-node clusters on one machine, for the engine tests: each node on its own loopback address.

Every daemon is started here in its own session and stopped by PID (and its descendants, found through /proc),
never with `ray stop`, `scancel -u` or a kill by name.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] not in ("Z", "X"):
                children.setdefault(int(fields[1]), []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def stop_tree(root: int, known: list[int], grace_s: float) -> None:
    """SIGTERM the root, wait, then SIGKILL whatever is left of it and of every process it had started."""
    tree = set(known) | set(descendants(root))
    try:
        os.kill(root, signal.SIGTERM)
    except ProcessLookupError:
        pass
    end = time.monotonic() + grace_s
    while time.monotonic() < end and alive(root):
        time.sleep(0.2)
    for pid in [root, *tree, *descendants(root)]:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class RayCluster:
    """A head on 127.0.0.2 offering `prefill_node`, a worker on 127.0.0.3 offering `decode_node`."""

    def __init__(self, tmp: Path, port: int = 6390):
        self.tmp, self.port = tmp, port
        self.address = f"127.0.0.2:{port}"
        self.nodes: dict[str, subprocess.Popen] = {}
        self.trees: dict[str, list[int]] = {}
        # Ray's socket paths must stay under 108 bytes: pytest's tmp dirs are too deep.
        self.ray_tmp = tempfile.mkdtemp(prefix="pdray-", dir="/tmp")

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.tmp / f"ray-{name}.log", "ab")
        self.nodes[name] = subprocess.Popen(
            [RAY, "start", "--block", "--disable-usage-stats", "--num-cpus", "1", "--object-store-memory",
             str(100 * 2**20), *args], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})

    @property
    def _driver(self) -> str:
        return f"import ray; ray.init(address='{self.address}', logging_level='ERROR', log_to_driver=False); "

    def alive_nodes(self) -> list[str]:
        """Addresses of the nodes the cluster counts as alive (asked from a separate driver process)."""
        code = self._driver + "print(' '.join(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return out.stdout.split() if out.returncode == 0 else []

    def named_actors(self) -> list[str]:
        """Live named actors in every namespace, as 'namespace/name'."""
        code = self._driver + ("print(' '.join(a['namespace'] + '/' + a['name'] for a in "
                               "ray.util.list_named_actors(all_namespaces=True)))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()

    def _wait_nodes(self, n: int, timeout: float = 90) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for name, p in self.nodes.items():
                assert p.poll() is None, f"ray node {name} exited:\n" + (self.tmp / f"ray-{name}.log").read_text()
            if len(self.alive_nodes()) >= n:
                return
            time.sleep(1)
        raise AssertionError(f"Ray cluster did not reach {n} nodes")

    def __enter__(self):
        try:
            self._up()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _up(self) -> None:
        self._start("head", ["--head", "--port", str(self.port), "--node-ip-address", "127.0.0.2",
                             "--resources", '{"prefill_node": 1}', "--include-dashboard=false",
                             "--temp-dir", self.ray_tmp])
        self._wait_nodes(1)
        self._start("worker", ["--address", self.address, "--node-ip-address", "127.0.0.3",
                               "--resources", '{"decode_node": 1}'])
        self._wait_nodes(2)

    def raylet_pid(self, node: str) -> int:
        """The raylet of a node, found among the descendants of that node's `ray start`."""
        for pid in descendants(self.nodes[node].pid):
            try:
                exe = os.readlink(f"/proc/{pid}/exe")
            except OSError:
                continue
            if exe.endswith("/raylet"):
                return pid
        raise LookupError(f"no raylet under {node}")

    def pids(self) -> list[int]:
        return [pid for p in self.nodes.values() for pid in [p.pid, *descendants(p.pid)]]

    def __exit__(self, *exc):
        for name in ("worker", "head"):
            p = self.nodes.get(name)
            if p is not None:
                self.trees[name] = descendants(p.pid)
                stop_tree(p.pid, self.trees[name], grace_s=40)
                p.wait(10)
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
