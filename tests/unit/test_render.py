"""Listings at 80 columns (plan, status): nothing truncated, plain text off a terminal, -o wide|json|yaml, --watch."""

import io
import json
import re

import pytest
import yaml
from rich.console import Console

import pdctl
from pdctl import render
from pdctl.api import StatusReport
from pdctl.launch.run import InstanceStatus
from tests.conftest import CONFIGS

BOX = re.compile("[\u2500-\u257f]")  # box-drawing characters
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour and style


def console(width: int = 80, terminal: bool = False) -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=width, force_terminal=terminal, color_system="truecolor" if terminal else None,
                   legacy_windows=False), buf


def lines_with(text: str, *values: str) -> bool:
    """Every value whole on one line (a folded or truncated value is split across lines or cut)."""
    return all(any(v in line for line in text.splitlines()) for v in values)


@pytest.fixture(scope="module")
def fleet_plan(tmp_path_factory):
    return pdctl.plan(pdctl.load(CONFIGS / "cpu-fleet.yaml"), state_dir=tmp_path_factory.mktemp("s") / "a-long"
                      "-state-directory-name-to-push-the-title-past-eighty-columns")


def status_report(plan, phase: str = "backoff") -> StatusReport:
    rows = [InstanceStatus(name=s.name, role=s.role, index=s.index, pid=12345 + i, http_port=s.ports["http"],
                           side_channel_port=s.ports.get("side_channel"), block_size=s.block_size, tp=s.tp,
                           running=i != 1, healthy=i > 1, uptime_s=3600.0 + i, pool=s.pool, restarts=i,
                           phase=phase if i == 1 else "running", kv_usage=0.123 if i else None,
                           requests_running=2, requests_waiting=0, last_exit="signal 9 (SIGKILL)" if i == 1 else None)
            for i, s in enumerate(plan.processes)]
    return StatusReport(name=plan.name, state_dir=str(plan.state_dir), engine={"kind": "local"},
                        supervisor={"mode": "detached", "pid": 999}, instances=rows)


@pytest.mark.parametrize("terminal", [True, False])
def test_plan_at_80_columns_shows_every_instance_and_url_whole(fleet_plan, terminal):
    out, buf = console(terminal=terminal)
    render.plan(out, fleet_plan)
    text = buf.getvalue()
    assert lines_with(text, *(s.name for s in fleet_plan.processes), *(s.http_url for s in fleet_plan.processes))
    table = text.split("\n\n")[0]
    assert "\u2026" not in table and all(len(ANSI.sub("", x)) <= 80 for x in table.splitlines())


@pytest.mark.parametrize("terminal", [True, False])
def test_status_at_80_columns_shows_every_instance_and_address_whole(fleet_plan, terminal):
    out, buf = console(terminal=terminal)
    report = status_report(fleet_plan)
    render.status(out, report)
    text = ANSI.sub("", buf.getvalue())
    assert lines_with(text, *(r.name for r in report.instances), *(f"{r.host}:{r.http_port}" for r in report.instances))
    assert "\u2026" not in text and all(len(x) <= 80 for x in text.splitlines())
    assert "down (backoff)" in text.replace("\n", " ") or "down" in text  # the phase may wrap, never vanish
    assert "12.3%" in text and "supervisor: detached pid 999" in text and "last exit: signal 9" in text
    assert "12346" not in text  # pid is a wide column


def test_status_says_the_pairs_probed_and_each_decodes_kv_read_trouble(fleet_plan):
    from dataclasses import replace

    report = status_report(fleet_plan)
    out, buf = console()
    render.status(out, report)
    assert "probed" not in buf.getvalue() and "KV reads" not in buf.getvalue()  # nothing to say: nothing said
    assert "fingerprint" not in buf.getvalue()
    rows = [replace(r, kv_reads_timed_out=2.0, kv_reads_refused=0.0, kv_recomputed=2.0,
                    kv_reads_peer_gone=1.0, kv_fingerprint_mismatches=3.0) if r.role == "decode" and
            r.index == 0 and r.pool == "d64" else r for r in report.instances]
    report = replace(report, instances=rows, probes={"prefill-p32-0 -> decode-d64-0": 0.0021,
                                                     "prefill-p128-0 -> decode-d64-0": 0.0153})
    out, buf = console()
    render.status(out, report)
    text = " ".join(buf.getvalue().split())
    assert "pairs probed at start: 2, slowest first read 15.3 ms (prefill-p128-0 -> decode-d64-0)" in text
    assert ("decode-d64-0: KV reads timed out 2, given up (prefill gone) 1, refused (lease) 0, requests recomputed 2"
            in text)
    assert "decode-d64-0: received KV not the prefill's (fingerprint mismatches) 3" in text
    assert report.to_dict()["probes"]["prefill-p32-0 -> decode-d64-0"] == 0.0021


def test_wide_adds_the_other_columns_at_their_natural_width(fleet_plan):
    out, buf = console()
    render.status(out, status_report(fleet_plan), render.Output.wide)
    text = buf.getvalue()
    assert "12346" in text and "3601s" in text and "side ch." in text
    assert any(len(x) > 80 for x in text.splitlines())  # not folded into 80 columns: wide is for wide screens
    out, buf = console()
    render.plan(out, fleet_plan, render.Output.wide)
    assert lines_with(buf.getvalue(), *(s.readiness_url for s in fleet_plan.processes))


def test_plain_off_a_terminal_or_with_no_color(fleet_plan, monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    out, buf = console(terminal=True)
    render.status(out, status_report(fleet_plan))
    assert BOX.search(buf.getvalue()) and ANSI.search(buf.getvalue())  # control: a terminal gets rules and colour
    out, buf = console(terminal=False)
    render.status(out, status_report(fleet_plan))
    assert not BOX.search(buf.getvalue()) and not ANSI.search(buf.getvalue())
    monkeypatch.setenv("NO_COLOR", "1")
    out, buf = console(terminal=True)
    render.status(out, status_report(fleet_plan))
    assert not BOX.search(buf.getvalue()) and not ANSI.search(buf.getvalue())


def test_json_and_yaml_are_the_same_data(fleet_plan, capsys):
    report = status_report(fleet_plan)
    out, _ = console()
    render.status(out, report, render.Output.json)
    as_json = json.loads(capsys.readouterr().out)
    render.status(out, report, render.Output.yaml)
    assert yaml.safe_load(capsys.readouterr().out) == as_json == json.loads(json.dumps(report.to_dict()))
    render.plan(out, fleet_plan, render.Output.yaml, batch="#!/bin/bash")
    got = yaml.safe_load(capsys.readouterr().out)
    assert got["batch_script"] == "#!/bin/bash" and [p["name"] for p in got["processes"]] == [
        s.name for s in fleet_plan.processes]


def test_watch_redraws_until_ctrl_c(fleet_plan, monkeypatch):
    monkeypatch.setattr(render.time, "sleep", lambda s: None)
    calls = []

    def view():
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt  # what Ctrl-C raises in the redraw loop
        out_, _ = console()
        return render.status_view(out_, status_report(fleet_plan))

    out, buf = console(terminal=False)
    render.watch(out, view, 0.5)  # returns: Ctrl-C is how one leaves, not an error
    text = buf.getvalue()
    assert len(calls) == 4 and text.count("every 0.5 s") == 3 and text.count("supervisor: detached") == 3


def test_the_80_column_check_catches_a_truncating_table(fleet_plan):
    """Negative control: the boxed 13-column status table of before (rich's default ellipsis overflow) at 80
    columns loses names and addresses, and the check above says so."""
    from rich.table import Table

    out, buf = console()
    report = status_report(fleet_plan)
    old = Table(title=report.name)
    for col in ("instance", "where", "pid", "HTTP", "side ch.", "block", "TP", "health", "uptime", "restarts",
                "run", "wait", "KV"):
        old.add_column(col)
    for r in report.instances:
        old.add_row(r.name, r.where, str(r.pid), f"{r.host}:{r.http_port}", str(r.side_channel_port),
                    str(r.block_size), str(r.tp), "ok", "3600s", str(r.restarts), "2", "0", "12.3%")
    out.print(old)
    assert not lines_with(buf.getvalue(), *(r.name for r in report.instances),
                          *(f"{r.host}:{r.http_port}" for r in report.instances))


def test_off_a_terminal_tables_print_at_their_natural_width(monkeypatch):
    import io
    import sys

    from rich.table import Table

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False, raising=False)
    c = render.stdout_console()
    c.file = io.StringIO()
    t = Table()
    for col in ("metric", "value"):
        t.add_column(col, overflow="fold")
    t.add_row("gsm8k_local exact_match,strict-match " * 3, "0.4375")
    c.print(t)
    assert "gsm8k_local exact_match,strict-match gsm8k_local" in c.file.getvalue()  # one line, no word cut
    monkeypatch.setenv("COLUMNS", "80")  # a width asked for is kept
    assert render.stdout_console().width == 80


def test_the_parity_verdict_says_the_kv_fingerprints_it_saw():
    from pdctl.gates.parity import ParityReport, TransferProof

    def shown(**kw) -> str:
        out, buf = console(width=200)
        render.parity(out, ParityReport([], TransferProof(191, 1, 4096.0, 192, requests=1, **kw)))
        return " ".join(buf.getvalue().split())

    assert "fingerprint" not in shown()  # the check off: nothing said
    assert "NIXL bytes 4096; KV fingerprints checked 2, all equal" in shown(fingerprints_checked=2.0)
    assert "KV fingerprints checked 2, 1 NOT the prefill's KV" in shown(fingerprints_checked=2.0,
                                                                         fingerprint_mismatches=1.0)
