"""The budget of one `make test`, printed at its end: the ten slowest test modules (setup, call and teardown of
their tests), the vLLM servers the e2e tests started, each run's wall clock and the total, from the JUnit XML
files pytest wrote.

Usage: python scripts/test_summary.py DIR   (DIR holds unit.xml and e2e.xml, and e2e-servers.json from the e2e run)
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def module_of(classname: str) -> str:
    """tests.e2e.test_fleet or tests.e2e.test_fleet.TestX -> tests.e2e.test_fleet."""
    parts = classname.split(".")
    return ".".join(p for p in parts if not p[:1].isupper()) or classname


def read(xml_file: Path) -> tuple[float, dict[str, float], dict[str, int]]:
    """A run's wall clock, seconds per test module, and its tests by outcome."""
    root = ET.parse(xml_file).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    wall = sum(float(s.get("time") or 0.0) for s in suites)
    times: dict[str, float] = defaultdict(float)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for case in root.iter("testcase"):
        times[module_of(case.get("classname", "?"))] += float(case.get("time") or 0.0)
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
        counts[outcome] += 1
    return wall, dict(times), counts


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    d = Path(argv[0])
    runs = {name: read(d / f"{name}.xml") for name in ("unit", "e2e") if (d / f"{name}.xml").is_file()}
    if not runs:
        print(f"{d}: no JUnit XML file (unit.xml, e2e.xml)", file=sys.stderr)
        return 2
    times: dict[str, float] = defaultdict(float)
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for _, per_module, counts in runs.values():
        for m, t in per_module.items():
            times[m] += t
        for k, v in counts.items():
            total[k] += v
    print("\nslowest test modules (setup + call + teardown, s):")
    for module, secs in sorted(times.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {secs:8.1f}  {module}")
    servers = d / "e2e-servers.json"
    if servers.is_file():
        doc = json.loads(servers.read_text())
        per_module: dict[str, int] = defaultdict(int)
        for nodeid, n in doc.get("by_test", {}).items():
            per_module[nodeid.split("::", 1)[0]] += n
        print(f"vLLM servers started by the e2e tests: {doc['vllm_servers_started']}"
              + "".join(f"\n  {n:8d}  {m}" for m, n in sorted(per_module.items(), key=lambda kv: -kv[1])))
    walls = {name: run[0] for name, run in runs.items()}
    print("pytest wall clock: " + ", ".join(f"{n} {s / 60:.1f} min" for n, s in walls.items())
          + f", together {sum(walls.values()) / 60:.1f} min")
    print(f"total: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
