"""The state dir of one launched topology: the resolved plan, and the pid/process group of every process."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdctl.plan import Plan

STATE_FILE = "state.json"
DEFAULT_ROOT = Path(".pdctl")


@dataclass
class ProcessRecord:
    name: str
    pid: int
    pgid: int
    start_ticks: int  # /proc/<pid>/stat starttime: tells our process from a later one reusing the pid
    started_at: float
    where: str = "local"  # or the engine's handle: "ray:<node ip>", "slurm:<node>"
    # Kept by the supervisor across restarts:
    restarts: int = 0
    phase: str = "running"  # running | starting (after a restart) | backoff | failed (gave up) | exited (clean)
    last_exit: str | None = None  # how the previous run ended: "killed by signal 9 (SIGKILL)", ...
    last_error: str | None = None  # the root-cause line of its log then


@dataclass
class LaunchState:
    plan: Plan
    engine_kind: str = "local"  # the engine that started it (Engine.name)
    detached: bool = True
    processes: dict[str, ProcessRecord] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    engine: dict = field(default_factory=dict)  # the engine's handle: Ray namespace, Slurm job id, ...
    probes: dict[str, float] = field(default_factory=dict)  # "prefill -> decode": its warm-up probe's read (s)

    def to_json(self) -> str:
        d = {"plan": self.plan.to_dict(), "engine_kind": self.engine_kind, "detached": self.detached,
             "created_at": self.created_at, "engine": self.engine, "probes": self.probes,
             "processes": {k: asdict(v) for k, v in self.processes.items()}}
        return json.dumps(d, indent=2)

    @classmethod
    def from_json(cls, text: str) -> LaunchState:
        d = json.loads(text)
        # "backend": the key of a state file an earlier pdctl wrote (a topology left running across an upgrade).
        kind = d.get("engine_kind", d.get("backend", "local"))
        return cls(plan=Plan.from_dict(d["plan"]), engine_kind=kind, detached=d["detached"],
                   created_at=d["created_at"], engine=d.get("engine", {}), probes=d.get("probes", {}),
                   processes={k: ProcessRecord(**v) for k, v in d["processes"].items()})


def state_path(state_dir: Path) -> Path:
    return state_dir / STATE_FILE


def save(state: LaunchState) -> None:
    d = Path(state.plan.state_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (STATE_FILE + ".tmp")
    tmp.write_text(state.to_json())
    os.replace(tmp, state_path(d))  # atomic: a reader never sees half a state


def load(state_dir: Path) -> LaunchState | None:
    p = state_path(state_dir)
    if not p.is_file():
        return None
    return LaunchState.from_json(p.read_text())


def remove(state_dir: Path) -> None:
    p = state_path(state_dir)
    if p.exists():
        p.unlink()


def clear_logs(state_dir: Path) -> None:
    shutil.rmtree(state_dir / "logs", ignore_errors=True)


SUPERVISOR_FILE = "supervisor.json"
LOCK_FILE = "lock"


@contextlib.contextmanager
def locked(state_dir: Path):
    """Exclusive hold of a topology's state: `down` for its whole run, the supervisor for each pass, so the
    supervisor never restarts an instance `down` is stopping, nor writes a state `down` removed."""
    import fcntl

    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def save_supervisor(state_dir: Path, pid: int, start_ticks: int, mode: str) -> None:
    tmp = state_dir / (SUPERVISOR_FILE + ".tmp")
    tmp.write_text(json.dumps({"pid": pid, "start_ticks": start_ticks, "mode": mode}))
    os.replace(tmp, state_dir / SUPERVISOR_FILE)


def load_supervisor(state_dir: Path) -> dict | None:
    try:
        d = json.loads((state_dir / SUPERVISOR_FILE).read_text())
        return d if isinstance(d, dict) and isinstance(d.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def remove_supervisor(state_dir: Path, pid: int) -> None:
    """Remove the supervisor record if it is still this process's."""
    d = load_supervisor(state_dir)
    if d and d["pid"] == pid:
        (state_dir / SUPERVISOR_FILE).unlink(missing_ok=True)


def find_state_dirs(root: Path = DEFAULT_ROOT) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p.parent for p in root.glob(f"*/{STATE_FILE}"))


def resolve_state_dir(name: str | None, state_dir: Path | None, root: Path = DEFAULT_ROOT) -> Path:
    """The state dir a command means: explicit, by topology name, or the only one there is."""
    if state_dir:
        return state_dir.absolute()
    if name:
        return (root / name).absolute()
    found = find_state_dirs(root)
    if len(found) == 1:
        return found[0].absolute()
    if not found:
        raise LookupError(f"no launched topology under {root}/ (pdctl up -d TOPOLOGY starts one)")
    raise LookupError(f"several launched topologies: {', '.join(p.name for p in found)}; name one")
