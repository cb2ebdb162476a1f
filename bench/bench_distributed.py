#!/usr/bin/env python
"""Activation memory, peak and step time per rank under FSDP2: torch_sac
against PyTorch's SAC and no checkpointing, side by side in one run.

Two gloo ranks on 127.0.0.1 (child processes of this script, one intra-op
thread each, bounded by a timeout). The model: 4 blocks of
LayerNorm -> Linear(d, 4d) -> GELU -> Linear(4d, d) -> ``* gamma``
(LayerScale) + residual, then a Linear head; d=256, batch 8 per rank,
seq 128, float32. Each block is ``fully_shard``-ed, then the root
(``reshard_after_forward=True``, FSDP2's default; the root keeps its own
parameters, the head, unsharded after forward, as FSDP2 always does).

Configurations (each its own model instance, same initial weights):

* ``no checkpointing``        - the reference;
* ``torch_sac region/block``  - ``with torch_sac.sac_context(policy): x = block(x)``;
* ``torch_sac region/2 blocks`` - one region spanning each pair of blocks
  (two FSDP2 units per region: a replay gathers a freed unit again);
* ``PyTorch SAC wrapper/block`` - ``checkpoint_wrapper(block, context_fn=
  partial(torch.utils.checkpoint.create_selective_checkpoint_contexts,
  policy.to_torch()))`` applied before ``fully_shard``;
* ``torch_sac drop-in wrapper/block`` - the same with
  ``torch_sac.create_selective_checkpoint_contexts``;

each with ``torch_sac.policies.save_matmuls()`` and ``recompute_all()``.

Measured per rank with torch_sac's counting CPU allocator (installed first
thing in each worker): activation memory = bytes still allocated after
forward (model + loss) minus before; peak = highest level during forward +
backward above the level before forward (includes gradients and FSDP2's
all-gather buffers). Step time = forward + backward + SGD step. Configs run
round robin, one step each per round; the first ``--warmup`` rounds are
discarded, the figures are medians over the next ``--steps`` rounds.
"grads exact": this rank's gradient shards after the first step (same
weights, same data) are bitwise equal to the no-checkpointing run's.
gloo's own threads allocate too, hence medians.

Usage::

    python bench/bench_distributed.py            # ~1-1.5 min on 2 cores
    python bench/bench_distributed.py --quick    # smoke run
    TORCH_SAC_ADAPTER=python python bench/bench_distributed.py
"""

import argparse
import datetime
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

D, BATCH, SEQ, N_BLOCKS = 256, 8, 128, 4
WORLD = 2
POLICIES = ("save_matmuls", "recompute_all")
# (config key, label, engine)
CONFIGS = (
    ("none", "no checkpointing", None),
    ("region_block", "torch_sac region/block", "region"),
    ("region_pair", "torch_sac region/2 blocks", "region"),
    ("torch_wrapper", "PyTorch SAC wrapper/block", "wrapper"),
    ("sac_wrapper", "torch_sac drop-in wrapper/block", "wrapper"),
)


def _runs():
    """(run id, config key, policy name or None), in table order."""
    runs = [("none", "none", None)]
    for policy in POLICIES:
        for key, _, engine in CONFIGS:
            if engine is not None:
                runs.append((f"{key}:{policy}", key, policy))
    return runs


# ==========================================================================
# Worker side
# ==========================================================================


def _build(key, policy_name, mesh):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.utils.checkpoint as tc
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    import torch_sac

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(D)
            self.fc1 = nn.Linear(D, 4 * D)
            self.fc2 = nn.Linear(4 * D, D)
            self.gamma = nn.Parameter(torch.full((D,), 0.1) + 0.01 * torch.randn(D))

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(self.norm(x)))) * self.gamma

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))
            self.head = nn.Linear(D, D)
            self.policy = None
            self.spans = [[i] for i in range(N_BLOCKS)]

        def forward(self, x):
            for span in self.spans:
                if self.policy is None:
                    for i in span:
                        x = self.blocks[i](x)
                else:
                    with torch_sac.sac_context(self.policy):
                        for i in span:
                            x = self.blocks[i](x)
            return self.head(x)

    torch.manual_seed(1234)
    model = Model()
    policy = getattr(torch_sac.policies, policy_name)() if policy_name else None
    if key in ("region_block", "region_pair"):
        model.policy = policy
        if key == "region_pair":
            model.spans = [list(range(i, min(i + 2, N_BLOCKS))) for i in range(0, N_BLOCKS, 2)]
    for i, block in enumerate(model.blocks):
        if key == "torch_wrapper":
            ctx = functools.partial(tc.create_selective_checkpoint_contexts, policy.to_torch())
            block = model.blocks[i] = checkpoint_wrapper(block, context_fn=ctx)
        elif key == "sac_wrapper":
            ctx = functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)
            block = model.blocks[i] = checkpoint_wrapper(block, context_fn=ctx)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _clean(name):
    for junk in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(junk, "")
    return name


def _local_grads(model):
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if isinstance(g, DTensor):
            g = g.to_local()
        out[_clean(n)] = None if g is None else g.detach().clone()
    return out


def _same(a, b):
    import torch

    if a.keys() != b.keys():
        return False
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in ((a[k], b[k]) for k in a)
    )


def _worker(rank, port, out_path, warmup, steps):
    import faulthandler

    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    import torch
    import torch_sac
    import torch_sac.memory

    torch_sac.memory.install_counting_allocator()  # before any tensor we measure
    torch.set_num_threads(1)
    import gc

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    store = dist.TCPStore(
        "127.0.0.1", port, WORLD, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")

    runs = _runs()
    models, opts = {}, {}
    for rid, key, policy in runs:
        models[rid] = _build(key, policy, mesh)
        opts[rid] = torch.optim.SGD(models[rid].parameters(), lr=1e-3)
    res = {rid: {"act": [], "peak": [], "ms": [], "exact": None} for rid, _, _ in runs}
    ref_grads = None
    w = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(7))

    for rnd in range(warmup + steps):
        x = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(1000 * rnd + rank))
        for rid, _, _ in runs:  # round robin: every config sees the same load
            model, opt = models[rid], opts[rid]
            gc.collect()
            t0 = time.perf_counter()
            with torch_sac.memory.track() as whole:
                with torch_sac.memory.track() as fwd:
                    loss = (model(x) * w).sum()
                loss.backward()
            if rnd == 0:  # same weights and data for every config
                grads = _local_grads(model)
                if rid == "none":
                    ref_grads = grads
                res[rid]["exact"] = _same(grads, ref_grads)
                del grads
            opt.step()
            opt.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - t0
            del loss
            if rnd >= warmup:
                res[rid]["act"].append(fwd.delta)
                res[rid]["peak"].append(whole.peak)
                res[rid]["ms"].append(1e3 * elapsed)

    summary = {
        rid: {
            "act": statistics.median(r["act"]),
            "peak": statistics.median(r["peak"]),
            "ms": statistics.median(r["ms"]),
            "exact": r["exact"],
            "act_spread": max(r["act"]) - min(r["act"]),
        }
        for rid, r in res.items()
    }
    with open(out_path + ".tmp", "w") as f:
        json.dump(
            {
                "rank": rank,
                "adapter": torch_sac.adapter(),
                "torch": torch.__version__,
                "results": summary,
            },
            f,
        )
    os.replace(out_path + ".tmp", out_path)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (gloo threads)


# ==========================================================================
# Parent side
# ==========================================================================


def _tail(path, n=40):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def _launch(warmup, steps, timeout):
    """Runs the two workers; returns their result dicts (rank order)."""
    import torch.distributed as dist

    # The parent hosts the rendezvous store on a port the OS picks: no
    # probe-then-bind race for a free port.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        WORLD,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    out_dir = tempfile.mkdtemp(prefix="torch_sac_bench_dist_")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    procs, logs = [], []
    try:
        for rank in range(WORLD):
            logs.append(os.path.join(out_dir, f"rank{rank}.log"))
            with open(logs[-1], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            os.path.abspath(__file__),
                            "--worker",
                            str(rank),
                            str(store.port),
                            os.path.join(out_dir, f"rank{rank}.json"),
                            str(warmup),
                            str(steps),
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )
        deadline = time.monotonic() + timeout
        failure = None
        while True:
            rcs = [p.poll() for p in procs]
            if all(rc == 0 for rc in rcs):
                break
            if any(rc not in (None, 0) for rc in rcs):
                time.sleep(2)  # let the peer notice and report
                failure = "worker exited: " + ", ".join(
                    f"rank {r} rc={p.poll()}" for r, p in enumerate(procs)
                )
                break
            if time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGUSR1)  # faulthandler: Python stacks to the log
                time.sleep(1)
                failure = f"timeout: no result within {timeout:.0f} s"
                break
            time.sleep(0.1)
        if failure:
            msg = [f"bench_distributed: {failure}"]
            for r in range(WORLD):
                msg.append(f"--- rank {r} log tail ---\n{_tail(logs[r])}")
            raise SystemExit("\n".join(msg))
        out = []
        for r in range(WORLD):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        shutil.rmtree(out_dir, ignore_errors=True)


def _table(res):
    labels = {key: label for key, label, _ in CONFIGS}
    none = res["none"]
    header = (
        f"{'config':<32} {'policy':<14} {'act MiB':>8} {'vs none':>8} {'vs PyTorch SAC':>15} "
        f"{'peak MiB':>9} {'step ms':>8} {'grads exact':>12}"
    )
    lines = [header, "-" * len(header)]
    for rid, key, policy in _runs():
        r = res[rid]
        if policy is None:
            vs_torch = "-"
        else:
            t = res[f"torch_wrapper:{policy}"]["act"]
            vs_torch = f"{r['act'] / t:.2f}x" if t > 0 else "n/a"
        lines.append(
            f"{labels[key]:<32} {policy or '-':<14} {r['act'] / 2**20:>8.2f} "
            f"{r['act'] / none['act']:>7.2f}x {vs_torch:>15} {r['peak'] / 2**20:>9.2f} "
            f"{r['ms']:>8.1f} {str(r['exact']):>12}"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (1 warm-up, 3 measured)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="measured rounds (default 5)")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds before the workers are killed"
    )
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps if args.steps is not None else (3 if args.quick else 5)
    warmup = max(warmup, 1)  # round 0 is the gradient check
    steps = max(steps, 1)
    timeout = args.timeout or (120.0 if args.quick else 240.0)

    t0 = time.monotonic()
    out = _launch(warmup, steps, timeout)
    wall = time.monotonic() - t0
    print(
        f"FSDP2 (fully_shard per block + root), {WORLD} gloo ranks on CPU, torch {out[0]['torch']}, "
        f"torch_sac adapter {out[0]['adapter']}, 1 thread/rank"
    )
    print(
        f"model: {N_BLOCKS} x [LayerNorm -> Linear({D},{4 * D}) -> GELU -> Linear({4 * D},{D}) * gamma + x] "
        f"+ head, batch {BATCH}/rank, seq {SEQ}, float32"
    )
    print(
        f"{warmup} warm-up + {steps} measured rounds (medians), configs round robin; "
        f"act = bytes allocated after forward - before; peak = forward+backward above that start"
    )
    print(
        "step ms = forward + backward + SGD step, wall clock per rank (noisy when the cores are shared)"
    )
    for rec in out:
        print(f"\n== rank {rec['rank']}")
        print(_table(rec["results"]))
    # Do the ranks agree? (Same model, same shard sizes: activation memory
    # should match up to the noise of gloo's threads.)
    worst = max(
        abs(out[0]["results"][rid]["act"] - out[1]["results"][rid]["act"]) for rid, _, _ in _runs()
    )
    exact = all(rec["results"][rid]["exact"] for rec in out for rid, _, _ in _runs())
    print(
        f"\nranks agree on activation memory within {worst / 2**20:.3f} MiB; "
        f"grads exact on every rank and config: {exact}; wall time {wall:.1f} s"
    )


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    else:
        main()
