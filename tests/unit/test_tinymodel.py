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
