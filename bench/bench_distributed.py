#!/usr/bin/env python
"""Activation memory, peak and step time per rank under FSDP2, tensor
parallel + sequence parallel, and FSDP2 + tensor parallel: torch_sac against
PyTorch's SAC, per-block checkpointing and no checkpointing, side by side in
one run.

Each section runs its own gloo ranks on 127.0.0.1 (child processes of this
script, one intra-op thread each, bounded by a timeout); ``--only`` picks
sections.

``fsdp``: FSDP2, 2 ranks. The model: 4 blocks of
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

``tp``: tensor parallel + sequence parallel, 2 ranks (a 1-D mesh).
``fsdp_tp``: FSDP2 + tensor parallel + sequence parallel, 4 ranks on a
2 x 2 mesh (``fully_shard`` on each block and the model over "dp", TP over
"tp"; the two data-parallel halves see different tokens). The model, the
plan and the builders are tests/python/tp_worker.py's (``Llama``,
``parallelize``, ``build``, ``build_fsdp_tp``), imported from there at a
larger size (its module constants set before building): a Llama-style
model, 4 blocks of RMSNorm -> attention (q/k/v/o, causal SDPA) and RMSNorm
-> SwiGLU, width 256, 8 heads, hidden 768, vocabulary 512, batch 8 (4 per
data-parallel rank under fsdp_tp; ``--quick``: 4 and 2, seq 64), seq 128,
float32, cross-entropy loss; torchtitan's TP plan with sequence parallel on
the norms. Rows (each its own model instance, same initial weights):

* ``no checkpointing``            - the reference;
* ``torch.utils.checkpoint/block`` - each block's forward through
  ``torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)``;
* ``PyTorch SAC/block``           - the same with ``context_fn=partial(
  torch.utils.checkpoint.create_selective_checkpoint_contexts,
  policy.to_torch())``;
* ``torch_sac drop-in/block``     - the same with
  ``torch_sac.create_selective_checkpoint_contexts`` and the policy;
* ``torch_sac apply_sac``         - ``torch_sac.apply_sac(model, policy)``;

the last three with ``save_matmuls()`` and ``recompute_all()``; and

* ``torch_sac plan_peak 0.5x``    - ``with torch_sac.sac_context(plan):``
  around forward + loss, ``plan = torch_sac.policies.plan_peak(step,
  peak_bytes=0.5 x this rank's peak without checkpointing)`` (measured on
  the plan's own model before the rounds, second of two plain steps).
  Every rank makes the same planning calls; the planners agree across
  ranks themselves (the least target any rank asks for). A refusal
  (``ValueError``) is printed with the least peak instead of the row.

Measured per rank with torch_sac's counting CPU allocator (installed first
thing in each worker): activation memory = bytes still allocated after
forward (model + loss) minus before; peak = highest level during forward +
backward above the level before forward (includes gradients and FSDP2's
all-gather buffers). gloo's threads free a collective's buffers a little
after the op returns, so both levels are read once the allocated bytes stop
changing (at most 0.1 s, not timed; without it 3 MiB came and went between
steps under TP). Step time = forward + backward + SGD step. Configs run
round robin, one step each per round; the first ``--warmup`` rounds are
discarded, the figures are medians over the next ``--steps`` rounds.
"grads exact": this rank's gradient shards after the first step (same
weights, same data) are bitwise equal to the no-checkpointing run's.
gloo's own threads allocate too, hence medians. The TP sections print rank
0's table and the most over the ranks (each column on its own), ratios vs
PyTorch's SAC with the same policy (/SAC) and vs per-block checkpointing
(/ckpt), and issue 39's targets per rank, MET or MISSED with the numbers:
apply_sac(save_matmuls) activations <= PyTorch SAC's; apply_sac(
recompute_all) activations <= 1.1x per-block checkpointing's; each
apply_sac row's peak and step time <= PyTorch SAC's with its policy; the
plan's peak <= its target, with the same plan (JSON) on every rank.

A row whose step raises (a collective timing out after 60 s, torch_sac
refusing a region the ranks checkpoint differently, ...) is reported as
FAILED with its error and left out of the later rounds; a failed plan
likewise. After a collective has timed out the group is broken and the
later rows fail too: ``--log-dir DIR`` keeps the workers' logs (their
tracebacks) as DIR/SECTION.rankN.log.

Usage::

    python bench/bench_distributed.py            # ~2 min on 2 idle cores (fsdp 20 s,
                                                 # tp 30 s, fsdp_tp 55 s); 2.5 min shared
    python bench/bench_distributed.py --quick    # smoke run, ~1 min
    python bench/bench_distributed.py --only tp fsdp_tp
    TORCH_SAC_ADAPTER=python python bench/bench_distributed.py
"""

import argparse
import datetime
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ---- fsdp section
D, BATCH, SEQ, N_BLOCKS = 256, 8, 128, 4
POLICIES = ("save_matmuls", "recompute_all")
# (config key, label, engine)
CONFIGS = (
    ("none", "no checkpointing", None),
    ("region_block", "torch_sac region/block", "region"),
    ("region_pair", "torch_sac region/2 blocks", "region"),
    ("torch_wrapper", "PyTorch SAC wrapper/block", "wrapper"),
    ("sac_wrapper", "torch_sac drop-in wrapper/block", "wrapper"),
)

# ---- tp and fsdp_tp sections: tp_worker's Llama at this size
TP_SIZE = {"DIM": 256, "HEADS": 8, "HIDDEN": 768, "LAYERS": 4, "VOCAB": 512}
# Tokens per step in all (split over the data-parallel ranks under fsdp_tp),
# sequence length; --quick uses the smaller pair.
TP_BATCH, TP_SEQ = 8, 128
TP_BATCH_QUICK, TP_SEQ_QUICK = 4, 64
PLAN_FRACTION = 0.5
# (row key, label); the policy rows once per policy
TP_ROWS = (
    ("none", "no checkpointing"),
    ("checkpoint", "torch.utils.checkpoint/block"),
)
TP_POLICY_ROWS = (
    ("pytorch_sac", "PyTorch SAC/block"),
    ("dropin", "torch_sac drop-in/block"),
    ("apply_sac", "torch_sac apply_sac"),
)
TP_PLAN_ROW = ("plan", f"torch_sac plan_peak {PLAN_FRACTION}x")

# section: (world size, title, timeout s, quick timeout s)
SECTIONS = {
    "fsdp": (2, "FSDP2 (fully_shard per block + root)", 240.0, 120.0),
    "tp": (2, "tensor parallel + sequence parallel (1-D mesh)", 300.0, 150.0),
    "fsdp_tp": (
        4,
        "FSDP2 + tensor parallel + sequence parallel (2 x 2 mesh: dp x tp)",
        420.0,
        240.0,
    ),
}


def _runs():
    """fsdp section: (run id, config key, policy name or None), in table order."""
    runs = [("none", "none", None)]
    for policy in POLICIES:
        for key, _, engine in CONFIGS:
            if engine is not None:
                runs.append((f"{key}:{policy}", key, policy))
    return runs


def _tp_runs():
    """tp sections: (run id, row key, policy name or None, label), in table
    order; the plan row last."""
    runs = [(key, key, None, label) for key, label in TP_ROWS]
    for policy in POLICIES:
        for key, label in TP_POLICY_ROWS:
            runs.append((f"{key}:{policy}", key, policy, label))
    runs.append((TP_PLAN_ROW[0], TP_PLAN_ROW[0], None, TP_PLAN_ROW[1]))
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


def _fsdp_setup(rank, world):
    """fsdp section: [(run id, model, optimizer, forward)], batch(round), info."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    w = torch.randn(BATCH, SEQ, D, generator=torch.Generator().manual_seed(7))
    rows = []
    for rid, key, policy in _runs():
        model = _build(key, policy, mesh)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        rows.append((rid, model, opt, lambda x, m=model: (m(x) * w).sum()))

    def batch(rnd):
        return torch.randn(
            BATCH, SEQ, D, generator=torch.Generator().manual_seed(1000 * rnd + rank)
        )

    return rows, batch, {}


def _tp_module():
    """tests/python/tp_worker.py, its sizes set to this bench's (its
    classes read the module constants when built and run)."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
    import tp_worker

    for name, value in TP_SIZE.items():
        setattr(tp_worker, name, value)
    return tp_worker


def _to_local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _checkpoint_blocks(model, context_fn=None):
    """Each block's forward through torch.utils.checkpoint (non-reentrant),
    inside FSDP2's hooks (they run in the block's ``__call__``)."""
    import torch.utils.checkpoint as tc

    kwargs = {} if context_fn is None else {"context_fn": context_fn}
    for block in model.layers:
        block.forward = functools.partial(
            tc.checkpoint, block.forward, use_reentrant=False, **kwargs
        )


def _plan(model, loss_fn, tokens):
    """plan_peak at PLAN_FRACTION of this rank's peak without checkpointing
    (the same calls on every rank); returns (plan or None, info)."""
    import torch_sac

    def plain():
        with torch_sac.memory.track() as m:
            loss_fn(model, tokens).backward()
        model.zero_grad(set_to_none=True)
        return m.peak

    plain()  # DTensor's sharding propagation runs on first calls
    peak = plain()
    asked = int(peak * PLAN_FRACTION)
    info = {"no_ckpt_peak": peak, "asked": asked}
    t0 = time.perf_counter()
    try:
        plan = torch_sac.policies.plan_peak(lambda: loss_fn(model, tokens), peak_bytes=asked)
    except ValueError as e:
        least = re.search(r"least peak measured here: (\d+) bytes", str(e))
        info.update(refused=str(e), least_peak=int(least.group(1)) if least else None)
        return None, info
    except RuntimeError as e:  # a failed planning run (a collective, ...): no row
        traceback.print_exc()
        info.update(failed=f"{type(e).__name__}: {e}")
        return None, info
    info.update(
        plan_s=time.perf_counter() - t0,
        target=plan.peak_bytes,
        planned_peak=plan.measured_peak,
        plan_no_ckpt_peak=plan.no_checkpoint_peak,
        runs=plan.planning_runs,
        summary=repr(plan),
        json=json.dumps(plan.to_dict(), sort_keys=True),
    )
    return plan, info


def _tp_setup(section, rank, world, quick):
    """tp and fsdp_tp sections: [(run id, model, optimizer, forward)],
    batch(round), info (the plan's)."""
    import torch
    import torch.nn.functional as F
    import torch.utils.checkpoint as tc
    from torch.distributed.device_mesh import init_device_mesh

    import torch_sac

    tpw = _tp_module()
    if section == "fsdp_tp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        data_rank = mesh.get_local_rank("dp")  # the ranks of one TP group see the same tokens

        def build():
            return tpw.build_fsdp_tp(mesh)
    else:
        mesh = init_device_mesh("cpu", (world,))
        data_rank = 0

        def build():
            return tpw.build(mesh, True)

    n_batch, seq = (TP_BATCH_QUICK, TP_SEQ_QUICK) if quick else (TP_BATCH, TP_SEQ)
    if section == "fsdp_tp":
        n_batch //= mesh["dp"].size()

    def batch(rnd):
        g = torch.Generator().manual_seed(1000 * rnd + data_rank)
        return torch.randint(0, TP_SIZE["VOCAB"], (n_batch, seq), generator=g)

    def loss_fn(model, tokens):
        logits = _to_local(model(tokens))
        return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    rows, keep, info = [], [], {}
    for rid, key, policy_name, _ in _tp_runs():
        model = build()
        policy = getattr(torch_sac.policies, policy_name)() if policy_name else None
        forward = functools.partial(loss_fn, model)
        if key == "checkpoint":
            _checkpoint_blocks(model)
        elif key == "pytorch_sac":
            _checkpoint_blocks(
                model,
                functools.partial(tc.create_selective_checkpoint_contexts, policy.to_torch()),
            )
        elif key == "dropin":
            _checkpoint_blocks(
                model, functools.partial(torch_sac.create_selective_checkpoint_contexts, policy)
            )
        elif key == "apply_sac":
            keep.append(torch_sac.apply_sac(model, policy))
        elif key == "plan":
            plan, info = _plan(model, loss_fn, batch(0))
            if plan is None:
                continue  # refused (every rank alike) or failed: no row

            def forward(tokens, model=model, plan=plan):
                with torch_sac.sac_context(plan):
                    return loss_fn(model, tokens)

        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        rows.append((rid, model, opt, forward))
    info["handles"] = keep  # apply_sac's handles live as long as the models
    info.update(batch=n_batch, seq=seq)
    return rows, batch, info


def _clean(name):
    for junk in ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(junk, "")
    return name


def _local_grads(model):
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is not None:
            g = _to_local(g)
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


def _settle(limit_s=0.1):
    """Waits until the allocated bytes stop changing (at most ``limit_s``).
    gloo's threads free a collective's buffers a little after
    the op has returned on this thread: without the wait, a buffer would
    count as an activation or not by timing (3 MiB at TP's size)."""
    import torch_sac.memory

    stats = torch_sac.memory.cpu_memory_stats
    deadline = time.perf_counter() + limit_s
    last = stats()["allocated"]
    while time.perf_counter() < deadline:
        time.sleep(0.005)
        now = stats()["allocated"]
        if now == last:
            break
        last = now


def _measure(rows, batch, warmup, steps):
    """Runs the rows round robin (one step each per round); returns each
    row's medians over the rounds after warm-up and its gradient check. A
    row whose step raises is dropped from the later rounds and reported
    with its error (every rank runs the same steps, so a collective that
    fails on one fails, or times out, on all)."""
    import gc

    import torch_sac.memory

    res = {rid: {"act": [], "peak": [], "ms": [], "exact": None} for rid, *_ in rows}
    ref_grads = None
    for rnd in range(warmup + steps):
        x = batch(rnd)
        for rid, model, opt, forward in rows:  # round robin: every config sees the same load
            if "error" in res[rid]:
                continue
            gc.collect()
            _settle()
            try:
                t0 = time.perf_counter()
                with torch_sac.memory.track() as whole:
                    loss = forward(x)
                    t_fwd = time.perf_counter() - t0
                    _settle()  # not timed
                    act = whole.delta
                    t1 = time.perf_counter()
                    loss.backward()
            except RuntimeError as e:
                traceback.print_exc()
                res[rid]["error"] = f"round {rnd}: {type(e).__name__}: {e}"
                opt.zero_grad(set_to_none=True)
                continue
            if rnd == 0:  # same weights and data for every config
                grads = _local_grads(model)
                if rid == "none":
                    ref_grads = grads
                res[rid]["exact"] = _same(grads, ref_grads)
                del grads
            opt.step()
            opt.zero_grad(set_to_none=True)
            elapsed = t_fwd + time.perf_counter() - t1
            del loss
            if rnd >= warmup:
                res[rid]["act"].append(act)
                res[rid]["peak"].append(whole.peak)
                res[rid]["ms"].append(1e3 * elapsed)
    return {
        rid: {"error": r["error"]}
        if "error" in r
        else {
            "act": statistics.median(r["act"]),
            "peak": statistics.median(r["peak"]),
            "ms": statistics.median(r["ms"]),
            "exact": r["exact"],
            "act_spread": max(r["act"]) - min(r["act"]),
            "peak_spread": max(r["peak"]) - min(r["peak"]),
        }
        for rid, r in res.items()
    }


def _worker(section, rank, world, port, out_path, warmup, steps, quick):
    import faulthandler

    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    import torch
    import torch_sac
    import torch_sac.memory

    torch_sac.memory.install_counting_allocator()  # before any tensor we measure
    torch.set_num_threads(1)
    import collections
    import warnings

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    # Warnings (a region keeping tensors it cannot rebuild, ...) go to the
    # parent, counted, instead of into the log.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        if section == "fsdp":
            rows, batch, info = _fsdp_setup(rank, world)
        else:
            rows, batch, info = _tp_setup(section, rank, world, quick)
        t1 = time.perf_counter()
        summary = _measure(rows, batch, warmup, steps)
        info.update(setup_s=t1 - t0, rounds_s=time.perf_counter() - t1)
    info.pop("handles", None)
    seen = collections.Counter(f"{w.category.__name__}: {w.message}" for w in caught)
    with open(out_path + ".tmp", "w") as f:
        json.dump(
            {
                "rank": rank,
                "adapter": torch_sac.adapter(),
                "torch_sac": os.path.dirname(os.path.dirname(os.path.abspath(torch_sac.__file__))),
                "torch": torch.__version__,
                "results": summary,
                "info": info,
                "warnings": sorted(seen.items()),
            },
            f,
        )
    os.replace(out_path + ".tmp", out_path)
    if "failed" not in info and not any("error" in r for r in summary.values()):
        dist.barrier()  # else the group may be broken: exit, the parent reports
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


def _launch(section, warmup, steps, quick, timeout, log_dir=None):
    """Runs the section's workers; returns their result dicts (rank order).
    Their logs go to ``log_dir/SECTION.rankN.log`` if given (kept), else to
    a temporary folder."""
    import torch.distributed as dist

    world = SECTIONS[section][0]
    # The parent hosts the rendezvous store on a port the OS picks: no
    # probe-then-bind race for a free port.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        world,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=60),
    )
    out_dir = tempfile.mkdtemp(prefix="torch_sac_bench_dist_")
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    procs, logs = [], []
    try:
        for rank in range(world):
            logs.append(os.path.join(log_dir or out_dir, f"{section}.rank{rank}.log"))
            with open(logs[-1], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            os.path.abspath(__file__),
                            "--worker",
                            section,
                            str(rank),
                            str(world),
                            str(store.port),
                            os.path.join(out_dir, f"rank{rank}.json"),
                            str(warmup),
                            str(steps),
                            str(int(quick)),
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
                time.sleep(2)  # let the peers notice and report
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
            msg = [f"bench_distributed [{section}]: {failure}"]
            for r in range(world):
                msg.append(f"--- rank {r} log tail ---\n{_tail(logs[r])}")
            raise SystemExit("\n".join(msg))
        out = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        shutil.rmtree(out_dir, ignore_errors=True)


def _elsewhere(out):
    """Where torch_sac came from, when not from this checkout."""
    where = out[0]["torch_sac"]
    return "" if os.path.samefile(where, ROOT) else f" (imported from {where})"


def _mib(n):
    return f"{n / 2**20:.2f} MiB"


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
        if "error" in r:
            lines.append(f"{labels[key]:<32} {policy or '-':<14} FAILED: {_short(r['error'])}")
            continue
        if policy is None:
            vs_torch = "-"
        else:
            t = res[f"torch_wrapper:{policy}"].get("act")
            vs_torch = f"{r['act'] / t:.2f}x" if t else "n/a"
        lines.append(
            f"{labels[key]:<32} {policy or '-':<14} {r['act'] / 2**20:>8.2f} "
            f"{r['act'] / none['act']:>7.2f}x {vs_torch:>15} {r['peak'] / 2**20:>9.2f} "
            f"{r['ms']:>8.1f} {str(r['exact']):>12}"
        )
    return "\n".join(lines)


def _report_fsdp(out, warmup, steps, wall):
    world = len(out)
    print(
        f"FSDP2 (fully_shard per block + root), {world} gloo ranks on CPU, torch {out[0]['torch']}, "
        f"torch_sac adapter {out[0]['adapter']}{_elsewhere(out)}, 1 thread/rank"
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
    _agree(out, wall)


def _agree(out, wall):
    """Do the ranks agree? (Same model, same shard sizes: activation memory
    should match up to the noise of gloo's threads.) Then the gradient
    check over every rank, the failures, the wall time and the workers'
    warnings."""
    rids = out[0]["results"].keys()
    ok = [rid for rid in rids if all("error" not in rec["results"][rid] for rec in out)]
    worst = max(
        (
            abs(rec["results"][rid]["act"] - out[0]["results"][rid]["act"])
            for rec in out[1:]
            for rid in ok
        ),
        default=0,
    )
    inexact = [
        f"rank {rec['rank']} {rid}" for rec in out for rid in ok if not rec["results"][rid]["exact"]
    ]
    info = out[0]["info"]
    print(
        f"\nranks agree on activation memory within {worst / 2**20:.3f} MiB; "
        f"grads exact on every rank and config that ran: {not inexact}"
        + (f" (NOT exact: {', '.join(inexact)})" if inexact else "")
        + f"; wall time {wall:.1f} s (rank 0: setup {info['setup_s']:.1f} s, "
        f"rounds {info['rounds_s']:.1f} s)"
    )
    for rec in out:
        for rid in rids:
            if "error" in rec["results"][rid]:
                print(
                    f"rank {rec['rank']} {rid} FAILED: {_short(rec['results'][rid]['error'], 600)}"
                )
        if "failed" in rec["info"]:
            print(f"rank {rec['rank']} plan_peak FAILED: {_short(rec['info']['failed'], 600)}")
    _print_warnings(out)


def _short(text, n=70):
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 4] + " ..."


def _print_warnings(out):
    """The workers' warnings, each once with the ranks that gave it."""
    by_text = {}
    for rec in out:
        for text, n in rec["warnings"]:
            by_text.setdefault((text, n), []).append(str(rec["rank"]))
    for (text, n), ranks in by_text.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(ranks)}"
        print(f"{who} warned {n}x{' each' if len(ranks) > 1 else ''}: {_short(text, 300)}")


def _ratio(a, b):
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def _tp_table(res):
    """One table: each row's act, peak and step time, each with its ratios
    vs PyTorch's SAC with the same policy (/SAC) and vs per-block
    checkpointing (/ckpt)."""
    header = (
        f"{'config':<28} {'policy':<13} {'act MiB':>8} {'/SAC':>6} {'/ckpt':>6} "
        f"{'peak MiB':>9} {'/SAC':>6} {'/ckpt':>6} {'step ms':>8} {'/SAC':>6} {'/ckpt':>6} "
        f"{'grads exact':>11}"
    )
    lines = [header, "-" * len(header)]
    ckpt = res["checkpoint"]
    for rid, _, policy, label in _tp_runs():
        if rid not in res:
            continue  # the plan, refused or failed (printed above the table)
        r = res[rid]
        if "error" in r:
            lines.append(f"{label:<28} {policy or '-':<13} FAILED: {_short(r['error'], 80)}")
            continue
        sac = res.get(f"pytorch_sac:{policy}") if policy else None
        cols = []
        for m, fmt in (("act", "{:>8.2f}"), ("peak", "{:>9.2f}"), ("ms", "{:>8.1f}")):
            v = r[m] if m == "ms" else r[m] / 2**20
            cols.append(fmt.format(v))
            cols.append(f"{_ratio(r[m], sac.get(m)) if sac else '-':>6}")
            cols.append(f"{_ratio(r[m], ckpt.get(m)):>6}")
        lines.append(f"{label:<28} {policy or '-':<13} " + " ".join(cols) + f" {r['exact']!s:>11}")
    return "\n".join(lines)


def _max_over_ranks(out):
    res = {}
    for rid in out[0]["results"]:
        rows = [rec["results"][rid] for rec in out]
        failed = [r["error"] for r in rows if "error" in r]
        if failed:
            res[rid] = {"error": failed[0]}
            continue
        res[rid] = {m: max(r[m] for r in rows) for m in ("act", "peak", "ms")}
        res[rid]["exact"] = all(r["exact"] for r in rows)
    return res


def _targets(out):
    """Issue 39's targets, per rank: MET/MISSED with the numbers."""
    plans = {rec["info"].get("json") for rec in out}
    same_plan = len(plans) == 1 and None not in plans
    lines, met, total = [], 0, 0

    def compare(what, a_rid, b_rid, m, factor=1.0):
        unit = (lambda v: f"{v:.1f} ms") if m == "ms" else _mib
        for rec in out:
            a, b = rec["results"].get(a_rid, {}), rec["results"].get(b_rid, {})
            if m not in a or m not in b:
                failed = " and ".join(rid for rid, r in ((a_rid, a), (b_rid, b)) if m not in r)
                check(what, rec["rank"], False, f"{failed} failed")
                continue
            a, b = a[m], b[m]
            bound = f"{factor} x {unit(b)} = {unit(factor * b)}" if factor != 1 else unit(b)
            check(what, rec["rank"], a <= factor * b, f"{unit(a)} vs {bound} ({_ratio(a, b)})")

    def check(what, rank, ok, detail):
        nonlocal met, total
        total += 1
        met += bool(ok)
        lines.append(f"  {'MET' if ok else 'MISSED':<6} rank {rank}: {what}: {detail}")

    compare(
        "apply_sac(save_matmuls) activations <= PyTorch SAC's (save_matmuls)",
        "apply_sac:save_matmuls",
        "pytorch_sac:save_matmuls",
        "act",
    )
    compare(
        "apply_sac(recompute_all) activations <= 1.1x per-block checkpoint's",
        "apply_sac:recompute_all",
        "checkpoint",
        "act",
        1.1,
    )
    for m, what in (("peak", "peak"), ("ms", "step time")):
        for policy in POLICIES:
            compare(
                f"apply_sac({policy}) {what} <= PyTorch SAC's ({policy})",
                f"apply_sac:{policy}",
                f"pytorch_sac:{policy}",
                m,
            )
    what = f"plan_peak({PLAN_FRACTION}x) meets its target, same plan on every rank"
    for rec in out:
        info = rec["info"]
        plan = rec["results"].get("plan", {})
        if "refused" in info:
            least = info["least_peak"]
            detail = (
                f"refused: least peak {_mib(least) if least else '?'} > asked {_mib(info['asked'])}"
            )
            # Whether any way of checkpointing measured here reaches the ask.
            peaks = [(r["peak"], rid) for rid, r in rec["results"].items() if "peak" in r]
            if peaks and min(peaks)[0] > info["asked"]:
                lowest, rid = min(peaks)
                detail += f"; no row reaches it either (least: {rid} at {_mib(lowest)})"
            check(what, rec["rank"], False, detail)
        elif "failed" in info or "error" in plan:
            check(
                what, rec["rank"], False, "plan_peak failed" if "failed" in info else "row failed"
            )
        else:
            peak = plan["peak"]
            check(
                what,
                rec["rank"],
                peak <= info["target"] and same_plan,
                f"peak {_mib(peak)} vs target {_mib(info['target'])} "
                f"({_ratio(peak, info['target'])}; planned {_mib(info['planned_peak'])}); "
                f"same plan: {same_plan}",
            )
    return lines, met, total


def _report_tp(section, out, warmup, steps, wall):
    world, title = SECTIONS[section][:2]
    size = TP_SIZE
    print(
        f"{title}, {world} gloo ranks on CPU, torch {out[0]['torch']}, "
        f"torch_sac adapter {out[0]['adapter']}{_elsewhere(out)}, 1 thread/rank"
    )
    print(
        f"model: tests/python/tp_worker.py's Llama, {size['LAYERS']} blocks, width {size['DIM']}, "
        f"{size['HEADS']} heads, SwiGLU hidden {size['HIDDEN']}, vocab {size['VOCAB']}; "
        f"torchtitan TP plan + sequence parallel; batch {out[0]['info']['batch']}"
        + (" per dp rank" if section == "fsdp_tp" else "")
        + f", seq {out[0]['info']['seq']}, float32, cross-entropy"
    )
    print(
        f"{warmup} warm-up + {steps} measured rounds (medians), rows round robin; "
        "/SAC: vs PyTorch SAC, same policy; /ckpt: vs torch.utils.checkpoint per block"
    )
    info = out[0]["info"]
    if "refused" in info:
        print(
            f"plan_peak at {PLAN_FRACTION}x of the peak without checkpointing "
            f"({_mib(info['no_ckpt_peak'])} on rank 0, asked {_mib(info['asked'])}): REFUSED, "
            f"least peak {_mib(info['least_peak']) if info['least_peak'] else '?'}"
        )
        print(f"  {info['refused']}")
    elif "failed" in info:
        print(
            f"plan_peak at {PLAN_FRACTION}x of the peak without checkpointing "
            f"({_mib(info['no_ckpt_peak'])} on rank 0, asked {_mib(info['asked'])}): FAILED"
        )
        print(f"  {_short(info['failed'], 600)}")
    else:
        print(
            f"plan_peak at {PLAN_FRACTION}x of the peak without checkpointing "
            f"({_mib(info['no_ckpt_peak'])} on rank 0; target agreed over ranks "
            f"{_mib(info['target'])}): {info['summary']}, {info['runs']} planning runs, "
            f"{info['plan_s']:.1f} s"
        )
    print(f"\n== rank {out[0]['rank']}")
    print(_tp_table(out[0]["results"]))
    print(f"\n== max over {world} ranks (each column on its own)")
    print(_tp_table(_max_over_ranks(out)))
    lines, met, total = _targets(out)
    print(
        f"\ntargets (issue 39), per rank: {met} of {total} met (step times are noisy on shared cores)"
    )
    print("\n".join(lines))
    _agree(out, wall)


def main():
    parser = argparse.ArgumentParser(
        description="Activation memory, peak and step time per rank under FSDP2, TP + SP "
        "and FSDP2 + TP: torch_sac vs PyTorch's SAC, per-block checkpointing, none."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: fewer rounds (1 warm-up, 3 measured), TP sections at "
        f"batch {TP_BATCH_QUICK}, seq {TP_SEQ_QUICK}",
    )
    parser.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="measured rounds (default 5)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=tuple(SECTIONS),
        default=tuple(SECTIONS),
        help="sections to run (default: all, in this order)",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds before a section's workers are killed"
    )
    parser.add_argument(
        "--log-dir", default=None, help="keep the workers' logs there (SECTION.rankN.log)"
    )
    args = parser.parse_args()
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    steps = args.steps if args.steps is not None else (3 if args.quick else 5)
    warmup = max(warmup, 1)  # round 0 is the gradient check
    steps = max(steps, 1)

    t_all = time.monotonic()
    crashed = []
    for i, section in enumerate(s for s in SECTIONS if s in args.only):
        timeout = args.timeout or SECTIONS[section][3 if args.quick else 2]
        if i:
            print("\n")
        print(f"######## {section}")
        t0 = time.monotonic()
        try:
            out = _launch(section, warmup, steps, args.quick, timeout, args.log_dir)
        except SystemExit as e:  # a worker died or timed out: the next section
            print(e, flush=True)
            crashed.append(section)
            continue
        wall = time.monotonic() - t0
        if section == "fsdp":
            _report_fsdp(out, warmup, steps, wall)
        else:
            _report_tp(section, out, warmup, steps, wall)
        sys.stdout.flush()
    print(f"\ntotal wall time {time.monotonic() - t_all:.1f} s")
    if crashed:
        raise SystemExit(f"bench_distributed: no results from {', '.join(crashed)}")


if __name__ == "__main__":
    if len(sys.argv) == 10 and sys.argv[1] == "--worker":
        section, rank, world, port, out_path, *rounds = sys.argv[2:]
        _worker(section, int(rank), int(world), int(port), out_path, *map(int, rounds))
    else:
        main()
