"""Every default is stated once: the CLI's come from the models and constants that define them, `pdctl proxy` has
an option for every field of the proxy's model, and no help text states a default of its own."""

import re

import pytest
import typer.main

from pdctl import api
from pdctl.cli.common import app
from pdctl.proxy.config import ProxyConfig

# A default written into a help text: "[8000]", "[on]", "default: 300".
STATED = re.compile(r"\[[^\]]*\d[^\]]*\]|\[(on|off)\]|default:? *\d")


def options():
    """(command, click option) for every option of every command."""
    root = typer.main.get_command(app)

    def walk(group, prefix=""):
        for name, cmd in group.commands.items():
            if hasattr(cmd, "commands"):
                yield from walk(cmd, f"{prefix}{name} ")
            else:
                yield from ((prefix + name, p) for p in cmd.params)

    return list(walk(root))


def test_no_help_text_states_a_default_of_its_own():
    stated = [(c, p.name, p.help) for c, p in options() if p.help and STATED.search(p.help)]
    assert stated == []
    assert STATED.search("listen port [8000]") and STATED.search("one line per request [on]")  # negative control


def test_waits_and_bench_defaults_are_the_apis():
    by = {(c, p.name): p.default for c, p in options()}
    for command in ("up", "check", "eval", "bench", "sweep"):
        assert by[(command, "timeout")] == api.READY_TIMEOUT_S
    assert by[("down", "grace")] == api.STOP_GRACE_S
    for command in ("bench", "sweep"):
        assert by[(command, "limit")] == api.BenchOptions.limit
        assert by[(command, "concurrency")] == api.BenchOptions.concurrency
        assert by[(command, "repeat")] == api.BenchOptions.repeat


def test_pdctl_proxy_has_an_option_for_every_field_of_the_proxy_model(run_cli, monkeypatch):
    seen = {}
    monkeypatch.setattr(api, "serve_proxy", lambda prefill, decode, **kw: seen.update(kw, prefill=prefill,
                                                                                     decode=decode))
    given = {"--host": "0.0.0.0", "--port": "9", "--policy": "round_robin", "--weight": "decode/d=2",
             "--exclude-pair": "p/d", "--affinity-epsilon": "1", "--affinity-prefix-chars": "9",
             "--on-prefill-down": "reject", "--connect-timeout": "1", "--first-byte-timeout": "1",
             "--read-timeout": "1", "--breaker-failures": "1", "--breaker-open": "1", "--health-interval": "1",
             "--api-key-env": "K", "--first-token": "on", "--prefill": "http://p", "--decode": "http://d"}
    code, _, err = run_cli("proxy", *[x for kv in given.items() for x in kv], "--no-access-log")
    assert code == 0, err
    fields = {n for n, f in ProxyConfig.model_fields.items() if not f.exclude}
    assert fields - {k for k, v in seen.items() if v is not None} == set()
    # Each option's help and shown default are the model's.
    opts = {p.name: p for c, p in options() if c == "proxy"}
    assert opts["port"].show_default == "8000" and opts["access_log"].show_default == "on"
    assert opts["health_interval_s"].help.startswith(ProxyConfig.model_fields["health_interval_s"].description)


@pytest.mark.parametrize("field", ["port", "health_interval_s"])
def test_negative_control_a_field_without_an_option_is_seen(field, run_cli, monkeypatch):
    seen = {}
    monkeypatch.setattr(api, "serve_proxy", lambda prefill, decode, **kw: seen.update(kw))
    run_cli("proxy", "--decode", "http://d")
    missing = {n for n, f in ProxyConfig.model_fields.items() if not f.exclude} - {"prefill", "decode"} - (
        set(seen) - {field})
    assert missing == {field}
