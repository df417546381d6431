"""Compatibility rules, tested on the pure function (the corpus tests them through the CLI)."""

import pytest

from pdctl.topology import ModelInfo, Topology, compatibility_problems, parse_bytes


def topo(**kw):
    base = {"name": "t", "model": {"path": "m/m"}, "prefill": {"block_size": 32, "devices": [0]},
            "decode": {"block_size": 64, "devices": [1]}}
    for k, v in kw.items():
        section, _, key = k.partition("__")
        base.setdefault(section, {})[key] = v
    return Topology.model_validate(base)


def msgs(t, info=ModelInfo()):
    return [p.message for p in compatibility_problems(t, info) if p.severity == "error"]


@pytest.mark.parametrize("pb,db,ok", [(32, 64, True), (64, 32, True), (128, 32, True), (32, 32, True),
                                      (64, 96, False), (96, 64, False)])
def test_pdctl_connector_allows_both_directions(pb, db, ok):
    assert (msgs(topo(prefill__block_size=pb, decode__block_size=db)) == []) == ok


@pytest.mark.parametrize("pb,db,ok", [(32, 64, True), (64, 32, False), (32, 32, True)])
def test_stock_connector_needs_decode_multiple(pb, db, ok):
    assert (msgs(topo(prefill__block_size=pb, decode__block_size=db, connector__kind="nixl")) == []) == ok


def test_stock_connector_cpu_hetero_is_a_warning():
    probs = compatibility_problems(topo(connector__kind="nixl"))
    assert [p.severity for p in probs] == ["warning"]
    assert "corrupts KV silently" in probs[0].message


def test_layout_aliases():
    t = topo(prefill__kv_layout="LBHNC", decode__kv_layout="lbnhc")
    assert (t.prefill[0].kv_layout, t.decode[0].kv_layout) == ("HND", "NHD")


def test_platform_defaults():
    t = Topology.model_validate({"name": "t", "model": {"path": "m/m"},
                                 "prefill": {"platform": "cuda", "devices": [0]},
                                 "decode": {"platform": "hpu", "devices": [0]}})
    assert (t.prefill[0].block_size, t.decode[0].block_size) == (16, 128)
    assert t.prefill[0].enforce_eager is False and t.prefill[0].kv_cache_memory is None
    assert topo().prefill[0].kv_cache_memory == 256 * 2**20 and topo().prefill[0].enforce_eager is True


def test_tp_must_divide_kv_heads():
    t = topo(decode__tp=2, decode__devices=[1, 2], decode__block_size=32)
    assert msgs(t, ModelInfo(kv_heads=2)) == []
    assert "does not divide" in msgs(t, ModelInfo(kv_heads=3))[0]


def test_decode_tp_greater_is_fine_prefill_greater_needs_equal_blocks():
    assert msgs(topo(decode__tp=2, decode__devices=[1, 2])) == []
    assert "only supported with equal block sizes" in msgs(topo(prefill__tp=2, prefill__devices=[0, 2]))[0]
    assert msgs(topo(prefill__tp=2, prefill__devices=[0, 2], decode__block_size=32)) == []


def test_same_host_other_host_ports():
    assert msgs(topo(prefill__http_port=8100, decode__http_port=8100)) != []
    assert msgs(topo(prefill__http_port=8100, prefill__side_channel_port=5600, decode__http_port=8100,
                     decode__side_channel_port=5600, decode__host="127.0.0.2")) == []


def test_ports_left_out_skip_every_explicit_one():
    t = topo(decode__http_port=8100)  # the prefill's automatic 8100 is taken: it moves on
    assert (t.prefill[0].http_port, t.decode[0].http_port) == (8101, 8100) and msgs(t) == []


@pytest.mark.parametrize("text,n", [("256MiB", 256 * 2**20), ("1GiB", 2**30), ("1.5 GiB", int(1.5 * 2**30)),
                                    ("1000", 1000), (4096, 4096)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


def test_example_configs_validate(run_cli):
    import yaml

    from tests.conftest import CONFIGS

    files = [f for f in sorted(CONFIGS.glob("*.yaml")) if "prefill" in (yaml.safe_load(f.read_text()) or {})]
    assert len(files) >= 6
    for f in files:
        code, out, err = run_cli("validate", f)
        assert code == 0, (f, err)


def test_example_matrices_load():
    from pdctl.bench.sweep import load_matrix
    from tests.conftest import CONFIGS

    assert [c.name for c in load_matrix(CONFIGS / "cpu-matrix.yaml").cases] == [
        "homog-32-32", "p32-d64", "p32-d128", "p64-d32"]
    up = load_matrix(CONFIGS / "upstream-matrix.yaml")
    assert len(up.cases) == 4
    assert {o.flag for o in up.cases[1].overrides()} >= {"--decode-tp 2", "--decode-block-size 64"}
