"""scripts/device_check.py: its CPU run passes quickly without pydantic or vLLM, its exactness check can fail, and
the KV layouts it builds from vLLM's stride orders are the layouts pdctl.kv models."""

import importlib.util
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.kv.layouts import VLLM_LAYOUTS, layout, vllm_layout

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device_check.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("pdctl_device_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


dc = _load_script()


def _run(*args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run the script; return the process, its wall seconds and its CPU seconds (children included). The CPU
    time is what the < 10 s budget bounds: the wall time also counts whatever else shares this host's cores."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return done, wall, cpu


SCRIPT_RUN = ("runs the whole script in a subprocess (torch imported by it and by its NIXL child, a real READ); its "
              "budget, 10 CPU seconds, is asserted inside, and wall time on a shared host runs longer")


@pytest.mark.unit_time_limit(30, reason=SCRIPT_RUN)
def test_small_cpu_run_passes_fast_and_imports_neither_pydantic_nor_vllm(tmp_path):
    out = tmp_path / "check.json"
    done, wall, cpu = _run("-X", "importtime", str(SCRIPT), "--device", "cpu", "--small", "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert cpu < 10, f"--small took {cpu:.1f} CPU seconds ({wall:.1f} s wall)"
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "import time:" in line]
    assert "torch" in imported and "pdctl.kv.receive" in imported  # the connector's own conversions, no copies
    assert not [m for m in imported if m.split(".")[0] in ("pydantic", "vllm") or m == "pdctl.topology"]
    report = json.loads(out.read_text())
    assert report["passed"] and report["forbidden_imports"] == []
    assert all(r["exact"] for r in report["exact"])
    cases = {(r["layout"], r["direction"], r["ratio"], r["case"]) for r in report["exact"]}
    for lay in ("LBHNC", "LBNHC", "BLHNC", "BLNHC"):
        for direction in ("merge", "split"):
            for ratio in (2, 4, 8):
                for case in ("full", "tail", "prefix", "window"):
                    assert (lay, direction, ratio, case) in cases
    assert {r["dtype"] for r in report["exact"]} == {"bf16", "fp16", "fp8_e4m3", "fp8_e5m2"}
    assert report["bench"] and all(b["conv_ms"] > 0 and b["copy_ms"] > 0 for b in report["bench"])
    # The NIXL READ ran in DRAM with the installed nixl, in a child process that imported neither either.
    attempt = report["nixl"]["attempts"][-1]
    assert attempt["cases"] and all(c["exact"] for c in attempt["cases"]), attempt
    assert not {"pydantic", "vllm"} & set(attempt["modules"])
    assert "exact" in done.stdout and "x copy" in done.stdout


@pytest.mark.unit_time_limit(30, reason=SCRIPT_RUN)
def test_corrupted_byte_makes_the_run_fail(tmp_path):
    done, _, _ = _run(str(SCRIPT), "--device", "cpu", "--small", "--corrupt", "--skip-nixl", "--skip-bench",
                      "--out", str(tmp_path / "bad.json"))
    assert done.returncode == 1, done.stdout[-2000:]
    assert "NO" in done.stdout and "not exact" in done.stdout
    report = json.loads((tmp_path / "bad.json").read_text())
    assert not report["passed"] and sum(not r["exact"] for r in report["exact"]) == 1


@pytest.mark.parametrize("case", ["full", "tail", "prefix", "window"])
@pytest.mark.parametrize("direction", ["merge", "split"])
def test_reference_catches_one_flipped_byte(direction, case):
    dims = {"base": 4, "layers": 2, "heads": 2, "head_dim": 8}
    spec = dc.Spec("BLNHC", "fp8_e4m3", direction, 4, case, **dims)
    assert dc.run_case(spec, "cpu", seed=3) == (True, "")
    ok, why = dc.run_case(spec, "cpu", seed=3, corrupt_it=True)
    assert not ok and why.startswith("1 (layer, block, head, slot) differ")


@pytest.mark.parametrize("direction", ["merge", "split"])
def test_reference_catches_a_wrong_layout(direction):
    """pdctl.kv reading token-major pages as head-major ones (a wrong layout mapping) is caught."""
    dims = {"base": 4, "layers": 2, "heads": 2, "head_dim": 8}
    req = dc.prepare(dc.Spec("LBNHC", "bf16", direction, 2, "tail", **dims), "cpu", seed=5, read_as="LBHNC")
    dc.move_torch(req, req.pre, req.dec)
    req.post(req.dec)
    assert not dc.verify(req)[0]


def test_vllm_stride_orders_are_vllms():
    """The script's copy of vLLM's KVCacheLayout values matches the installed vLLM (read without importing it)."""
    found = importlib.util.find_spec("vllm")
    if found is None or not found.submodule_search_locations:
        pytest.skip("vllm not installed")
    path = Path(found.submodule_search_locations[0]) / "v1" / "kv_cache_layout.py"
    spec = importlib.util.spec_from_file_location("_vllm_kv_cache_layout", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    enum = {m.name: m.value for m in mod.KVCacheLayout}
    assert {k: enum[k] for k in dc.STRIDE_ORDER} == dc.STRIDE_ORDER
    # Every layout vLLM has is either checked here or refused by pdctl.kv.
    for name in enum:
        if name in dc.STRIDE_ORDER:
            assert mod.KVCacheLayout[name].is_block_compact
            vllm_layout(name)
        else:
            assert not mod.KVCacheLayout[name].is_block_compact
            with pytest.raises(ValueError, match="not keep a .layer, block. page contiguous"):
                vllm_layout(name)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(dc.STRIDE_ORDER)), layers=st.integers(1, 3), blocks=st.integers(1, 4),
       heads=st.integers(1, 4), n=st.sampled_from([1, 2, 16]), d=st.sampled_from([1, 4, 8]), seed=st.integers(0, 9))
def test_vllm_page_is_the_pdctl_layout(name, layers, blocks, heads, n, d, seed):
    """A value written at (layer, block, head, token) of vLLM's logical view is where vllm_layout(name) unpacks it
    from that block's page: K in the first head_dim entries of the last axis, V in the rest."""
    gen = torch.Generator().manual_seed(seed)
    cache = dc.KvCache.stale(name, layers, blocks, heads, n, d, 2, "cpu", gen)
    rows_layout = vllm_layout(name)
    shape = dc.BlockShape(heads, n, d)
    for layer in range(layers):
        logical = cache.logical(layer).view(torch.bfloat16)  # [B, H, N, 2D]
        k, v = rows_layout.unpack(cache.rows(layer, torch.bfloat16), shape)
        assert torch.equal(k.view(torch.int16), logical[..., :d].view(torch.int16))
        assert torch.equal(v.view(torch.int16), logical[..., d:].view(torch.int16))
        # And packing the logical K and V gives the page bytes.
        packed = rows_layout.pack(logical[..., :d], logical[..., d:], shape)
        assert torch.equal(packed.view(torch.int16), cache.rows(layer, torch.bfloat16).view(torch.int16))


def test_vllm_layout_names():
    assert vllm_layout("LBHNC") is layout("HND") and vllm_layout("BLHNC") is layout("HND")
    assert vllm_layout("LBNHC") is layout("NHD") and vllm_layout("BLNHC") is layout("NHD")
    assert vllm_layout("HND") is layout("HND") and vllm_layout("NHD") is layout("NHD")
    assert set(VLLM_LAYOUTS) == {"LBHNC", "BLHNC", "LBNHC", "BLNHC", "HND", "NHD"}
    with pytest.raises(ValueError, match="unknown vLLM KV cache layout 'cpu_vec'"):
        vllm_layout("cpu_vec")
