"""pdctl: vLLM prefill/decode disaggregation across heterogeneous hardware, from Python or the command line.

    import pdctl

    t = pdctl.load("configs/cpu-demo.yaml", {"decode.block_size": 128})
    with pdctl.up(t) as d:
        print(d.proxy_url, d.status().ready)
    assert pdctl.check(t).passed

The names below live in pdctl.api (and the types it returns); they are imported on first use, so `import pdctl`
stays cheap for the proxy, the pytest plugin and every command.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = [
    "load", "plan", "up", "attach", "down", "check", "evaluate", "bench", "sweep", "render_k8s", "tiny_model",
    "warnings", "gate_notes", "serve_proxy",
    "Deployment", "DownReport", "StatusReport", "CheckOptions", "EvalOptions", "EvalResult", "BenchOptions",
    "BenchResult", "SweepResult", "UserError", "TopologyError", "LaunchFailed", "Topology", "Plan", "ProcessSpec",
]

_WHERE = {"TopologyError": "pdctl.topology", "Topology": "pdctl.topology", "LaunchFailed": "pdctl.launch.errors",
          "Plan": "pdctl.plan", "ProcessSpec": "pdctl.plan"}

if TYPE_CHECKING:
    from pdctl.api import (  # noqa: F401
        BenchOptions,
        BenchResult,
        CheckOptions,
        Deployment,
        DownReport,
        EvalOptions,
        EvalResult,
        StatusReport,
        SweepResult,
        UserError,
        attach,
        bench,
        check,
        down,
        evaluate,
        gate_notes,
        load,
        plan,
        render_k8s,
        serve_proxy,
        sweep,
        tiny_model,
        up,
        warnings,
    )
    from pdctl.launch.errors import LaunchFailed  # noqa: F401
    from pdctl.plan import Plan, ProcessSpec  # noqa: F401
    from pdctl.topology import Topology, TopologyError  # noqa: F401


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'pdctl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE.get(name, "pdctl.api")), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
