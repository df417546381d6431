"""A tiny random-weight Llama with an offline-trained BPE tokenizer: no hub, deterministic per seed.

Used by the CPU demo and the tests. Random weights with a large initializer_range keep greedy logits away
from ties, so token-for-token comparisons are sensitive to the KV they decode from.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

# Enough words for a few thousand BPE merges; numbers and arithmetic words so gsm8k text tokenizes sensibly.
_WORDS = """the of and to in is was for on that with as by at from it an be this are or his her they which
one two three four five six seven eight nine ten hundred thousand dollars cents hours minutes days weeks
many much more less each every total how what who when where why answer question number numbers sum
buys sells has had have gets got makes made takes took gives gave left remaining spent earns paid cost
costs price per twice half third quarter times plus minus equals apples books pens cookies miles friends
students class school store farm eggs cups boxes bags pages trees cars dogs cats birds water money day
week month year old older younger than after before then so if she he we you I Natalie James Mary John
let think step first second next finally therefore because result calculate multiply divide add subtract
""".split()

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _corpus(seed: int, lines: int = 6000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 24)
        words = [rng.choice(_WORDS) if rng.random() > 0.15 else str(rng.randint(0, 9999)) for _ in range(n)]
        punct = rng.choice([".", "?", "!", ",", ":", " =", " +", " *", " $", "%"])
        out.append(" ".join(words) + punct + rng.choice(["", " #### " + str(rng.randint(0, 500))]))
    return out


def build_tiny_model(out_dir: str | Path, seed: int = 0, vocab_size: int = 2048, window: int | None = None) -> Path:
    """Write config, bf16 safetensors weights, tokenizer and chat template to out_dir; returns it.

    `window`: a hybrid-attention model instead, 4 layers with sliding-window (`window` tokens) and full attention
    in turn. vLLM's Llama reads `layer_types` per layer (vllm/model_executor/models/llama.py), so its hybrid KV
    cache manager keeps one KV cache group per kind (docs/notes/hybrid-attention-research.md); transformers'
    own Llama ignores the field, which no gate relies on (the reference is an aggregated vLLM server)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=256, intermediate_size=512, num_hidden_layers=4 if window else 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        initializer_range=0.2, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id,
        **({"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": window} if window else {}),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "pdctl-tiny.json").write_text(json.dumps({"seed": seed, "vocab_size": len(fast), "sliding_window": window,
                                                     "fingerprint": fingerprint(out)}, indent=2))
    return out


def fingerprint(model_dir: str | Path) -> str:
    """Hash of the weights and tokenizer, to show two builds with one seed are the same model."""
    h = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json"):
        h.update((Path(model_dir) / name).read_bytes())
    return h.hexdigest()[:16]
