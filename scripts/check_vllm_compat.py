#!/usr/bin/env python
"""Does pdctl's connector fit the vLLM on the Python path? Imports it, then checks that every vLLM method it
overrides or calls still exists on vLLM's classes with the parameters pdctl passes.

Against another vLLM without installing it (e.g. 0.33 for CUDA on a CPU machine: its Python sources suffice):

    pip download vllm==0.33.0 --no-deps -d /tmp/v033
    unzip -q /tmp/v033/vllm-0.33.0-*.whl 'vllm/*' -x 'vllm/*.so' -d /tmp/v033/site
    PYTHONPATH=/tmp/v033/site .venv/bin/python scripts/check_vllm_compat.py
"""

from __future__ import annotations

import inspect
import json
import sys

# (class path, method, parameters pdctl relies on)
REQUIRED = [
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker.NixlPullConnectorWorker", "add_remote_agent",
     ["nixl_agent_meta", "remote_tp_rank", "remote_tp_size"]),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker.NixlPullConnectorWorker", "register_kv_caches",
     ["kv_caches"]),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker.NixlPullConnectorWorker", "_read_blocks_for_req",
     ["req_id", "meta"]),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker.NixlPullConnectorWorker",
     "_map_block_ids_for_block_size_ratio", ["local_block_ids", "remote_block_ids", "block_size_ratio"]),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker.NixlPullConnectorWorker",
     "post_process_device_kv_on_receive", ["block_size_ratio", "block_ids_list"]),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker.NixlPullConnectorWorker", "get_transfer_results",
     []),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler.NixlPullConnectorScheduler", "__init__",
     ["vllm_config", "engine_id", "kv_cache_config"]),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector.NixlBaseConnector", "__init__",
     ["vllm_config", "role", "kv_cache_config"]),
    ("vllm.v1.attention.backends.cpu_attn", "_get_attn_isa", ["dtype", "block_size", "head_size"]),
    # Its readers' spin after a message is what pdctl's worker_spin_s sets.
    ("vllm.distributed.device_communicators.shm_broadcast.SpinCondition", "__init__", ["is_reader", "busy_loop_s"]),
    # ...and its wait, which pdctl replaces on each reader (a bounded poll, see _bounded_wait).
    ("vllm.distributed.device_communicators.shm_broadcast.SpinCondition", "wait", ["timeout_ms"]),
]
# Attributes pdctl's bounded wait reads off a reader, by the source that sets them.
SPIN_SOURCE = [("__init__", "self.poller"), ("__init__", "self.local_notify_socket"),
               ("record_read", "self.last_read"), ("wait", "self.busy_loop_s")]
REQUIRED_ATTRS = [
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", "NixlWrapper"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata", "NixlHandshakePayload"),
    ("vllm.distributed.utils", "sched_yield"),
]
METADATA_FIELDS = ["attn_backend_name", "block_size", "block_lens", "block_strides", "num_blocks",
                   "kv_cache_layout", "region_num_blocks"]


def _resolve(path: str):
    import importlib

    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    raise ImportError(path)


def check() -> dict:
    import vllm

    problems: list[str] = []
    try:
        import pdctl.connector.nixl  # noqa: F401
    except Exception as e:  # the first thing a user would hit
        problems.append(f"import pdctl.connector.nixl: {type(e).__name__}: {e}")
    for owner, name, params in REQUIRED:
        try:
            fn = getattr(_resolve(owner), name) if not owner.endswith("cpu_attn") else _resolve(f"{owner}.{name}")
        except (ImportError, AttributeError) as e:
            problems.append(f"{owner}.{name}: missing ({e})")
            continue
        have = list(inspect.signature(fn).parameters)
        missing = [p for p in params if p not in have]
        if missing:
            problems.append(f"{owner}.{name}: no parameter(s) {missing} (has {have})")
    for owner, name in REQUIRED_ATTRS:
        try:
            getattr(_resolve(owner), name)
        except (ImportError, AttributeError) as e:
            problems.append(f"{owner}.{name}: missing ({e})")
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

        for method, attr in SPIN_SOURCE:
            if attr not in inspect.getsource(getattr(SpinCondition, method)):
                problems.append(f"SpinCondition.{method}: no longer uses {attr}")
    except (ImportError, AttributeError) as e:
        problems.append(f"SpinCondition: {e}")
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

        fields = set(NixlAgentMetadata.__dataclass_fields__)
        problems += [f"NixlAgentMetadata.{f}: missing" for f in METADATA_FIELDS if f not in fields]
    except ImportError as e:
        problems.append(f"NixlAgentMetadata: {e}")
    try:
        # The plan passes kv_load_failure_policy to every decode; the connector reads it to say what its
        # failed loads become, and relies on _handle_failed_transfer to report them as failed loads.
        from vllm.config.kv_transfer import KVTransferConfig

        field = KVTransferConfig.__dataclass_fields__.get("kv_load_failure_policy")
        if field is None or "recompute" not in str(field.type) or "fail" not in str(field.type):
            problems.append("KVTransferConfig.kv_load_failure_policy: missing or without recompute|fail")
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker as _W

        if "failed_req_ids" not in inspect.signature(_W._handle_failed_transfer).parameters:
            problems.append("NixlBaseConnectorWorker._handle_failed_transfer: no parameter failed_req_ids")
    except (ImportError, AttributeError) as e:
        problems.append(f"kv_load_failure_policy: {e}")
    return {"vllm": getattr(vllm, "__version__", "?"), "vllm_path": vllm.__file__, "problems": problems,
            "ok": not problems}


if __name__ == "__main__":
    result = check()
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["ok"] else 1)
