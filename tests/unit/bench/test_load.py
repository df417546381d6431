"""The load benchmark (vLLM's benchmark() and datasets) against a tiny streaming server: what it sends, what it
measures, closed and open loop; and what it refuses before anything is sent or started."""

import asyncio
import json
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from pdctl.bench import load
from pdctl.protocol import ROUTE_HEADER
from tests.conftest import CONFIGS, REPO

TINY = REPO / ".pdctl" / "models" / "tiny"
STEP_S = 0.01  # the fake decode's time per token
PIN = "X-PDCTL-Pair"

pytestmark = pytest.mark.skipif(not (TINY / "tokenizer.json").is_file(), reason="no tiny model (pdctl model tiny)")


class Fake:
    """A /v1/completions that streams max_tokens SSE events STEP_S apart (or all at once: `bunch`) and a usage
    chunk; answers 500 to every `fail_every`-th request. Records each request's body, headers and arrival time."""

    def __init__(self, bunch: bool = False, fail_every: int = 0):
        self.bunch, self.fail_every = bunch, fail_every
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.arrived: list[float] = []
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.arrived.append(time.perf_counter())
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return web.Response(status=500, text="boom")
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        n = body["max_tokens"]
        if self.bunch:
            await asyncio.sleep(STEP_S * n)
        for _ in range(n):
            if not self.bunch:
                await asyncio.sleep(STEP_S)
            await r.write(b'data: {"choices":[{"text":"x"}]}\n\n')
        usage = {"completion_tokens": n} | ({"prompt_tokens": len(body["prompt"])} if isinstance(body["prompt"], list)
                                            else {})  # text: the client's count stands
        await r.write(b'data: {"choices":[],"usage":%s}\n\ndata: [DONE]\n\n' % json.dumps(usage).encode())
        return r

    def prompts(self) -> list:
        return [json.dumps(b["prompt"]) for b in self.bodies]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module", autouse=True)
def vllm_benchmark_imported():
    """vLLM's serving benchmark takes ~12 s to import: paid once in this module's setup, not in the call of
    whichever test runs first (alone, that test went over the unit tier's time limit)."""
    load._serve()


@pytest.fixture
def fake():
    servers: list[Fake] = []

    def make(**kw) -> Fake:
        servers.append(Fake(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.stop()


def work(n: int = 6, seed: int = 0, **kw) -> load.Workload:
    kw = {"prompt_len": 16, "max_tokens": 6, "tokenizer": TINY, **kw}
    return load.workload(n, seed=seed, **kw)


def test_both_sides_get_the_same_prompts_a_new_seed_new_ones_and_none_repeats(fake):
    pd, agg = fake(), fake()
    w = work(8, seed=1)
    a = load.run_load("P/D", pd.url, "tiny", w, None, 3)
    b = load.run_load("aggregated", agg.url, "tiny", w, None, 3)
    assert (a.requests, a.errors, b.requests, b.errors) == (8, 0, 8, 0)
    assert sorted(pd.prompts()) == sorted(agg.prompts()) == sorted(json.dumps(p) for p in w.prompts)
    assert len(set(pd.prompts())) == 8  # no prompt twice in a run (so none is answered from the prefix cache)
    assert all(isinstance(p, str) and p for p in w.prompts) and {r.prompt_len for r in w.requests} == {16}
    body = pd.bodies[0]  # as vLLM's completions request sends it, with pdctl's settings
    assert (body["max_tokens"], body["temperature"], body["ignore_eos"], body["stream"]) == (6, 0, True, True)
    assert (body["model"], a.dataset, a.input_tokens) == ("tiny", "random", 8 * 16)
    assert a.vllm["completed"] == 8 and len(a.vllm["ttfts"]) == 8 and "generated_texts" in a.vllm
    w2 = work(8, seed=2)
    load.run_load("P/D", pd.url, "tiny", w2, None, 3)
    assert not set(pd.prompts()[:8]) & set(pd.prompts()[8:])  # another seed, other prompts


def test_closed_loop_measures_tpot_and_ttft_and_paced_streams_are_not_bunched(fake):
    s = fake()
    r = load.run_load("t", s.url, "tiny", work(6), 10, 2)
    assert (r.requests, r.errors, r.bunched, r.request_rate) == (6, 0, 0, None)
    assert STEP_S * 0.9 < r.tpot_ms_p50 / 1e3 < STEP_S * 3  # one step per token, not zero, not stalled
    assert STEP_S * 0.9 < r.ttft_ms_p50 / 1e3 < STEP_S * 5
    assert r.out_tok_per_s > 0 and r.e2e_ms_p50 > 9 * r.tpot_ms_p50 and r.ttft_ms_p99 >= r.ttft_ms_p50
    assert all(b["max_tokens"] == 10 for b in s.bodies)  # max_tokens given: it wins over the workload's
    assert json.loads(load.to_json(r, r))["ratio"]["ttft_ms_p50"] == 1.0 and "vllm" not in r.to_dict()


def test_streams_that_arrive_all_at_once_are_flagged(fake):
    s = fake(bunch=True)
    r = load.run_load("t", s.url, "tiny", work(3), 10, 1)
    assert r.bunched == 3 and r.tpot_ms_p50 < 1.0  # what bench_hetero leaves out as a burst run


def test_failed_requests_are_counted_not_measured(fake):
    s = fake(fail_every=3)
    r = load.run_load("t", s.url, "tiny", work(9), 4, 1)
    assert (r.errors, r.requests, len(s.bodies)) == (3, 6, 9)
    assert sum(bool(e) for e in r.vllm["errors"]) == 3


def test_headers_reach_the_server(fake):
    s = fake()
    load.run_load("t", s.url, "tiny", work(3), 4, 2, headers={PIN: "p0/d1"})
    assert [h.get(PIN) for h in s.headers] == ["p0/d1"] * 3


def test_an_http_proxy_in_the_environment_does_not_carry_the_load(fake, monkeypatch):
    s = fake()
    for var in ("HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("no_proxy", "example.com")
    monkeypatch.delenv("NO_PROXY", raising=False)
    r = load.run_load("t", s.url, "tiny", work(2), 4, 1)
    assert (r.requests, r.errors) == (2, 0)
    assert os.environ["no_proxy"] == "example.com" and "NO_PROXY" not in os.environ  # as it was


def _offsets(s: Fake) -> list[float]:
    return [t - s.arrived[0] for t in s.arrived]


def test_open_loop_arrivals_repeat_with_the_seed_and_keep_the_schedule(fake):
    a, b, c = fake(), fake(), fake()
    r = load.run_load("t", a.url, "tiny", work(8, seed=1), 20, 1, request_rate=20.0, seed=3)
    np.random.random(5)  # whatever else drew from numpy's global RNG in between
    load.run_load("t", b.url, "tiny", work(8, seed=1), 20, 1, request_rate=20.0, seed=3)
    load.run_load("t", c.url, "tiny", work(8, seed=1), 20, 1, request_rate=20.0, seed=4)
    assert (r.requests, r.errors, r.request_rate) == (8, 0, 20.0)
    # 50 ms of slack: a loaded 2-core CI host delays a send by tens of ms (20 ms failed once in a full suite here);
    # the schedules of two seeds differ by ~100 ms, and a closed loop would space requests >= 200 ms.
    assert max(abs(x - y) for x, y in zip(_offsets(a), _offsets(b), strict=True)) < 0.05
    assert max(abs(x - y) for x, y in zip(_offsets(a), _offsets(c), strict=True)) > 0.05
    # vLLM's schedule: exponential gaps from numpy's global RNG, stretched to end at n / rate. Each request takes
    # ~0.2 s, so a closed loop of 1 would space them >= 0.2 s; the open loop keeps the schedule.
    np.random.seed(3)
    due = np.cumsum(np.random.gamma(1.0, 1 / 20.0, 8))
    due = due * (8 / 20.0) / due[-1]
    assert max(abs(x - (d - due[0])) for x, d in zip(_offsets(a), due, strict=True)) < 0.05, (_offsets(a), due)


def test_prefix_repetition_shares_prefixes_but_no_prompt_repeats():
    w = work(16, seed=5, dataset="prefix_repetition", prompt_len=32)
    assert len(w) == 16 and len(set(w.prompts)) == 16 and w.dataset == "prefix_repetition"
    ids = [tuple(w.tokenizer.encode(p, add_special_tokens=False)[:8]) for p in w.prompts]
    assert len(set(ids)) == 2  # 16 // 8 prefixes (of 16 tokens) shared


def test_token_id_prompts_with_and_without_a_tokenizer(fake):
    s = fake()
    w = work(4, token_ids=True)
    assert all(isinstance(p, list) and len(p) == 16 for p in w.prompts)
    raw = work(4, tokenizer=None, vocab=500)  # no tokenizer: ids from the vocabulary size
    assert all(isinstance(p, list) and len(p) == 16 and max(p) < 500 for p in raw.prompts) and raw.tokenizer is None
    r = load.run_load("t", s.url, "tiny", raw, None, 2)
    assert r.errors == 0 and sorted(map(json.dumps, raw.prompts)) == sorted(s.prompts())
    assert r.out_tok_per_s > 0  # counted from the stream's usage


def test_seen_prompts_are_not_drawn_again():
    seen: set = set()
    a = work(8, seed=9, seen=seen)
    b = work(8, seed=9, seen=seen)  # the same seed: the same prompts, all seen, so others
    assert len(seen) == 16 and not set(a.prompts) & set(b.prompts)


def test_file_datasets_read_local_files(tmp_path):
    rows = [{"prompt": f"question {i}: what is {i} + {i}?"} for i in range(6)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    w = work(4, dataset="custom", dataset_path=tmp_path / "c.jsonl")
    assert len(set(w.prompts)) == 4 and all(r.expected_output_len == 6 for r in w.requests)
    (tmp_path / "bad.jsonl").write_text('{"question": "no prompt column"}\n')
    with pytest.raises(load.WorkloadError, match="--dataset custom:.*bad.jsonl: vLLM's dataset gave no "
                       "prompts: JSONL file must contain a 'prompt' column"):
        work(2, dataset="custom", dataset_path=tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match=r"gave 2 distinct prompts not sent before, 4 wanted \(--requests\)"):
        work(4, dataset="custom", dataset_path=tmp_path / "c.jsonl", seen=set(w.prompts))
    conv = [{"conversations": [{"from": "human", "value": f"tell me about number {i}"},
                               {"from": "gpt", "value": f"number {i} is a number"}]} for i in range(5)]
    (tmp_path / "s.json").write_text(json.dumps(conv))
    w = work(5, dataset="sharegpt", dataset_path=tmp_path / "s.json")
    assert sorted(w.prompts) == sorted(c["conversations"][0]["value"] for c in conv)


# ------------------------------------------------------------------------------------------------------------
# Refused


def test_a_workload_whose_prompts_repeat_is_not_sent(fake):
    s = fake()
    w = work(3)
    w = replace(w, requests=[*w.requests, w.requests[0]])
    with pytest.raises(ValueError, match="1 of the workload's 4 prompts repeat an earlier one"):
        load.run_load("t", s.url, "tiny", w, None, 1)
    assert s.bodies == []


@pytest.mark.parametrize("dataset,path,message", [
    ("sharegpt", None, "--dataset sharegpt needs its file: --dataset sharegpt:FILE, a ShareGPT JSON file on this "
     "machine"),
    ("custom", None, "--dataset custom needs its file: --dataset custom:FILE"),
    ("sharegpt", "/nonexistent/s.json", "--dataset sharegpt:/nonexistent/s.json: no such file"),
    ("custom", "configs/cpu-demo.yaml", "--dataset custom:configs/cpu-demo.yaml: custom reads a .jsonl file"),
    ("random", "configs/cpu-demo.yaml", "--dataset random:configs/cpu-demo.yaml: random is synthetic"),
    ("hf", None, "--dataset hf: pdctl builds prompts from one of random, prefix_repetition, sharegpt:FILE, "
     "custom:FILE"),
])
def test_datasets_that_cannot_be_built_here_are_refused(dataset, path, message):
    with pytest.raises(ValueError) as e:
        load.check_dataset(dataset, path)
    assert str(e.value).startswith(message)
    with pytest.raises(ValueError, match="needs its file"):
        work(2, dataset="sharegpt")


@pytest.mark.parametrize("text, parsed", [
    ("random", ("random", None)), ("sharegpt:/data/s.json", ("sharegpt", Path("/data/s.json"))),
    ("custom:c.jsonl", ("custom", Path("c.jsonl"))), ("custom:", ("custom", Path(""))),
])
def test_the_dataset_option_is_a_kind_and_maybe_its_file(text, parsed):
    assert load.dataset_option(text) == parsed


def test_bench_and_sweep_refuse_a_bad_dataset_before_anything_starts(run_cli, monkeypatch, tmp_path):
    started = []
    for where in ("pdctl.api", "pdctl.api.deploy", "pdctl.api.gates", "pdctl.api.benchmarks"):  # each holds the name
        monkeypatch.setattr(f"{where}.plan", lambda *a, **kw: started.append(1) or pytest.fail("started"))
    code, _, err = run_cli("bench", CONFIGS / "cpu-demo.yaml", "--skip", "eval", "--dataset", "sharegpt")
    assert code == 1 and started == [] and "Traceback" not in err
    assert "error: --dataset sharegpt needs its file: --dataset sharegpt:FILE" in err
    code, _, err = run_cli("bench", CONFIGS / "cpu-demo.yaml", "--skip", "eval", "--dataset", "nope")
    assert code == 1 and "error: --dataset nope: pdctl builds prompts from one of" in err
    (tmp_path / "m.yaml").write_text("cases:\n  - name: a\n")
    code, _, err = run_cli("sweep", CONFIGS / "cpu-demo.yaml", "--matrix", tmp_path / "m.yaml", "--skip", "eval",
                           "--dataset", f"random:{tmp_path / 'm.yaml'}", "--results", tmp_path / "r")
    assert code == 1 and started == [] and "error: --dataset random:" in err and "is synthetic" in err
    code, _, err = run_cli("bench", CONFIGS / "cpu-demo.yaml", "--skip", "eval", "--dataset", "custom",
                           "--dataset-path", tmp_path / "c.jsonl")
    assert code == 1 and started == [] and "--dataset-path: removed: use --dataset sharegpt:FILE or" in err


# ------------------------------------------------------------------------------------------------------------
# pdctl bench's load phase, wired


def test_bench_builds_the_prompts_before_bring_up_one_list_for_both_sides_fresh_ones_per_pair(monkeypatch, tmp_path):
    import pdctl
    from pdctl.bench import run as run_mod
    from pdctl.bench.options import BenchOptions

    t = pdctl.load(CONFIGS / "cpu-fleet.yaml")
    plan = pdctl.plan(t, state_dir=tmp_path / "state", reference_port=8300)
    events: list = []
    monkeypatch.setattr(run_mod.run_mod, "up", lambda *a, **kw: events.append("up"))
    monkeypatch.setattr(run_mod.run_mod, "down", lambda *a, **kw: events.append("down"))

    def run_load(target, url, model, w, max_tokens, concurrency, decode_urls=(), request_rate=None, seed=0,
                 headers=None):
        events.append((target, w, seed, headers))
        return load.LoadResult(target, len(w), 0, 1.0, 1.0, 1.0, *[1.0] * 8, dataset=w.dataset, vllm={"x": 1})

    monkeypatch.setattr(run_mod.load, "run_load", run_load)
    built = load.workload
    monkeypatch.setattr(run_mod.load, "workload", lambda *a, **kw: events.append("workload") or built(*a, **kw))
    o = BenchOptions(skip={"check", "eval"}, requests=4, prompt_len=16, max_tokens=4, request_rate=2.0)
    s = run_mod.run_bench(t.origin, plan, plan.get("reference"), None, tmp_path / "out", o, {})
    loads = [e for e in events if isinstance(e, tuple)]
    pairs = len(t.pairs())
    assert events[: pairs + 2] == ["workload"] * (1 + pairs) + ["up"] and events[-1] == "down"
    assert len(loads) == 2 + pairs
    (_, pd, seed, _), (_, agg, seed2, _) = loads[:2]
    assert pd is agg and seed == seed2 == s["perf"]["seed"]  # the same prompts, the same arrivals
    prompts = [set(w.prompts) for _, w, _, _ in loads[1:]]
    assert all(len(p) == 4 for p in prompts) and len(set().union(*prompts)) == 4 * len(prompts)  # no reuse
    assert [h for *_, h in loads[2:]] == [{ROUTE_HEADER: f"{p.name}/{d.name}"} for p, d in t.pairs()]
    assert s["perf"]["dataset"] == "random" and (tmp_path / "out" / "load" / "pd.vllm.json").is_file()
