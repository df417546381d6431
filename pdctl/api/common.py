"""What every part of pdctl's API shares: the user-error type and the callbacks' shape."""

from __future__ import annotations

from collections.abc import Callable

from pdctl.topology.overrides import REMOVED_OVERRIDE_FLAGS

Say = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


class UserError(Exception):
    """Bad input from the user: one message, never a traceback."""

DASHBOARD = "configs/grafana/pdctl-fleet.json"  # over its Prometheus (docs/operations.md: Monitoring)


# Flags renamed in 0.2 (one word per concept: --data-dir for GSM8K, --proxy for a running proxy, --reference for
# the gates' aggregated server), refused with their new name for one release.
RENAMED_FLAGS = {"check": {"--gsm8k-dir": "--data-dir"}, "eval": {"--url": "--proxy", "--baseline": "--reference"}}

# Flags removed in 0.2, refused with what replaces each for one release: the typed topology overrides other than
# the role flags (each a --set of its own), the reference's port (reference.port),
# bench's three skips (one --skip list), its accuracy gate's concurrency (1: per-sample agreement stays exact),
# the load's one open-loop rate (--rates) and dataset file (--dataset KIND:FILE).
_OVERRIDES = {flag: f"--set {s}" for flag, s in REMOVED_OVERRIDE_FLAGS.items()}
_REFERENCE = {"--reference-port": "--set reference.port=N"}
_BENCH = {"--skip-check": "--skip check", "--skip-eval": "--skip eval", "--skip-perf": "--skip perf",
          "--eval-concurrency": "pdctl eval --concurrency N (bench's accuracy gate runs at 1)",
          "--request-rate": "--rates R (one rate: the load benchmark in open loop)",
          "--dataset-path": "--dataset sharegpt:FILE or --dataset custom:FILE"}
REMOVED_FLAGS = {"validate": _OVERRIDES, "plan": _OVERRIDES, "render k8s": _OVERRIDES, "up": _OVERRIDES,
                 "check": {**_OVERRIDES, **_REFERENCE}, "eval": {**_OVERRIDES, **_REFERENCE},
                 "bench": {**_OVERRIDES, **_REFERENCE, **_BENCH}, "sweep": {**_OVERRIDES, **_REFERENCE, **_BENCH}}


def refuse_renamed(argv: list[str]) -> None:
    """UserError naming the replacement when this command line uses a flag that was renamed or removed."""
    two_words = " ".join(argv[:2])  # `render k8s`
    command = two_words if two_words in REMOVED_FLAGS else argv[0] if argv else ""
    renamed, removed = RENAMED_FLAGS.get(command, {}), REMOVED_FLAGS.get(command, {})
    for arg in argv[len(command.split()):]:
        if arg == "--":
            return
        old = arg.partition("=")[0]
        if old in renamed:
            raise UserError(f"pdctl {command} {old}: renamed to {renamed[old]}")
        if old in removed:
            raise UserError(f"pdctl {command} {old}: removed: use {removed[old]}")
