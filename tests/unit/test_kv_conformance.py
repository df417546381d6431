"""scripts/kv_conformance.py: real NIXL reads between two processes through pdctl's connector code. A few cells of
every path are exact, a flipped byte is caught, and the harness is no copy of the connector: breaking one line of
the conversion, or the block-outermost chunk addresses the way they were before pdctl.kv.reads, makes it report
`wrong`."""

import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import msgspec
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import kv_conformance as kc  # noqa: E402

HARNESS = ("runs the harness in a subprocess: torch and NIXL imported by it and by its prefill process, one NIXL "
           "READ per cell")


FINGERPRINTS: dict[str, str] = {}  # the last run's fingerprint comparison per cell


def run(*args: str, patch: str = "") -> tuple[int, dict]:
    """The harness on the fast cells, in a subprocess; `patch`: Python run in the decode's process first."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import kv_conformance as kc\n{patch}\n"
            f"sys.exit(kc.main({['--fast', '--json', *args]!r}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.stdout.strip(), done.stderr[-3000:]
    cases = {c["prefill"]["form"] + "->" + c["decode"]["form"] + f":{c['decode']['block']}": c
             for c in json.loads(done.stdout)["cases"]}
    FINGERPRINTS.clear()
    FINGERPRINTS.update({name: c["fingerprint"] for name, c in cases.items()})
    return done.returncode, {name: c["result"] for name, c in cases.items()}


@pytest.mark.unit_time_limit(30, reason=HARNESS)
def test_fast_cells_are_exact_over_real_nixl_reads():
    rc, results = run()
    assert rc == 0, results
    assert results.pop("LBNHC->LBHNC:32").startswith("refused: vLLM: the KV cache layouts differ")
    assert set(results.values()) == {"exact"} and len(results) == 7
    assert {FINGERPRINTS[name] for name in results} == {"equal"}  # the prefill's and the decode's agree
    assert {"LBNHC->hpu:128", "host:hpu->host:LBHNC:16"} <= set(results)  # Gaudi's cache and host buffers


@pytest.mark.unit_time_limit(30, reason=HARNESS)
def test_a_flipped_byte_is_wrong_in_every_form():
    rc, results = run("--corrupt")
    assert rc == 1
    results.pop("LBNHC->LBHNC:32")
    assert all(r.startswith("wrong: rank 0 layer 0 block") for r in results.values()), results
    # ... and the fingerprint catches it too, in the chunk of the flipped token (the prompt's last)
    assert all(FINGERPRINTS[name].startswith("differs at layer ") for name in results), FINGERPRINTS


@pytest.mark.unit_time_limit(30, reason=HARNESS)
def test_a_fingerprint_that_disagrees_alone_makes_a_cell_wrong():
    # The decode's fingerprint computed over another layer's coordinates (its KV itself exact): every cell fails on
    # the fingerprint, which the prefill process (unpatched) computed right.
    patch = ("import pdctl.kv.fingerprint as f; real = f.head_partials\n"
             "f.head_partials = lambda k, v, *, layer, **kw: real(k, v, layer=layer + 1, **kw)")
    rc, results = run(patch=patch)
    assert rc == 1
    results.pop("LBNHC->LBHNC:32")
    assert all(r.startswith("wrong: the fingerprint differs at layer") for r in results.values()), results


@pytest.mark.unit_time_limit(30, reason=HARNESS)
def test_not_a_copy_a_merge_that_does_not_merge_is_wrong():
    # One line of pdctl.kv's receive path broken: the received sub-blocks are left as NIXL wrote them.
    rc, results = run(patch="import pdctl.kv.receive as r; r.merge_in_place = lambda blocks, *a: blocks")
    assert rc == 1
    assert results["LBHNC->LBHNC:32"].startswith("wrong")  # head-major pages: sub-blocks must be interleaved
    assert results["cpu_vec->cpu_amx:64"].startswith("wrong")
    assert results["LBNHC->LBNHC:64"] == "exact"  # token-major pages back to back are the merged page already
    assert results["BLHNC->BLHNC:16"] == "exact"  # a split does not merge
    assert results["LBNHC->hpu:128"].startswith("wrong")  # a joined page into K and V pages must be converted


@pytest.mark.unit_time_limit(30, reason=HARNESS)
def test_not_a_copy_kv_pair_units_left_as_nixl_placed_them_are_wrong():
    # The regrouping of units read into (or from) a (K, V) pair's two regions skipped: the K pieces of every
    # received page are taken for whole pages.
    rc, results = run(patch="import pdctl.kv.receive as r; r._received_order = lambda rows, *a, **k: rows")
    assert rc == 1
    assert results["LBNHC->hpu:128"].startswith("wrong")
    assert results["host:hpu->host:LBHNC:16"].startswith("wrong")
    assert results["BLHNC->BLHNC:16"] == "exact"  # one region on both sides: nothing to regroup


@pytest.mark.unit_time_limit(30, reason=HARNESS)
def test_not_a_copy_block_outermost_chunks_addressed_as_before_are_wrong():
    # The chunk addresses as vLLM computes them from a stride divided by the ratio (pdctl before kv.reads).
    old = ("import numpy as np, pdctl.kv.reads as r\n"
           "def old(meta, ratio, descs):\n"
           "    counts = meta.region_num_blocks\n"
           "    return np.concatenate([b + np.arange(n, dtype=np.uint64) * (s // ratio) for b, s, n in\n"
           "                           zip(meta.kv_caches_base_addr, meta.block_strides, counts)])\n"
           "r.split_addresses = old")
    rc, results = run(patch=old)
    assert rc == 1
    assert results["BLHNC->BLHNC:16"].startswith("wrong")
    assert results["cpu_amx->cpu_amx:32"] == "exact"  # layer-outermost: a page's chunks abut


def test_the_advertised_metadata_is_vllms_field_for_field():
    ours = [(f.name, f.type, f.default, f.default_factory) for f in fields(kc.AgentMetadata)]
    theirs = [(f.name, str(f.type) if not isinstance(f.type, str) else f.type, f.default, f.default_factory)
              for f in fields(NixlAgentMetadata)]
    assert [o[0] for o in ours] == [t[0] for t in theirs]
    assert [(o[2], o[3]) for o in ours] == [(t[2], t[3]) for t in theirs]
    m = kc.AgentMetadata("p", b"x", [1], 0, 2, [3], [4], "LBHNC", 16, (0, 0), "CPU_ATTN+pdctl-isa=vec", 1, [2])
    assert msgspec.msgpack.decode(kc.encode(m), type=NixlAgentMetadata).attn_backend_name == m.attn_backend_name


def test_the_matrix_spans_what_the_issue_names():
    cells = kc.matrix()
    assert {c.prefill.form for c in cells} == set(kc.FORMS) == {c.decode.form for c in cells}
    gaudi = {(c.prefill.form, c.prefill.block, c.decode.form, c.decode.block) for c in cells}
    for pair in (("LBHNC", 16, "hpu", 128), ("LBNHC", 16, "hpu", 128), ("hpu", 128, "LBHNC", 16),
                 ("hpu", 128, "LBNHC", 16), ("cpu_vec", 32, "hpu", 128), ("host:LBHNC", 16, "host:hpu", 128),
                 ("host:hpu", 128, "host:LBNHC", 16)):
        assert pair in gaudi, pair
    assert {(c.prefill.tp, c.decode.tp) for c in cells} == {(1, 1), (1, 2), (2, 1)}
    ratios = {max(c.prefill.block, c.decode.block) // min(c.prefill.block, c.decode.block) for c in cells}
    assert ratios == {1, 2, 4, 8}
    assert {c.dtype for c in cells} == {"bf16", "fp16", "fp8"}
    assert any(c.window for c in cells) and any(c.prefix_hit for c in cells)
    assert any(c.prefill.block > c.decode.block for c in cells) and any(c.prefill.block < c.decode.block
                                                                        for c in cells)


def test_cli_errors_name_the_flag(capsys):
    assert kc.main(["--prefill", "LBHNC:16"]) == 2
    assert "both --prefill and --decode" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--decode LBHNC: expected FORM:BLOCK"):
        kc.main(["--prefill", "LBHNC:16", "--decode", "LBHNC"])
    assert kc.main(["--tp", "x", "--list"]) == 2
    assert kc.main(["--prefill", "LBHNC:16", "--decode", "LBHNC:32", "--tokens", "0"]) == 2
    assert "--tokens 0: a prompt has at least one token" in capsys.readouterr().err
    assert kc.main(["--prefill", "LBHNC:16", "--decode", "LBHNC:16", "--window", "40"]) == 2
    assert "--window: at equal block sizes" in capsys.readouterr().err
    assert kc.main(["--list", "--fast"]) == 0 and "8 cells" in capsys.readouterr().out
