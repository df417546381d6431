"""Old code against new, one topology, one interleaved run: does a change cost the KV path or idle CPU anything?

Each variant is a source tree (the working tree, and `git archive REF` unpacked beside it) run with the same venv:
`pdctl up -d` with PYTHONPATH set to the tree, so its servers load that tree's connector and plugin. Per
alternation (the order flips every time), each variant is brought up, sent --requests fresh prompts at
concurrency 1 and then 4 through its proxy (the working tree's load generator, vLLM's serving benchmark), left
idle for --idle-s while each server's CPU time is sampled (every process of its group), and taken down.

Reported per variant (medians) and as the median of per-alternation ratios new / old: KV read time per request (the
decodes' vllm:nixl_xfer_time_seconds over the requests), TTFT/TPOT p50, and idle CPU per server in cores (new - old).
Results: a table and results/bench_regression.json.

Usage: python scripts/bench_regression.py [configs/cpu-demo.yaml] [--old 4c5b5ad] [--repeat 3] [--requests 50]
                                          [--idle-s 20] [--out results/bench_regression.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "scripts"))
from bench_kv import cpu_seconds  # noqa: E402

from pdctl.bench.load import run_load, workload  # noqa: E402
from pdctl.plan import build_plan  # noqa: E402
from pdctl.topology import load_topology, resolved_model  # noqa: E402


def unpack(ref: str, into: Path) -> Path:
    """The tree at `ref` (git archive), unpacked once; returns its directory."""
    tree = into / f"pdctl-{ref}"
    if not (tree / "pdctl").is_dir():
        blob = subprocess.run(["git", "archive", "--format=tar", ref], cwd=REPO, capture_output=True, check=True)
        tree.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=BytesIO(blob.stdout)) as tar:
            tar.extractall(tree, filter="data")
    # Models and the tokenizer cache are the working tree's (downloaded once, never versioned).
    (tree / ".pdctl").mkdir(exist_ok=True)
    if not (tree / ".pdctl" / "models").exists():
        (tree / ".pdctl" / "models").symlink_to(REPO / ".pdctl" / "models")
    return tree


def pdctl(tree: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-m", "pdctl", *args], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology", nargs="?", default="configs/cpu-demo.yaml")
    ap.add_argument("--old", default="4c5b5ad", help="git ref of the old code (default: before #30's connector)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--idle-s", type=float, default=20.0)
    ap.add_argument("--out", default="results/bench_regression.json")
    a = ap.parse_args()
    topo = str(Path(a.topology).resolve())
    loaded = load_topology(topo)
    t = loaded.topology
    plan = build_plan(t, base_dir=loaded.base_dir, state_dir=Path("/tmp/x"), python=sys.executable)
    proxy = plan.get("proxy").http_url
    decodes = [s.http_url for s in plan.by_role("decode")]
    tokenizer = resolved_model(t, t.decode[0], loaded.base_dir)
    work = Path(tempfile.gettempdir()) / "pdctl-bench-regression"
    variants = {"new": REPO, "old": unpack(a.old, work)}
    seen: set = set()
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for rep in range(a.repeat):
        for name in (list(variants) if rep % 2 == 0 else list(reversed(variants))):
            tree, state_dir = variants[name], work / f"state-{name}"
            t0 = time.perf_counter()
            up = pdctl(tree, "up", "-d", topo, "--state-dir", str(state_dir), "--timeout", "400")
            ready = time.perf_counter() - t0
            try:
                if up.returncode != 0:
                    print(f"{name}: pdctl up failed:\n{up.stderr[-3000:]}", file=sys.stderr)
                    return 1
                row = {"ready_s": ready}
                for conc in (1, 4):
                    w = workload(a.requests, a.prompt_len, seed=1000 * rep + conc, tokenizer=tokenizer,
                                 max_tokens=a.max_tokens, seen=seen)
                    r = run_load(name, proxy, t.model.name, w, a.max_tokens, conc, decode_urls=decodes, seed=rep)
                    row[f"c{conc}_ttft_ms_p50"], row[f"c{conc}_tpot_ms_p50"] = r.ttft_ms_p50, r.tpot_ms_p50
                    row[f"c{conc}_errors"] = r.errors
                    if r.kv_xfer_s is not None and r.requests:
                        row[f"c{conc}_kv_read_ms"] = 1000 * r.kv_xfer_s / r.requests
                state = json.loads((state_dir / "state.json").read_text())
                groups = {n: p["pgid"] for n, p in state["processes"].items() if not n.startswith("proxy")}
                time.sleep(5)  # the load's tail settles
                before = {n: cpu_seconds(g) for n, g in groups.items()}
                time.sleep(a.idle_s)
                for n, g in groups.items():
                    row[f"idle_cores_{n}"] = (cpu_seconds(g) - before[n]) / a.idle_s
            finally:
                pdctl(tree, "down", "--state-dir", str(state_dir))
            runs[name].append(row)
            print(f"repeat {rep + 1}/{a.repeat} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()),
                  flush=True)
    keys = [k for k in runs["new"][0] if all(k in r for rows in runs.values() for r in rows)]
    med = {name: {k: statistics.median(r[k] for r in rows) for k in keys} for name, rows in runs.items()}
    ratio = {k: statistics.median(n[k] / o[k] for n, o in zip(runs["new"], runs["old"], strict=True) if o[k])
             for k in keys if not k.startswith(("idle", "c1_errors", "c4_errors"))}
    idle_delta = {k: med["new"][k] - med["old"][k] for k in keys if k.startswith("idle")}
    print(f"\n{'metric':34}{'new':>12}{'old ' + a.old:>16}{'new/old':>10}   (medians over {a.repeat} alternations)")
    for k in keys:
        extra = f"{ratio[k]:>10.3f}" if k in ratio else (f"{idle_delta[k]:>+10.3f}" if k in idle_delta else "")
        print(f"{k:34}{med['new'][k]:>12.3f}{med['old'][k]:>16.3f}{extra}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "old": a.old, "runs": runs, "median": med,
                                       "median_ratio_new_over_old": ratio, "idle_cores_new_minus_old": idle_delta},
                                      indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
