"""The parity gate's report as JUnit XML (`pdctl check --junit FILE`): one case per prompt and one for the KV
transfer proof, per pool pair in a fleet."""

from __future__ import annotations

import json
from xml.sax.saxutils import escape


def junit_xml(report, name: str = "pdctl.check") -> str:
    """A ParityReport, or a fleet's report (one proof case per pool pair)."""
    cases = []
    if hasattr(report, "pairs"):
        return _junit_fleet(report, name)
    for r in report.results:
        body = "" if r.passed else (f'<failure message="{escape(r.failure, {chr(34): "&quot;"})}">'
                                    f"{escape(r.error or '')}\nP/D: {escape(str(r.pd))}\n"
                                    f"reference: {escape(str(r.reference))}</failure>")
        cases.append(f'  <testcase classname="{name}" name="{escape(r.label)}">{body}</testcase>')
    proof_ok = bool(report.proof and report.proof.ok)
    proof = escape(json.dumps(report.to_dict()["proof"]))
    why = escape(report.proof.message if report.proof else "no transfer proof", {'"': "&quot;"})
    failure = "" if proof_ok else f'<failure message="{why}">{proof}</failure>'
    cases.append(f'  <testcase classname="{name}" name="kv-transfer-proof">{failure}</testcase>')
    failures = sum(not r.passed for r in report.results) + (not proof_ok)
    return (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="{name}" tests="{len(cases)}" '
            f'failures="{failures}">\n' + "\n".join(cases) + "\n</testsuite>\n")


def _junit_fleet(report, name: str) -> str:
    cases = []
    for pair in report.all():
        pid = f"{pair.prefill_pool}/{pair.decode_pool}"
        for r in pair.report.results:
            body = "" if r.passed else (f'<failure message="{escape(r.failure, {chr(34): "&quot;"})}">'
                                        f"{escape(r.error or '')}</failure>")
            cases.append(f'  <testcase classname="{name}.{escape(pid)}" name="{escape(r.label)}">{body}</testcase>')
        ok = pair.report.proof is not None and pair.report.proof.ok and not pair.problems
        detail = escape(json.dumps(pair.to_dict()))
        proof = pair.report.proof
        why = escape(pair.problems[0] if proof and proof.ok and pair.problems else
                     proof.message if proof else "no transfer proof", {'"': "&quot;"})
        failure = "" if ok else f'<failure message="{why}">{detail}</failure>'
        cases.append(f'  <testcase classname="{name}.{escape(pid)}" name="kv-transfer-proof">{failure}</testcase>')
    failures = sum("<failure" in c for c in cases)
    return (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="{name}" tests="{len(cases)}" '
            f'failures="{failures}">\n' + "\n".join(cases) + "\n</testsuite>\n")
