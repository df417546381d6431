"""What the rules know of the model and of how its servers run it: the facts of the model's config.json
(ModelInfo), where the model is (a local path or a hub id), its attention, and whether a pool runs vLLM's hybrid
KV cache manager.

Pure apart from `read_model_info`, which reads the model's config.json.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pdctl import yamlsrc
from pdctl.topology.schema import ModelSpec, Pool, Topology

# KV heads of hub models that example topologies use, so TP rules work without downloading config.json.
KNOWN_MODEL_KV_HEADS: dict[str, int] = {"Qwen/Qwen3-0.6B": 8, "Qwen/Qwen3-8B": 8, "meta-llama/Llama-3.1-8B-Instruct": 8,
                                        "openai/gpt-oss-20b": 8}

# vLLM's switch for its hybrid KV cache manager (HMA), a BooleanOptionalAction: the last of the two forms wins.
HMA_OFF_FLAG = "--disable-hybrid-kv-cache-manager"
HMA_ON_FLAG = "--no-disable-hybrid-kv-cache-manager"


@dataclass(frozen=True)
class ModelInfo:
    kv_heads: int | None = None
    attention_heads: int | None = None
    max_position: int | None = None
    vocab_size: int | None = None
    # For the KV cache capacity rule (all None unless a local config.json gave them):
    layers: int | None = None  # num_hidden_layers
    head_dim: int | None = None  # head_dim, else hidden_size / num_attention_heads
    max_len: int | None = None  # what vLLM serves without --max-model-len: the smallest of its length keys
    config: str | None = None  # the config.json these came from
    capacity_unknown: str | None = None  # why the config's attention is not plain (sliding window, MLA, ...)
    # What config.json says of the attention (None without a local config.json, or when its layer kinds are
    # others, e.g. Mamba or linear attention): full; hybrid, sliding-window and full-attention layers (vLLM's
    # hybrid KV cache manager keeps a KV cache group per kind); sliding, every layer windowed. The topology's
    # model.attention stands in when this is None (model_attention).
    attention: Literal["full", "hybrid", "sliding"] | None = None
    attention_why: str | None = None  # what in config.json says so, for messages
    sliding_window: int | None = None  # the window, in tokens


_MAX_CONFIG_BYTES = 4 * 2**20  # a config.json is a few KiB
# vLLM's own max-length keys (model_arch_config_convertor): it serves the smallest one present.
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")


def _count(v: Any) -> int | None:
    """A positive int from config.json, else None (a string, a float, a bool, 0 or an absurd value)."""
    return v if type(v) is int and 0 < v <= 2**40 else None


def _read_config(cfg_file: Path) -> dict[str, Any] | None:
    """config.json as a mapping; None when it is not a readable, small JSON object."""
    try:
        if not cfg_file.is_file():
            return None
        cfg = json.loads(yamlsrc.read_file(cfg_file, max_bytes=_MAX_CONFIG_BYTES))
    except (OSError, ValueError, RecursionError, yamlsrc.YamlSourceError):
        return None
    if not isinstance(cfg, dict):
        return None
    # Multimodal checkpoints keep the language model's numbers in text_config.
    text = cfg.get("text_config")
    if "num_hidden_layers" not in cfg and isinstance(text, dict):
        cfg = {**cfg, **text}
    return cfg


_SLIDING, _FULL = "sliding_attention", "full_attention"
# Model types whose config classes alternate sliding and full layers when config.json has no layer_types.
_ALTERNATING = {"gemma2": "Gemma 2", "gpt_oss": "gpt-oss"}


def _attention_kind(cfg: dict[str, Any]) -> tuple[Literal["full", "hybrid", "sliding"] | None, str]:
    """What config.json says of the attention, and what in it says so. vLLM windows a layer when layer_types
    names it sliding_attention (Llama, Gemma 2/3, gpt-oss: the model's sliding_window), else every layer when
    the config has a sliding_window and no layer_types (engine/arg_utils.py); older Gemma/Cohere configs give a
    pattern instead of layer_types, and Qwen2's max_window_layers splits the layers."""
    window = _count(cfg.get("sliding_window"))
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        if not all(isinstance(x, str) for x in layer_types):
            return None, "layer_types holds something other than names"
        kinds = set(layer_types)
        if kinds == {_FULL}:
            return "full", "layer_types: every layer full_attention"
        if not kinds <= {_SLIDING, _FULL}:
            return None, f"layer_types names {', '.join(sorted(kinds - {_SLIDING, _FULL}))[:200]}"
        if not window:
            return None, "layer_types names sliding_attention layers but sliding_window is no window"
        if kinds == {_SLIDING}:
            return "sliding", f"layer_types: every layer sliding_attention (window {window})"
        n = layer_types.count(_SLIDING)
        return "hybrid", (f"layer_types: {n} sliding_attention (window {window}) and {len(layer_types) - n} "
                          "full_attention layers")
    if not window or cfg.get("use_sliding_window", True) is False:
        return "full", "no sliding_window and no sliding_attention layers"
    pattern, layers, split = (_count(cfg.get(k)) for k in ("sliding_window_pattern", "num_hidden_layers",
                                                             "max_window_layers"))
    if pattern and pattern > 1:
        return "hybrid", f"sliding_window_pattern {pattern}: one layer in {pattern} is full attention"
    if cfg.get("model_type") in _ALTERNATING:
        return "hybrid", f"{_ALTERNATING[cfg['model_type']]} alternates sliding-window and full-attention layers"
    if split and layers and split < layers:
        return "hybrid", f"max_window_layers {split} of {layers} layers"
    return "sliding", f"sliding_window {window} for every layer (no layer_types)"


def _irregular_attention(cfg: dict[str, Any]) -> str | None:
    """Why layers x 2 x KV heads x head_dim does not describe this model's KV cache, if it does not."""
    if cfg.get("kv_lora_rank") is not None:
        return "the model uses MLA (compressed KV)"
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and any(x != "full_attention" for x in layer_types):
        if _attention_kind(cfg)[0] == "hybrid":
            return ("the model mixes sliding-window and full attention (layer_types): vLLM keeps one KV cache "
                    "group per kind")
        return "the model mixes attention kinds (layer_types)"
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) is not False:
        return "the model uses sliding-window attention"
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict):
        inner = quant.get("quantization")
        if any("kv_cache" in str(k) for k in [*quant, *(inner if isinstance(inner, dict) else ())]):
            return "the checkpoint's quantization_config chooses the KV cache dtype"
    return None


def read_model_info(topo_model: ModelSpec, base_dir: Path) -> ModelInfo:
    """What the rules need from the model: its config.json when local, else the topology's or a known value."""
    cfg_file = resolve_path(topo_model.path, base_dir) / "config.json"
    cfg = _read_config(cfg_file)
    if cfg is not None:
        heads = _count(cfg.get("num_attention_heads"))
        hidden = _count(cfg.get("hidden_size"))
        return ModelInfo(
            kv_heads=topo_model.kv_heads or _count(cfg.get("num_key_value_heads")) or heads,
            attention_heads=heads,
            max_position=_count(cfg.get("max_position_embeddings")),
            vocab_size=_count(cfg.get("vocab_size")),
            max_len=min((n for k in _MAX_LEN_KEYS if (n := _count(cfg.get(k)))), default=None),
            layers=_count(cfg.get("num_hidden_layers")),
            head_dim=_count(cfg.get("head_dim")) or (hidden // heads if hidden and heads and hidden % heads == 0
                                                     else None),
            config=str(cfg_file),
            capacity_unknown=_irregular_attention(cfg),
            attention=(kind := _attention_kind(cfg))[0],
            attention_why=kind[1],
            sliding_window=_count(cfg.get("sliding_window")) if kind[0] in ("hybrid", "sliding") else None,
        )
    return ModelInfo(kv_heads=topo_model.kv_heads or KNOWN_MODEL_KV_HEADS.get(topo_model.path))


def resolve_path(value: str, base_dir: Path) -> Path:
    """Relative model paths are relative to the topology file, like docker-compose's."""
    p = Path(value)
    try:
        p = p.expanduser()
    except RuntimeError:  # ~nosuchuser: vLLM would not find it either; left as written
        pass
    return p if p.is_absolute() else Path(os.path.normpath(base_dir / p))


def is_local_path(value: str) -> bool:
    return value.startswith((".", "/", "~")) or not re.fullmatch(r"[\w.-]+/[\w.-]+", value)


def resolved_model(t: Topology, pool: Pool, base_dir: Path) -> str:
    """A pool's model as its servers get it: a local path made absolute, a hub id as it is."""
    raw = t.model_path(pool)
    return str(resolve_path(raw, base_dir)) if is_local_path(raw) else raw


def model_attention(t: Topology, info: ModelInfo) -> str | None:
    """full, hybrid or sliding: what the local config.json says, else the topology's model.attention; None when
    neither says (a hub id without model.attention)."""
    return info.attention or t.model.attention


def flag_name(arg: str) -> str:
    """The vLLM flag an argument names, as vLLM reads it: `--x_y=V` is `--x-y` (an argument that is no flag
    comes back as it is)."""
    name = arg.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _hma_flag(pool: Pool) -> tuple[int, bool] | None:
    """The last of vLLM's HMA switches in a pool's extra_args: its index, and whether it leaves HMA on."""
    found = None
    for i, a in enumerate(pool.extra_args):
        name = flag_name(a)
        if name in (HMA_OFF_FLAG, HMA_ON_FLAG):
            found = (i, name == HMA_ON_FLAG)
    return found


def hma_enabled(pool: Pool) -> bool:
    """Whether a pool's servers run vLLM's hybrid KV cache manager (HMA): on unless its extra_args pass
    --disable-hybrid-kv-cache-manager. (vLLM would also turn it off for a connector without HMA support; vLLM's
    NixlConnector and pdctl's both have it.)"""
    flag = _hma_flag(pool)
    return flag is None or flag[1]
