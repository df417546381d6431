import json

from pdctl.tinymodel import build_tiny_model, fingerprint


def test_tiny_model_is_deterministic_per_seed(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    c = build_tiny_model(tmp_path / "c", seed=4)
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)
    cfg = json.loads((a / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]) == (2, 2, 64)
    assert cfg["initializer_range"] == 0.2  # random weights: keep greedy logits away from ties


def test_tiny_model_tokenizer_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    d = build_tiny_model(tmp_path / "m", seed=0)
    tok = AutoTokenizer.from_pretrained(d)
    text = "Natalie sold 48 clips in April. How many clips?"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|assistant|>\n")


def test_the_hybrid_tiny_model_alternates_sliding_window_and_full_attention(tmp_path):
    from pdctl import api

    d = tmp_path / "h"
    assert api.tiny_model(d, seed=0, window=96)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 and cfg["sliding_window"] == 96
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert api.tiny_model(d, seed=0, window=96) is None  # this model is there: kept
    # Another window (or the plain model) in that directory is not this model: rebuilt.
    assert api.tiny_model(d, seed=0, window=64) and json.loads((d / "config.json").read_text())["sliding_window"] == 64
    assert api.tiny_model(d, seed=0) and "layer_types" not in json.loads((d / "config.json").read_text())
