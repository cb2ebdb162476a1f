"""Trains a small GPT-style model with torch_sac and reports what SAC did.

    python -m torch_sac.demo [--steps N] [--policy save_matmuls|recompute_all|save_all]

Each transformer block runs under ``torch.utils.checkpoint`` with torch_sac's
contexts. After training, the script prints per op what was saved, dropped
and recomputed in the last step, and checks that the gradients equal those of
the same step without checkpointing.
"""

import argparse
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torch_sac

POLICIES = {
    "save_matmuls": torch_sac.policies.save_matmuls,
    "recompute_all": torch_sac.policies.recompute_all,
    "save_all": torch_sac.policies.save_all,
}


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


class TinyGPT(nn.Module):
    def __init__(self, vocab=64, dim=32, heads=4, depth=4, dropout=0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(depth))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens, context_fn=None):
        x = self.embed(tokens)
        for block in self.blocks:
            if context_fn is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
        return self.head(x)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--policy", choices=sorted(POLICIES), default="save_matmuls")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TinyGPT()
    reference = TinyGPT()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = POLICIES[args.policy]()
    print(f"torch {torch.__version__}, torch_sac adapter: {torch_sac.adapter()}, policy: {policy!r}")

    contexts = []

    def context_fn():
        pair = torch_sac.create_selective_checkpoint_contexts(policy)
        contexts.append(pair[0])
        return pair

    for step in range(args.steps):
        tokens = torch.randint(0, 64, (8, 16))
        contexts.clear()
        optimizer.zero_grad()
        torch.manual_seed(1000 + step)
        loss = F.cross_entropy(model(tokens, context_fn).flatten(0, 1), tokens.roll(-1, 1).flatten())
        loss.backward()
        if step == args.steps - 1:
            torch.manual_seed(1000 + step)
            reference.zero_grad()
            ref_loss = F.cross_entropy(reference(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten())
            ref_loss.backward()
            same = all(
                torch.equal(p.grad, r.grad) for p, r in zip(model.parameters(), reference.parameters())
            )
        optimizer.step()
        reference.load_state_dict(model.state_dict())
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    print(f"\nLast step, {len(contexts)} checkpointed blocks; per op over all blocks:")
    rows = {}
    for ctx in contexts:
        for op, saved, dropped, recomputed in ctx.op_summary():
            row = rows.setdefault(op, [0, 0, 0])
            row[0] += saved
            row[1] += dropped
            row[2] += recomputed
    print(f"  {'op':<44} {'saved':>6} {'dropped':>8} {'recomputed':>11}")
    for op, (saved, dropped, recomputed) in rows.items():
        print(f"  {op:<44} {saved:>6} {dropped:>8} {recomputed:>11}")
    totals = {k: sum(c.stats()[k] for c in contexts) for k in contexts[0].stats()}
    print(
        f"\n  ops seen by the policy: {totals['policy_calls']}, saved: {totals['saved_ops']} "
        f"({totals['saved_bytes'] / 1024:.1f} KiB cached), recomputed in backward: "
        f"{totals['recomputed_ops']}, cache hits: {totals['cache_hits']}"
    )
    print(f"  gradients bitwise equal to the run without checkpointing: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
