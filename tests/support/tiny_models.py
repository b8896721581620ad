"""Tiny models for CPU tests: Hugging Face configs of each family, and one plain nn.Module."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 97


def llama(tied: bool = True, layers: int = 3, dropout: float = 0.0) -> nn.Module:
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            tie_word_embeddings=tied,
            attention_dropout=dropout,
            attn_implementation="sdpa",
        )
    )


def llama_wide() -> nn.Module:
    """:func:`llama` 8x wider (about 0.6 M parameters): host state of a few MB, for measuring a node's share of it
    ([Note: nodes hold a slice of the state]) where the pages at each slice's edges are a small part."""
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            attn_implementation="sdpa",
        )
    )


def llama_lora() -> nn.Module:
    """PEFT LoRA (r 4, every linear of the blocks, A and B both random) over :func:`llama` (untied)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        llama(tied=False),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False),
    )


def qwen2() -> nn.Module:  # attention projections with biases
    return Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            attn_implementation="sdpa",
        )
    )


def qwen3() -> nn.Module:
    return Qwen3ForCausalLM(
        Qwen3Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            head_dim=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            attn_implementation="sdpa",
        )
    )


def _small(**kw) -> dict:
    """The tiny models' shared config fields: 32 wide, 2 blocks, 4 heads over 2 key/value heads, SDPA."""
    return (
        dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            attn_implementation="sdpa",
        )
        | kw
    )


def mistral(window: int | None = None) -> nn.Module:
    """Mistral; ``window``: a sliding window (shorter than the test sequences), else its config's default."""
    extra = {} if window is None else {"sliding_window": window}
    return MistralForCausalLM(MistralConfig(**_small(max_position_embeddings=64, **extra)))


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**_small(num_local_experts=4, num_experts_per_tok=2)))


def qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**_small(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)))


def gpt2(dropout: float = 0.0) -> nn.Module:
    return GPT2LMHeadModel(
        GPT2Config(
            n_embd=32,
            n_layer=3,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=64,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="sdpa",
        )
    )


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 3 * d)
        self.down = nn.Linear(3 * d, d, bias=False)

    def forward(self, x, scale: float = 1.0):
        return x + scale * self.down(F.gelu(self.up(self.norm(x))))


class PlainLM(nn.Module):
    """Not a Hugging Face model: embedding, a list of residual MLP blocks, a head; returns the loss."""

    def __init__(self, d: int = 24, n: int = 4, vocab: int = VOCAB):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x, scale=0.5)
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class LoopedLM(PlainLM):
    """Not block-sequential: the block list applied twice (weight sharing across depth); refused only by the
    post pass, after the blocks' forward ran."""

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for _ in range(2):
            for b in self.blocks:
                x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class EarlyExitLM(PlainLM):
    """Not block-sequential: never calls its last block."""

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for b in self.blocks[:-1]:
            x = b(x)
        logits = self.head(x)
        return logits if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class MLPRegressor(nn.Module):
    """No block list at all: trained through the generic path."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, VOCAB))

    def forward(self, input_ids, labels):
        return F.cross_entropy(self.net(input_ids).flatten(0, 1), labels.flatten())


def batches(steps: int, G: int, B: int = 2, T: int = 16, seed: int = 1) -> list[list[dict]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(G):
            ids = torch.randint(0, VOCAB, (B, T), generator=g)
            mbs.append({"input_ids": ids, "labels": ids})
        out.append(mbs)
    return out


def reference_train(
    model: nn.Module,
    data: list[list[dict]],
    lr: float = 1e-3,
    wd: float = 0.01,
    clip: float = 0.0,
    sched=None,
    param_groups=None,
    fused: bool = False,
) -> list[float]:
    """Plain PyTorch training, the textbook way: loss / G accumulated, optional global-norm clipping,
    torch.optim.AdamW (over ``param_groups`` of ``model``'s parameters when given), an optional LambdaLR.
    Returns the mean loss of each step."""
    params = model.parameters() if param_groups is None else param_groups
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=wd, fused=fused or None)
    lrs = torch.optim.lr_scheduler.LambdaLR(opt, sched) if sched else None
    losses = []
    for mbs in data:
        opt.zero_grad()
        total = 0.0
        for mb in mbs:
            out = model(**mb)
            loss = out if isinstance(out, torch.Tensor) else out.loss
            (loss / len(mbs)).backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if lrs:
            lrs.step()
        losses.append(total / len(mbs))
    return losses


def assert_masters(engine, ref: nn.Module) -> None:
    """The engine's master weights are ``ref``'s parameters, at fp32 tolerances."""
    master = engine.master_state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(master[name], p.detach(), msg=lambda m, name=name: f"{name}: {m}")


def fp16_reference_train(
    master: nn.Module, mbs: list[dict], steps: int, lr: float, scaler, clip: float = 0.0, param_groups=None
) -> tuple[list[float], list[float]]:
    """fp16 compute on a copy of fp32 master weights with dynamic loss scaling (``scaler``: a
    DynamicLossScaler), gradients summed in fp32 over ``mbs``, optional global-norm clipping,
    torch.optim.AdamW on the master (over ``param_groups`` of its parameters when given). The same batch
    every step. Returns (losses, scales)."""
    work = copy.deepcopy(master).half()
    opt = torch.optim.AdamW(master.parameters() if param_groups is None else param_groups, lr=lr, weight_decay=0.01)
    G = len(mbs)
    losses, scales = [], []
    for _ in range(steps):
        with torch.no_grad():
            for p16, p32 in zip(work.parameters(), master.parameters()):
                p16.copy_(p32)
        s = scaler.scale
        acc = [torch.zeros_like(p) for p in master.parameters()]
        total = 0.0
        for mb in mbs:
            work.zero_grad()
            loss = work(**mb).loss
            (loss * (s / G)).backward()
            for a, p16 in zip(acc, work.parameters()):
                a += p16.grad.float()
            total += loss.item()
        losses.append(total / G)
        scales.append(s)
        norm = torch.sqrt(sum((a.double() ** 2).sum() for a in acc))
        if scaler.update(not bool(torch.isfinite(norm))):
            continue
        factor = 1.0 / s
        if clip and float(norm) / s > clip:
            factor *= clip / (float(norm) / s + 1e-6)
        for a, p32 in zip(acc, master.parameters()):
            p32.grad = a * factor
        opt.step()
    return losses, scales


def ds_losses(engine, mbs: list[dict]) -> list[torch.Tensor]:
    """The DeepSpeed tutorial loop over ``mbs`` (forward, backward, step per micro-batch); each micro-batch's
    loss, detached, in fp32."""
    losses = []
    for mb in mbs:
        out = engine(**mb)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.detach().float())
    return losses


def ds_step(engine, mbs: list[dict]) -> float:
    """One optimizer step through the DeepSpeed-shaped API; returns the mean loss."""
    return sum(loss.item() for loss in ds_losses(engine, mbs)) / len(mbs)


def upload_labels(engine) -> list[str]:
    """The labels of the last step's weight uploads (engine.trace()), assisted updates left out;
    a label ending in "(16)" read a 16-bit host copy."""
    return [e["label"] for e in engine.trace() if e["lane"] == "upload" and "+adamw" not in e["label"]]


def initial_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of the parameters (tied ones once), before training."""
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def assert_updates_close(engine, before: dict[str, torch.Tensor], ref: nn.Module, rtol: float) -> None:
    """16-bit compute: each parameter's total update (final master - initial) matches the reference's within
    ``rtol`` of the reference update's norm. Rounding in 16-bit compute moves single elements, so weights are
    not compared elementwise; a block whose update was skipped, doubled or applied to the wrong unit is off
    by ~100% and fails."""
    master = engine.master_state_dict()
    for n, p in ref.named_parameters():
        d_ref = p.detach().float().cpu() - before[n]
        d_eng = master[n] - before[n]
        err = float((d_eng - d_ref).norm() / d_ref.norm().clamp_min(1e-12))
        assert err < rtol, f"{n}: update differs from the reference by {err:.3g} of its norm (limit {rtol})"


def bench_module(name: str):
    """A module of bench/ (not a package), loaded from its file: ``"trace"``, ``"probes/live_bytes"``."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location("bench_" + name.replace("/", "_"), path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
