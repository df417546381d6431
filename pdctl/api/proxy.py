"""The P/D proxy, run in this process (`pdctl proxy`)."""

from __future__ import annotations

from pdctl import auth
from pdctl.api.common import UserError


def proxy_weights(flags: list[str]) -> dict[str, float]:
    """`--weight ROLE/POOL=W` flags as ProxyConfig.weights."""
    weights: dict[str, float] = {}
    for w in flags:
        key, sep, val = w.partition("=")
        try:
            weights[key] = float(val)
        except ValueError:
            sep = ""
        if not sep or key.count("/") != 1:
            raise UserError(f"--weight {w}: expected ROLE/POOL=W, e.g. --weight decode/d64=2")
    return weights


def proxy_pairs(flags: list[str]) -> list[tuple[str, str]]:
    """`--exclude-pair PREFILL_POOL/DECODE_POOL` flags as ProxyConfig.exclude_pairs."""
    pairs = []
    for x in flags:
        p, sep, d = x.partition("/")
        if not sep or not p or not d:
            raise UserError(f"--exclude-pair {x}: expected PREFILL_POOL/DECODE_POOL, e.g. --exclude-pair p128/d32")
        pairs.append((p, d))
    return pairs


def serve_proxy(prefill: list[str], decode: list[str], *, host: str = "127.0.0.1", port: int = 8000,
                **settings) -> None:
    """Run the P/D proxy in this process until interrupted; every routing rule is checked before the port opens.
    settings: ProxyConfig's fields (policy, on_prefill_down, timeouts, weights, exclude_pairs, ...), and
    api_key_env: the name of the environment variable holding the key clients must send (never the key itself:
    a flag's value is in the process's command line)."""
    from pdctl.proxy import first_token
    from pdctl.proxy.server import Proxy, ProxyConfig, serve

    name = settings.pop("api_key_env", None)
    if name:
        try:
            settings["api_key"] = auth.read(name, what=f"{auth.PROXY_FLAG} {name}")
        except auth.MissingKey as e:
            raise UserError(str(e)) from None

    flags = {"connect_timeout_s": "--connect-timeout", "first_byte_timeout_s": "--first-byte-timeout",
             "read_timeout_s": "--read-timeout", "breaker_open_s": "--breaker-open",
             "breaker_failures": "--breaker-failures"}
    for key, flag in flags.items():
        value = settings.get(key)
        if value is not None and not value > 0:
            raise UserError(f"{flag} {value:g}: must be > 0")
    mode = settings.get("first_token", "off")
    if mode not in first_token.MODES:
        raise UserError(f"--first-token {mode}: expected one of {', '.join(first_token.MODES)}")
    cfg = ProxyConfig(prefill, decode, **settings)
    try:
        Proxy(cfg)
    except ValueError as e:
        raise UserError(f"proxy: {e}") from None
    serve(cfg, host, port)
