"""The fleet's parity gate, on its pure parts: which prefill a decode's logged read came from, and every way a
pair's proof can fail (the e2e test runs it on a real fleet)."""

from pathlib import Path

import pytest

from pdctl.gates.fleet import FleetReport, PairReport, attribute, received_from
from pdctl.gates.parity import ParityReport, PromptResult, TransferProof
from pdctl.plan import build_plan
from pdctl.topology import load_topology
from tests.conftest import CONFIGS

LINE = ("(Worker pid=1) INFO 12-01 21:36:00 [nixl.py:301] pdctl connector: received request "
        "cmpl-{rid}-0-1a2b3c4d from engine 5f1e at 127.0.0.1:{port} (prefill block 32 -> decode block 64): "
        "3 decode blocks, 129 prompt tokens; 900 tokens from this engine so far\n")


def _plan():
    loaded = load_topology(CONFIGS / "cpu-fleet.yaml")
    return build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/s"))


def _pair(rid: str, prefill: str = "prefill-p32-0", decode: str = "decode-d64-0", passed: bool = True):
    r = PromptResult("random-129", 129, passed, None if passed else 3, [1], [1], None, rid, prefill, decode)
    return PairReport("p32", "d64", ParityReport([r], TransferProof(128, 1, 131072, 129, requests=1)))


def test_reads_are_attributed_to_the_prefill_instance_by_its_side_channel(tmp_path):
    plan, rid = _plan(), "pdctl-check-0123456789abcdef"
    log = tmp_path / "d.log"
    log.write_text("noise\n" + LINE.format(rid=rid, port=5600) + "more noise\n")
    received = received_from([str(log), str(tmp_path / "missing.log")])
    assert received == {rid: [("127.0.0.1", 5600)]}
    pair = _pair(rid)
    attribute(pair, plan, received, {s.name: s.pool for s in plan.processes if s.pool})
    assert pair.kv_from == {"prefill-p32-0": 1} and pair.problems == [] and pair.passed


def test_kv_from_another_pool_fails_the_pair(tmp_path):
    plan, rid = _plan(), "pdctl-check-00000000000000aa"
    received = {rid: [("127.0.0.1", 5601)]}  # p128's side channel
    pair = _pair(rid)
    attribute(pair, plan, received, {s.name: s.pool for s in plan.processes if s.pool})
    assert not pair.passed and "read its KV from prefill-p128-0, not prefill pool p32" in pair.problems[0]
    assert not FleetReport([pair]).passed


def test_no_log_line_or_a_misrouted_request_fails_the_pair():
    plan = _plan()
    pools = {s.name: s.pool for s in plan.processes if s.pool}
    silent = _pair("pdctl-check-00000000000000bb")
    attribute(silent, plan, {}, pools)
    assert silent.problems == ["random-129: no connector line says where its KV came from"]
    misrouted = _pair("pdctl-check-00000000000000cc", decode="decode-d32-0")
    attribute(misrouted, plan, {"pdctl-check-00000000000000cc": [("127.0.0.1", 5600)]}, pools)
    assert any("pinned to p32/d64" in p for p in misrouted.problems)


def test_a_fleet_without_pairs_or_with_a_failed_prompt_fails():
    assert not FleetReport([]).passed
    failed = _pair("pdctl-check-00000000000000dd", passed=False)
    assert not failed.passed and not FleetReport([failed]).passed
    no_transfer = _pair("pdctl-check-00000000000000ee")
    no_transfer.report.proof = TransferProof(0, 129, 0, 129, requests=1)
    doc = no_transfer.to_dict()
    assert not no_transfer.passed and doc["kv_travelled"] is False and doc["tokens_computed"] == 129
    assert doc["kv_proof"] == ("KV did not travel: 0 prompt tokens arrived by transfer, at least 128 required: all "
                               "but the last token of 1 prompts (129 - 1); 129 computed locally")


def test_a_pair_one_token_short_of_all_but_the_last_fails_and_the_junit_says_why(tmp_path):
    from pdctl.gates.junit import junit_xml

    plan = _plan()
    pools = {s.name: s.pool for s in plan.processes if s.pool}
    rid = "pdctl-check-00000000000000ff"
    edge = _pair(rid)  # 128 of 129 tokens by transfer: the edge
    attribute(edge, plan, {rid: [("127.0.0.1", 5600)]}, pools)
    assert edge.passed and edge.report.proof.required == 128 and FleetReport([edge]).passed
    short = _pair(rid)
    short.report.proof = TransferProof(127, 2, 131072, 129, requests=1)
    attribute(short, plan, {rid: [("127.0.0.1", 5600)]}, pools)
    assert short.problems == [] and not short.passed and not FleetReport([edge, short]).passed
    xml = junit_xml(FleetReport([edge, short]))
    assert 'failures="1"' in xml
    assert ('<failure message="KV did not travel: 127 prompt tokens arrived by transfer, at least 128 required'
            in xml)


def test_a_read_after_the_prefill_released_the_kv_fails_the_pair(tmp_path):
    # vLLM's prefill logs it when a decode's read arrives after the KV lease expired (seen with a prefill and a
    # decode bound to one CPU core); the decode is not told. Negative control: other requests' lines do not count.
    from pdctl.gates.fleet import late_reads

    plan, rid, other = _plan(), "pdctl-check-0000000000000abc", "pdctl-check-0000000000000def"
    line = ("(Worker pid=2460) ERROR 12-03 06:16:02 [pull_worker.py:667] Potentially invalid KV blocks for "
            "unrecognized request cmpl-{rid}-0-af8ed5b5 were retrieved by a decode worker. They may have expired.\n")
    log = tmp_path / "p.log"
    log.write_text("noise\n" + line.format(rid=rid))
    late = late_reads({"prefill-p32-0": str(log), "prefill-p128-0": str(tmp_path / "missing.log")})
    assert late == {rid: "prefill-p32-0"}
    pools = {s.name: s.pool for s in plan.processes if s.pool}
    pair = _pair(rid)
    attribute(pair, plan, {rid: [("127.0.0.1", 5600)]}, pools, late)
    assert not pair.passed and "after prefill-p32-0 had released it" in pair.problems[0]
    fine = _pair(other)
    attribute(fine, plan, {other: [("127.0.0.1", 5600)]}, pools, late)
    assert fine.passed and fine.problems == []


def test_each_pair_and_the_mixed_phase_of_a_seeded_run_draw_their_own_prompts(monkeypatch):
    """check_fleet hands every pool pair its index (prompts_for(..., k)), and a seeded run's pair seeds and mixed
    seeds never meet (a repeat at one decode would be a prefix-cache hit, no KV to prove)."""
    import pdctl.gates.fleet as fleet

    asked, sent = [], []
    monkeypatch.setattr(fleet, "run_parity", lambda *a, **kw: sent.append(a[4]) or ParityReport([], None))
    fleet.check_fleet(_plan(), "http://p", "http://r", "m", lambda pb, db, k: asked.append(k) or [], mixed=16,
                      seed=5, read_logs=False)
    assert asked == list(range(len(_plan().topology.pairs())))
    pair_seeds = {fleet.pair_seed(5, k) for k in range(100)}
    mixed = {fleet.mixed_seed(5, i) for i in range(16)}
    assert len(pair_seeds) == 100 and not pair_seeds & mixed and len(sent[-1]) == 16
    assert fleet.pair_seed(None, 3) is None and fleet.mixed_seed(None, 3) is None


def test_bench_hands_the_fleet_gate_a_prompt_source_it_can_call(monkeypatch, tmp_path):
    """The fleet gates call prompts_for(prefill_block, decode_block, pair); bench's must take those three."""
    from types import SimpleNamespace

    from pdctl.bench import run as bench_run
    from pdctl.bench.options import BenchOptions

    loaded = load_topology(CONFIGS / "cpu-fleet.yaml")
    plan = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=tmp_path / "s", python="py")
    drawn: list = []

    def fake_check_fleet(plan, proxy, ref, model, prompts_for, **kw):
        drawn.append(len(prompts_for(32, 64, 1)))
        raise RuntimeError("stop here")  # the servers are not real: the prompts are what this test is about

    monkeypatch.setattr(bench_run.fleet, "check_fleet", fake_check_fleet)
    monkeypatch.setattr(bench_run.run_mod, "up", lambda *a, **k: SimpleNamespace())
    monkeypatch.setattr(bench_run.run_mod, "down", lambda *a, **k: None)
    ref = SimpleNamespace(http_url="http://127.0.0.1:1")
    with pytest.raises(RuntimeError, match="stop here"):
        bench_run.run_bench(loaded, plan, ref, None, tmp_path / "r", BenchOptions(skip={"perf", "eval"}).resolved(),
                            {})
    assert drawn and drawn[0] > 0


def test_a_diagnosed_divergence_is_in_the_fleets_json():
    import json
    import math

    from pdctl.gates.parity import Divergence

    pair = _pair("pdctl-check-0123456789abcdef", passed=False)
    pair.report.results[0].divergence = Divergence(7, 9, rank=None, gap=None, spread=math.inf)
    [r] = json.loads(json.dumps(FleetReport([pair]).to_dict(), allow_nan=False))["results"]
    assert r["pair"] == "p32/d64" and r["divergence"]["spread"] is None and r["divergence"]["tie"] is False
    assert "not in P/D's top 20" in r["divergence"]["summary"]
