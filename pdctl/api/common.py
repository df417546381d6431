"""What every part of pdctl's API shares: the user-error type and the callbacks' shape."""

from __future__ import annotations

from collections.abc import Callable

Say = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


class UserError(Exception):
    """Bad input from the user: one message, never a traceback."""

DASHBOARD = "configs/grafana/pdctl-fleet.json"  # over its Prometheus (docs/operations.md: Monitoring)


# Flags renamed in 0.2 (one word per concept: --data-dir for GSM8K, --proxy for a running proxy, --reference for
# the gates' aggregated server), refused with their new name for one release.
RENAMED_FLAGS = {"check": {"--gsm8k-dir": "--data-dir"}, "eval": {"--url": "--proxy", "--baseline": "--reference"}}


def refuse_renamed(argv: list[str]) -> None:
    """UserError naming the new flag when this command line uses one that was renamed."""
    renamed = RENAMED_FLAGS.get(argv[0], {}) if argv else {}
    for arg in argv[1:]:
        old = arg.partition("=")[0]
        if old in renamed:
            raise UserError(f"pdctl {argv[0]} {old}: renamed to {renamed[old]}")
