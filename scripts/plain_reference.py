"""A benchmark's plain-vLLM reference: the plan's aggregated reference copied as "reference-plain" without
pdctl's executor-queue calming, so one bring-up compares P/D with both (bench_reference.py, bench_pd_latency.py).
pdctl itself always calms the servers it starts; this copy exists only to measure what that is worth."""

from dataclasses import replace
from pathlib import Path

from pdctl.plan import Plan
from pdctl.protocol import QUEUE_SPIN_ENV


def with_plain_reference(plan: Plan, port: int) -> Plan:
    """The plan (which holds its aggregated reference) plus "reference-plain": the same server as plain vLLM,
    executor queues not calmed, on `port`."""
    ref = plan.get("reference")
    argv = list(ref.argv)
    argv[argv.index("--port") + 1] = str(port)
    old = ref.http_url
    plain = replace(ref, name="reference-plain", argv=argv, ports={**ref.ports, "http": port},
                    env={k: v for k, v in ref.env.items() if k != QUEUE_SPIN_ENV},
                    log_path=str(Path(ref.log_path).with_name("reference-plain.log")))
    plain = replace(plain, readiness_url=ref.readiness_url.replace(old, plain.http_url, 1))
    return plan.with_processes([*plan.processes, plain])
