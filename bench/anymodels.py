"""The benchmarks' models that are not one chain of decoder blocks (common.Workload's ``family``): an
encoder-decoder of T5's shapes, and a Llama-shaped U-Net. zerofit streams them in the hooked mode (docs/engine.md,
"the hooked mode"); DeepSpeed ZeRO-3 and FSDP stream any module, so these are where their reach is compared."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig, T5Config
from transformers.modeling_outputs import CausalLMOutput
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)


def t5_config(w) -> T5Config:
    """Flan-T5's shape at ``w``'s sizes: gated-GELU feed-forward, 64-wide heads, an untied head, no KV cache."""
    return T5Config(
        vocab_size=w.vocab,
        d_model=w.hidden,
        d_kv=64,
        d_ff=w.intermediate,
        num_layers=w.layers,
        num_decoder_layers=w.layers,
        num_heads=w.heads,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        use_cache=False,
    )


class UNetLlama(LlamaPreTrainedModel):
    """Llama's decoder layers arranged as a U-Net (U-ViT's long skips): the first half is the down path, whose
    outputs the second half takes back in reverse (``h + skip`` before each up layer), so no layer's input is only
    the layer before it: not a chain of blocks. Llama's embedding, RMSNorm, rotary positions and untied head; the
    loss is the next token's cross-entropy in fp32."""

    _no_split_modules = ["LlamaDecoderLayer"]

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids, labels=None, **_):
        h = self.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        rope = self.rotary_emb(h, positions)
        half, skips = len(self.layers) // 2, []
        for i, layer in enumerate(self.layers):
            if i >= half:
                h = h + skips.pop()
            h = layer(h, position_embeddings=rope, position_ids=positions)
            if i < half:
                skips.append(h)
        logits = self.lm_head(self.norm(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())
        return CausalLMOutput(loss=loss, logits=logits)
