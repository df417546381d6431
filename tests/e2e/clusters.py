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

from pdctl.launch.local import live_processes

RAY = str(Path(sys.executable).parent / "ray")


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for child, parent, _ in live_processes():
        children.setdefault(parent, []).append(child)
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


class _Cluster:
    """Started on enter; a failed start stops whatever had started (`__exit__` is not called then)."""

    def _up(self) -> None:
        raise NotImplementedError

    def __exit__(self, *exc) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self._up()
        except BaseException:
            self.__exit__()
            raise
        return self


class RayCluster(_Cluster):
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


SLURM_CONF = """\
ClusterName=pdctl-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/cgroup
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
KillWait=10
SlurmdTimeout=10
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
NodeName=node1 NodeAddr=127.0.0.2 NodeHostname=node1 Port={node1_port} CPUs=2 State=UNKNOWN
NodeName=node2 NodeAddr=127.0.0.3 NodeHostname=node2 Port={node2_port} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""

# cgroup v1 freezer tracking: every process of a step, even a setsid daemon, goes with scancel.
CGROUP_CONF = """\
CgroupPlugin=cgroup/v1
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
"""


class SlurmCluster(_Cluster):
    """munge, slurmctld and two slurmd (node1 on 127.0.0.2, node2 on 127.0.0.3), private to one test module."""

    def __init__(self, tmp: Path, ctld_port: int = 6917):
        from tests.conftest import REPO

        self.d = tmp
        self.repo = REPO
        self.ports = {"ctld_port": ctld_port, "node1_port": ctld_port + 4, "node2_port": ctld_port + 5}
        self.conf = tmp / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}
        self.munged: int | None = None  # only when this fixture started it

    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _cmd(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=30, env=self.env())

    def _munge(self) -> None:
        pidfile = Path("/run/munge/munged.pid")
        if pidfile.is_file() and alive(int(pidfile.read_text().split()[0])):
            return
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        key = Path("/etc/munge/munge.key")
        if not key.is_file():
            subprocess.run(["runuser", "-u", "munge", "--", "mungekey", "--create"], check=True, timeout=30)
        subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, timeout=30)
        for _ in range(50):
            if pidfile.is_file():
                self.munged = int(pidfile.read_text().split()[0])
                return
            time.sleep(0.1)
        raise AssertionError("munged wrote no pid file")

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(self.d / f"{name}.out", "ab")
        self.daemons[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True, env=self.env())

    def _up(self) -> None:
        r = subprocess.run(["bash", str(self.repo / "scripts" / "install_slurm.sh")], capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        (self.d / "state").mkdir(parents=True, exist_ok=True)
        self.conf.write_text(SLURM_CONF.format(d=self.d, **self.ports))
        (self.d / "cgroup.conf").write_text(CGROUP_CONF)
        self._munge()
        self._start("slurmctld", ["slurmctld", "-D", "-i"])
        time.sleep(1)
        self._start("slurmd-node1", ["slurmd", "-D", "-N", "node1"])
        self._start("slurmd-node2", ["slurmd", "-D", "-N", "node2"])
        end = time.monotonic() + 60
        while time.monotonic() < end:
            for name, p in self.daemons.items():
                assert p.poll() is None, f"{name} exited:\n" + (self.d / f"{name}.out").read_text()[-3000:]
            idle = self._cmd("sinfo", "--noheader", "--Node", "--format", "%N %T").stdout.split()
            if idle.count("idle") >= 2:
                return
            time.sleep(0.5)
        raise AssertionError("slurm nodes never became idle: " + self._cmd("sinfo").stdout)

    def jobs(self) -> list[str]:
        return self._cmd("squeue", "--noheader", "--format", "%i").stdout.split()

    def __exit__(self, *exc):
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            for job in self.jobs():  # this cluster is private to the test: every job on it is the test's
                self._cmd("scancel", job)
            end = time.monotonic() + 30
            while self.jobs() and time.monotonic() < end:
                time.sleep(0.5)
        for name in ("slurmd-node2", "slurmd-node1", "slurmctld"):
            p = self.daemons.get(name)
            if p is not None:
                stop_tree(p.pid, descendants(p.pid), grace_s=15)
                p.wait(10)
        # A lost node's slurmstepd (ppid 1, no slurmd left to end it) still carries this cluster's SLURM_CONF.
        mine = f"SLURM_CONF={self.conf}".encode()
        for pid, _, _ in live_processes():
            if pid == os.getpid():
                continue
            try:
                if mine in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    stop_tree(pid, [], grace_s=5)
            except OSError:
                pass
        if self.munged:
            stop_tree(self.munged, [], grace_s=5)
