"""Small models that are not one chain of blocks, for the hooked mode's tests ([Note: the hooked mode],
engine/model/hooked.py): residuals around the blocks with a long skip, a U-Net (the up path takes the down path's
outputs), and two towers with a module applied twice. Each takes ``input_ids`` and ``labels`` (batch, T) and returns a
dict with ``loss`` and ``logits``, as a language model does, so tiny_models' batches drive them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers.utils import ModelOutput

VOCAB, WIDTH = 256, 16


@dataclass
class Out(ModelOutput):
    """``loss`` and ``logits``, by key and by attribute, as a transformers model returns them."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def _loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) if labels is not None else None


class Residual(nn.Module):
    """h = h + block(h) over a ModuleList, then the head reads h + the embedding (a skip around every block)."""

    def __init__(self, layers: int = 4, d: int = WIDTH):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, labels=None, **_):
        h0 = h = self.emb(input_ids)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(self.norm(h + h0))
        return Out(_loss(logits, labels), logits)


class UNet(nn.Module):
    """Down path d -> 2d -> 4d, up path 4d -> 2d -> d, each up stage taking the matching down stage's output
    (concatenated); dropout in the stages (a recompute replays its random numbers)."""

    def __init__(self, d: int = WIDTH, p: float = 0.1):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.down = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(d, 2 * d), nn.Dropout(p), nn.GELU()),
                nn.Sequential(nn.Linear(2 * d, 4 * d), nn.Dropout(p), nn.GELU()),
            ]
        )
        self.mid = nn.Linear(4 * d, 4 * d)
        self.up = nn.ModuleList(
            [nn.Sequential(nn.Linear(8 * d, 2 * d), nn.GELU()), nn.Sequential(nn.Linear(4 * d, d), nn.GELU())]
        )
        self.head = nn.Linear(2 * d, VOCAB)

    def forward(self, input_ids, labels=None, **_):
        x = self.emb(input_ids)
        skips = [x]
        for stage in self.down:
            skips.append(stage(skips[-1]))
        h = self.mid(skips[-1])
        for stage, skip in zip(self.up, reversed(skips[1:])):
            h = stage(torch.cat([h, skip], dim=-1))
        logits = self.head(torch.cat([h, skips[0]], dim=-1))
        return Out(_loss(logits, labels), logits)


class TwoTowers(nn.Module):
    """Two towers over the same tokens (one of them reversed), a shared projection applied to both (a module called
    twice in a step), their sum into the head."""

    def __init__(self, d: int = WIDTH, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.left = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.right = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.shared = nn.Linear(d, d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, input_ids, labels=None, **_):
        x = self.emb(input_ids)
        a, b = x, x.flip(1)
        for la, lb in zip(self.left, self.right):
            a, b = torch.tanh(la(a)), torch.tanh(lb(b))
        logits = self.head(self.shared(a) + self.shared(b).flip(1))
        return Out(_loss(logits, labels), logits)
