#!/usr/bin/env python
"""Does pdctl fit the vLLM and NIXL on the Python path? Driven by pdctl.connector.seam.INTERNALS, the one list of
every vLLM/NIXL internal pdctl relies on: hooks it overrides and methods it calls (with the parameters it
passes), classes, instance attributes (class attributes, or `self.<name> = ...` in the class or its bases),
dataclass fields, module globals it swaps, nixl's agent config fields, and the calls in vLLM's source its
patches depend on. It also imports pdctl's connector, checks that pdctl's own methods and attributes do not
shadow vLLM's by accident (an override must be listed as a hook), and reports entries not yet checked against
this vLLM version (`checked` in the seam).

Against another vLLM without installing it (e.g. 0.33 for CUDA on a CPU machine: its Python sources suffice):

    pip download vllm==0.33.0 --no-deps -d /tmp/v033
    unzip -q /tmp/v033/vllm-0.33.0-*.whl 'vllm/*' -x 'vllm/*.so' -d /tmp/v033/site
    PYTHONPATH=/tmp/v033/site .venv/bin/python scripts/check_vllm_compat.py
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdctl.connector import seam  # noqa: E402  (pure: imports nothing from vLLM)

# pdctl's subclasses and the vLLM classes they extend (names pdctl adds must not shadow the base's).
SUBCLASSES = [("pdctl.connector.nixl:PdctlNixlWorker", seam.PULL_WORKER),
              ("pdctl.connector.scheduler:PdctlNixlScheduler", seam.PULL_SCHEDULER),
              ("pdctl.connector.nixl:NixlConnector", seam.PULL_CONNECTOR)]
_OWN = {"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__",
        "__static_attributes__", "__firstlineno__", "_abc_impl", "__abstractmethods__", "__parameters__"}


def _resolve(path: str):
    """'module' or 'module:Attr.chain' -> the object."""
    module, _, qual = path.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qual.split(".")):
        obj = getattr(obj, part)
    return obj


def _assigns(cls: type, name: str) -> bool:
    """Whether `self.<name> = ...` (optionally annotated) appears in the source of cls or a base (not object)."""
    # An annotation may span lines (`self.x: dict[\n  K, V\n] = {}`).
    pattern = re.compile(rf"self\.{re.escape(name)}\s*(?::[^=]*)?=(?!=)")
    for k in cls.__mro__:
        if k is object:
            continue
        try:
            if pattern.search(inspect.getsource(k)):
                return True
        except (OSError, TypeError):
            continue
    return False


def _check_one(e: seam.Internal) -> str | None:
    """None when the entry holds, else what is wrong."""
    where = f"{e.owner}.{e.name}" if e.kind not in ("class", "source") else (
        f"{e.owner}:{e.name}" if e.kind == "class" else f"{e.owner} (source)")
    try:
        if e.kind == "class":
            obj = getattr(_resolve(e.owner), e.name)
            return None if isinstance(obj, type) else f"{where}: not a class"
        owner = _resolve(e.owner)
        if e.kind in ("hook", "method", "function"):
            fn = getattr(owner, e.name)
            if e.kind != "function" and not any(e.name in vars(k) for k in owner.__mro__ if k is not object):
                return f"{where}: missing (only object's)"
            have = list(inspect.signature(fn).parameters)
            missing = [p for p in e.params if p not in have]
            return f"{where}: no parameter(s) {missing} (has {have})" if missing else None
        if e.kind == "attr":
            ok = hasattr(owner, e.name) or _assigns(owner, e.name)
            return None if ok else f"{where}: missing (no class attribute, no self.{e.name} = ... in its source)"
        if e.kind == "field":
            return None if e.name in seam.field_names(owner) else f"{where}: missing field"
        if e.kind == "module_global":
            return None if hasattr(owner, e.name) else f"{where}: missing"
        if e.kind == "nixl_config_field":
            config = owner()
            setattr(config, e.name, getattr(config, e.name))  # present and settable
            return None
        if e.kind == "source":
            return None if e.name in inspect.getsource(owner) else f"{where}: no longer contains {e.name!r}"
        return f"{where}: unknown kind {e.kind!r}"
    except Exception as exc:  # ImportError, AttributeError, TypeError (read-only field), ...
        return f"{where}: missing ({type(exc).__name__}: {exc})"


def _shadowing(internals: tuple[seam.Internal, ...]) -> list[str]:
    """pdctl's own methods/attributes that silently override vLLM's (an intended override is a seam hook, an
    intended write a seam attr)."""
    problems = []
    for ours_path, base_path in SUBCLASSES:
        ours, base = _resolve(ours_path), _resolve(base_path)
        declared = {e.name for e in internals if e.kind in ("hook", "attr", "method")
                    and (e.owner == base_path or issubclass(base, _resolve(e.owner)))}
        # The class and the mixins it is built from (pdctl's own classes in its MRO).
        own = [k for k in ours.__mro__ if k.__module__.startswith("pdctl.")]
        for name in set().union(*(vars(k) for k in own)) - _OWN:
            if hasattr(base, name) and name not in declared:
                problems.append(f"{ours_path}.{name}: overrides vLLM's {base.__name__}.{name} but is not a seam hook")
        source = "\n".join(inspect.getsource(k) for k in own)
        for name in set(re.findall(r"self\.(\w+)\s*(?::[^=\n]*)?=(?!=)", source)):
            if name not in declared and (hasattr(base, name) or _assigns(base, name)):
                problems.append(f"{ours_path}: self.{name} is also vLLM's {base.__name__}.{name} (not in the seam)")
    return problems


def check(internals: tuple[seam.Internal, ...] | None = None) -> dict:
    import vllm

    internals = seam.INTERNALS if internals is None else internals
    version = getattr(vllm, "__version__", "?")
    problems: list[str] = []
    try:
        import pdctl.connector.nixl  # noqa: F401
    except Exception as e:  # the first thing a user would hit
        problems.append(f"import pdctl.connector.nixl: {type(e).__name__}: {e}")
    for e in internals:
        p = _check_one(e)
        if p:
            problems.append(p)
    if not problems:
        problems += _shadowing(internals)
    try:
        # The plan passes kv_load_failure_policy to every decode; the connector reads it to say what its
        # failed loads become, and reports them through _handle_failed_transfer (a seam method).
        from vllm.config.kv_transfer import KVTransferConfig

        field = KVTransferConfig.__dataclass_fields__.get("kv_load_failure_policy")
        if field is None or "recompute" not in str(field.type) or "fail" not in str(field.type):
            problems.append("KVTransferConfig.kv_load_failure_policy: missing or without recompute|fail")
    except (ImportError, AttributeError) as e:
        problems.append(f"kv_load_failure_policy: {e}")
    unchecked = sorted({f"{e.owner}.{e.name}" for e in internals if version not in e.checked})
    return {"vllm": version, "vllm_path": vllm.__file__, "internals": len(internals), "problems": problems,
            "ok": not problems, "not_yet_checked_for_this_version": unchecked}


if __name__ == "__main__":
    result = check()
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)
