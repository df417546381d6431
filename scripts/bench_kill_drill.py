#!/usr/bin/env python3
"""Kill drill: open-loop load through a supervised P/D topology, a prefill SIGKILLed mid-run and restarted by
pdctl's supervisor; every KV read accounted for from the decodes' logs (`connector.trace` and pdctl's received,
timed-out and refused lines).

Reported (table + results/bench_kill_drill.json):
  surviving reads     reads from the prefills that were not killed, issued -> done: count, p50, p99, max
  in flight at kill   reads from the killed prefill issued before the kill and not done by it: how long after the
                      kill each ended (failed, or done) and what kv_load_failure_policy made of it
  after restart       the restarted prefill's probe read (its pairs, re-proven by the supervisor) and its first read
                      under load
  client errors       requests that did not get an answer (HTTP status != 200)

  .venv/bin/python scripts/bench_kill_drill.py                      # 4 req/s for 60 s, prefill-0 killed at 20 s
  .venv/bin/python scripts/bench_kill_drill.py --rate 6 --duration 90 --kill-at 30
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from soak import kill  # noqa: E402 (SIGKILL an instance's server, as a crash would)

from pdctl.protocol import READ_TIMED_OUT_MARK, RECEIVED_LINE, TRACE_LINE  # noqa: E402

PDCTL = [sys.executable, "-m", "pdctl"]
RID = re.compile(r"(drill-\d+)")
FAILED = re.compile(r"pdctl connector: FAILED request (\S+) from engine \S+ at [^\s:]+:(\d+) ")
PORT = 8095


def pdctl(*args, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([*PDCTL, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def ask(rid: str, body: dict) -> dict:
    t0 = time.time()
    try:
        c = http.client.HTTPConnection("127.0.0.1", PORT, timeout=300)
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                               "X-Request-Id": rid})
        r = c.getresponse()
        r.read()
        c.close()
        return {"rid": rid, "status": r.status, "t0": t0, "t1": time.time(),
                "prefill": r.getheader("x-pdctl-prefill")}
    except (OSError, http.client.HTTPException) as e:
        return {"rid": rid, "status": 0, "t0": t0, "t1": time.time(), "error": repr(e)}


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def reads(state: Path) -> dict[str, dict]:
    """Per drill request: its read's trace times, the prefill side-channel port it read from, and its outcome."""
    out: dict[str, dict] = {}
    for log in (state / "logs").glob("decode-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            m = RID.search(line)
            if not m:
                continue
            r = out.setdefault(m.group(1), {})
            if t := TRACE_LINE.search(line):
                r.setdefault(t.group(1), float(t.group(3)))
            elif got := RECEIVED_LINE.search(line):
                r["port"], r["outcome"] = int(got.group(3)), "received"
            elif bad := FAILED.search(line):
                r["port"], r["outcome"] = int(bad.group(2)), "failed"
            elif READ_TIMED_OUT_MARK in line:
                r["timed_out"] = True
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default=str(REPO / "configs" / "cpu-demo.yaml"))
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson arrivals)")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--kill-at", type=float, default=20.0)
    ap.add_argument("--kill", default="prefill-0")
    ap.add_argument("--state-dir", default="/tmp/pdctl-kill-drill")
    ap.add_argument("--results", default=str(REPO / "results" / "bench_kill_drill.json"))
    a = ap.parse_args()

    state = Path(a.state_dir)
    args = ["--set", "prefill.count=2", "--set", "decode.count=2", "--set", "prefill.devices=[0,0]",
            "--set", "decode.devices=[1,1]", "--set", f"proxy.port={PORT}", "--set", "prefill.http_port=8195",
            "--set", "decode.http_port=8295", "--set", "prefill.side_channel_port=5695",
            "--set", "decode.side_channel_port=5795", "--set", "supervision.backoff_s=1",
            "--set", "connector.trace=true"]
    print(f"bringing up {a.topology} (2 prefills on core 0, 2 decodes on core 1) ...", flush=True)
    r = pdctl("up", "-d", a.topology, "--state-dir", state, *args)
    if r.returncode:
        print(r.stdout, r.stderr, file=sys.stderr)
        return 1
    plan = json.loads((state / "state.json").read_text())["plan"]
    port_of = {p["name"]: p["ports"].get("side_channel") for p in plan["processes"]}
    killed_port = port_of[a.kill]
    results: list[dict] = []
    threads: list[threading.Thread] = []
    rng = random.Random(7)
    killed_at = None
    t_start = time.monotonic()
    try:
        i = 0
        next_at = 0.0
        while (now := time.monotonic() - t_start) < a.duration:
            if killed_at is None and now >= a.kill_at:
                killed_at = time.time()
                print(f"{now:.0f} s: SIGKILL {a.kill} (server pid {kill(state, a.kill)})", flush=True)
            if now >= next_at:
                body = {"model": "tiny", "prompt": [rng.randrange(5, 1500) for _ in range(rng.randrange(64, 256))],
                        "max_tokens": 8, "temperature": 0}
                rid = f"drill-{i}"
                t = threading.Thread(target=lambda rid=rid, body=body: results.append(ask(rid, body)))
                t.start()
                threads.append(t)
                i += 1
                next_at += rng.expovariate(a.rate)
            time.sleep(0.005)
        for t in threads:
            t.join(300)
        # the restart: the supervisor re-proves the restarted prefill's pairs before it counts as serving
        serving_at = None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            rec = json.loads((state / "state.json").read_text())["processes"][a.kill]
            if rec.get("restarts", 0) >= 1 and rec.get("phase") == "running":
                serving_at = time.time()
                break
            time.sleep(0.5)
        after = []  # a few requests after the restart, to see the restarted prefill's first read under load
        for k in range(12):
            after.append(ask(f"drill-{i + k}", {"model": "tiny", "max_tokens": 8, "temperature": 0,
                                                "prompt": [rng.randrange(5, 1500) for _ in range(128)]}))
        results += after
        probes = json.loads((state / "state.json").read_text()).get("probes", {})
    finally:
        pdctl("down", "--state-dir", state)

    per_req = reads(state)
    surviving = [(v["read_done"] - v["read_issued"]) for v in per_req.values()
                 if v.get("port") not in (None, killed_port) and {"read_issued", "read_done"} <= v.keys()]
    in_flight = {rid: v for rid, v in per_req.items() if v.get("port") == killed_port and killed_at
                 and v.get("read_issued", 1e18) <= killed_at and v.get("read_done", 1e18) > killed_at}
    ended_after_kill = [v["read_done"] - killed_at for v in in_flight.values() if "read_done" in v]
    restarted_reads = sorted((v["read_issued"], v["read_done"] - v["read_issued"]) for v in per_req.values()
                             if v.get("port") == killed_port and serving_at and v.get("read_issued", 0) > serving_at
                             and "read_done" in v)
    row = {
        "requests": len(results), "client_errors": sum(1 for x in results if x["status"] != 200),
        "surviving_reads": len(surviving),
        "surviving_read_p50_ms": round(1e3 * pct(surviving, 0.5), 2) if surviving else None,
        "surviving_read_p99_ms": round(1e3 * pct(surviving, 0.99), 2) if surviving else None,
        "surviving_read_max_ms": round(1e3 * max(surviving), 2) if surviving else None,
        "in_flight_at_kill": len(in_flight),
        "in_flight_ended_after_kill_max_s": round(max(ended_after_kill), 3) if ended_after_kill else None,
        "in_flight_outcomes": sorted({v.get("outcome", "?") + (" (timed out)" if v.get("timed_out") else "")
                                      for v in in_flight.values()}),
        "restarted_probe_ms": {k: round(v * 1e3, 2) for k, v in probes.items() if k.startswith(a.kill)},
        "restarted_first_read_ms": round(1e3 * restarted_reads[0][1], 2) if restarted_reads else None,
        "kill_to_serving_s": round(serving_at - killed_at, 1) if serving_at and killed_at else None,
    }
    print("\n| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join(str(v) for v in row.values()) + " |")
    Path(a.results).parent.mkdir(parents=True, exist_ok=True)
    Path(a.results).write_text(json.dumps({"command": " ".join(sys.argv), **row,
                                           "surviving_read_median_s": statistics.median(surviving) if surviving
                                           else None}, indent=2))
    print(f"wrote {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
