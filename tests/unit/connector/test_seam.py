"""pdctl.connector.seam and scripts/check_vllm_compat.py: every vLLM/NIXL internal pdctl relies on is listed in the
seam and holds on the installed vLLM (0.32) and nixl; the check fails on each kind of drift (negative controls);
the connector names no internal outside the seam; the [cuda] extra admits only releases the seam was checked
against (`make check-vllm VLLM=X` checks a release's sources)."""

import functools
import importlib.util
import inspect
import re
import sys
import types
from types import SimpleNamespace

import pytest

from pdctl.connector import seam
from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("check_vllm_compat", REPO / "scripts" / "check_vllm_compat.py")
compat = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compat)


class _SourceOnce:
    """The script's `inspect`, reading each object's source once: inspect.getsource parses a class's whole module
    on every call, and the check asks for the same few vLLM classes hundreds of times. Sources do not change
    while the tests run, so the answers are the same."""

    getsource = staticmethod(functools.cache(inspect.getsource))

    def __getattr__(self, name):
        return getattr(inspect, name)


compat.inspect = _SourceOnce()


@pytest.fixture(scope="module", autouse=True)
def _connector_imported():
    """vLLM and the connector imported once, at setup: the import (~8 s) is not what a test here times."""
    import pdctl.connector.nixl  # noqa: F401


def cuda_admits(pyproject: str) -> list[str]:
    """The vLLM minor releases (X.Y.0) pyproject's [cuda] extra admits, up to 0.99."""
    import tomllib

    from packaging.requirements import Requirement

    extra = tomllib.loads(pyproject)["project"]["optional-dependencies"]["cuda"]
    spec = next(Requirement(r).specifier for r in extra if Requirement(r).name == "vllm")
    return [v for v in (f"0.{minor}.0" for minor in range(100)) if v in spec]


def test_the_cuda_extra_admits_only_checked_releases():
    text = (REPO / "pyproject.toml").read_text()
    admitted = cuda_admits(text)
    assert admitted and set(admitted) <= set(seam.CHECKED), (admitted, seam.CHECKED)
    # Negative control: one more release admitted than was checked is seen.
    wider = cuda_admits(text.replace('"vllm>=0.32,<0.35"', '"vllm>=0.32,<0.36"'))
    assert "0.35.0" in wider and not set(wider) <= set(seam.CHECKED)


def test_connector_fits_the_installed_vllm():
    result = compat.check()
    assert result["vllm"].startswith("0.32") and result["ok"], result["problems"]
    assert result["internals"] == len(seam.INTERNALS) and not result["not_yet_checked_for_this_version"]


BOGUS = (
    seam.Internal("hook", seam.PULL_WORKER, "_gone_in_a_future_vllm", why="negative control"),
    seam.Internal("hook", seam.PULL_WORKER, "add_remote_agent", ("renamed_parameter",)),
    seam.Internal("method", seam.BASE_WORKER, "__init__", ("no_such_parameter",)),
    seam.Internal("function", seam.CPU_ATTN, "_get_attn_isa", ("isa_hint",)),
    seam.Internal("class", "vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector", "NixlGoneConnector"),
    seam.Internal("attr", seam.BASE_WORKER, "_remote_agents_v2"),
    seam.Internal("attr", seam.SPIN, "notify_socket"),
    seam.Internal("field", seam.AGENT_META, "attn_isa"),
    seam.Internal("module_global", "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", "NixlAgent"),
    seam.Internal("nixl_config_field", f"{seam.NIXL_API}:nixlBind.nixlAgentConfig", "progressDelay"),
    seam.Internal("source", f"{seam.SHM}:MessageQueue.acquire_read", "_spin_condition.poll("),
)


def test_each_kind_of_drift_is_reported():
    result = compat.check(seam.INTERNALS + BOGUS)
    assert not result["ok"]
    assert len(result["problems"]) == len(BOGUS), result["problems"]  # one per bogus entry, none for the real
    text = "\n".join(result["problems"])
    for needle in ("_gone_in_a_future_vllm: missing", "no parameter(s) ['renamed_parameter']",
                   "no parameter(s) ['no_such_parameter']", "no parameter(s) ['isa_hint']", "NixlGoneConnector",
                   "_remote_agents_v2: missing", "notify_socket: missing", "attn_isa: missing field",
                   "NixlAgent: missing", "progressDelay: missing", "no longer contains '_spin_condition.poll('"):
        assert needle in text, (needle, text)


def test_a_private_override_outside_the_seam_is_reported(monkeypatch):
    """pdctl's own names must not silently shadow vLLM's: an override is a seam hook or it is a problem."""
    from pdctl.connector.nixl import PdctlNixlWorker

    monkeypatch.setattr(PdctlNixlWorker, "_nixl_handshake", lambda self, *a: None, raising=False)
    result = compat.check()
    assert result["problems"] == ["pdctl.connector.nixl:PdctlNixlWorker._nixl_handshake: overrides vLLM's "
                                  "NixlPullConnectorWorker._nixl_handshake but is not a seam hook"]


def test_the_inventory_is_well_formed():
    kinds = set(seam.Kind.__args__)
    seen = set()
    for e in seam.INTERNALS:
        assert e.kind in kinds and e.checked and e.why, e
        assert (e.kind, e.owner, e.name) not in seen, e
        seen.add((e.kind, e.owner, e.name))
    assert {"useProgThread", "pthrDelay"} <= {e.name for e in seam.INTERNALS if e.kind == "nixl_config_field"}


def test_the_connector_names_no_vllm_internal_outside_the_seam():
    """Private vLLM/NIXL names (attributes, methods, globals it swaps) appear in the connector only as the seam's
    hooks; everything else goes through seam's accessors. No gc scans, no flags written onto vLLM's objects."""
    source = (REPO / "pdctl" / "connector" / "nixl.py").read_text()
    hooks = {e.name for e in seam.INTERNALS if e.kind == "hook"}
    private = {e.name for e in seam.INTERNALS if e.kind in ("attr", "method", "function", "module_global")
               and (e.name.startswith("_") or e.name in ("NixlWrapper", "nixlBind", "enable_permute_local_kv",
                                                          "transfer_groups", "xfer_handshake_metadata"))} - hooks
    used = sorted(n for n in private if re.search(rf"\b{re.escape(n)}\b", source))
    assert used == [], f"nixl.py names {used}: reach them through pdctl.connector.seam"
    for banned in ("gc.get_objects", "meta._pdctl", "SpinCondition", "_base_worker"):
        assert banned not in source


# -- accessors --------------------------------------------------------------------------------------------------


def test_worker_accessors():
    calls = []
    w = SimpleNamespace(_remote_agents={"p1": {(0, 0): "agent"}}, _recv_failures={"old"},
                        _physical_blocks_per_logical_kv_block=2, enable_permute_local_kv=0,
                        kv_cache_config=SimpleNamespace(transfer_groups=(SimpleNamespace(layer_names=["l0", "l1"]),)),
                        _handle_failed_transfer=lambda *a, **k: calls.append((a, k)))
    assert seam.has_remote_agent(w, "p1") and not seam.has_remote_agent(w, "p2")
    assert seam.kernel_blocks_per_block(w) == 2
    assert seam.group_layer_names(w, 0) == ["l0", "l1"]
    seam.fail_recv(w, "r1")
    assert calls == [(("r1", None, {"old"}), {"record_failed_transfer": True})]


def test_nixl_agent_settings_swap_both_globals_and_restore_them(monkeypatch):
    """The base worker's NixlWrapper(name, config) builds a binding config and nixlBind.nixlAgent(name, config):
    inside the block the agent gets our progress-thread settings; outside, nixl's own build is untouched."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    built = []
    bind = SimpleNamespace(nixlAgentConfig=lambda: SimpleNamespace(useProgThread=True, pthrDelay=0),
                           nixlAgent=lambda name, cfg: built.append((name, cfg.useProgThread, cfg.pthrDelay)))
    fake_api = types.ModuleType("fake_nixl_api")
    fake_api.nixlBind = bind

    class Agent:  # what nixl_agent.__init__ does with its config
        def __init__(self, name, conf):
            api = sys.modules[type(self).__module__]
            api.nixlBind.nixlAgent(name, api.nixlBind.nixlAgentConfig())

    Agent.__module__ = "fake_nixl_api"
    monkeypatch.setitem(sys.modules, "fake_nixl_api", fake_api)
    monkeypatch.setattr(base_worker, "NixlWrapper", Agent)
    with seam.nixl_agent_settings(progress_thread=True, delay_us=1000):
        assert base_worker.NixlWrapper is not Agent
        base_worker.NixlWrapper("a", None)
        assert fake_api.nixlBind is bind  # swapped only while the agent is built
    assert base_worker.NixlWrapper is Agent
    Agent("b", None)
    assert built == [("a", True, 1000), ("b", True, 0)]


def test_nixl_agent_settings_restore_on_error(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    real = base_worker.NixlWrapper
    with pytest.raises(RuntimeError), seam.nixl_agent_settings(False, 0):
        raise RuntimeError("worker init failed")
    assert base_worker.NixlWrapper is real


def test_rewrite_handshake_metadata_round_trips():
    import dataclasses

    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata, NixlHandshakePayload

    meta = NixlAgentMetadata(engine_id="p", agent_metadata=b"", kv_caches_base_addr=[0], device_id=0,
                             num_blocks=10, block_lens=[4096], block_strides=[4096], kv_cache_layout="HND",
                             block_size=32, ssm_sizes=(0, 0), attn_backend_name="CPU_ATTN",
                             physical_blocks_per_logical_kv_block=1)
    w = SimpleNamespace(xfer_handshake_metadata=None)
    assert not seam.rewrite_handshake_metadata(w, lambda m: m)
    w.xfer_handshake_metadata = NixlHandshakePayload(compatibility_hash="h",
                                                     agent_metadata_bytes=msgspec.msgpack.Encoder().encode(meta))
    assert seam.rewrite_handshake_metadata(w, lambda m: dataclasses.replace(m, attn_backend_name="X"))
    got = msgspec.msgpack.decode(w.xfer_handshake_metadata.agent_metadata_bytes, type=NixlAgentMetadata)
    assert got.attn_backend_name == "X" and got.block_size == 32
    assert w.xfer_handshake_metadata.compatibility_hash == "h"
