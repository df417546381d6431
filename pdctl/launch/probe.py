"""Small network probes: /health, TCP ports, Prometheus /metrics. Stdlib only, always with timeouts."""

from __future__ import annotations

import http.client
import json
import re
import socket
import urllib.parse

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)\s*(\d+)?$")


def http_get(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """(status, body); status 0 when nothing answered. `headers`: e.g. the API key's (pdctl.auth.headers)."""
    return http_call("GET", url, None, timeout, headers)


def http_post_json(url: str, body: object, timeout: float = 2.0, headers: dict[str, str] | None = None
                   ) -> tuple[int, str]:
    """POST `body` as JSON: (status, body); status 0 when nothing answered."""
    return http_call("POST", url, json.dumps(body).encode(), timeout,
                     {"Content-Type": "application/json", **(headers or {})})


def http_call(method: str, url: str, data: bytes | None, timeout: float, headers: dict[str, str] | None
              ) -> tuple[int, str]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    try:
        conn.request(method, (u.path or "/") + (f"?{u.query}" if u.query else ""), body=data, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        return 0, ""
    finally:
        conn.close()


def healthy(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> bool:
    return http_get(url, timeout, headers)[0] == 200


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def port_free(host: str, port: int) -> bool:
    """True when nothing listens there and we could bind it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Servers (uvicorn, aiohttp) bind with SO_REUSEADDR, so TIME_WAIT leftovers do not block them.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return not port_open(host, port, timeout=0.2)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; also sums each metric name over its labels as 'name'."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        out[name + labels] = value
        if labels:
            out[name] = out.get(name, 0.0) + value
    return out


def metrics(base_url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> dict[str, float] | None:
    status, body = http_get(base_url.rstrip("/") + "/metrics", timeout, headers)
    return parse_metrics(body) if status == 200 else None
