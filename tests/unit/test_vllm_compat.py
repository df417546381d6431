"""scripts/check_vllm_compat.py: the connector fits the installed vLLM (0.32); the check fails on a missing hook.
(Against vLLM 0.33's sources it passed too; the command is in the script's docstring.)"""

import importlib.util

from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("check_vllm_compat", REPO / "scripts" / "check_vllm_compat.py")
compat = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compat)


def test_connector_fits_the_installed_vllm():
    result = compat.check()
    assert result["vllm"].startswith("0.32") and result["ok"], result["problems"]


def test_a_missing_hook_is_reported(monkeypatch):
    owner = compat.REQUIRED[0][0]
    monkeypatch.setattr(compat, "REQUIRED", [*compat.REQUIRED, (owner, "_gone_in_a_future_vllm", []),
                                             (owner, "add_remote_agent", ["renamed_parameter"])])
    result = compat.check()
    assert not result["ok"]
    assert any("_gone_in_a_future_vllm: missing" in p for p in result["problems"])
    assert any("no parameter(s) ['renamed_parameter']" in p for p in result["problems"])
