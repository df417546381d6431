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
import sys
import types
from typing import TYPE_CHECKING

__all__ = [
    "load", "plan", "up", "attach", "down", "check", "check_topology", "check_deployment", "check_urls", "evaluate",
    "bench", "sweep", "render_k8s", "tiny_model", "warnings", "gate_notes", "serve_proxy",
    "Deployment", "DownReport", "StatusReport", "CheckOptions", "EvalOptions", "EvalResult", "BenchOptions",
    "BenchResult", "SweepResult", "GoodputSweepResult", "UserError", "TopologyError", "LaunchFailed", "Topology",
    "Plan", "ProcessSpec",
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
        GoodputSweepResult,
        StatusReport,
        SweepResult,
        UserError,
        attach,
        bench,
        check,
        check_deployment,
        check_topology,
        check_urls,
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


class _Both:
    """`pdctl.plan` / `pdctl.bench`: the API function when called, the submodule (pdctl/plan.py, pdctl/bench/) for
    everything else, so both `pdctl.plan(t)` and `import pdctl.bench.sweep as m` work."""

    def __init__(self, name: str, module):
        self._name, self._module = name, module
        self.__name__ = module.__name__  # what `import pdctl.bench.x as y` resolves submodules from

    def __call__(self, *args, **kwargs):
        return getattr(importlib.import_module("pdctl.api"), self._name)(*args, **kwargs)

    def __getattr__(self, attr: str):
        return getattr(self._module, attr)

    @property
    def __doc__(self):  # help(pdctl.plan) shows the function's
        return getattr(importlib.import_module("pdctl.api"), self._name).__doc__

    def __repr__(self) -> str:
        return f"<pdctl.{self._name}: the API function pdctl.api.{self._name}, and the module {self._module.__name__}>"


class _Package(types.ModuleType):
    """Importing a submodule sets it as an attribute of its package, which would shadow the API functions named
    like pdctl/plan.py and pdctl/bench/. These two names are properties of the package's type (they win over its
    attributes) and answer with both."""

    def _both(self, name: str) -> _Both:
        return _Both(name, importlib.import_module(f"pdctl.{name}"))

    plan = property(lambda self: self._both("plan"), lambda self, _module: None)
    bench = property(lambda self: self._both("bench"), lambda self, _module: None)


sys.modules[__name__].__class__ = _Package
