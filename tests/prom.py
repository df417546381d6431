"""What the monitoring tests read: a running Prometheus' HTTP API (unit: over fake targets; e2e: over a topology),
the metric names a PromQL expression reads, and Grafana's dashboard as Prometheus would receive its queries."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from pdctl.monitoring import KNOWN_SERIES


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


# ----------------------------------------------------------------------------------------------------------------
# PromQL: the metric names an expression reads (enough for pdctl's rules and dashboards, not a full parser)

_FUNCTIONS_AND_KEYWORDS = frozenset("""
    sum min max avg group stddev stdvar count count_values bottomk topk quantile limitk limit_ratio
    by without on ignoring group_left group_right bool offset and or unless atan2 inf nan
    """.split())
_TOKEN = re.compile(r"""
    "(?:\\.|[^"\\])*" | '(?:\\.|[^'\\])*' | `[^`]*`    # strings
    | \$\{[^}]*\} | \$\w+ | \[\[[^\]]*\]\]          # Grafana variables
    | \[[^\]]*\]                                   # range and subquery selectors
    | [0-9][A-Za-z0-9_.]*                            # numbers and durations (0.99, 1e3, 5m)
    | [A-Za-z_:][A-Za-z0-9_:]*                       # names
    | \S""", re.VERBOSE)
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def series_names(expr: str) -> set[str]:
    """Metric names an expression reads: names outside {...} matchers, strings, [ranges] and Grafana variables;
    not a function (a name followed by '('), an aggregation or keyword, nor a label in the list after by,
    without, on, ignoring, group_left or group_right."""
    tokens = _TOKEN.findall(expr)
    out: set[str] = set()
    braces = 0
    in_list = False  # inside the (...) after by, without, on, ...
    list_open = -1  # index of that list's '(' (not a function call's)
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok == "{":
            braces += 1
        elif tok == "}":
            braces = max(0, braces - 1)
        elif braces:
            continue
        elif i == list_open:
            in_list = True
        elif in_list:
            in_list = tok != ")"
        elif tok in _GROUPING:
            list_open = i + 1 if nxt == "(" else -1
        elif _NAME.fullmatch(tok) and nxt != "(" and tok.lower() not in _FUNCTIONS_AND_KEYWORDS:
            out.add(tok)
    return out


# ----------------------------------------------------------------------------------------------------------------
# The Grafana dashboard (configs/grafana/pdctl-fleet.json)

GRAFANA_BUILTINS = ("__rate_interval", "__interval", "__range", "__range_s", "__interval_ms")


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' collapsed panels too."""
    out = []
    for p in dashboard.get("panels", []):
        if p.get("type") == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out


def load_dashboard(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("panels"), list):
        raise ValueError(f"{path}: not a Grafana dashboard (no panels)")
    return data


def dashboard_queries(path: str | Path) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel, as written (Grafana variables unexpanded)."""
    return [(p.get("title", "?"), t["expr"]) for p in dashboard_panels(load_dashboard(path))
            for t in p.get("targets", []) if t.get("expr")]


def expand(expr: str, dashboard: dict | None = None, rate_interval: str = "30s", all_value: str = ".*") -> str:
    """expr as Prometheus would receive it from Grafana with every template variable at All ($__rate_interval and
    friends: rate_interval), so a check can run a panel's query against Prometheus directly."""
    names = {v["name"]: v.get("allValue") or all_value for v in (dashboard or {}).get("templating", {}).get("list", [])
             if v.get("type") == "query"}
    builtin = dict.fromkeys(GRAFANA_BUILTINS, rate_interval) | {"__range_s": "300", "__interval_ms": "2000"}

    def value(name: str) -> str:
        return builtin.get(name) or names.get(name, all_value)

    expr = re.sub(r"\$\{(\w+)(?::\w+)?\}", lambda m: value(m.group(1)), expr)
    expr = re.sub(r"\[\[(\w+)\]\]", lambda m: value(m.group(1)), expr)
    return re.sub(r"\$(\w+)", lambda m: value(m.group(1)), expr)


def unknown_series(queries: list[tuple[str, str]], recorded: list[str] | set[str]) -> list[str]:
    """'panel: name' for every metric a query reads that neither a recording rule nor a known series provides."""
    known = KNOWN_SERIES | set(recorded)
    return [f"{title}: {name}" for title, expr in queries for name in sorted(series_names(expr) - known)]
