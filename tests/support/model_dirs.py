"""Hugging Face model directories for tests, made offline: a tiny model of a family, saved sharded in a dtype,
with the tiny test tokenizer (tests/support/tiny_tokenizer.py) beside it, as a user's downloaded model looks."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from tests.support.tiny_tokenizer import build_tokenizer

# prompts of the test tokenizer's words on which a tiny fp32 folder held in bf16 answers some otherwise (greedy)
TWELVE = [
    "Hello there",
    "The quick brown fox",
    "def train(model",
    "The answer is 42",
    "x",
    "Streaming the",
    "Once upon a time",
    "import torch",
    "The weights stream",
    "Good morning",
    "1 2 3 4",
    "What is the capital",
]


def make_model_dir(
    path: Path,
    family: str = "llama",
    dtype: torch.dtype = torch.bfloat16,
    tied: bool = False,
    layers: int = 2,
    shard: str = "40KB",
    seed: int = 0,
) -> Path:
    """Save a freshly initialised tiny model (vocabulary = the test tokenizer's) and the tokenizer into ``path``."""
    tok = build_tokenizer(path)
    vocab = len(tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if family == "llama":
            model = LlamaForCausalLM(
                LlamaConfig(
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=layers,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    vocab_size=vocab,
                    max_position_embeddings=256,
                    tie_word_embeddings=tied,
                    bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id,
                )
            )
        elif family == "gpt2":
            model = GPT2LMHeadModel(
                GPT2Config(
                    n_embd=32,
                    n_layer=layers,
                    n_head=4,
                    vocab_size=vocab,
                    n_positions=256,
                    bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id,
                )
            )
        elif family == "t5":  # an encoder-decoder: [Note: pairs for an encoder-decoder]
            from transformers import T5Config, T5ForConditionalGeneration

            cfg = T5Config(
                vocab_size=vocab,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=layers,
                num_decoder_layers=layers,
                num_heads=4,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
                decoder_start_token_id=tok.pad_token_id,
                dropout_rate=0.0,  # (a loss comparable with an evaluation-mode forward)
            )
            model = T5ForConditionalGeneration(cfg)
        else:
            raise ValueError(f"unknown family {family!r}")
    model.to(dtype).save_pretrained(path, max_shard_size=shard)
    return path


def write_data(folder: Path) -> list[Path]:
    """A few small files in every supported format (text, prompt/completion, chat)."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("The quick brown fox jumps over the lazy dog. " * 20)
    (folder / "more.txt").write_text("Streaming the weights through the GPU, block by block. " * 15)
    with open(folder / "qa.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"What is {i} plus {i}? ", "completion": f"It is {2 * i}."}) + "\n")
    with open(folder / "chat.jsonl", "w") as f:
        for i in range(8):
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"Hello {i}, how are you?"},
                            {"role": "assistant", "content": f"I am fine, thank you {i}."},
                        ]
                    }
                )
                + "\n"
            )
    return [folder / "notes.txt", folder / "more.txt", folder / "qa.jsonl", folder / "chat.jsonl"]
