"""The demo's model: a tiny Llama (about 3 M parameters) and a sampling loop for it.

The architecture is the real Hugging Face ``LlamaForCausalLM`` (RMSNorm, rotary
positions, grouped-query attention, SwiGLU), only small, so the demo exercises
the same adapter path as a 3 B model.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from zerofit.demo.tokenizer import ByteTokenizer


def demo_config(max_seq_len: int = 1024, tokenizer: ByteTokenizer | None = None) -> LlamaConfig:
    tok = tokenizer or ByteTokenizer()
    return LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_seq_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.eos_id,
        use_cache=False,
        attn_implementation="sdpa",
    )


def build_model(max_seq_len: int = 1024, seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised demo model on the CPU, fp32; the same ``seed`` gives the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(demo_config(max_seq_len))


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    tokenizer: ByteTokenizer,
    prompt: str,
    max_new_tokens: int = 200,
    top_k: int = 8,
    temperature: float = 0.8,
    seed: int = 0,
) -> str:
    """Top-k sampling with a plain loop (no KV cache: the model is tiny), on the model's own device.

    Returns the prompt followed by the generated text. ``top_k=1`` is greedy.
    """
    if max_new_tokens <= 0:
        return prompt
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", 1 << 30)
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.tensor([tokenizer.encode(prompt, bos=False)], dtype=torch.long)  # (1, T)
    for _ in range(max_new_tokens):
        window = ids[:, -limit:].to(device)
        logits = model(input_ids=window).logits[0, -1].float().cpu()  # (V,)
        logits[tokenizer.vocab_size :] = float("-inf")  # padded vocab rows, if any
        logits[tokenizer.bos_id] = float("-inf")
        top = torch.topk(logits / max(temperature, 1e-5), k=min(top_k, logits.numel()))
        choice = top.indices[torch.multinomial(torch.softmax(top.values, dim=-1), 1, generator=g)]
        if int(choice) == tokenizer.eos_id:
            break
        ids = torch.cat([ids, choice.view(1, 1)], dim=1)
    model.train(was_training)
    return tokenizer.decode(ids[0])


@torch.no_grad()
def eval_loss(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    """Mean causal-LM loss of ``model`` over ``batches`` (no gradients), on the model's own device."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    losses = [float(model(input_ids=b["input_ids"].to(device), labels=b["labels"].to(device)).loss) for b in batches]
    model.train(was_training)
    return sum(losses) / len(losses)
