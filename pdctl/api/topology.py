"""Topologies and plans: load a YAML topology (validated, with overrides), plan it, render it for
Kubernetes or Slurm, build the tiny test model."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdctl.api.common import Say, UserError, _quiet
from pdctl.plan import Plan, build_plan, reference_spec
from pdctl.topology import Loaded, Override, Topology, load_topology


def as_overrides(overrides: Iterable[Override | str] | Mapping[str, Any] | None) -> list[Override]:
    """Overrides as the API takes them: Override objects, "dotted.path=value" strings (as --set) or a mapping
    {"decode.block_size": 128} (values as Python objects)."""
    if not overrides:
        return []
    if isinstance(overrides, Mapping):
        out = []
        for key, value in overrides.items():
            probe = Override.parse_set(f"{key}=0")  # the path as --set reads it (pool names, list indices)
            out.append(Override(probe.path, value, f"{key}={value!r}"))
        return out
    return [o if isinstance(o, Override) else Override.parse_set(str(o)) for o in overrides]


def load(path: str | Path, overrides: Iterable[Override | str] | Mapping[str, Any] | None = None, *,
         gated: bool = False) -> Topology:
    """A topology file, validated against every rule (TopologyError with file:line otherwise).

    `gated=True` loads it as a gate runs it: proxy.on_prefill_down=reject and connector.kv_load_failure_policy=
    fail unless the overrides set them (a fallback must never count as P/D). `topology.origin` keeps where it was
    loaded from; `warnings(topology)` and `gate_notes(topology)` say what to tell the user."""
    from pdctl.gates import gated as gated_mod

    ovr = as_overrides(overrides)
    applied: list[str] = []
    kept: list[str] = []
    if gated:
        ovr, applied, kept = gated_mod.gated(ovr)
    loaded = load_topology(path, ovr)
    if gated:
        loaded.gate = (applied, kept)
    return loaded.topology


def origin(t: Topology) -> Loaded:
    if t.origin is None:
        raise UserError(f"topology '{t.name}' was not loaded from a file (use pdctl.load)")
    return t.origin


def warnings(t: Topology) -> list[str]:
    """The loader's warnings, each with its file:line."""
    o = t.origin
    return [o.source.describe(w) for w in o.warnings] if o else []


def gate_notes(t: Topology) -> list[str]:
    """What a gated load runs with, and a warning for a setting the user kept that lets a fallback pass."""
    from pdctl.gates import gated as gated_mod

    g = getattr(t.origin, "gate", None)
    return [line for line in gated_mod.gated_lines(*g) if line] if g else []


def _gated(t: Topology, say: Say) -> Topology:
    """A topology as a gate must run it. Loaded with gated=True: as is (the user's explicit choice kept, with its
    warning); else the gate's settings replace the topology's own."""
    from pdctl.gates import gated as gated_mod

    if getattr(t.origin, "gate", None) is not None:
        for line in gate_notes(t):
            say(line)
        return t
    updates: dict[str, dict] = {}
    for (section, name), value in gated_mod.GATE_SETTINGS:
        updates.setdefault(section, {})[name] = value
    gt = t.model_copy(update={s: getattr(t, s).model_copy(update=u) for s, u in updates.items()})
    gt._origin = replace(t.origin, topology=gt) if t.origin else None
    say(_gate_note())
    return gt


def _gate_note() -> str:
    """What every gated run is brought up with."""
    from pdctl.gates import gated as gated_mod

    return gated_mod.gated_lines([f"{'.'.join(path)}={v}" for path, v in gated_mod.GATE_SETTINGS], [])[0]


def default_state_dir(t: Topology) -> Path:
    return (Path(".pdctl") / t.name).absolute()


def plan(t: Topology, *, state_dir: str | Path | None = None, reference_port: int | None = None,
         python: str | None = None, baseline: bool = False) -> Plan:
    """The exact processes `up` starts (pure: same topology, same plan); with `reference_port` (the gates give
    `t.reference.port`), plus an aggregated reference server (the first decode pool's settings, no connector).
    `baseline`: instead, the aggregated deployment `bench --goodput` compares the topology with (plan.baseline_plan)."""
    o = origin(t)
    sd = Path(state_dir).absolute() if state_dir else default_state_dir(t)
    if baseline:
        from pdctl.plan import baseline_plan

        return baseline_plan(t, base_dir=o.base_dir, state_dir=sd / "baseline", python=python or sys.executable)
    p = build_plan(t, base_dir=o.base_dir, state_dir=sd, python=python or sys.executable)
    if reference_port:
        ref = reference_spec(t, base_dir=o.base_dir, state_dir=sd, port=reference_port, python=python or sys.executable)
        p = p.with_processes([*p.processes, ref])
    return p


def slurm_batch(p: Plan) -> str | None:
    """The batch script `up` submits for the Slurm engine (None for the others)."""
    if p.topology.engine.kind != "slurm":
        return None
    from pdctl.launch.slurm_engine import render_batch

    return render_batch(p, p.topology.engine)


def render_k8s(t: Topology, out_dir: str | Path, *, image: str | None = None, namespace: str = "default",
               validate: bool = True) -> list[Path]:
    """Kubernetes manifests for the topology, written to out_dir (checked offline with kubernetes-validate
    --strict unless validate=False); the paths written."""
    import yaml

    from pdctl.launch import k8s
    from pdctl.topology import ROLES, pool_field

    niced = [pool_field(t, r, g, "nice") for r in ROLES for g in t.pools(r) if g.nice]
    if niced:
        raise UserError(f"{niced[0]}: Kubernetes runs each instance in a pod of its own, whose processes a niceness "
                        "does not rank against other pods' (each pod's CPU share comes from its cgroup); remove it "
                        "(and give the pods CPU requests instead) to render for Kubernetes")
    o = origin(t)
    p = build_plan(t, base_dir=o.base_dir, state_dir=Path("/var/lib/pdctl") / t.name, python="python3")
    manifests = k8s.render(t, p, image=image or k8s.DEFAULT_IMAGE, namespace=namespace)
    if validate:
        import kubernetes_validate

        problems = []
        for fname, m in manifests.items():
            try:
                kubernetes_validate.validate(m, kubernetes_validate.latest_version(), strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{fname}: {e.message}")
        if problems:
            raise UserError("rendered manifests failed validation (a pdctl bug):\n  " + "\n  ".join(problems))

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data):  # shared label dicts would become &id001 anchors: legal, hard to read
            return True

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, m in manifests.items():
        (out / fname).write_text(yaml.dump(m, Dumper=_NoAliases, sort_keys=False))
        written.append(out / fname)
    return written


def tiny_model(out_dir: str | Path, *, seed: int = 0, force: bool = False, say: Say = _quiet,
               window: int | None = None) -> str | None:
    """Build the tiny random-weight Llama for tests and demos (`window`: the hybrid one, sliding-window and full
    attention layers in turn); its fingerprint, or None when out_dir holds this model already (kept unless
    force)."""
    from pdctl import tinymodel

    out = Path(out_dir)
    marker = out / "pdctl-tiny.json"
    try:
        made = json.loads(marker.read_text()) if marker.is_file() else {}
        kept = not force and made.get("seed") == seed and made.get("sliding_window") == window
    except (ValueError, OSError, AttributeError):
        kept = False  # a marker that is not ours: rebuild
    if kept:
        return None
    say(f"building tiny model in {out} ...")
    tinymodel.build_tiny_model(out, seed=seed, window=window)
    return tinymodel.fingerprint(out)
