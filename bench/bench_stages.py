#!/usr/bin/env python
"""Where the region engine's time per op goes: a breakdown by stage.

Runs the workloads of ``bench_overhead.py`` (a chain of small elementwise ops,
a tiny GPT block; CPU, one thread) under the region engine with an op-list
policy (``save_ops([mm, addmm])``), and times pieces of it side by side
(interleaved rounds, medians), once per interception adapter (a worker
subprocess each, as in ``bench_overhead.py``):

forward
  * ``eager``: the un-checkpointed forward (reference);
  * ``region entry``: ``sac_context`` entered and exited around nothing (the
    fixed cost per region: contexts, hooks, mode or key switch);
  * ``adapter hop``: the forward with the region's handler switched on but
    letting every op through (``_C.OpaqueCode``): the key adapter's boxed
    fallback and redispatch, or the Python-key adapter's
    ``__torch_dispatch__``, stack conversion and GIL release;
  * ``saved-tensor hooks``: the forward under the region's pack hook only:
    autograd calling a hook per saved tensor (GIL, wrapping the tensor, the
    SavedActivation object and freeing it);
  * ``policy + record``: the full region forward minus the three above:
    the policy's decision, the tape record, version and alias bookkeeping,
    RNG snapshots. ``record (stat)`` is the part the region times itself
    under its lock (``stats()["record_ns"]``).

backward
  * ``eager``: the un-checkpointed backward (reference);
  * ``replay (stat)``: time the region spent replaying (``replay_ns``: the
    replayed ops' kernels and their dispatch), per replayed op;
  * ``unpack + planning``: the region's backward minus eager's minus replay:
    unpack hooks, rebuild planning, releasing rebuilt tensors.

Every figure is a median over rounds of paired differences (each piece
minus its reference in the same round). Per op: forward stages per op the
region recorded (``policy_calls``), replay per replayed op.

Usage::

    python bench/bench_stages.py            # both adapters, ~1 min
    python bench/bench_stages.py --quick    # smoke run
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_overhead import ADAPTERS, build_workloads, log, measure, run_workers  # noqa: E402

WORKLOADS = ("elementwise", "gpt")


def worker(args):
    import torch

    torch.set_num_threads(1)
    import torch_sac
    from torch_sac import _C
    from torch_sac._modes import handler_mode

    aten = torch.ops.aten
    policy = torch_sac.policies.save_ops([aten.mm.default, aten.addmm.default])
    grad = torch.autograd.grad
    out = {"adapter": torch_sac.adapter(), "torch": torch.__version__, "workloads": {}}
    for wname in args.workloads:
        fn, x, targets = build_workloads(torch, args.chain_ops)[wname]

        def eager_fwd(fn=fn, x=x):
            return fn(x)

        def eager_step(fn=fn, x=x, targets=targets):
            return grad(fn(x).sum(), targets)

        def region_entry(x=x):
            with torch_sac.sac_context(policy):
                return x

        def adapter_hop(fn=fn, x=x):
            with handler_mode(_C.Region(policy, False)):
                opaque = _C.OpaqueCode()  # the handler lets every op through
                try:
                    return fn(x)
                finally:
                    del opaque

        def hooks_only(fn=fn, x=x):
            region = _C.Region(policy, False)
            with torch.autograd.graph.saved_tensors_hooks(region.pack_hook(), _C.unpack_saved):
                return fn(x)

        def region_fwd(fn=fn, x=x):
            with torch_sac.sac_context(policy):
                return fn(x)

        def region_step(fn=fn, x=x, targets=targets):
            with torch_sac.sac_context(policy):
                y = fn(x)
            return grad(y.sum(), targets)

        steps = {
            "eager forward": eager_fwd,
            "region entry": region_entry,
            "adapter hop": adapter_hop,
            "hooks only": hooks_only,
            "region forward": region_fwd,
            "eager step": eager_step,
            "region step": region_step,
        }
        for a, b in zip(eager_step(), region_step()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        log(f"[{out['adapter']}] {wname}: timing ...")
        iters, samples = measure(steps, args.reps, args.rep_seconds, args.warmup_seconds)
        with torch_sac.sac_context(policy) as ctx:
            y = fn(x)
        grad(y.sum(), targets)
        stats = ctx.stats()
        # The region's own timers, per step, over a few steps.
        record_ns, replay_ns = [], []
        for _ in range(args.reps):
            with torch_sac.sac_context(policy) as ctx:
                y = fn(x)
            grad(y.sum(), targets)
            s = ctx.stats()
            record_ns.append(s["record_ns"])
            replay_ns.append(s["replay_ns"])

        def paired(name, ref):
            return statistics.median(a - b for a, b in zip(samples[name], samples[ref])) * 1e6

        e_fwd = statistics.median(samples["eager forward"]) * 1e6
        entry = statistics.median(samples["region entry"]) * 1e6
        hop = paired("adapter hop", "eager forward")
        hooks = paired("hooks only", "eager forward")
        fwd_total = paired("region forward", "eager forward")
        step_total = paired("region step", "eager step")
        e_bwd = statistics.median(samples["eager step"]) * 1e6 - e_fwd
        replay = statistics.median(replay_ns) / 1e3
        out["workloads"][wname] = {
            "iters_per_rep": iters,
            "recorded_ops": stats["policy_calls"],
            "saved_tensors": stats["packed_kept"] + stats["packed_dropped"],
            "replayed_ops": stats["replayed_ops"],
            "eager_forward_us": e_fwd,
            "eager_backward_us": e_bwd,
            "region_entry_us": entry,
            "adapter_hop_us": hop,
            "hooks_us": hooks,
            "policy_record_us": fwd_total - hop - hooks - entry,
            "record_stat_us": statistics.median(record_ns) / 1e3,
            "forward_total_us": fwd_total,
            "replay_stat_us": replay,
            "unpack_planning_us": (step_total - fwd_total) - replay,
            "backward_total_us": step_total - fwd_total,
            "step_total_us": step_total,
        }
    return out


ROWS = [
    # (label, key, per what)
    ("forward: eager (reference)", "eager_forward_us", "recorded"),
    ("  region entry + exit (fixed)", "region_entry_us", None),
    ("  adapter hop", "adapter_hop_us", "recorded"),
    ("  saved-tensor hooks", "hooks_us", "saved"),
    ("  policy + record", "policy_record_us", "recorded"),
    ("    of which record (stat)", "record_stat_us", "recorded"),
    ("  forward added, total", "forward_total_us", "recorded"),
    ("backward: eager (reference)", "eager_backward_us", None),
    ("  replay (stat)", "replay_stat_us", "replayed"),
    ("  unpack + planning", "unpack_planning_us", "saved"),
    ("  backward added, total", "backward_total_us", None),
    ("step added, total", "step_total_us", "recorded"),
]
PER = {"recorded": "recorded_ops", "saved": "saved_tensors", "replayed": "replayed_ops"}


def print_report(results, args):
    first = next(iter(results.values()))
    print(
        f"torch {first['torch']}, CPU, 1 thread; region engine, save_ops([mm, addmm]); "
        f"medians of {args.reps} interleaved rounds (paired differences)"
    )
    for wname in args.workloads:
        w = {a: r["workloads"][wname] for a, r in results.items()}
        counts = next(iter(w.values()))
        print()
        print(
            f"== {wname}: {counts['recorded_ops']} ops recorded, {counts['saved_tensors']} "
            f"tensors saved by autograd, {counts['replayed_ops']} ops replayed per step"
        )
        header = f"{'stage':<32}" + "".join(f"{a + ' µs/step':>16}{'µs per':>14}" for a in results)
        print(header)
        print("-" * len(header))
        for label, key, per in ROWS:
            line = f"{label:<32}"
            for a in results:
                value = w[a][key]
                unit = ""
                if per is not None and w[a][PER[per]]:
                    unit = f"{value / w[a][PER[per]]:.2f} /{per[:5]}"
                line += f"{value:>16.1f}{unit:>14}"
            print(line)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=ADAPTERS, help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--rep-seconds", type=float, default=0.12)
    p.add_argument("--warmup-seconds", type=float, default=0.3)
    p.add_argument("--chain-ops", type=int, default=200)
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quick", action="store_true", help="smoke run: 5 short rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.rep_seconds, args.warmup_seconds = 5, 0.03, 0.05
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        sys.stdout.write(json.dumps(worker(args)) + "\n")
        return
    t0 = time.perf_counter()
    results = run_workers(args, script=__file__)
    print_report(results, args)
    print(f"\ntotal wall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
