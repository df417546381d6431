"""pdctl's own CLI (`python -m tests.e2e.hooked_pdctl up ...`), except that the vLLM servers of each pool whose
env sets PDCTL_TEST_* variables (conftest.hooks_env) load tests/e2e/connector_hooks.py as their connector, through
vLLM's `kv_connector_module_path`; that module wraps pdctl's connector for the e2e drills. Test code only: pdctl
itself has no switch that loads a test module into its servers. State written this way keeps the hooked argv, so
the supervisor's restarts and `pdctl down/status/check --state-dir` (the real CLI) see the same servers."""

from __future__ import annotations

import importlib

HOOKS_MODULE = "tests.e2e.connector_hooks"
HOOK_PREFIX = "PDCTL_TEST_"


def install() -> None:
    """Wrap the plan's kv_transfer_config in this process: a pool whose env sets PDCTL_TEST_* variables gets the
    hooks module as its connector module."""
    plan_mod = importlib.import_module("pdctl.plan")  # the module (`from pdctl import plan` is the API's function)
    planned = plan_mod.kv_transfer_config

    def kv_transfer_config(t, role, pool) -> dict:
        cfg = planned(t, role, pool)
        if any(k.startswith(HOOK_PREFIX) for k in pool.env):
            assert cfg.get("kv_connector_module_path") == plan_mod.CONNECTOR_MODULE, "hooks wrap pdctl's connector"
            cfg["kv_connector_module_path"] = HOOKS_MODULE
        return cfg

    plan_mod.kv_transfer_config = kv_transfer_config


if __name__ == "__main__":  # only here: importing HOOK_PREFIX (conftest) leaves the test process's pdctl as it is
    install()
    from pdctl.cli import main

    main()
