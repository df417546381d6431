"""API keys (`auth.api_key_env` in the topology): the one place that reads a key and builds its header.

The topology and the plan carry only the NAME of an environment variable; its value is read from pdctl's own
environment when a process is spawned (`spawn_env`) and when pdctl calls its servers (`api_key`, `headers`). The
key never goes into argv: argv is in the plan (`pdctl plan`, state.json) and in /proc/*/cmdline, readable by every
user of the host. So vLLM gets it through VLLM_API_KEY (vLLM 0.32 adds its auth middleware for `--api-key` or that
variable alike) and the proxy through `--api-key-env NAME` plus NAME in its environment.

Imports nothing of pdctl's: the plan, the launch engines, the gates and the proxy all use it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

# vLLM's server requires `Authorization: Bearer <key>` on /v1/* when this is set (envs.VLLM_API_KEY).
VLLM_KEY_ENV = "VLLM_API_KEY"
PROXY_FLAG = "--api-key-env"  # the proxy's flag: the name of the variable holding its key
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
# A Bearer token the proxy can pass upstream as a header (latin-1) and vLLM splits on the first space: printable
# ASCII, no spaces.
_TOKEN = re.compile(r"[\x21-\x7e]{1,4096}")


class MissingKey(ValueError):
    """The key a topology names is not in the environment (or is no usable token); the message names the field
    and the variable, never a value."""


def is_token(value: str) -> bool:
    """Whether a key can be a Bearer token in a header: printable ASCII, no spaces, at most 4096 characters."""
    return bool(_TOKEN.fullmatch(value))


def key_env(topology: Any) -> str | None:
    """The variable a topology (or None) reads its key from; None without auth."""
    auth = getattr(topology, "auth", None)
    return auth.api_key_env if auth is not None else None


def read(name: str, environ: Mapping[str, str] = os.environ, what: str = "auth.api_key_env") -> str:
    """The key in variable `name`; MissingKey when it is unset, empty or not a Bearer token."""
    value = environ.get(name, "")
    if not value:
        raise MissingKey(f"{what}: {name} is not set (or empty) in pdctl's environment; export {name}=<the API key> "
                         f"before pdctl starts or calls the servers")
    if not is_token(value):
        raise MissingKey(f"{what}: the value of {name} is not a usable API key: use printable ASCII without spaces "
                         "(at most 4096 characters)")
    return value


def api_key(topology: Any, environ: Mapping[str, str] = os.environ) -> str | None:
    """The key pdctl sends to a topology's servers and proxy; None when the topology has no auth."""
    name = key_env(topology)
    return read(name, environ) if name else None


def headers(key: str | None) -> dict[str, str]:
    """The header that carries a key (nothing without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def open_route_headers(topology: Any, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The key's header for calls to routes that work without one (/health, /metrics, the proxy's /ready): sent
    when this environment has the key, nothing when it has not (`pdctl status` from a shell without it)."""
    try:
        return headers(api_key(topology, environ))
    except MissingKey:
        return {}


def spawn_env(spec: Any, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A process's secret environment, resolved at spawn: its `secret_env` maps each variable it gets to the name
    of the variable in pdctl's environment the value is read from. Never stored: only the spawn sees it."""
    return {target: read(source, environ) for target, source in getattr(spec, "secret_env", {}).items()}


def problems(processes: list, environ: Mapping[str, str] = os.environ) -> list[str]:
    """What would keep a plan's processes from getting their keys (for pre-flight: nothing starts then)."""
    out: list[str] = []
    for source in dict.fromkeys(src for p in processes for src in getattr(p, "secret_env", {}).values()):
        try:
            read(source, environ)
        except MissingKey as e:
            out.append(str(e))
    return out
