"""How a launch fails, for every engine and for `up`: a leaf module (it imports only the log helpers), so the
engines, the runner and the CLI can all raise and catch these without importing each other."""

from __future__ import annotations

from pdctl.launch.logs import root_cause, tail

LOG_TAIL_LINES = 40


class LaunchFailed(Exception):
    """A process did not come up (or a cluster refused the plan); `log_tail` holds the end of its log."""

    def __init__(self, name: str, reason: str, log_path: str | None):
        self.name, self.reason, self.log_path = name, reason, log_path
        self.log_tail = tail(log_path, LOG_TAIL_LINES) if log_path else []
        super().__init__(f"{name}: {reason}")

    @property
    def cause(self) -> str | None:
        """The line of the log that says why (pdctl's own error, else the first exception), if any."""
        return root_cause(tail(self.log_path, 400) if self.log_path else self.log_tail)


class PlacementFailed(LaunchFailed):
    """A cluster engine found no node for an instance within the placement timeout."""

    def __init__(self, name: str, placement: dict, timeout_s: float, nodes: list[str]):
        wanted = ", ".join(f"{k}={v}" for k, v in placement.items() if v) or "any node"
        super().__init__(name, f"no node satisfied placement ({wanted}) within {timeout_s:.0f} s; the cluster's "
                         f"nodes:\n  " + "\n  ".join(nodes or ["(none alive)"]), None)


class PreflightFailed(Exception):
    """What pre-flight found before anything started (ports taken, a model path missing, ...)."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))
