"""What every part of pdctl's connector shares: its logger, its settings in vLLM's config, the timing lines."""

from __future__ import annotations

import time

from vllm.logger import init_logger

from pdctl import protocol

log = init_logger("vllm.pdctl.connector")  # under "vllm" so it lands in the server log


def settings(vllm_config) -> protocol.ConnectorSettings:
    """pdctl's settings in the connector's extra config, as its plan wrote them; a server started with settings
    this connector does not read stops here, naming the key (pdctl.protocol.SettingsError)."""
    return protocol.ConnectorSettings.from_dict(
        vllm_config.kv_transfer_config.get_from_extra_config(protocol.CONNECTOR_SETTINGS_KEY, None))


def trace(stage: str, req_id: str, at: float | None = None) -> None:
    """One timing line (wall clock `at`, default now: the proxy and every engine process on a host share it),
    read by pdctl.bench.breakdown. Only when the connector's `trace` setting is on."""
    log.info("%s", protocol.trace_line(stage, req_id, time.time() if at is None else at))
