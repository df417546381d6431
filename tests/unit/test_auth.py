"""API keys (auth.api_key_env): the topology names a variable, the plan carries only that name, the engines read
the key at spawn, pdctl's own calls send it, and no key value reaches the plan, the state, the k8s render or a
command line. The proxy's own check is tested with the proxy (proxy/test_proxy.py)."""

import json
import secrets
import subprocess
import sys
import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

import pdctl
from pdctl import auth
from pdctl.launch.state import LaunchState, ProcessRecord
from pdctl.plan import Plan, build_plan
from pdctl.proxy.config import spec_of
from pdctl.topology import ModelInfo, Topology, TopologyError, compatibility_problems, load_topology
from tests.conftest import CONFIGS, wait_for

NAME = "PDCTL_UNIT_KEY"
AUTH = {"auth.api_key_env": NAME}


@pytest.fixture
def key(monkeypatch):
    """A fresh key in NAME: every test greps for this value where it must not be."""
    value = f"k-{secrets.token_hex(12)}"
    monkeypatch.setenv(NAME, value)
    return value


def _plan(config="cpu-demo", overrides=AUTH, state_dir="/tmp/pdctl-auth"):
    t = pdctl.load(CONFIGS / f"{config}.yaml", overrides)
    return pdctl.plan(t, state_dir=state_dir, reference_port=8390)


# ------------------------------------------------------------------------------------------------------------
# The topology


def topo(**kw) -> Topology:
    base = {"name": "t", "model": {"path": "m/m"}, "prefill": {"block_size": 32, "devices": [0]},
            "decode": {"block_size": 64, "devices": [1]}}
    for k, v in kw.items():
        section, _, field_ = k.partition("__")
        base.setdefault(section, {})[field_] = v
    return Topology.model_validate(base)


def exposure(t: Topology) -> list:
    return [p for p in compatibility_problems(t, ModelInfo()) if "reachable from other machines" in p.message
            or "node's address" in p.message]


def test_auth_names_an_environment_variable(run_cli):
    assert topo(auth__api_key_env="MY_KEY").auth.api_key_env == "MY_KEY"
    assert topo().auth is None
    for bad in ("1KEY", "MY-KEY", "A B", ""):
        code, _, err = run_cli("validate", CONFIGS / "cpu-demo.yaml", "--set", f"auth.api_key_env={bad}")
        assert code == 1 and "auth.api_key_env" in err and "Traceback" not in err, err
    code, _, err = run_cli("validate", CONFIGS / "cpu-demo.yaml", "--set", "auth.api_key=secret")
    assert code == 1 and "unknown key 'api_key'" in err and "did you mean 'api_key_env'" in err, err
    code, out, err = run_cli("validate", CONFIGS / "cpu-demo.yaml", "--set", "auth.api_key_env=MY_KEY")
    assert code == 0 and "valid" in out, err


@pytest.mark.parametrize("where,host,path", [
    ("decode__host", "0.0.0.0", ("decode", 0, "host")),
    ("prefill__host", "10.1.2.3", ("prefill", 0, "host")),
    ("proxy__host", "::", ("proxy", "host")),
    ("proxy__host", "node7.example", ("proxy", "host")),
])
def test_a_non_loopback_listener_without_auth_is_a_warning(where, host, path):
    (w,) = exposure(topo(**{where: host}))
    assert w.severity == "warning" and w.path == path and host in w.message and "auth.api_key_env" in w.hint


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost", "LOCALHOST"])
def test_loopback_listeners_need_no_auth(host):
    """The negative control: only what other machines reach is warned about."""
    kw = {"decode__host": host, "proxy__host": host}
    if host == "127.0.0.2":
        kw["decode__http_port"] = 8201
    assert exposure(topo(**kw)) == []


def test_auth_silences_the_warning_and_cluster_engines_warn_once():
    assert exposure(topo(decode__host="0.0.0.0", proxy__host="0.0.0.0", auth__api_key_env="K")) == []
    (w,) = exposure(topo(engine__kind="slurm"))
    assert w.path == ("engine", "kind") and "node's address" in w.message
    assert exposure(topo(engine__kind="slurm", auth__api_key_env="K")) == []


def test_validate_shows_the_warning_with_its_line(run_cli):
    code, out, err = run_cli("validate", CONFIGS / "cuda-gaudi-fleet.yaml")
    assert code == 0 and "valid" in out
    assert f"{CONFIGS / 'cuda-gaudi-fleet.yaml'}:" in err and "warning: proxy.host: 0.0.0.0 is reachable" in err
    code, out, err = run_cli("validate", CONFIGS / "cuda-gaudi-fleet.yaml", "--set", "auth.api_key_env=K")
    assert code == 0 and "reachable from other machines" not in err


# ------------------------------------------------------------------------------------------------------------
# The plan and the state: names only


def test_the_plan_carries_the_variables_name_never_its_value(key, run_cli):
    p = _plan()
    servers = [s for s in p.processes if s.role in ("prefill", "decode", "reference")]
    assert [s.secret_env for s in servers] == [{"VLLM_API_KEY": NAME}] * 3
    assert all("--api-key" not in s.argv and "VLLM_API_KEY" not in s.env for s in servers)  # argv is in /proc
    px = p.get("proxy")
    assert spec_of(px.argv).api_key_env == NAME and px.secret_env == {NAME: NAME}
    assert key not in p.to_json() and key not in repr(p)
    back = Plan.from_dict(json.loads(p.to_json()))
    assert back.to_dict() == p.to_dict() and back.topology.auth.api_key_env == NAME
    code, out, err = run_cli("plan", CONFIGS / "cpu-demo.yaml", "--set", f"auth.api_key_env={NAME}", "--json")
    assert code == 0 and key not in out + err and json.loads(out)["topology"]["auth"] == {"api_key_env": NAME}
    code, out, err = run_cli("plan", CONFIGS / "cpu-demo.yaml", "--set", f"auth.api_key_env={NAME}", "-o", "wide")
    assert code == 0 and f'VLLM_API_KEY="${NAME}"' in out and key not in out + err


def test_the_grep_finds_a_key_that_is_there(key):
    """The negative control of the checks above: a key written as plain env is found."""
    from dataclasses import replace

    p = _plan()
    leaky = p.with_processes([replace(s, env={**s.env, "VLLM_API_KEY": key}) for s in p.processes])
    assert key in leaky.to_json()


def test_a_plan_without_auth_has_neither_field():
    d = _plan(overrides=None).to_dict()
    assert "auth" not in d["topology"] and all("secret_env" not in s for s in d["processes"])


def test_the_state_record_holds_no_key(key, tmp_path):
    p = _plan(state_dir=tmp_path)
    st = LaunchState(p, processes={s.name: ProcessRecord(s.name, 1, 1, 0, 0.0) for s in p.processes})
    text = st.to_json()
    assert key not in text and NAME in text
    assert LaunchState.from_json(text).plan.get("decode-0").secret_env == {"VLLM_API_KEY": NAME}


def test_the_slurm_script_exports_the_key_by_reference(key):
    from pdctl.launch.slurm_engine import render_batch

    p = _plan("cpu-slurm")
    script = render_batch(p, p.topology.engine)
    assert f'export VLLM_API_KEY="${{{NAME}:?' in script and key not in script
    assert "export VLLM_API_KEY" not in render_batch(*(lambda q: (q, q.topology.engine))(_plan("cpu-slurm", None)))


# ------------------------------------------------------------------------------------------------------------
# Reading the key


def test_a_missing_empty_or_unusable_key_names_the_field_and_never_the_value(monkeypatch):
    t = topo(auth__api_key_env=NAME)
    monkeypatch.delenv(NAME, raising=False)
    with pytest.raises(auth.MissingKey, match=f"auth.api_key_env: {NAME} is not set"):
        auth.api_key(t)
    monkeypatch.setenv(NAME, "")
    with pytest.raises(auth.MissingKey, match="not set \\(or empty\\)"):
        auth.api_key(t)
    monkeypatch.setenv(NAME, "two words")
    with pytest.raises(auth.MissingKey) as e:
        auth.api_key(t)
    assert "printable ASCII" in str(e.value) and "two words" not in str(e.value)
    assert auth.open_route_headers(t) == {}  # /health and /metrics work without it
    monkeypatch.setenv(NAME, "good")
    assert auth.headers(auth.api_key(t)) == {"Authorization": "Bearer good"} == auth.open_route_headers(t)
    assert auth.api_key(topo()) is None and auth.headers(None) == {}


def test_up_refuses_before_anything_starts_when_the_key_is_missing(monkeypatch, tmp_path):
    import pdctl.launch
    from pdctl.launch import run

    class FakeEngine:
        name = "local"

        def preflight(self, plan):
            return []

    def launched(*a, **kw):
        raise AssertionError("started something")

    monkeypatch.setattr(pdctl.launch, "engine_for", lambda spec: FakeEngine())
    monkeypatch.setattr(run, "up", launched)
    monkeypatch.delenv(NAME, raising=False)
    t = pdctl.load(CONFIGS / "cpu-demo.yaml", {**AUTH, "proxy.port": 18090})
    with pytest.raises(pdctl.UserError, match=f"nothing was started:\n  auth.api_key_env: {NAME} is not set"):
        pdctl.up(t, state_dir=tmp_path)
    monkeypatch.setenv(NAME, "k")
    assert auth.problems(pdctl.plan(t, state_dir=tmp_path).processes) == []  # the negative control
    with pytest.raises(pdctl.UserError, match="auth.api_key_env"):  # the gates refuse as early
        pdctl.check(pdctl.load(CONFIGS / "cpu-demo.yaml", {"auth.api_key_env": "PDCTL_UNIT_NO_SUCH_KEY"}))


def test_the_local_engine_gives_the_key_at_spawn_and_keeps_an_exported_one_from_plain_servers(key, tmp_path,
                                                                                                monkeypatch):
    """The child sees VLLM_API_KEY; the state record and the log do not. A VLLM_API_KEY in pdctl's own shell
    must not reach a server of a topology without auth (pdctl would never send it)."""
    from dataclasses import replace

    from pdctl.launch.local import LocalEngine

    monkeypatch.setenv("VLLM_API_KEY", "from-the-shell")
    seen = {}
    for name, overrides in (("auth", AUTH), ("plain", None)):
        p = _plan(overrides=overrides, state_dir=tmp_path / name)
        out = tmp_path / f"{name}.env"
        code = f"import os; open({str(out)!r}, 'w').write(os.environ.get('VLLM_API_KEY', '-'))"
        spec = replace(p.get("decode-0"), argv=[sys.executable, "-c", code])
        st = LaunchState(p)
        b = LocalEngine()
        b.start(p, spec, st, attached=True)
        assert wait_for(lambda out=out: out.exists() and out.read_text(), 20)
        b.stop(st, grace_s=5)
        seen[name] = out.read_text()
        assert key not in st.to_json() and key not in Path(spec.log_path).read_text()
    assert seen == {"auth": key, "plain": "-"}


# ------------------------------------------------------------------------------------------------------------
# pdctl's own calls send it


class _Server:
    """A stand-in for vLLM and the proxy that records each call's path and Authorization header."""

    def __init__(self):
        self.calls: list[tuple[str, str | None]] = []
        calls = self.calls

        class H(BaseHTTPRequestHandler):
            def _answer(self, body: bytes, ctype: str = "application/json"):
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                calls.append((self.path, self.headers.get("Authorization")))
                self._answer(b"" if self.path == "/metrics" else b'{"data": [{"id": "m"}]}', "text/plain")

            def do_POST(self):  # noqa: N802
                sent = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                calls.append((self.path, self.headers.get("Authorization")))
                kv = {"kv_transfer_params": {"remote_engine_id": "e"}} if sent.get("kv_transfer_params") else {}
                self._answer(json.dumps({"choices": [{"text": "x", "token_ids": [1, 2]}],
                                         "usage": {"prompt_tokens": 3}, **kv}).encode())

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    s = _Server()
    yield s
    s.close()


def test_the_parity_gate_sends_the_key_on_every_call(stub):
    from pdctl.gates import parity

    prompts = parity.random_prompts([5, 9], 100, seed=1)
    parity.run_parity(stub.url, stub.url, [stub.url], "m", prompts, 2, api_key="K1")
    parity.reference_answers(stub.url, "m", prompts, 2, api_key="K1")
    paths = {p for p, _ in stub.calls}
    assert {"/v1/completions", "/metrics"} <= paths and {a for _, a in stub.calls} == {"Bearer K1"}
    stub.calls.clear()
    parity.run_parity(stub.url, stub.url, [stub.url], "m", prompts, 2)  # without auth: no header
    assert stub.calls and {a for _, a in stub.calls} == {None}


def test_warm_up_readiness_and_status_send_the_key(stub, key, tmp_path):
    from pdctl.launch import run as run_mod
    from pdctl.launch.warmup import warm_up

    port = int(stub.url.rsplit(":", 1)[1])
    # vLLM's stock connector: the probes need no log of the KV received (the stub writes none)
    p = _plan(overrides={**AUTH, "proxy.port": port, "connector.kind": "nixl"}, state_dir=tmp_path)
    p = p.with_processes([replace(s, ports={**s.ports, "http": port}) for s in p.processes if s.role != "reference"])
    warm_up(p, timeout_s=5)
    posts = [a for path, a in stub.calls if path == "/v1/completions"]
    assert posts == [f"Bearer {key}"] * 3  # the pair's probe (prefill, decode), then one through the proxy
    assert ("/ready", f"Bearer {key}") in stub.calls
    stub.calls.clear()
    assert run_mod._ready(p.get("proxy"), auth.open_route_headers(p.topology))[0]
    assert stub.calls == [("/health", f"Bearer {key}")]


def test_lm_eval_gets_the_key_in_its_environment_not_its_command_line(monkeypatch, tmp_path):
    from pdctl.gates import accuracy

    seen = {}

    def run(args, env, **kw):
        seen.update(args=args, env=env)
        return subprocess.CompletedProcess(args, 1)

    monkeypatch.setattr(accuracy.subprocess, "run", run)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(RuntimeError):
        accuracy.run_lm_eval("http://p", "m", tmp_path, tokenizer=None, limit=1, num_fewshot=0, concurrency=1,
                             data_dir=None, api_key="K2")
    assert seen["env"]["OPENAI_API_KEY"] == "K2" and not any("K2" in a for a in seen["args"])
    with pytest.raises(RuntimeError):
        accuracy.run_lm_eval("http://p", "m", tmp_path, tokenizer=None, limit=1, num_fewshot=0, concurrency=1,
                             data_dir=None)
    assert "OPENAI_API_KEY" not in seen["env"]


def test_the_accuracy_gate_passes_the_key_to_both_runs_and_the_fallback_counter(monkeypatch, tmp_path):
    from pdctl.gates import accuracy

    keys, headers = [], []

    def run(base_url, model, out_dir, **kw):
        keys.append(kw["api_key"])
        results = {"results": {"gsm8k": {"exact_match,strict-match": 0.5}}, "pdctl_task": "gsm8k"}
        return accuracy.EvalRun(results, [{"doc_id": 0, "filter": "strict-match", "resps": [["x"]]}], out_dir)

    monkeypatch.setattr(accuracy, "run_lm_eval", run)
    monkeypatch.setattr("pdctl.gates.parity.proxy_fallbacks", lambda url, h=None: headers.append(h) or 0.0)
    accuracy.run_gate("http://proxy", "http://ref", "m", tmp_path, {}, tokenizer=None, limit=1, num_fewshot=0,
                      concurrency=1, data_dir=None, api_key="K3")
    assert keys == ["K3", "K3"] and headers == [{"Authorization": "Bearer K3"}] * 2


def test_bench_sends_the_key_with_every_load_and_each_pair(monkeypatch, key, tmp_path):
    from pdctl.bench import load
    from pdctl.bench import run as run_mod
    from pdctl.bench.options import BenchOptions

    t = pdctl.load(CONFIGS / "cpu-fleet.yaml", AUTH)
    plan = pdctl.plan(t, state_dir=tmp_path / "state", reference_port=8390)
    monkeypatch.setattr(run_mod.run_mod, "up", lambda *a, **kw: None)
    monkeypatch.setattr(run_mod.run_mod, "down", lambda *a, **kw: None)
    sent = []

    def run_load(target, url, model, w, max_tokens, concurrency, decode_urls=(), request_rate=None, seed=0,
                 headers=None):
        sent.append(headers)
        return load.LoadResult(target, 1, 0, 1.0, 1.0, 1.0, *[1.0] * 8, dataset="random", vllm={})

    monkeypatch.setattr(run_mod.load, "run_load", run_load)
    monkeypatch.setattr(run_mod, "_workloads", lambda loaded, o, seed, vocab, count, phase: [object()] * count)
    o = BenchOptions(skip={"check", "eval"}, requests=1)
    run_mod.run_bench(t.origin, plan, plan.get("reference"), None, tmp_path / "out", o, {})
    assert len(sent) == 2 + len(t.pairs())
    assert all(h["Authorization"] == f"Bearer {key}" for h in sent)
    assert key not in "".join(f.read_text() for f in (tmp_path / "out").rglob("*.json"))


# ------------------------------------------------------------------------------------------------------------
# Kubernetes: a Secret reference, never a value


def test_k8s_takes_the_key_from_a_secret(key):
    import kubernetes_validate

    from pdctl.launch import k8s

    loaded = load_topology(CONFIGS / "cpu-demo.yaml", pdctl.api.as_overrides(AUTH))
    t = loaded.topology
    p = build_plan(t, base_dir=loaded.base_dir, state_dir=loaded.base_dir / ".s", python="python3")
    m = k8s.render(t, p, namespace="pd")
    ref = {"secretKeyRef": {"name": "cpu-demo-api-key", "key": "api-key"}}
    for f in ("11-prefill-statefulset.yaml", "21-decode-statefulset.yaml"):
        env = m[f]["spec"]["template"]["spec"]["containers"][0]["env"]
        assert {"name": "VLLM_API_KEY", "valueFrom": ref} in env
    proxy = m["30-proxy-deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
    assert proxy["env"] == [{"name": NAME, "valueFrom": ref}]
    assert spec_of(proxy["command"]).api_key_env == NAME
    text = yaml.safe_dump(m)
    assert key not in text
    for manifest in m.values():
        kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)
    bare = load_topology(CONFIGS / "cpu-demo.yaml")
    plain = k8s.render(bare.topology, build_plan(bare.topology, base_dir=bare.base_dir, state_dir=Path("/s")))
    assert "secretKeyRef" not in yaml.safe_dump(plain) and '"auth"' not in yaml.safe_dump(plain)


# ------------------------------------------------------------------------------------------------------------
# The standalone proxy


def test_the_standalone_proxy_reads_its_key_from_the_named_variable(monkeypatch):
    from pdctl.proxy import server

    got = {}
    monkeypatch.setattr(server, "serve", lambda cfg: got.update(cfg=cfg))
    monkeypatch.delenv(NAME, raising=False)
    with pytest.raises(pdctl.UserError, match=f"--api-key-env {NAME}: {NAME} is not set"):
        pdctl.api.serve_proxy(["http://p:1"], ["http://d:2"], api_key_env=NAME)
    monkeypatch.setenv(NAME, "K4")
    pdctl.api.serve_proxy(["http://p:1"], ["http://d:2"], api_key_env=NAME)
    assert got["cfg"].api_key == "K4" and "K4" not in repr(got["cfg"]) and "K4" not in got["cfg"].to_spec()


def test_validate_with_auth_loads_through_the_topology_error_path():
    """A bad variable name is a TopologyError (exit 1, file:line), not a crash at spawn."""
    with pytest.raises(TopologyError, match="auth.api_key_env"):
        pdctl.load(CONFIGS / "cpu-demo.yaml", {"auth.api_key_env": "not valid"})
