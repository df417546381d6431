"""The whole configuration of a running pdctl proxy, one model: the topology's proxy settings
(topology.ProxySettings, where every default and description lives) plus the instances to route to.

`pdctl up` writes it as one JSON argument (`pdctl proxy --spec JSON`, in the plan's argv, so it reaches Ray, Slurm and
Kubernetes as it is); `pdctl proxy`'s flags, for people running it by hand, parse into the same model. Pure.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field, ValidationError, model_validator

from pdctl.auth import ENV_NAME_PATTERN
from pdctl.topology import DEFAULT_POOL, ProxySettings, instance_name

SPEC_FLAG = "--spec"

# The flag of each field, for errors about a configuration given by flags.
FLAGS = {"connect_timeout_s": "--connect-timeout", "first_byte_timeout_s": "--first-byte-timeout",
         "read_timeout_s": "--read-timeout", "breaker_open_s": "--breaker-open", "exclude_pairs": "--exclude-pair",
         "weights": "--weight", "prefill": "--prefill", "decode": "--decode", "health_interval_s": "--health-interval"}


def _on_off(v: object) -> object:
    """YAML 1.1 reads a bare off / on as a boolean: take it as the word it was."""
    return {False: "off", True: "on"}.get(v, v) if isinstance(v, bool) else v


class ProxyConfig(ProxySettings):
    prefill: list[str] = Field(default_factory=list, description="[POOL=]URL per prefill instance; none: "
                               "aggregated serving, each request whole to one decode")
    decode: list[str] = Field(min_length=1, description="[POOL=]URL per decode instance (aggregated: per server)")
    weights: dict[str, float] = Field(default_factory=dict, description='"ROLE/POOL" -> share of traffic')
    # Not a topology setting: on for a whole deployment it measured no goodput gain at the SLO (it trades TPOT for
    # TTFT; docs/latency.md). A client asks for it per request with the header; `pdctl proxy --first-token` sets it.
    first_token: Annotated[Literal["off", "on", "auto"], BeforeValidator(_on_off)] = Field(
        "off", description="stream the prefill's token to the client as soon as the prefill answers, and the "
        "decode's stream after it without its first token (the same token: only for greedy streaming requests of "
        "one choice, without logprobs, echo, stop strings or tools; any other request is served as it is). "
        "'auto': only while the pair's decode has other requests in flight. Per request, the header "
        "x-pdctl-first-token: on|off|auto overrides it")
    api_key_env: str | None = Field(None, pattern=ENV_NAME_PATTERN, description="the environment variable "
                                    "holding the key clients must send (never the key: a spec is in argv)")
    access_log: bool = Field(True, description="one log line per request: id, status, ms, pair")
    health_interval_s: float = Field(2.0, gt=0, description="how often every instance's /health is probed")
    # The key itself, read from api_key_env's variable when the proxy starts; never serialised.
    api_key: str | None = Field(None, exclude=True, repr=False)

    @model_validator(mode="after")
    def _consistent(self) -> ProxyConfig:
        if not self.prefill and self.first_token != "off":
            raise ValueError("aggregated serving (no prefill instances) has no prefill token")
        return self

    def to_spec(self) -> str:
        """The JSON `pdctl proxy --spec` reads: every field that differs from its default."""
        return self.model_dump_json(exclude_defaults=True)


def spec_of(argv: list[str]) -> ProxyConfig:
    """The configuration in a pdctl proxy's command line (the plan's, `pdctl proxy --spec JSON`)."""
    return ProxyConfig.model_validate_json(argv[argv.index(SPEC_FLAG) + 1])


def with_spec(argv: list[str], cfg: ProxyConfig) -> list[str]:
    """The command line with its configuration replaced."""
    k = argv.index(SPEC_FLAG) + 1
    return [*argv[:k], cfg.to_spec(), *argv[k + 1:]]


def parse_upstream(text: str) -> tuple[str, str]:
    """'p32=http://h:8100' -> ('p32', 'http://h:8100'); a bare URL is in the default pool."""
    pool, sep, url = text.partition("=")
    if not sep or "://" in pool:
        return DEFAULT_POOL, text.rstrip("/")
    return pool, url.rstrip("/")


def upstream(pool: str, url: str) -> str:
    """parse_upstream's inverse: a single-pool role's URLs stay bare."""
    return url if pool == DEFAULT_POOL else f"{pool}={url}"


def moved_upstreams(cfg: ProxyConfig, urls: dict[str, str]) -> ProxyConfig:
    """The configuration with its upstreams' base URLs moved (old -> new): cluster engines learn an instance's
    address once it is placed."""
    def move(items: list[str]) -> list[str]:
        return [upstream(pool, urls.get(url, url)) for pool, url in map(parse_upstream, items)]

    return cfg.model_copy(update={"prefill": move(cfg.prefill), "decode": move(cfg.decode)})


def names(role: str, upstreams: list[str]) -> list[tuple[str, str, str]]:
    """(instance name as the plan names it, pool, url) per upstream: prefill-p32-0, index within its pool."""
    seen: dict[str, int] = {}
    out = []
    for text in upstreams:
        pool, url = parse_upstream(text)
        k = seen[pool] = seen.get(pool, -1) + 1
        out.append((instance_name(role, pool, k), pool, url))
    return out


def problem(e: ValidationError, by_flags: bool) -> str:
    """A validation error as one line per field, named by its flag when the configuration came from flags."""
    lines = []
    for err in e.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        name = FLAGS.get(field, "--" + field.replace("_", "-")) if by_flags else field
        lines.append(f"{name}: {err['msg']}" if name else err["msg"])
    return "; ".join(lines)
