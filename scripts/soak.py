#!/usr/bin/env python3
"""Soak: N streamed requests at concurrency C through a supervised P/D topology, one instance killed (SIGKILL of
its server) in the middle and restarted by pdctl's supervisor.

Counts client errors (a bad status, or a stream ending in an error event or without [DONE]); the only ones allowed
are streams that were running on a killed decode, each ended by an error event. Reports latency p50/p99 (TTFT
and end to end), throughput, and the restarts `pdctl status` shows. A benchmark, not part of `make test`.

  .venv/bin/python scripts/soak.py                       # 2,000 requests, c=16, prefill-0 killed halfway
  .venv/bin/python scripts/soak.py --kill decode-0 --requests 500
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PDCTL = [sys.executable, "-m", "pdctl"]


def pdctl(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([*PDCTL, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def one(port: int, body: dict) -> dict:
    t0 = time.monotonic()
    ttft = None
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        decode = r.getheader("x-pdctl-decode")
        events = []
        while True:
            line = r.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                ttft = ttft if ttft is not None else time.monotonic() - t0
                events.append(line[6:].strip().decode(errors="replace"))
        c.close()
    except (OSError, http.client.HTTPException) as e:
        return {"ok": False, "error": f"client: {e!r}", "t0": t0, "t1": time.monotonic(), "decode": None}
    t1 = time.monotonic()
    err = None
    if r.status != 200:
        err = f"HTTP {r.status}"
    elif any(e.startswith("{") and '"error"' in e for e in events):
        err = "error event"
    elif not events or events[-1] != "[DONE]":
        err = "no [DONE]"
    return {"ok": err is None, "error": err, "t0": t0, "t1": t1, "ttft": ttft, "e2e": t1 - t0, "decode": decode}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default=str(REPO / "configs" / "cpu-demo.yaml"))
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kill", default="prefill-0", help="instance whose server is SIGKILLed halfway")
    ap.add_argument("--state-dir", default="/tmp/pdctl-soak")
    ap.add_argument("--results", default=str(REPO / "results" / "soak.json"))
    a = ap.parse_args()

    state = Path(a.state_dir)
    port = 8090
    args = ["--set", "prefill.count=2", "--set", "decode.count=2", "--set", "prefill.devices=[0,1]",
            "--set", "decode.devices=[1,0]", "--set", f"proxy.port={port}", "--set", "prefill.http_port=8190",
            "--set", "decode.http_port=8290", "--set", "prefill.side_channel_port=5690",
            "--set", "decode.side_channel_port=5790", "--set", "supervision.backoff_s=1"]
    print(f"bringing up {a.topology} (2 prefills, 2 decodes) ...", flush=True)
    t_up = time.monotonic()
    r = pdctl("up", "-d", a.topology, "--state-dir", state, *args)
    if r.returncode:
        print(r.stdout, r.stderr, file=sys.stderr)
        return 1
    print(f"ready in {time.monotonic() - t_up:.0f} s", flush=True)
    results: list[dict] = []
    lock = threading.Lock()
    nxt = iter(range(a.requests))
    killed: dict = {}

    def client(k: int) -> None:
        rng = random.Random(k)
        for _ in nxt:
            body = {"model": "tiny", "prompt": [rng.randrange(5, 1500) for _ in range(rng.randrange(64, 256))],
                    "max_tokens": a.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
            res = one(port, body)
            with lock:
                results.append(res)
                if len(results) == a.requests // 2 and not killed:
                    killed["at"] = time.monotonic()
                    killed["pid"] = kill(state, a.kill)
                    print(f"{len(results)} done: SIGKILL {a.kill} (server pid {killed['pid']})", flush=True)
                elif len(results) % 250 == 0:
                    print(f"{len(results)} done", flush=True)

    t0 = time.monotonic()
    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(a.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        # The restart is part of the drill: wait until the killed instance serves again (load or not).
        serving_at = None
        deadline = time.monotonic() + 600
        while killed and time.monotonic() < deadline:
            rec = json.loads((state / "state.json").read_text())["processes"][a.kill]
            if rec.get("restarts", 0) >= 1 and rec.get("phase") == "running":
                serving_at = time.monotonic()
                break
            time.sleep(1)
        status = json.loads(pdctl("status", "--state-dir", state, "--json").stdout)
    finally:
        pdctl("down", "--state-dir", state)

    errors = [x for x in results if not x["ok"]]
    # Allowed: streams on the killed decode that were running at the kill, ended by an error event.
    allowed = [x for x in errors if a.kill.startswith("decode") and x["decode"] == a.kill and x["error"] ==
               "error event" and x["t0"] <= killed.get("at", 0) <= x["t1"]]
    ok = [x for x in results if x["ok"]]
    restarts = {i["name"]: i["restarts"] for i in status["instances"]}
    row = {"requests": len(results), "concurrency": a.concurrency, "killed": a.kill, "errors": len(errors),
           "errors_allowed": len(allowed), "wall_s": round(wall, 1), "req_per_s": round(len(results) / wall, 1),
           "ttft_p50_ms": round(1e3 * pct([x["ttft"] for x in ok if x["ttft"]], 0.5), 1),
           "ttft_p99_ms": round(1e3 * pct([x["ttft"] for x in ok if x["ttft"]], 0.99), 1),
           "e2e_p50_ms": round(1e3 * pct([x["e2e"] for x in ok], 0.5), 1),
           "e2e_p99_ms": round(1e3 * pct([x["e2e"] for x in ok], 0.99), 1),
           "e2e_max_ms": round(1e3 * max((x["e2e"] for x in ok), default=0), 1),
           "kill_to_serving_s": round(serving_at - killed["at"], 1) if serving_at else None,
           "load_done_after_kill_s": round(t0 + wall - killed["at"], 1) if killed else None,
           "restarts": restarts, "error_kinds": dict(sorted(
               {e["error"]: sum(1 for x in errors if x["error"] == e["error"]) for e in errors}.items()))}
    print("\n| " + " | ".join(k for k in row if k not in ("restarts", "error_kinds")) + " |")
    print("|" + "---|" * (len(row) - 2))
    print("| " + " | ".join(str(v) for k, v in row.items() if k not in ("restarts", "error_kinds")) + " |")
    print(f"restarts: {restarts}; error kinds: {row['error_kinds']}")
    Path(a.results).parent.mkdir(parents=True, exist_ok=True)
    Path(a.results).write_text(json.dumps({"command": " ".join(sys.argv), **row,
                                           "median_e2e_s": statistics.median(x["e2e"] for x in ok) if ok else None},
                                          indent=2))
    print(f"wrote {a.results}")
    unexplained = len(errors) - len(allowed)
    return 1 if unexplained or restarts.get(a.kill, 0) < 1 or serving_at is None else 0


def kill(state: Path, name: str) -> int:
    """SIGKILL an instance's server (its guard's child), as a crash would; returns its pid."""
    from pdctl.launch.local import live_processes

    rec = json.loads((state / "state.json").read_text())["processes"][name]
    kids = [pid for pid, ppid, _ in live_processes() if ppid == rec["pid"]]
    pid = kids[0] if kids else rec["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


if __name__ == "__main__":
    sys.exit(main())
