"""What every part of pdctl's API shares: the user-error type and the callbacks' shape."""

from __future__ import annotations

from collections.abc import Callable

Say = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


class UserError(Exception):
    """Bad input from the user: one message, never a traceback."""

DASHBOARD = "configs/grafana/pdctl-fleet.json"  # over its Prometheus (docs/operations.md: Monitoring)
