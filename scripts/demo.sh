#!/usr/bin/env bash
# The CPU demo: validate and plan the built-in topology.
set -euo pipefail
PDCTL=${1:-pdctl}
TOPO=configs/cpu-demo.yaml
$PDCTL validate "$TOPO"
$PDCTL plan "$TOPO"
