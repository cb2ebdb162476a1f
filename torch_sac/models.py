"""Small built-in models for the demo, the command line and the benchmarks."""

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Block", "ConvBNReLU", "TinyGPT"]


class Block(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = self.dropout(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.dropout(self.proj(y))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class ConvBNReLU(nn.Module):
    """Conv2d 3x3 -> BatchNorm2d -> ReLU(inplace)."""

    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.bn = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4, depth=4, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, wrap=None):
        """``wrap(block, x)`` runs one block checkpointed; None runs it plainly."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x) if wrap is None else wrap(block, x)
        return self.head(x)
