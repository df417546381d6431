"""pdctl's Python API: everything the command line does, callable from a CI job or a notebook.

    import pdctl

    t = pdctl.load("configs/cpu-demo.yaml", {"decode.block_size": 128})
    with pdctl.up(t) as d:                      # in-process: everything stops when the block ends
        print(d.proxy_url, [i.name for i in d.instances])
    report = pdctl.check(t)                     # brings P/D up beside an aggregated reference, then down
    assert report.passed, report.to_dict()

Functions return typed results (`Plan`, `Deployment`, `ParityReport`/`FleetReport`, `EvalResult`, `BenchResult`,
`SweepResult`); bad input raises `UserError` or `TopologyError` (both carry a message for a person, never a
traceback's worth). Long waits report through two optional callbacks: `say(line)` for lines worth keeping
(what a gate runs with, warnings) and `progress(text)` for a status that replaces the last one.

By subject: topology (load, plan, render), deploy (up, attach, down, status), gates (check, evaluate), bench
(bench, sweep), proxy (serve_proxy). Imports here are light (pydantic, yaml): what needs vLLM, lm-eval or the launch
machinery is imported where used.
"""

from __future__ import annotations

from pdctl.api.benchmarks import (  # noqa: F401
    BenchResult,
    GoodputSweepResult,
    SweepResult,
    bench,
    dataset_option,
    load_rates,
    parse_rates,
    parse_skip,
    sweep,
)
from pdctl.api.common import (  # noqa: F401
    DASHBOARD,
    REMOVED_FLAGS,
    RENAMED_FLAGS,
    Say,
    UserError,
    refuse_renamed,
)
from pdctl.api.deploy import (  # noqa: F401
    Deployment,
    DownReport,
    StatusReport,
    attach,
    down,
    state_dir_of,
    up,
)
from pdctl.api.gates import (  # noqa: F401
    CheckOptions,
    EvalOptions,
    EvalResult,
    check,
    check_deployment,
    check_topology,
    check_urls,
    evaluate,
    expected_table,
    gsm8k_source,
)
from pdctl.api.proxy import (  # noqa: F401
    proxy_options,
    proxy_pairs,
    proxy_weights,
    serve_proxy,
)
from pdctl.api.topology import (  # noqa: F401
    as_overrides,
    default_state_dir,
    gate_notes,
    load,
    origin,
    plan,
    render_k8s,
    slurm_batch,
    tiny_model,
    warnings,
)
from pdctl.bench.options import GOODPUT_DEFAULTS, LOAD_DEFAULTS, BenchOptions  # noqa: F401
from pdctl.launch.errors import LaunchFailed  # noqa: F401
from pdctl.launch.waits import READY_TIMEOUT_S, STOP_GRACE_S  # noqa: F401
