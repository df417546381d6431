"""A running Prometheus' HTTP API, as the monitoring tests read it (unit: over fake targets; e2e: over a topology)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request


def api(url: str, path: str, **params: str) -> dict | list:
    """GET url/api/v1/<path>: its `data`, or AssertionError with Prometheus' own error."""
    full = f"{url.rstrip('/')}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    try:
        with urllib.request.urlopen(full, timeout=10) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:
        body = json.load(e)
    assert body.get("status") == "success", f"{full}: {body}"
    return body["data"]


def query(url: str, expr: str) -> list[dict]:
    """The instant vector (or scalar as one sample) `expr` evaluates to now."""
    data = api(url, "query", query=expr)
    if data["resultType"] in ("scalar", "string"):
        return [{"metric": {}, "value": data["result"]}]
    return data["result"]


def targets(url: str) -> list[dict]:
    return api(url, "targets", state="active")["activeTargets"]


def rules(url: str) -> list[dict]:
    """Every recording and alerting rule Prometheus loaded, with its health and last error."""
    return [r for g in api(url, "rules")["groups"] for r in g["rules"]]


def metric_names(url: str) -> set[str]:
    return set(api(url, "label/__name__/values"))


def empty(url: str, exprs: list[str]) -> list[str]:
    """The expressions that evaluate to no series."""
    return [e for e in exprs if not query(url, e)]


def wait_until_all_answer(url: str, exprs: list[str], timeout_s: float) -> list[str]:
    """Poll until every expression has a series (rules need two scrapes and an evaluation); the ones still empty."""
    deadline = time.monotonic() + timeout_s
    missing = list(exprs)
    while missing and time.monotonic() < deadline:
        missing = empty(url, missing)
        if missing:
            time.sleep(0.5)
    return missing
