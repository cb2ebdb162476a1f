#!/usr/bin/env python
"""The memory-budget policy (torch_sac.policies.budget_for_region): solver time, and the
activation-memory / step-time trade-off it buys on a GPT-style model.

Part 1, solver time. The C++ solver on instances of 100, 1,000, 2,000 and 10,000 op
calls, ``exact`` and ``greedy``, median of several runs, budgets of 10%, 50%
and 90% of all bytes. Two families:

* ``gpt``: the real profile of one GPT block (the model of part 2), repeated
  to the size wanted as if the region held that many blocks, every op's time
  jittered by +-10% (so ties do not make it easy);
* ``random``: random op-graph-shaped instances (allocating ops with 1-3
  storages, views and in-place ops aliasing earlier storages, ops on storage
  from outside the region), values uniform;
* ``corr``: the hard case for the exact solver: no aliasing, every op's
  value proportional to its bytes within +-1% (memory-bound ops timed
  precisely). The exact DP cannot prune here; ``exact`` gives up at its state
  limit and the row shows greedy's result with its certified gap (``auto``
  does the same and says so).

"solve" is the time inside the C++ ``solve()``; "call" is the Python call
including list conversion. "gap" is how far greedy's avoided cost is below
exact's (exact is optimal).

Part 2, memory / step time. A stack of pre-LN GPT blocks (tests/python/models.py
``GPTBlock``: attention written out with matmuls, softmax, dropout, GELU MLP,
in-place residual adds), each block checkpointed on its own: by default in a
``torch_sac.sac_context(policy)`` region (``--engine dropin``: with
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)``
and ``torch_sac.create_selective_checkpoint_contexts``):

* ``no checkpoint``: plain autograd, the reference for memory and time;
* ``torch checkpoint``: PyTorch's full checkpointing
  (``torch.utils.checkpoint``, recompute everything), the target's baseline;
* ``recompute_all``: full checkpointing with torch_sac's engine;
* ``save_matmuls``: save mm/addmm/bmm outputs (torchtitan-style);
* ``budget f``: ``torch_sac.policies.budget_for_region(block, (x,), fraction=f)``, the plan
  made once from block 0 and used for every block;
* ``budget @50% model``: the per-block budget chosen so the whole model keeps
  at most 50% of the un-checkpointed activation memory, including the block
  inputs every checkpointed model keeps (measured from ``recompute_all``).

Activation memory = bytes of the storages created during forward that are
still alive after it, not counting the model output and input
(``torch_sac._op_profile.LiveStorages``: a dispatch mode keeping weak
references, so measured in a separate, untimed forward). For the plain model
this equals the distinct storages autograd saves (cross-checked with
saved_tensors_hooks and printed). Step time = forward + backward, median over
rounds; the configurations run round-robin, one step each per round, so load
on a shared machine hits them alike. Overhead = step time minus the
no-checkpoint step time of the same round (median over rounds).

The target: at 50% of the un-checkpointed activation memory, the step-time
overhead is at most half that of PyTorch's full checkpointing.

Usage::

    python bench/bench_budget.py              # ~3 min on 1 thread
    python bench/bench_budget.py --quick      # smoke run
    python bench/bench_budget.py --json out.json
"""

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))

import torch_sac  # noqa: E402
from models import GPTBlock  # noqa: E402
from torch_sac._op_profile import LiveStorages, format_bytes, profile_region  # noqa: E402


# --------------------------------------------------------------------------
# Part 1: solver time
# --------------------------------------------------------------------------


def random_instance(rng, n):
    storage_bytes = [0]
    values, item_storages, owners = [], [], []
    for _ in range(n):
        u = rng.random()
        if u < 0.5 or not owners:
            k = 1 if rng.random() < 0.8 else int(rng.integers(2, 4))
            st = []
            for _ in range(k):
                storage_bytes.append(int(rng.integers(1, 1 << 22)))
                st.append(len(storage_bytes) - 1)
            owners.append(st)
            item_storages.append(st)
            values.append(float(rng.random()))
        elif u < 0.9:
            owner = owners[int(rng.integers(0, len(owners)))]
            item_storages.append([owner[int(rng.integers(0, len(owner)))]])
            values.append(float(rng.random() * 0.05))
        else:
            item_storages.append([0])
            values.append(float(rng.random() * 0.05))
    return storage_bytes, values, item_storages


def correlated_instance(rng, n):
    storage_bytes = rng.integers(1, 1 << 22, n).tolist()
    values = [b * float(rng.uniform(0.99, 1.01)) * 1e-9 for b in storage_bytes]
    return storage_bytes, values, [[i] for i in range(n)]


def gpt_instance(profile, rng, n):
    """The block's profile repeated until n op calls, times jittered."""
    records = [r for r in profile.records if r.saveable]
    storage_bytes, values, item_storages = [], [], []
    while len(values) < n:
        base = len(storage_bytes)
        storage_bytes.extend(s.nbytes if s.internal else 0 for s in profile.storages)
        for r in records:
            if len(values) == n:
                break
            values.append(r.seconds * float(rng.uniform(0.9, 1.1)))
            item_storages.append([base + s for s in r.storages])
    return storage_bytes, values, item_storages


def bench_solver(profile, sizes, runs):
    rng = np.random.default_rng(0)
    rows = []
    for n in sizes:
        for family in ("gpt", "random", "corr"):
            if family == "gpt":
                inst = gpt_instance(profile, rng, n)
            elif family == "random":
                inst = random_instance(rng, n)
            else:
                inst = correlated_instance(rng, n)
            total = sum(inst[0])
            for frac in (0.1, 0.5, 0.9):
                cap = int(total * frac)
                row = {"ops": n, "family": family, "budget": frac}
                for method in ("exact", "greedy"):
                    solve_t, call_t = [], []
                    for _ in range(runs):
                        t0 = time.perf_counter()
                        sol = torch_sac._C.budget_solve(
                            *inst, cap, "auto" if method == "exact" else method
                        )
                        call_t.append(time.perf_counter() - t0)
                        solve_t.append(sol["seconds"])
                    row[method] = {
                        "solve_ms": statistics.median(solve_t) * 1e3,
                        "call_ms": statistics.median(call_t) * 1e3,
                        "value": sol["value"],
                        "optimal": sol["optimal"],
                        "states": sol["states"],
                        "method": sol["method"],
                        "cert_gap": (sol["upper_bound"] - sol["value"]) / sol["upper_bound"]
                        if sol["upper_bound"]
                        else 0.0,
                    }
                ex, gr = row["exact"], row["greedy"]
                row["gap"] = (ex["value"] - gr["value"]) / ex["value"] if ex["value"] else 0.0
                rows.append(row)
    return rows


def print_solver(rows):
    print("\n== Solver time (C++ solve(), median; 'exact' column = solver='auto') ==")
    print(
        "gap: greedy below exact; cert: (upper_bound - value) / upper_bound of what auto returned"
    )
    hdr = (
        f"{'ops':>6} {'family':>7} {'budget':>6} | {'exact ms':>9} {'(call)':>8} {'states':>9} {'used':>6} "
        f"{'optimal':>7} {'cert':>8} | {'greedy ms':>9} {'(call)':>8} {'gap':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        ex, gr = r["exact"], r["greedy"]
        print(
            f"{r['ops']:>6} {r['family']:>7} {r['budget']:>6.0%} | {ex['solve_ms']:>9.2f} {ex['call_ms']:>8.2f} "
            f"{ex['states']:>9} {ex['method']:>6} {str(ex['optimal']):>7} {ex['cert_gap']:>8.1e} | "
            f"{gr['solve_ms']:>9.2f} {gr['call_ms']:>8.2f} {r['gap']:>9.2e}"
        )


# --------------------------------------------------------------------------
# Part 2: memory / step time
# --------------------------------------------------------------------------


class NanoGPTBlock(torch.nn.Module):
    """A nanoGPT block: pre-LN, fused qkv, causal SDPA, GELU MLP, out-of-place
    residual adds; dropout 0 (nanoGPT's pretraining setting)."""

    def __init__(self, d_model, n_head, dropout=0.0):
        super().__init__()
        self.n_head, self.p = n_head, dropout
        self.ln_1 = torch.nn.LayerNorm(d_model)
        self.c_attn = torch.nn.Linear(d_model, 3 * d_model)
        self.c_proj = torch.nn.Linear(d_model, d_model)
        self.ln_2 = torch.nn.LayerNorm(d_model)
        self.c_fc = torch.nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = torch.nn.Linear(4 * d_model, d_model)
        self.drop = torch.nn.Dropout(dropout)

    def attn(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True
        )
        return self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.drop(self.mlp_proj(torch.nn.functional.gelu(self.c_fc(self.ln_2(x)))))


# name -> (description, block factory, default sizes)
MODELS = {
    "nanogpt": (
        "nanoGPT-style blocks: causal SDPA, out-of-place residuals, dropout 0",
        lambda a: NanoGPTBlock(a.d_model, a.heads),
        dict(layers=4, d_model=256, heads=4, batch=8, seq=256),
    ),
    "testgpt": (
        "tests/python/models.py GPTBlock: attention written out with matmuls + softmax, "
        "dropout 0.1 (bernoulli_/div_ in place), in-place residual adds",
        lambda a: GPTBlock(d_model=a.d_model, n_head=a.heads, dropout=0.1, max_len=a.seq),
        dict(layers=4, d_model=128, heads=4, batch=8, seq=128),
    ),
}


class Model(torch.nn.Sequential):
    pass


def build_model(args):
    torch.manual_seed(0)
    factory = MODELS[args.model][1]
    return Model(*[factory(args) for _ in range(args.layers)]).train()


def make_input(args):
    g = torch.Generator().manual_seed(1)
    return torch.randn(args.batch, args.seq, args.d_model, generator=g).requires_grad_(True)


# How each block is checkpointed with a policy: "region" (torch_sac.sac_context)
# or "dropin" (torch.utils.checkpoint + torch_sac's drop-in contexts): the
# engine names of apply_sac(engine=...).
ENGINE = "region"
TORCH_CHECKPOINT = "torch checkpoint"  # sentinel policy: torch.utils.checkpoint, full recompute


def forward(model, x, policy):
    if policy is None:
        return model(x)
    h = x
    if policy is TORCH_CHECKPOINT:
        for block in model:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
    elif ENGINE == "region":
        for block in model:
            with torch_sac.sac_context(policy):
                h = block(h)
    else:
        ctx_fn = functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)
        for block in model:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False, context_fn=ctx_fn)
    return h


def activation_bytes(model, x, policy):
    torch.manual_seed(0)
    with LiveStorages() as live:
        out = forward(model, x, policy)
    nbytes = live.live_bytes(exclude=[out, x])
    out.sum().backward()
    model.zero_grad(set_to_none=True)
    x.grad = None
    return nbytes


def autograd_saved_bytes(model, x):
    """Distinct storages autograd saves in the plain forward (cross-check)."""
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        saved[st._cdata] = st.nbytes()
        return t

    params = {p.untyped_storage()._cdata for p in model.parameters()} | {x.untyped_storage()._cdata}
    params |= {b.untyped_storage()._cdata for b in model.buffers()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    nbytes = sum(
        b for k, b in saved.items() if k not in params and k != out.untyped_storage()._cdata
    )
    del out
    return nbytes


def step(model, x, policy):
    out = forward(model, x, policy)
    out.sum().backward()
    model.zero_grad(set_to_none=True)
    x.grad = None


def bench_tradeoff(args, fractions):
    model = build_model(args)
    x = make_input(args)
    block_x = x.detach().clone().requires_grad_(True)
    t0 = time.perf_counter()
    plan = torch_sac.policies.budget_for_region(
        model[0], (block_x,), fraction=1.0, repeats=args.repeats
    )
    profile_s = time.perf_counter() - t0
    configs = [
        ("no checkpoint", None),
        (TORCH_CHECKPOINT, TORCH_CHECKPOINT),
        ("recompute_all", torch_sac.policies.recompute_all()),
        ("save_matmuls", torch_sac.policies.save_matmuls()),
    ]
    plans = {}
    for f in fractions:
        p = plan.with_budget(fraction=f)
        plans[f"budget {f:.0%}"] = p
        configs.append((f"budget {f:.0%}", p))

    mem = {name: activation_bytes(model, x, pol) for name, pol in configs}
    # The per-block budget that keeps the whole model at 50%: block inputs are
    # kept by any checkpointed model (what recompute_all keeps).
    target = 0.5 * mem["no checkpoint"]
    per_block = max(0, int((target - mem["recompute_all"]) / args.layers))
    p50 = plan.with_budget(bytes=per_block)
    plans["budget @50% model"] = p50
    configs.append(("budget @50% model", p50))
    mem["budget @50% model"] = activation_bytes(model, x, p50)

    # Step times, round-robin.
    for name, pol in configs:
        for _ in range(args.warmup):
            step(model, x, pol)
    times = {name: [] for name, _ in configs}
    overhead = {name: [] for name, _ in configs}
    gc.collect()
    for _ in range(args.rounds):
        this_round = {}
        for name, pol in configs:
            t0 = time.perf_counter()
            step(model, x, pol)
            this_round[name] = time.perf_counter() - t0
            times[name].append(this_round[name])
        for name in this_round:
            overhead[name].append(this_round[name] - this_round["no checkpoint"])

    rows = []
    for name, _ in configs:
        p = plans.get(name)
        rows.append(
            {
                "config": name,
                "activation_bytes": mem[name],
                "memory_fraction": mem[name] / mem["no checkpoint"],
                "step_ms": statistics.median(times[name]) * 1e3,
                "overhead_ms": statistics.median(overhead[name]) * 1e3,
                "plan_bytes_per_block": None if p is None else p.saved_bytes,
                "plan_budget_per_block": None if p is None else p.budget_bytes,
                "saved_calls": None if p is None else len(p.chosen),
                "avoided_fraction": None if p is None else p.avoided_cost / p.total_cost,
                "solver": None if p is None else p.solver + (" (optimal)" if p.optimal else ""),
            }
        )
    info = {
        "block_activation_bytes": plan.activation_bytes,
        "block_ops": len(plan.items),
        "profile_seconds": profile_s,
        "autograd_saved_bytes": autograd_saved_bytes(model, x),
    }
    return rows, info


def print_tradeoff(rows, info, args):
    print(
        f"\n== {args.model}: {MODELS[args.model][0]}; {args.layers} blocks, d_model {args.d_model}, "
        f"{args.heads} heads, batch {args.batch}, seq {args.seq}; {torch.get_num_threads()} thread(s), "
        f"adapter {torch_sac.adapter()}, engine {ENGINE} =="
    )
    print(
        f"per block: {info['block_ops']} op calls, un-checkpointed activations "
        f"{format_bytes(info['block_activation_bytes'])}; profiling took {info['profile_seconds']:.2f} s"
    )
    print(
        f"whole model, no checkpoint: live after forward {format_bytes(rows[0]['activation_bytes'])}, "
        f"autograd saved (distinct storages) {format_bytes(info['autograd_saved_bytes'])}"
    )
    hdr = (
        f"{'config':<20} {'activations':>11} {'of plain':>8} {'step ms':>8} {'overhead ms':>11} "
        f"{'of full ckpt':>12} | {'plan/block':>10} {'budget/block':>12} {'saved':>5} {'avoided':>7} solver"
    )
    print(hdr)
    print("-" * len(hdr))
    full = next(r for r in rows if r["config"] == TORCH_CHECKPOINT)["overhead_ms"]
    for r in rows:
        of_full = r["overhead_ms"] / full if full > 0 else float("nan")
        plan_cols = ""
        if r["plan_bytes_per_block"] is not None:
            plan_cols = (
                f"{format_bytes(r['plan_bytes_per_block']):>10} {format_bytes(r['plan_budget_per_block']):>12} "
                f"{r['saved_calls']:>5} {r['avoided_fraction']:>7.0%} {r['solver']}"
            )
        print(
            f"{r['config']:<20} {format_bytes(r['activation_bytes']):>11} {r['memory_fraction']:>8.0%} "
            f"{r['step_ms']:>8.1f} {r['overhead_ms']:>11.1f} {of_full:>12.0%} | {plan_cols}"
        )
    at50 = next(r for r in rows if r["config"] == "budget @50% model")
    ratio = at50["overhead_ms"] / full if full > 0 else float("nan")
    ok = at50["memory_fraction"] <= 0.5 + 1e-9 and ratio <= 0.5
    print(
        "\nTarget: at <= 50% of the un-checkpointed activation memory, overhead <= 1/2 of full checkpointing."
    )
    print(
        f"Measured: budget @50% model keeps {at50['memory_fraction']:.1%} of the activation memory with "
        f"{at50['overhead_ms']:.1f} ms overhead vs {full:.1f} ms for {TORCH_CHECKPOINT} ({ratio:.0%}): "
        f"{'MET' if ok else 'NOT MET'}"
    )
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: fewer sizes and rounds, smaller models"
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: steadier timings)"
    )
    ap.add_argument(
        "--models", default="nanogpt,testgpt", help=f"comma-separated, from {sorted(MODELS)}"
    )
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="op replays when profiling")
    ap.add_argument("--solver-runs", type=int, default=7)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--engine",
        # "contexts": the drop-in's former name.
        type=lambda name: "dropin" if name == "contexts" else name,
        choices=("region", "dropin"),
        default="region",
        help="how blocks are checkpointed with a policy: torch_sac.sac_context (default) or "
        "torch.utils.checkpoint with torch_sac's drop-in contexts",
    )
    args = ap.parse_args()
    global ENGINE
    ENGINE = args.engine
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {sorted(MODELS)}")
    if args.quick:
        args.rounds, args.solver_runs = 3, 3
    torch.set_num_threads(args.threads)

    def model_args(name):
        a = argparse.Namespace(**vars(args))
        a.model = name
        for k, v in MODELS[name][2].items():
            setattr(a, k, v)
        if args.quick:
            a.layers, a.seq = 2, min(a.seq, 64)
        return a

    # Part 1, with the first model's block profile as the "gpt" family.
    first = model_args(models[0])
    block = build_model(first)[0]
    profile, _ = profile_region(block, (make_input(first),), repeats=1)
    sizes = (100, 1000) if args.quick else (100, 1000, 2000, 10000)
    solver_rows = bench_solver(profile, sizes, args.solver_runs)
    print_solver(solver_rows)

    fractions = (
        (0.1, 0.5, 1.0) if args.quick else (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    )
    results = {
        "solver": solver_rows,
        "models": {},
        "threads": args.threads,
        "adapter": torch_sac.adapter(),
    }
    for name in models:
        a = model_args(name)
        rows, info = bench_tradeoff(a, fractions)
        ok = print_tradeoff(rows, info, a)
        results["models"][name] = {
            "rows": rows,
            "info": info,
            "target_met": ok,
            "sizes": MODELS[name][2],
        }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
