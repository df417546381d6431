"""The parity gate's pure parts: prompt ordering, recorded reference answers, the transfer proof."""

import math

import pytest

from pdctl.gates.parity import Prompt, _in_cache_order, first_divergence


def test_shared_prefix_prompts_come_in_a_second_wave():
    prompts = [Prompt(ids=[1], label="random-1"), Prompt(ids=[1, 2], label="prefix1+1"),
               Prompt(ids=[3], label="random-3"), Prompt(text="q", label="gsm8k-0")]
    assert _in_cache_order(prompts) == ([0, 2, 3], [1])


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # a shorter answer diverges where it ends


# ------------------------------------------------------------------------------------------------------------
# The transfer proof's bound, and every way the parity gate fails (each with its passing twin)


def _proof(external: float, prompts: list[int], cache_hit: float = 0, **kw):
    from pdctl.gates.parity import TransferProof

    return TransferProof(external, kw.pop("local", len(prompts)), kw.pop("bytes_", 4096.0), sum(prompts), 0,
                         len(prompts), cache_hit, **kw)


def test_transfer_proof_needs_every_prompt_token_but_the_last_by_transfer():
    """At the edge (one token per request computed by the decode) it passes; one token short, it fails."""
    prompts = [65, 129, 300]  # 494 tokens, 3 requests: at least 491 must arrive by transfer
    edge = _proof(491, prompts)
    assert edge.required == 491 and edge.ok
    assert edge.message.startswith("KV travelled: 491 prompt tokens by transfer, at least 491 required: all but "
                                   "the last token of 3 prompts (494 - 3)")
    short = _proof(490, prompts, local=4)
    assert not short.ok
    assert short.message == ("KV did not travel: 490 prompt tokens arrived by transfer, at least 491 required: all "
                             "but the last token of 3 prompts (494 - 3); 4 computed locally")


def test_the_decodes_own_prefix_cache_is_not_required_to_travel():
    """A prompt sharing a head with an earlier one: the decode serves the head from its prefix cache."""
    from pdctl.gates.parity import TransferProof

    # random-130 (fresh, 130 tokens) then prefix130+37 (167 tokens; 128 of them in the decode's cache).
    proof = TransferProof(130 + 39, 0, 4096.0, 130, 167, 2, 128)
    assert proof.required == 130 + 167 - 2 - 128 == 167 and proof.ok
    assert "minus 128 served by the decode's own prefix cache" in proof.message
    below = TransferProof(166, 2, 4096.0, 130, 167, 2, 128)
    assert not below.ok and below.message.startswith("KV did not travel: 166 prompt tokens arrived by transfer, "
                                                     "at least 167 required")


def test_transfer_proof_fails_when_the_tokens_were_computed_locally():
    """The KV did not travel: the decode computed every prompt (a fallback, or no connector)."""
    proof = _proof(0, [65, 129], local=194, bytes_=0.0)
    assert not proof.ok
    assert proof.message == ("KV did not travel: 0 prompt tokens arrived by transfer, at least 192 required: all "
                             "but the last token of 2 prompts (194 - 2); 194 computed locally")


def test_transfer_proof_fails_without_nixl_bytes_failed_transfers_or_on_a_fallback():
    assert _proof(192, [65, 129]).ok
    no_bytes = _proof(192, [65, 129], bytes_=0.0)
    assert not no_bytes.ok and no_bytes.message == ("KV did not travel: the decodes' NIXL bytes did not grow "
                                                    "(vllm:nixl_bytes_transferred)")
    failed = _proof(192, [65, 129], failed_transfers=1.0)  # vLLM counts a recomputed load as transferred
    assert not failed.ok and failed.message.startswith("1 NIXL transfers failed (vllm:nixl_num_failed_transfers)")
    fell_back = _proof(192, [65, 129], fallbacks=1.0)
    assert not fell_back.ok and fell_back.message.startswith("1 requests were served by a decode alone (proxy "
                                                             "fallback, pdctl_decode_only_fallback_total)")
    assert _proof(192, [65, 129], fallbacks=0.0).ok
    checked = _proof(192, [65, 129], fingerprints_checked=2.0)
    assert checked.ok and checked.message.endswith("; KV fingerprints checked 2, all equal")
    mismatch = _proof(192, [65, 129], fingerprints_checked=2.0, fingerprint_mismatches=1.0)
    assert not mismatch.ok and mismatch.message.startswith("1 received KV not the prefill's (KV fingerprint "
                                                           "mismatches, vllm:pdctl_kv_fingerprint_mismatches_total)")


def test_transfer_proof_fails_on_a_missing_metric():
    missing = _proof(192, [65, 129], missing=["decode http://d: /metrics has no vllm:prompt_tokens_by_source_total "
                                              "(prompt tokens by source)"])
    assert not missing.ok
    assert missing.message == ("cannot prove the transfer: decode http://d: /metrics has no "
                               "vllm:prompt_tokens_by_source_total (prompt tokens by source)")


class FakePD:
    """One loopback HTTP server playing the P/D proxy (/proxy), the aggregated reference (/ref) and the decode's
    /metrics (/decode): the proxy's answers move the decode's counters as a real P/D pair would, or not."""

    def __init__(self, mode: str = "transfer", diverge_on: int | None = None, metrics: bool = True):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.mode, self.diverge_on, self.with_metrics = mode, diverge_on, metrics
        self.counters = {"external_kv_transfer": 0, "local_compute": 0, "local_cache_hit": 0}
        self.bytes = 0
        self.fallbacks = 0
        self.stream_error = False
        # The reference's top logprobs at the divergent token: P/D's token `gap` nats below its own (None: absent
        # from the top); P/D's there: the reference's, its token `spread` nats lower (P/D's token then ahead).
        self.gap: float | None = None
        self.spread, self.logprobs_fail = 0.0, False
        self.streams: list[tuple[str, dict]] = []  # (path, body) of each streamed request
        # x-pdctl-first-token's mismatch: for this prompt length the proxy streams the prefill's token (token 0,
        # plus `first_offset`), then ends the stream with the error; the diagnosis then asks at token 0.
        self.mismatch_on: int | None = None
        self.first_offset, self.logprobs_at = 0, 5
        fake = self

        class H(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                import json

                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.endswith("/detokenize"):  # each token's text is its id and a comma
                    out = json.dumps({"prompt": "".join(f"{t}," for t in body["tokens"])}).encode()
                    self.send_response(200)
                    self.end_headers()
                    self.wfile.write(out)
                    return
                prompt, n = body["prompt"], body["max_tokens"]
                ids = [(sum(prompt) + i) % 997 for i in range(n)]
                if body.get("logprobs"):  # the diagnosis asks both sides at token 5, given the 5 agreed on
                    self.send_response(500 if fake.logprobs_fail else 200)
                    self.end_headers()
                    if not fake.logprobs_fail:
                        at = fake.logprobs_at
                        ref = (sum(prompt[:len(prompt) - at]) + at) % 997
                        top = {ref: -0.5, 998: -4.0} | ({} if fake.gap is None else {ref + 1: -0.5 - fake.gap})
                        if self.path.startswith("/proxy"):
                            top[ref] -= fake.spread
                            top.setdefault(ref + 1, -0.5)  # P/D's own token is in its own top
                        top = {f"token_id:{t}": lp for t, lp in top.items()}
                        self.wfile.write(json.dumps({"choices": [{"text": "", "logprobs": {
                            "top_logprobs": [top]}}]}).encode())
                    return
                if self.path.startswith("/proxy"):
                    fake.served(len(prompt))
                    if len(prompt) == fake.diverge_on:
                        ids[5] += 1
                usage = {"prompt_tokens": len(prompt)}
                if body.get("stream"):  # one event per token, its text the id; then usage, or an error
                    fake.streams.append((self.path, body))
                    evs = [{"choices": [{"text": f"{i},"} | ({"token_ids": [i]} if body.get("return_token_ids")
                                                             else {})]} for i in ids]
                    if self.path.startswith("/proxy") and len(prompt) == fake.mismatch_on:
                        evs = [{"choices": [{"text": f"{ids[0] + fake.first_offset},"}]},
                               {"error": {"message": "the decode's first text differs", "type":
                                          "first_token_mismatch", "code": 502}}]
                    evs += [{"error": {"message": "boom"}}] if fake.stream_error else [{"choices": [],
                                                                                       "usage": usage}]
                    out = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in evs) + b"data: [DONE]\n\n"
                else:
                    assert body["return_token_ids"] is True
                    out = json.dumps({"choices": [{"token_ids": ids, "text": ""}], "usage": usage}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream" if body.get("stream") else "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_GET(self):  # noqa: N802
                text = fake.metrics_text(self.path)
                self.send_response(200 if text is not None else 404)
                self.end_headers()
                self.wfile.write((text or "").encode())

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def served(self, tokens: int) -> None:
        if self.mode == "transfer":  # vLLM 0.32: the connector claims the whole prompt
            self.counters["external_kv_transfer"] += tokens
            self.bytes += 1024 * tokens
        elif self.mode == "all-but-one":  # a connector that leaves the last token to the decode
            self.counters["external_kv_transfer"] += tokens - 1
            self.counters["local_compute"] += 1
            self.bytes += 1024 * tokens
        elif self.mode == "fallback":  # the proxy sent it to the decode alone
            self.counters["local_compute"] += tokens
            self.fallbacks += 1
        else:  # "local": the decode computed it, no fallback counted (no connector at all)
            self.counters["local_compute"] += tokens

    def metrics_text(self, path: str) -> str | None:
        if path.startswith("/decode"):
            lines = [f'vllm:nixl_bytes_transferred_sum{{engine="0"}} {self.bytes}']
            if self.with_metrics:
                lines += [f'vllm:prompt_tokens_by_source_total{{engine="0",source="{k}"}} {v}'
                          for k, v in self.counters.items()]
            return "\n".join(lines) + "\n"
        if path.startswith("/proxy"):
            return f'pdctl_decode_only_fallback_total{{reason="prefill_down"}} {self.fallbacks}\n'
        return None

    def run(self, lengths=(33, 65, 129), stream=False):
        from pdctl.gates.parity import random_prompts, run_parity

        try:
            return run_parity(self.url + "/proxy", self.url + "/ref", [self.url + "/decode"], "tiny",
                              random_prompts(list(lengths), 1000, seed=3), max_tokens=8, stream=stream)
        finally:
            self.server.shutdown()


def test_parity_gate_passes_when_every_token_matches_and_the_kv_travelled():
    report = FakePD("transfer").run()
    assert report.passed and report.pass_rate == 1.0 and report.proof.ok
    assert (report.proof.external_kv_tokens, report.proof.required) == (227, 224)
    assert report.to_dict()["proof"]["message"].startswith("KV travelled: 227 prompt tokens by transfer")


def test_parity_gate_passes_at_the_edge_all_but_one_token_per_request():
    report = FakePD("all-but-one").run()
    assert report.passed and report.proof.external_kv_tokens == report.proof.required == 224


def test_parity_gate_fails_on_one_mismatching_prompt():
    report = FakePD("transfer", diverge_on=65).run()
    assert not report.passed and report.proof.ok  # the KV travelled; one prompt's tokens differ
    failed = [r for r in report.results if not r.passed]
    assert [(r.label, r.first_divergence) for r in failed] == [("random-65", 5)]
    from pdctl.gates.junit import junit_xml

    assert '<failure message="first divergent token 5: ' in junit_xml(report)
    d = failed[0].divergence  # wrong KV: a token the reference does not rank
    assert (d.rank, d.gap, d.spread, d.tie) == (None, None, 0.0, False)
    assert failed[0].failure == ("first divergent token 5: P/D's token not in the reference's top 20; P/D's "
                                 "logprobs there within 0 nats of the reference's (top 5)")
    assert report.to_dict()["results"][1]["divergence"]["summary"] == d.summary


def test_a_near_tie_passes_and_is_shown():
    from pdctl.gates.parity import TIE_NATS

    bound = TIE_NATS["half"]
    fake = FakePD("transfer", diverge_on=65)
    fake.gap, fake.spread = bound / 10, bound / 2
    report = fake.run()
    [r] = [r for r in report.results if r.first_divergence is not None]
    assert report.passed and r.passed and r.divergence.rank == 2 and r.failure == ""
    assert abs(r.divergence.gap - bound / 10) < 1e-9 and abs(r.divergence.spread - bound / 2) < 1e-9
    assert r.outcome.startswith("first divergent token 5: a near tie: P/D's token is the reference's choice 2, ")
    assert r.outcome.endswith(" nats of the reference's (top 5)")


@pytest.mark.parametrize("gap, spread", [(None, 0.0), (0.3, 0.3), (1e-6, 1.0)],
                         ids=["not-ranked", "past-the-bound", "near-tie-but-p/d-elsewhere"])
def test_a_divergence_fails_unless_a_near_tie_on_both_sides(gap, spread):
    """Negative controls of the rule above, one condition at a time: a token the reference does not rank, or
    ranks past the bound, fails; so does a near tie where P/D's logprobs for the reference's top tokens are off by
    more than rounding (P/D's distribution moved: its KV)."""
    fake = FakePD("transfer", diverge_on=65)
    fake.gap, fake.spread = gap, spread
    report = fake.run()
    [r] = [r for r in report.results if r.first_divergence is not None]
    assert not report.passed and not r.passed and not r.divergence.tie and r.failure == r.outcome


def test_a_diagnosis_that_cannot_be_made_leaves_the_failure_as_it_is():
    fake = FakePD("transfer", diverge_on=65)
    fake.logprobs_fail = True
    report = fake.run()
    [r] = [r for r in report.results if not r.passed]
    assert not report.passed and r.divergence is None and r.failure == "first divergent token 5"


def test_a_streamed_check_compares_the_text_a_client_reads():
    report = FakePD("transfer").run(stream=True)
    assert report.passed and report.proof.ok
    assert all(isinstance(r.pd, str) and r.pd.count(",") == 8 and r.pd == r.reference for r in report.results)
    failed = FakePD("transfer", diverge_on=65).run(stream=True)  # negative control: token 5's text differs
    assert [(r.label, r.pd[:r.first_divergence] == r.reference[:r.first_divergence]) for r in failed.results
            if not r.passed] == [("random-65", True)]


def test_a_streamed_near_tie_is_found_at_its_token_and_passes():
    """Streamed answers are text: the divergent character is traced to its token through the reference's stream
    (each event's token ids, asked of the reference only: P/D's stream stays the one a client gets), P/D's token
    there by its text, and the same near-tie rule applies."""
    from pdctl.gates.parity import TIE_NATS

    bound = TIE_NATS["half"]
    fake = FakePD("transfer", diverge_on=65)
    fake.gap, fake.spread = bound / 10, bound / 2
    report = fake.run(stream=True)
    [r] = [r for r in report.results if r.first_divergence is not None]
    ref5 = int(r.reference.split(",")[5])
    start = len(",".join(r.reference.split(",")[:5])) + 1  # where token 5's text starts
    assert report.passed and r.passed and start < r.first_divergence < start + len(f"{ref5},")  # "935," / "936,"
    assert (r.divergence.token, r.divergence.reference_token, r.divergence.pd_token) == (5, ref5, ref5 + 1)
    assert r.outcome.startswith(f"first divergent character {r.first_divergence} (token 5): a near tie: P/D's "
                                "token is the reference's choice 2, ")
    assert {(path.split("/")[1], "return_token_ids" in body) for path, body in fake.streams} == {
        ("ref", True), ("proxy", False)}


@pytest.mark.parametrize("gap, spread", [(None, 0.0), (0.3, 0.3), (1e-6, 1.0)],
                         ids=["not-ranked", "past-the-bound", "near-tie-but-p/d-elsewhere"])
def test_a_streamed_divergence_fails_unless_a_near_tie_on_both_sides(gap, spread):
    """The negative controls of the streamed diagnosis: found at its token, then held to the same rule."""
    fake = FakePD("transfer", diverge_on=65)
    fake.gap, fake.spread = gap, spread
    report = fake.run(stream=True)
    [r] = [r for r in report.results if r.first_divergence is not None]
    assert not report.passed and not r.passed and r.divergence.token == 5 and not r.divergence.tie
    assert r.failure.startswith(f"first divergent character {r.first_divergence} (token 5): ")


def test_a_streamed_divergence_that_cannot_be_traced_to_a_token_fails_as_it_is():
    fake = FakePD("transfer", diverge_on=65)
    fake.logprobs_fail = True
    report = fake.run(stream=True)
    [r] = [r for r in report.results if not r.passed]
    assert r.divergence is None and r.failure == f"first divergent character {r.first_divergence}"


def test_stream_position_finds_the_token_that_wrote_a_character():
    from pdctl.gates.parity import stream_position

    pieces = [["ab", [7]], ["", [8]], ["\u00e9", [9]], ["cd", [10]]]  # 8 and 9: one character of two bytes
    assert stream_position(pieces, 0) == ([], 7, 0) and stream_position(pieces, 1) == ([], 7, 0)
    assert stream_position(pieces, 2) is None  # inside a character two tokens wrote: which differed is unknown
    assert stream_position(pieces, 4) == ([7, 8, 9], 10, 3)
    assert stream_position(pieces, 5) is None  # past the text (P/D's answer longer)
    assert stream_position([], 0) is None


def test_stream_token_is_p_d_s_likeliest_top_token_whose_text_starts_its_rest():
    from pdctl.gates.parity import stream_token

    texts = {1: " 12", 2: " 123", 3: " 1", 4: "\ufffd", 5: " 9"}

    def detok(ids):
        return "".join(texts.get(t, "?") for t in ids)

    ref, pd = {5: -0.1, 1: -0.2, 3: -3.0, 4: -4.0}, {1: -0.1, 2: -0.3, 5: -0.2}
    assert stream_token(" 123 45", [5], ref, pd, detok, exclude=5) == 1  # 1, 2 and 3 fit: P/D's likeliest
    assert stream_token(" 123 45", [5], ref, {2: -0.1, 1: -0.3}, detok, exclude=5) == 2
    assert stream_token(" 1x", [5], ref, {}, detok, exclude=5) == 3  # the only one that fits
    assert stream_token(" 9", [5], ref, pd, detok, exclude=5) is None  # the reference's token, where P/D left it
    assert stream_token(" 9", [5], ref, pd, detok) == 5  # a first-token mismatch: the prefill's may be it
    assert stream_token("\u00e9", [5], ref, pd, detok, exclude=5) is None  # part of a character: no text to tell it by
    assert stream_token("x", [5], ref, pd, detok, exclude=5) is None  # ranked by neither side


@pytest.mark.parametrize("offset, gap, spread, tie", [
    (0, None, 0.1, True), (1, 0.1, 0.1, True), (0, None, 1.0, False), (1, None, 0.1, False)],
    ids=["decode-odd-near-tie", "prefill-odd-near-tie", "decode-kv-moved", "prefill-token-not-ranked"])
def test_a_first_token_mismatch_is_diagnosed_at_token_0(offset, gap, spread, tie):
    """The proxy ends a stream whose decode's first token is not the prefill's (which the client already has):
    a near tie the two sides broke differently passes as one (the prefill's token within the bound of the
    reference's, the decode's logprobs the reference's); the decode's distribution moved (its KV), or a prefill
    token the reference does not rank, fails."""
    fake = FakePD("transfer")
    fake.mismatch_on, fake.first_offset, fake.logprobs_at = 65, offset, 0
    fake.gap, fake.spread = gap, spread
    report = fake.run(stream=True)
    [r] = [r for r in report.results if r.label == "random-65"]
    assert r.first_token_mismatch and r.error and "first_token_mismatch" in r.error
    assert r.pd == f"{int(r.reference.split(',')[0]) + offset},"  # the prefill's token, as the client read it
    assert r.divergence.token == 0 and r.divergence.tie is tie and r.passed is tie and report.passed is tie
    assert r.outcome.startswith("first token: the decode's is not the prefill's, which the client already had "
                                "(the proxy ended the stream: first_token_mismatch): ")
    assert report.proof.ok  # the other prompts' KV travelled; the ended stream is not counted as answered


def test_a_first_token_mismatch_against_recorded_answers_fails_undiagnosed():
    """`--reference-first`: the reference's answers were recorded and it is gone; nothing can tell a near tie."""
    from pdctl.gates.parity import random_prompts, reference_answers, run_parity

    fake = FakePD("transfer")
    fake.mismatch_on, fake.logprobs_at = 65, 0
    prompts = random_prompts([33, 65], 1000, seed=3)
    try:
        recorded = reference_answers(fake.url + "/ref", "tiny", prompts, 8, stream=True)
        report = run_parity(fake.url + "/proxy", recorded, [fake.url + "/decode"], "tiny", prompts, max_tokens=8,
                            stream=True)
    finally:
        fake.server.shutdown()
    [r] = [r for r in report.results if not r.passed]
    assert r.first_token_mismatch and r.divergence is None and not report.passed
    assert r.outcome.endswith("(the proxy ended the stream: first_token_mismatch)")


def test_a_stream_that_ends_with_an_error_fails_its_prompt():
    fake = FakePD("transfer")
    fake.stream_error = True
    report = fake.run(lengths=(33,), stream=True)
    (r,) = report.results
    assert not report.passed and "the stream ended with an error" in r.error and "boom" in r.error


def test_parity_gate_fails_when_the_kv_did_not_travel():
    """Same answers, but the decode computed the prompts itself: the proof fails the gate."""
    report = FakePD("local").run()
    assert all(r.passed for r in report.results) and not report.passed
    assert report.proof.message == ("KV did not travel: 0 prompt tokens arrived by transfer, at least 224 "
                                    "required: all but the last token of 3 prompts (227 - 3); 227 computed locally")
    from pdctl.gates.junit import junit_xml

    assert '<failure message="KV did not travel: 0 prompt tokens arrived by transfer' in junit_xml(report)


def test_parity_gate_fails_on_a_proxy_fallback():
    report = FakePD("fallback").run()
    assert all(r.passed for r in report.results) and not report.passed
    assert report.proof.fallbacks == 3 and report.proof.message.startswith("3 requests were served by a decode "
                                                                           "alone (proxy fallback")


def test_parity_gate_fails_when_the_decode_lacks_the_prompt_tokens_by_source_counter():
    fake = FakePD("transfer", metrics=False)
    report = fake.run()
    assert all(r.passed for r in report.results) and not report.passed
    assert report.proof.message == (f"cannot prove the transfer: decode {fake.url}/decode: /metrics has no "
                                    "vllm:prompt_tokens_by_source_total (prompt tokens by source)")


def test_parity_gate_fails_when_the_decode_metrics_do_not_answer():
    fake = FakePD("transfer")
    from pdctl.gates.parity import random_prompts, run_parity

    try:
        report = run_parity(fake.url + "/proxy", fake.url + "/ref", [fake.url + "/nowhere"], "tiny",
                            random_prompts([33], 1000, seed=3), max_tokens=8)
    finally:
        fake.server.shutdown()
    assert not report.passed
    assert report.proof.message == f"cannot prove the transfer: decode {fake.url}/nowhere: /metrics did not answer"


def test_a_hybrid_models_window_adds_prompts_around_it():
    from pdctl.gates.parity import boundary_lengths

    plain = boundary_lengths([32, 64], 1024)
    hybrid = boundary_lengths([32, 64], 1024, window=96)
    assert set(plain) < set(hybrid)
    assert {95, 96, 97, 288} <= set(hybrid)  # around the window, 3x longer
    # n - 96 + 1 a multiple of a block: where vLLM's stock connector leaves the recomputed token one key short
    assert {127, 159, 255} <= set(hybrid) and all((n - 95) % 32 == 0 for n in (127, 159, 255))
    assert max(boundary_lengths([32], 200, window=96)) <= 200


def test_float32_is_held_to_a_tighter_tie_than_half_precision():
    from pdctl.gates.parity import Divergence, tie_nats

    assert tie_nats("float32") < tie_nats("bfloat16") == tie_nats("float16") == tie_nats("auto") == tie_nats(None)
    near = dict(reference_token=1, pd_token=2, rank=2, spread=1e-5)
    assert Divergence(**near, gap=0.0625, tie_nats=tie_nats("bfloat16")).tie  # one bf16 step at logits 8-16
    assert not Divergence(**near, gap=0.0625, tie_nats=tie_nats("float32")).tie
    assert Divergence(**near, gap=-1e-5, tie_nats=tie_nats("float32")).tie  # ordered the other way asked again
    assert not Divergence(**{**near, "spread": math.inf}, gap=0.0).tie  # a top token missing on P/D's side
    # Three tokens within one bf16 step (measured: P/D took the reference's third, 0.0625 below, spread 0.049).
    assert Divergence(**{**near, "rank": 3, "spread": 0.049}, gap=0.0625, tie_nats=tie_nats("bfloat16")).tie
    assert not Divergence(**{**near, "rank": None, "spread": 0.049}, gap=None).tie  # not in the reference's top
