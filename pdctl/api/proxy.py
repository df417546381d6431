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


def proxy_options() -> dict[str, tuple[str, str, str | None]]:
    """`pdctl proxy`'s options: per ProxyConfig field, its flag, its description and its default as --help shows
    it (None: no default to show), from the one model that holds them."""
    from pdctl.proxy.config import FLAGS, ProxyConfig

    out = {}
    for name, f in ProxyConfig.model_fields.items():
        default = None if f.is_required() or f.default_factory is not None else f.default
        shown = {True: "on", False: "off"}[default] if isinstance(default, bool) else default
        if not f.exclude:
            flag = FLAGS.get(name, "--" + name.replace("_", "-"))
            flag = f"{flag}/--no-{flag[2:]}" if isinstance(default, bool) else flag
            out[name] = (flag, f.description or "", None if shown is None else str(shown))
    return out


def serve_proxy(prefill: list[str] | None = None, decode: list[str] | None = None, *, spec: str | None = None,
                **settings) -> None:
    """Run the P/D proxy in this process until interrupted; every routing rule is checked before the port opens.

    Its configuration is one pdctl.proxy.config.ProxyConfig: `spec` (the JSON `pdctl up` writes: the whole of
    it), or the upstreams and `settings` (ProxyConfig's fields; None: its default), never both. api_key_env names
    the environment variable holding the key clients must send (never the key itself: argv is visible)."""
    from pydantic import ValidationError

    from pdctl.proxy.config import FLAGS, ProxyConfig, problem
    from pdctl.proxy.server import Proxy, serve

    given = {k: v for k, v in settings.items() if v is not None}
    try:
        if spec is not None:
            extra = [*(["--prefill"] if prefill else []), *(["--decode"] if decode else []),
                     *(FLAGS.get(k, "--" + k.replace("_", "-")) for k in given)]
            if extra:
                raise UserError(f"--spec holds the whole configuration: drop {', '.join(extra)}")
            cfg = ProxyConfig.model_validate_json(spec)
        else:
            cfg = ProxyConfig(prefill=prefill or [], decode=decode or [], **given)
    except ValidationError as e:
        raise UserError(f"proxy: {problem(e, by_flags=spec is None)}") from None
    if cfg.api_key_env:
        try:
            key = auth.read(cfg.api_key_env, what=f"{auth.PROXY_FLAG} {cfg.api_key_env}")
        except auth.MissingKey as e:
            raise UserError(str(e)) from None
        cfg = cfg.model_copy(update={"api_key": key})
    try:
        Proxy(cfg)
    except ValueError as e:
        raise UserError(f"proxy: {e}") from None
    serve(cfg)
