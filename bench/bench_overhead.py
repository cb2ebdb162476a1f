#!/usr/bin/env python
"""Per-op overhead of torch_sac's interception versus PyTorch's own SAC contexts.

Workloads (CPU, one thread, forward + backward per step):

* ``elementwise``: a chain of small elementwise ops (sin, mul, add, tanh, ...)
  on a 16-element tensor that requires grad;
* ``gpt``: one tiny pre-LN GPT block (LayerNorm, causal attention written
  with matmuls + softmax, GELU MLP); batch 2, seq 8, dim 16;
* ``region``: a single op (sin) per checkpointed region: its added time is
  essentially the fixed cost per region (creating and entering the contexts),
  printed to help read the per-op numbers; not checked against the targets.

Every checkpointed variant goes through
``torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=...)``
so only ``context_fn`` differs:

* ``eager``                  - no checkpoint at all (reference only);
* ``checkpoint``             - plain checkpoint, no context_fn (the baseline);
* ``torch SAC, op list``     - PyTorch's create_selective_checkpoint_contexts
  with ``[aten.mm.default, aten.addmm.default]``;
* ``torch SAC, callable``    - PyTorch's contexts with an equivalent Python
  callable policy;
* ``torch_sac, save_ops``    - torch_sac with the same op list as a built-in
  C++ policy (``torch_sac.policies.save_ops``), no Python call per op;
* ``torch_sac, callable``    - torch_sac with the same Python callable;
* ``torch_sac, recompute_all`` - torch_sac's cheapest built-in (extra row);
* ``torch_sac region, save_ops`` / ``torch_sac region, callable`` - the region
  engine (``with torch_sac.sac_context(policy): y = fn(x)``), no
  ``torch.utils.checkpoint``: backward replays the dropped ops from C++.

The interception adapter is chosen when torch_sac is imported
(``TORCH_SAC_ADAPTER``), so the parent process runs this same script once per
adapter as a worker subprocess (``--worker key`` / ``--worker python``), reads
the JSON each worker prints on stdout and prints one combined table. The
PyTorch rows are measured in both workers, and every ratio is computed within
one worker process (same process, same interleaved timing rounds).

Two measures, both per op intercepted by the checkpointed step:

* **interception** (drop-in rows): (variant step time - plain checkpoint step
  time) / ops. What a context_fn adds to ``torch.utils.checkpoint``. Targets:
  key adapter <= 0.1x PyTorch SAC's, Python-key adapter <= 0.5x.
* **SAC cost** (drop-in and region rows): (variant step time - eager step
  time) / ops: everything checkpointing adds to the un-checkpointed step
  (recompute or replay, interception, hooks, bookkeeping), against PyTorch
  SAC's with the same kind of policy. Targets: region <= 0.2x and drop-in
  <= 0.4x under the key adapter, <= 0.35x and <= 0.6x under the Python-key
  adapter. The drop-in's floor is plain ``checkpoint``'s own cost (its row's
  ratio), which re-runs the Python forward.

 Variants run round-robin, one rep (many iterations) of
each in turn; the added time is the median over reps of the difference to the
plain-checkpoint (or eager) rep of the same round (paired, so load bursts on a shared
machine largely cancel). "Ops intercepted" is every op a TorchDispatchMode
sees inside the checkpointed region in forward plus recompute (counted once
with a counting mode used as context_fn; torch_sac's ``stats()`` are reported
alongside as a cross-check: they count the same ops minus the SAC-ignored
metadata/detach ops).

Usage::

    python bench/bench_overhead.py                 # both adapters, ~2 min
    python bench/bench_overhead.py --quick         # smoke run, ~20 s
    python bench/bench_overhead.py --json out.json
    TORCH_SAC_ADAPTER=key python bench/bench_overhead.py --worker key  # one worker
"""

import argparse
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

ADAPTERS = ("key", "python")
WORKLOADS = ("elementwise", "gpt", "region")
# Workloads whose per-op figures are checked against the targets. "region" is
# a one-op region: its added time is the fixed cost per checkpointed region
# (context creation, enter/exit), shown to help read the per-op numbers.
TARGET_WORKLOADS = ("elementwise", "gpt")

# Targets for torch_sac's added per-op overhead, as a fraction of PyTorch SAC's.
TARGETS = {"key": 0.1, "python": 0.5}
# Targets for the SAC cost over eager, as a fraction of PyTorch SAC's, per engine.
COST_TARGETS = {
    "key": {"region": 0.2, "drop-in": 0.4},
    "python": {"region": 0.35, "drop-in": 0.6},
}

# (name, kind): kind is used to pick the matching PyTorch SAC reference.
VARIANTS = [
    ("eager", "ref"),
    ("checkpoint", "baseline"),
    ("torch SAC, op list", "torch-list"),
    ("torch SAC, callable", "torch-callable"),
    ("torch_sac, save_ops", "sac-list"),
    ("torch_sac, callable", "sac-callable"),
    ("torch_sac, recompute_all", "sac-builtin"),
    ("torch_sac region, save_ops", "region-list"),
    ("torch_sac region, callable", "region-callable"),
]


def engine_of(kind):
    """'region', 'drop-in' or None (PyTorch's rows and the references)."""
    if kind.startswith("region"):
        return "region"
    return "drop-in" if kind.startswith("sac") else None


def same_torch_variant(kind):
    """PyTorch SAC's row with the same kind of policy as a torch_sac row."""
    return "torch SAC, callable" if kind.endswith("callable") else "torch SAC, op list"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# Worker: runs inside one process with one adapter.
# --------------------------------------------------------------------------


def build_workloads(torch, n_chain):
    """name -> (fn, inputs, grad_targets); fn(x) is the checkpointed region."""
    import torch.nn as nn
    import torch.nn.functional as F

    # (a) elementwise chain: n_chain ops on a 16-element tensor.
    def chain(x):
        for i in range(n_chain // 4):
            x = torch.sin(x)
            x = x * 1.01
            x = x + 0.1
            x = torch.tanh(x)
        for _ in range(n_chain % 4):
            x = torch.cos(x)
        return x

    g = torch.Generator().manual_seed(0)
    x_chain = torch.randn(16, generator=g).requires_grad_(True)

    # (b) tiny pre-LN GPT block, attention with explicit matmuls + softmax.
    class Block(nn.Module):
        def __init__(self, d=16, n_head=2, max_len=8):
            super().__init__()
            self.h = n_head
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc = nn.Linear(d, 4 * d)
            self.fc_out = nn.Linear(4 * d, d)
            self.register_buffer(
                "mask", torch.ones(max_len, max_len, dtype=torch.bool).triu(1), persistent=False
            )
            self.scale = 1.0 / math.sqrt(d // n_head)

        def forward(self, x):
            B, T, C = x.shape
            H, D = self.h, C // self.h
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q = q.view(B, T, H, D).transpose(1, 2)
            k = k.view(B, T, H, D).transpose(1, 2)
            v = v.view(B, T, H, D).transpose(1, 2)
            att = (q @ k.transpose(-2, -1)) * self.scale
            att = att.masked_fill(self.mask[:T, :T], float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
            x = x + self.proj(y)
            return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))

    torch.manual_seed(0)
    block = Block().train()
    x_gpt = torch.randn(2, 8, 16, generator=g).requires_grad_(True)

    # (c) a single op: the fixed cost of one checkpointed region.
    def single(x):
        return torch.sin(x)

    x_single = torch.randn(16, generator=g).requires_grad_(True)

    return {
        "elementwise": (chain, x_chain, [x_chain]),
        "region": (single, x_single, [x_single]),
        "gpt": (block, x_gpt, [x_gpt, *block.parameters()]),
    }


def make_variants(torch, torch_sac, fn, x, targets):
    """name -> step(): one forward + backward, returns the grads."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts as torch_contexts,
    )

    aten = torch.ops.aten
    save_list = [aten.mm.default, aten.addmm.default]
    save_set = frozenset(save_list)

    def callable_policy(ctx, op, *args, **kwargs):
        if op in save_set:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    # Built-in policies are built once, as a user would.
    sac_save_ops = torch_sac.policies.save_ops(save_list)
    sac_recompute_all = torch_sac.policies.recompute_all()
    sac_contexts = torch_sac.create_selective_checkpoint_contexts

    context_fns = {
        "checkpoint": None,
        "torch SAC, op list": functools.partial(torch_contexts, save_list),
        "torch SAC, callable": functools.partial(torch_contexts, callable_policy),
        "torch_sac, save_ops": functools.partial(sac_contexts, sac_save_ops),
        "torch_sac, callable": functools.partial(sac_contexts, callable_policy),
        "torch_sac, recompute_all": functools.partial(sac_contexts, sac_recompute_all),
    }

    grad = torch.autograd.grad

    def eager_step():
        return grad(fn(x).sum(), targets)

    steps = {"eager": eager_step}
    for name, cfn in context_fns.items():
        if cfn is None:

            def step():
                return grad(checkpoint(fn, x, use_reentrant=False).sum(), targets)
        else:

            def step(cfn=cfn):
                return grad(checkpoint(fn, x, use_reentrant=False, context_fn=cfn).sum(), targets)

        steps[name] = step

    def region_step(policy):
        def step():
            with torch_sac.sac_context(policy):
                y = fn(x)
            return grad(y.sum(), targets)

        return step

    steps["torch_sac region, save_ops"] = region_step(sac_save_ops)
    steps["torch_sac region, callable"] = region_step(callable_policy)
    return steps, context_fns


def count_ops(torch, torch_sac, fn, x, targets, context_fns):
    """Ops intercepted per step, counted a few independent ways."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    class Counter(TorchDispatchMode):
        def __init__(self, ignored):
            super().__init__()
            self.n = 0
            self.n_ignored = 0
            self.ignored = ignored

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            if func in self.ignored:
                self.n_ignored += 1
            return func(*args, **(kwargs or {}))

    ignored = torch_sac.IGNORED_OPS
    modes = []

    def counting_contexts():
        pair = (Counter(ignored), Counter(ignored))
        modes.append(pair)
        return pair

    grad = torch.autograd.grad
    grad(checkpoint(fn, x, use_reentrant=False, context_fn=counting_contexts).sum(), targets)
    ((fwd, rec),) = modes
    counts = {
        "forward": fwd.n,
        "recompute": rec.n,
        "total": fwd.n + rec.n,
        "ignored_ops": fwd.n_ignored + rec.n_ignored,
    }

    # torch_sac's own counters, per torch_sac variant.
    sac_stats = {}
    for name, cfn in context_fns.items():
        if cfn is None or not name.startswith("torch_sac"):
            continue
        made = []

        def recording(cfn=cfn):
            pair = cfn()
            made.append(pair)
            return pair

        grad(checkpoint(fn, x, use_reentrant=False, context_fn=recording).sum(), targets)
        s = dict(made[0][0].stats())
        s["intercepted"] = s["policy_calls"] + s["replayed_ops"] + s["cache_hits"]
        sac_stats[name] = s
    counts["torch_sac_stats"] = sac_stats
    return counts


def check_grads(torch, steps):
    ref = steps["eager"]()
    bad = []
    for name, step in steps.items():
        got = step()
        for a, b in zip(ref, got):
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
                bad.append(name)
                break
    return bad


def time_block(step, iters):
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return (time.perf_counter() - t0) / iters


def measure(steps, reps, target_rep_s, warmup_s):
    """Round-robin over variants: rep r of every variant runs back to back."""
    names = list(steps)
    # Warm up and calibrate iterations per rep from the slowest variant, so
    # every variant runs the same number of iterations per rep.
    per_step = {}
    for name in names:
        step = steps[name]
        t_end = time.perf_counter() + warmup_s
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() < t_end or n < 3:
            step()
            n += 1
        per_step[name] = (time.perf_counter() - t0) / n
    iters = max(5, int(target_rep_s / max(per_step.values())))
    samples = {name: [] for name in names}
    gc_was = gc.isenabled()
    gc.collect()
    gc.freeze()  # torch's objects move to the permanent generation: cheap collects below
    gc.disable()
    try:
        for r in range(reps):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                gc.collect()  # outside the timed block; gc stays off inside it
                samples[name].append(time_block(steps[name], iters))
    finally:
        gc.unfreeze()
        if gc_was:
            gc.enable()
    return iters, samples


def worker(args):
    import torch

    torch.set_num_threads(1)
    import torch_sac

    active = torch_sac.adapter()
    if active != args.worker:
        raise SystemExit(f"worker asked for adapter {args.worker!r} but torch_sac uses {active!r}")

    workloads = build_workloads(torch, args.chain_ops)
    out = {
        "adapter": active,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "threads": torch.get_num_threads(),
        "reps": args.reps,
        "workloads": {},
    }
    for wname in args.workloads:
        fn, x, targets = workloads[wname]
        steps, context_fns = make_variants(torch, torch_sac, fn, x, targets)
        bad = check_grads(torch, steps)
        counts = count_ops(torch, torch_sac, fn, x, targets, context_fns)
        log(f"[{active}] {wname}: {counts['total']} ops intercepted/step; timing ...")
        t0 = time.perf_counter()
        iters, samples = measure(steps, args.reps, args.rep_seconds, args.warmup_seconds)
        log(f"[{active}] {wname}: done in {time.perf_counter() - t0:.1f} s ({iters} iters/rep)")
        base = samples["checkpoint"]
        eager = samples["eager"]
        variants = {}
        for name, s in samples.items():
            paired = sorted(v - b for v, b in zip(s, base))
            over_eager = sorted(v - e for v, e in zip(s, eager))
            variants[name] = {
                "median_s": statistics.median(s),
                "min_s": min(s),
                "samples_s": s,
                "paired_diff_median_s": statistics.median(paired),
                "paired_diff_p25_s": paired[len(paired) // 4],
                "paired_diff_p75_s": paired[(3 * len(paired)) // 4],
                "cost_median_s": statistics.median(over_eager),
                "cost_p25_s": over_eager[len(over_eager) // 4],
                "cost_p75_s": over_eager[(3 * len(over_eager)) // 4],
            }
        out["workloads"][wname] = {
            "iters_per_rep": iters,
            "ops": counts,
            "grad_mismatch": bad,
            "variants": variants,
        }
    return out


# --------------------------------------------------------------------------
# Parent: runs one worker per adapter, combines and prints.
# --------------------------------------------------------------------------


def run_workers(args, script=__file__):
    """Runs ``script --worker ADAPTER`` once per adapter (with ``args``' reps,
    timings, chain length and workloads); the JSON each prints, by adapter."""
    here = os.path.dirname(os.path.abspath(script))
    results = {}
    for adapter in ADAPTERS:
        cmd = [
            sys.executable,
            os.path.abspath(script),
            "--worker",
            adapter,
            "--reps",
            str(args.reps),
            "--rep-seconds",
            str(args.rep_seconds),
            "--warmup-seconds",
            str(args.warmup_seconds),
            "--chain-ops",
            str(args.chain_ops),
            "--workloads",
            *args.workloads,
        ]
        env = dict(os.environ, TORCH_SAC_ADAPTER=adapter, OMP_NUM_THREADS="1")
        log(f"running worker: {adapter} adapter")
        # cwd: the repo root (never inside torch's site-packages).
        proc = subprocess.run(
            cmd, env=env, cwd=os.path.dirname(here), stdout=subprocess.PIPE, text=True
        )
        if proc.returncode != 0:
            raise SystemExit(f"worker {adapter} failed with exit code {proc.returncode}")
        results[adapter] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


def summarize(results):
    """Derived numbers per workload / adapter / variant."""
    summary = {}
    for wname in next(iter(results.values()))["workloads"]:
        rows = []
        for adapter, res in results.items():
            w = res["workloads"][wname]
            n_ops = w["ops"]["total"]
            v = w["variants"]
            base = v["checkpoint"]["median_s"]

            # Added time per step: the median over reps of (variant - checkpoint)
            # measured in the same round-robin rep, which cancels slow drift and
            # bursts of load better than a difference of two medians.
            def added(name):
                return v[name]["paired_diff_median_s"]

            for name, kind in VARIANTS:
                r = {
                    "workload": wname,
                    "process": adapter,
                    "variant": name,
                    "kind": kind,
                    "median_us": v[name]["median_s"] * 1e6,
                    "added_us_per_step": added(name) * 1e6,
                    "added_us_per_step_diff_of_medians": (v[name]["median_s"] - base) * 1e6,
                    "added_us_per_op": added(name) / n_ops * 1e6,
                    "paired_p25_us_per_op": v[name]["paired_diff_p25_s"] / n_ops * 1e6,
                    "paired_p75_us_per_op": v[name]["paired_diff_p75_s"] / n_ops * 1e6,
                    "ratio_vs_torch_list": None,
                    "ratio_vs_torch_same": None,
                    "target": None,
                    "target_met": None,
                }
                engine = engine_of(kind)
                if kind != "ref":
                    same = "torch SAC, op list" if engine is None else same_torch_variant(kind)
                    torch_cost = v[same]["cost_median_s"]
                    r["cost_us_per_op"] = v[name]["cost_median_s"] / n_ops * 1e6
                    r["cost_ratio"] = v[name]["cost_median_s"] / torch_cost
                    r["cost_ratio_p25"] = v[name]["cost_p25_s"] / torch_cost
                    r["cost_ratio_p75"] = v[name]["cost_p75_s"] / torch_cost
                    if kind in ("sac-list", "region-list") and wname in TARGET_WORKLOADS:
                        t = COST_TARGETS[adapter][engine]
                        r["cost_target"] = t
                        r["cost_target_met"] = r["cost_ratio"] <= t
                        r["cost_target_borderline"] = (
                            r["cost_ratio_p25"] <= t <= r["cost_ratio_p75"]
                        )
                if engine == "drop-in":
                    r["ratio_vs_torch_list"] = added(name) / added("torch SAC, op list")
                    same = "torch SAC, callable" if kind == "sac-callable" else "torch SAC, op list"
                    r["ratio_vs_torch_same"] = added(name) / added(same)
                    # Noise band: quartiles of the paired per-rep differences.
                    r["ratio_same_p25"] = v[name]["paired_diff_p25_s"] / added(same)
                    r["ratio_same_p75"] = v[name]["paired_diff_p75_s"] / added(same)
                    if kind in ("sac-list", "sac-callable") and wname in TARGET_WORKLOADS:
                        t = TARGETS[adapter]
                        r["target"] = t
                        r["target_met"] = r["ratio_vs_torch_same"] <= t
                        # Within noise: the target lies inside the quartile band.
                        r["target_borderline"] = r["ratio_same_p25"] <= t <= r["ratio_same_p75"]
                rows.append(r)
        summary[wname] = rows
    return summary


def fmt_ratio(x):
    return "" if x is None else f"{x:.3f}x"


def print_report(results, summary, args):
    any_res = next(iter(results.values()))
    print(
        f"torch {any_res['torch']}, Python {any_res['python']}, CPU, "
        f"torch.set_num_threads({any_res['threads']}); "
        f"median of {args.reps} reps, forward+backward per step"
    )
    print(
        "step µs = median over reps. added µs = median over reps of (variant - plain checkpoint), "
        "paired within each rep;\nadded µs/op = that / ops intercepted per step (every op a "
        "dispatch mode sees in the region, forward + recompute);\n[p25, p75] = quartiles of "
        "those paired differences, per op."
    )
    print(
        "Ratios = torch_sac's added overhead / PyTorch SAC's, both measured in the same worker "
        "process; 'vs same' compares callable with callable, built-in with PyTorch's op list."
    )
    for wname, rows in summary.items():
        print()
        parts = []
        for adapter, res in results.items():
            w = res["workloads"][wname]
            o = w["ops"]
            parts.append(f"{adapter}: {w['iters_per_rep']} iters/rep")
        o = any_res["workloads"][wname]["ops"]
        if wname == "region":
            print(
                "== region: one op (sin) per checkpointed region, so the added time is "
                "mostly the fixed per-region cost (not checked against the targets)"
            )
        print(
            f"== {wname}: {o['total']} ops intercepted per step "
            f"({o['forward']} forward + {o['recompute']} recompute, "
            f"{o['ignored_ops']} of them SAC-ignored metadata/detach ops); " + ", ".join(parts)
        )
        for adapter, res in results.items():
            for name, s in res["workloads"][wname]["ops"]["torch_sac_stats"].items():
                print(
                    f"   [{adapter}] {name} stats: policy_calls={s['policy_calls']} "
                    f"saved_ops={s['saved_ops']} cache_hits={s['cache_hits']} "
                    f"replayed_ops={s['replayed_ops']} (sum {s['intercepted']})"
                )
            bad = res["workloads"][wname]["grad_mismatch"]
            if bad:
                print(f"   [{adapter}] WARNING: gradients differ from eager for: {', '.join(bad)}")
        header = (
            f"{'process':<8} {'variant':<26} {'step µs':>9} {'added µs':>9} {'added µs/op':>12} "
            f"{'[p25, p75]':>15} {'vs torch list':>14} {'vs same':>9} {'target':>8} {'met?':>5}"
        )
        print(header)
        print("-" * len(header))
        for r in rows:
            step_added = f"{r['added_us_per_step']:.1f}"
            if r["kind"] == "ref":
                added = "(ref)"
                spread = ""
            elif r["kind"] == "baseline":
                added = "0 (base)"
                step_added = "0"
                spread = ""
            elif engine_of(r["kind"]) == "region":
                added = "n/a"  # no torch.utils.checkpoint under it: see the SAC cost
                step_added = ""
                spread = ""
            else:
                added = f"{r['added_us_per_op']:.3f}"
                spread = f"[{r['paired_p25_us_per_op']:.2f}, {r['paired_p75_us_per_op']:.2f}]"
            target = "" if r["target"] is None else f"<={r['target']:g}x"
            met = "" if r["target_met"] is None else ("yes" if r["target_met"] else "NO")
            if r.get("target_borderline"):
                met += "~"
            print(
                f"{r['process']:<8} {r['variant']:<26} {r['median_us']:>9.1f} {step_added:>9} {added:>12} "
                f"{spread:>15} {fmt_ratio(r['ratio_vs_torch_list']):>14} "
                f"{fmt_ratio(r['ratio_vs_torch_same']):>9} {target:>8} {met:>5}"
            )
        print(
            "  SAC cost over eager (variant - eager, paired per rep), per op, and its ratio "
            "to PyTorch SAC's with the same kind of policy:"
        )
        header = (
            f"  {'process':<8} {'variant':<26} {'cost µs/op':>11} {'vs PyTorch SAC':>15} "
            f"{'[p25, p75]':>16} {'target':>8} {'met?':>5}"
        )
        print(header)
        print("  " + "-" * (len(header) - 2))
        for r in rows:
            if "cost_ratio" not in r:
                continue
            target = "" if r.get("cost_target") is None else f"<={r['cost_target']:g}x"
            met = ""
            if r.get("cost_target") is not None:
                met = "yes" if r["cost_target_met"] else "NO"
                if r["cost_target_borderline"]:
                    met += "~"
            band = f"[{r['cost_ratio_p25']:.2f}, {r['cost_ratio_p75']:.2f}]"
            print(
                f"  {r['process']:<8} {r['variant']:<26} {r['cost_us_per_op']:>11.3f} "
                f"{r['cost_ratio']:>14.3f}x {band:>16} {target:>8} {met:>5}"
            )

    print()
    print(
        "Targets (torch_sac's added overhead per op / PyTorch SAC's, same policy kind): "
        "key adapter <= 0.1x, python adapter <= 0.5x. Verdicts use the medians; the quartile "
        "band is the quartiles of the paired differences / PyTorch SAC's median added time."
    )
    for wname, rows in summary.items():
        for r in rows:
            if r["target"] is not None:
                verdict = "met" if r["target_met"] else "NOT met"
                if r.get("target_borderline"):
                    verdict += " (within noise: target inside the quartile band)"
                print(
                    f"  {wname:<11} {r['process']:<6} {r['variant']:<22} "
                    f"{r['ratio_vs_torch_same']:.3f}x  (quartile band "
                    f"{r['ratio_same_p25']:.3f}-{r['ratio_same_p75']:.3f}x, target "
                    f"<= {r['target']:g}x)  -> {verdict}"
                )


def print_cost_verdicts(summary):
    print()
    print(
        "Targets (SAC cost over eager per op / PyTorch SAC's, op-list policies): region "
        "<= 0.2x, drop-in <= 0.4x under the key adapter; <= 0.35x and <= 0.6x under the "
        "Python-key adapter."
    )
    for wname, rows in summary.items():
        for r in rows:
            if r.get("cost_target") is None:
                continue
            verdict = "met" if r["cost_target_met"] else "NOT met"
            if r["cost_target_borderline"]:
                verdict += " (within noise: target inside the quartile band)"
            floor = next(
                x["cost_ratio"]
                for x in rows
                if x["process"] == r["process"] and x["kind"] == "baseline"
            )
            print(
                f"  {wname:<11} {r['process']:<6} {r['variant']:<26} {r['cost_ratio']:.3f}x "
                f"(band {r['cost_ratio_p25']:.3f}-{r['cost_ratio_p75']:.3f}x, target "
                f"<= {r['cost_target']:g}x; plain checkpoint {floor:.3f}x)  -> {verdict}"
            )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=ADAPTERS, help=argparse.SUPPRESS)
    p.add_argument("--json", metavar="PATH", help="write raw results and summary as JSON")
    p.add_argument(
        "--reps", type=int, default=21, help="timed repetitions per variant (default 21)"
    )
    p.add_argument(
        "--rep-seconds",
        type=float,
        default=0.12,
        help="target duration of one rep of the slowest variant (default 0.12 s)",
    )
    p.add_argument(
        "--warmup-seconds", type=float, default=0.3, help="warmup per variant (default 0.3 s)"
    )
    p.add_argument(
        "--chain-ops",
        type=int,
        default=200,
        help="elementwise ops in the chain workload (default 200)",
    )
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--quick", action="store_true", help="smoke run: 7 short reps")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.rep_seconds, args.warmup_seconds = 7, 0.03, 0.1
    if args.reps < 1:
        p.error("--reps must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        res = worker(args)
        sys.stdout.write(json.dumps(res) + "\n")
        return
    t0 = time.perf_counter()
    results = run_workers(args)
    summary = summarize(results)
    print_report(results, summary, args)
    print_cost_verdicts(summary)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "summary": summary}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
