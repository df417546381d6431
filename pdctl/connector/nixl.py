"""pdctl's NIXL connector, loaded by vLLM from `kv_connector_module_path: pdctl.connector.nixl`.

The class keeps the name NixlConnector because several vLLM config checks test that name.
Importing this module must have no side effects: vLLM imports it in the API server, the engine core and every
worker.

Status: this is vLLM's own NIXL path, correct for equal block sizes. The heterogeneous block-size and layout
conversions (issue 5) are not wired in yet: with unequal block sizes it behaves like the stock connector.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector as _StockNixlConnector

__all__ = ["NixlConnector"]


class NixlConnector(_StockNixlConnector):
    pass
