"""docs/reference/ is generated from the code (scripts/gen_docs.py): stale references fail here."""

import shutil
import subprocess
import sys

from tests.conftest import REPO

GEN = [sys.executable, str(REPO / "scripts" / "gen_docs.py")]


def test_the_references_match_the_schema_and_the_cli(tmp_path):
    r = subprocess.run([*GEN, "--check"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    # the negative control: a reference that says something else is stale
    shutil.copytree(REPO / "docs" / "reference", tmp_path / "ref")
    cli = tmp_path / "ref" / "cli.md"
    cli.write_text(cli.read_text().replace("phases not to run", "nothing to skip"))
    r = subprocess.run([*GEN, "--check", "--out", str(tmp_path / "ref")], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 1 and "stale:" in r.stderr and "cli.md" in r.stderr and "topology.md" not in r.stderr


def test_every_topology_field_and_command_is_in_the_references():
    topo = (REPO / "docs" / "reference" / "topology.md").read_text()
    for field in ("`connector.kv_read_timeout_s`", "`prefill[].net_devices`", "`proxy.on_prefill_down`"):
        assert field in topo
    cli = (REPO / "docs" / "reference" / "cli.md").read_text()
    for cmd in ("## pdctl up", "## pdctl sweep", "## pdctl model tiny", "## pdctl render k8s"):
        assert cmd in cli
    assert "`--goodput`" in cli
