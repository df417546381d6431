"""pytest plugin: a P/D parity and accuracy gate in another project's CI, in five lines.

    import pytest
    from pdctl.pytest_plugin import assert_accuracy, assert_parity

    @pytest.mark.parametrize("pdctl_deployment", ["configs/cpu-demo.yaml"], indirect=True)
    def test_pd(pdctl_deployment):
        assert_parity(pdctl_deployment)
        assert_accuracy(pdctl_deployment, limit=10, data_dir="../shared/data/gsm8k")

`pdctl_deployment` (session-scoped) brings the topology up once, in-process, beside an aggregated reference server
(the gates compare with it), with the gates' settings (a request whose KV did not travel fails instead of passing as
P/D), and takes everything down after the last test that uses it. Parametrize it (indirect) with a topology path,
(path, overrides) or {"topology": path, "overrides": {...}, "timeout_s": 300} (the reference listens on the
topology's reference.port: {"reference.port": N} among the overrides, or a "reference_port": N key); or give
`--pdctl-topology PATH` (and `--pdctl-set dotted.path=value`, repeatable) on the command line.

pytest loads this module in every run of the environment (entry point `pytest11`), so it imports only pytest, the
standard library and pdctl.launch.waits (which imports nothing) here; the rest of pdctl, and through it vLLM's
tooling, only when the fixture is used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdctl.launch.waits import READY_TIMEOUT_S


def pytest_addoption(parser) -> None:
    group = parser.getgroup("pdctl", "pdctl P/D deployments (the pdctl_deployment fixture)")
    group.addoption("--pdctl-topology", default=None, help="topology YAML for pdctl_deployment (unless parametrized)")
    group.addoption("--pdctl-set", action="append", default=[], metavar="PATH=VALUE",
                    help="override a topology field for pdctl_deployment (repeatable), e.g. decode.block_size=128")
    group.addoption("--pdctl-timeout", type=float, default=READY_TIMEOUT_S, help="seconds to wait for readiness")


def _target(param: Any, config) -> dict:
    if param is None:
        path = config.getoption("--pdctl-topology")
        if not path:
            raise pytest.UsageError("pdctl_deployment needs a topology: parametrize it (indirect=True) or give "
                                    "--pdctl-topology PATH")
        return {"topology": path, "overrides": list(config.getoption("--pdctl-set"))}
    if isinstance(param, (str, Path)):
        return {"topology": param}
    if isinstance(param, tuple) and len(param) == 2:
        return {"topology": param[0], "overrides": param[1]}
    if isinstance(param, dict) and "topology" in param:
        return dict(param)
    raise pytest.UsageError(f"pdctl_deployment: parameter {param!r}: give a topology path, (path, overrides) or "
                            "{'topology': path, ...}")


@pytest.fixture(scope="session")
def pdctl_deployment(request, tmp_path_factory):
    """A topology up for the session, beside an aggregated reference; a pdctl.Deployment."""
    import pdctl

    spec = _target(getattr(request, "param", None), request.config)
    t = pdctl.load(spec["topology"], spec.get("overrides"), gated=True)
    state_dir = spec.get("state_dir") or tmp_path_factory.mktemp(f"pdctl-{t.name}")
    timeout = spec.get("timeout_s", request.config.getoption("--pdctl-timeout"))
    port = spec.get("reference_port", t.reference.port)
    with pdctl.up(t, state_dir=state_dir, reference_port=port, timeout_s=timeout) as d:
        yield d


def assert_parity(deployment, **options):
    """P/D answers equal the reference's token for token, and the prompts' KV travelled; the report otherwise
    raises AssertionError naming each failed prompt. options: pdctl.CheckOptions fields (max_tokens, seed, ...)."""
    import pdctl

    report = pdctl.check(deployment, options=pdctl.CheckOptions(**options))
    if not report.passed:
        raise AssertionError("P/D parity failed:\n  " + "\n  ".join(_parity_problems(report)))
    return report


def _parity_problems(report) -> list[str]:
    out = []
    for pair in getattr(report, "all", lambda: [report])():
        rep = getattr(pair, "report", pair)
        name = f"{pair.prefill_pool}/{pair.decode_pool} " if hasattr(pair, "prefill_pool") else ""
        out += [f"{name}{r.label}: {r.failure}" for r in rep.results if not r.passed]
        out += [f"{name}{p}" for p in getattr(pair, "problems", [])]
        if rep.proof is not None and not rep.proof.ok:
            out.append(f"{name}{rep.proof.message}")
    return out or [f"pass rate {100 * report.pass_rate:.1f}%"]


def assert_accuracy(deployment, *, limit: int | None = None, data_dir: str | Path | None = None,
                    expected: str | Path | None = None, allow_ungated: bool = False, **options):
    """lm-eval's gsm8k through the deployment's proxy passes the expected-accuracy table's gate for the model
    (`expected`: a file; default pdctl's own; relative gates against the deployment's reference). A model the table
    does not know fails unless allow_ungated. options: pdctl.EvalOptions fields (num_fewshot, min_agreement,
    tolerance, results, ...)."""
    import pdctl

    if expected is not None and not Path(expected).is_file():
        raise pytest.UsageError(f"assert_accuracy: expected accuracy table {expected} not found (relative to "
                                f"{Path.cwd()}); give expected=PATH, or leave it out for pdctl's own")
    r = pdctl.evaluate(deployment, options=pdctl.EvalOptions(
        limit=limit, data_dir=Path(data_dir) if data_dir else None,
        expected=Path(expected) if expected is not None else None, allow_ungated=allow_ungated, **options))
    if r.status == "FAIL" or (r.status == "UNGATED" and not allow_ungated):
        lines = list(r.summary.get("gates", [])) + [f"{v['metric']}: {v['status']} {v.get('message') or ''}".rstrip()
                                                     for v in r.summary.get("verdicts", [])]
        raise AssertionError(f"accuracy gate {r.status} for {r.model} (results {r.out_dir}):\n  " + "\n  ".join(lines))
    return r
