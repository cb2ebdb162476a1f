#!/usr/bin/env python
"""torch_sac on one GPU: peak memory and step time of real-sized models in
bf16, against no checkpointing, torch.utils.checkpoint and PyTorch's SAC.

Models (Hugging Face ``transformers`` configs, random weights, nothing
downloaded, bf16, SDPA attention, ``use_cache=False``):

* ``gpt2``: GPT-2 small (12 layers, 768 wide, 12 heads, ~124M parameters),
  sequence 1024, batch 8 (4 with ``--quick``), dropout 0.1 as in GPT-2;
* ``llama``: a Llama of ~0.85B parameters (16 layers, 2048 wide, 16 heads,
  4 KV heads, MLP 5632, vocabulary 32000, untied head), sequence 2048,
  batch 8: without checkpointing its activations (~30 GB) dwarf its
  parameters and gradients (~3.4 GB) and fit an 80 GB H100.

Rows (each layer of the model is one checkpointed block, except the peak
plans, which are one region around the whole step):

* no checkpointing;
* ``torch.utils.checkpoint`` per block (``use_reentrant=False``);
* PyTorch's SAC saving matmuls (``torch.utils.checkpoint`` with
  ``create_selective_checkpoint_contexts`` and a ``policy_fn`` saving
  mm/addmm/bmm/baddbmm, convolutions and the SDPA kernels);
* torch_sac region (``sac_context``) per block, ``save_matmuls()`` and
  ``recompute_all()``;
* torch_sac drop-in: ``torch.utils.checkpoint`` with
  ``context_fn=partial(torch_sac.create_selective_checkpoint_contexts, save_matmuls())``;
* ``torch_sac.apply_sac(model, save_matmuls())``;
* offloading, per block: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``;
  a torchtune-style offload of everything saved (bench/offload_reference.py:
  saved-tensor hooks, pinned memory, a side stream, one prefetch); torch_sac
  ``offload_matmuls()`` (matmul outputs to host memory, the rest recomputed)
  in a region and in the drop-in;
* peak plans ``torch_sac.policies.plan_peak(step, peak_bytes=P)`` at the
  step peak measured for ``torch.utils.checkpoint`` per block, and at 0.5x,
  0.35x and 0.25x of no checkpointing's step peak (above the memory
  allocated before the step); the row's note says the solver (``block
  chain``: an option per block; else multiple recomputation) and a plan
  the planner refuses shows its reason in the row;
* peak plans with offload (``plan_peak(..., offload=True)``: a block may
  keep its matmuls' outputs in host memory where the measured bandwidth
  makes that cheaper than recomputing) at 0.5x, 0.3x and 0.2x.

Columns:

* ``peak``: ``torch.cuda.max_memory_allocated()`` over one step
  (forward + backward, reset before the step; parameters and gradients
  included), the median over rounds (it is the same every round);
* ``step ms``: forward + backward, timed with CUDA events on the current
  stream, the median over rounds; rounds interleave the rows (rotating their
  order) so drifts of clock and temperature hit every row alike;
* ratios of both to no checkpointing and to PyTorch's SAC;
* ``GPU idle``: 1 - (time the GPU ran kernels, memcpys or memsets in one
  profiled step, from torch.profiler's CUDA activity, overlaps merged) /
  (the row's median step time). The share of the step in which the GPU
  waited for the CPU: launch overhead, Python, torch_sac's bookkeeping,
  host syncs. It does not say which;
* ``grads``: the row's gradients against no checkpointing's from the same
  inputs and seed: ``bitwise`` if every gradient is ``torch.equal``, else
  the largest per-tensor error relative to that tensor's largest entry,
  ``ok`` if at most ``--tol`` (default 3e-2: about 4 bf16 ulps of the
  tensor's largest entry; SDPA's fused backward kernels are not
  deterministic, so two runs without checkpointing differ too: that noise
  floor is printed first). On GPT-2, whose SDPA call draws its own dropout
  on CUDA, PyTorch's SAC (this policy saves SDPA kernels) serves the kernel
  from its cache in recompute without drawing from the generator, so every
  later dropout mask of the block differs: expect ``DIFF`` there (README,
  "Exact where PyTorch's SAC is not"); its memory and time are still shown.

Usage::

    python bench/bench_gpu.py                  # gpt2 + llama, < 4 min on an H100
    python bench/bench_gpu.py --quick          # gpt2 only, fewer rounds, < 90 s
    python bench/bench_gpu.py --out gpu.md     # also gpu.md (markdown) and gpu.json
    python bench/bench_gpu.py --device cpu --tiny   # tiny configs on the CPU (checks the code)

A soft deadline (``--deadline``, default 190 s, 80 s with ``--quick``) keeps
the run inside a time-limited job: GPT-2 gets 40% of it, the Llama the rest;
past its share a model skips its remaining plans, stops its rounds (after at
least one) and its profiling, and the table says what was cut. The markdown
and JSON files are rewritten after each model, so a run killed later keeps
what it measured.

Without a CUDA device (and without ``--device cpu``) it prints
"no CUDA device" and exits 0.
"""

import argparse
import contextlib
import functools
import json
import os
import platform
import statistics
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="GPT-2 only (batch 4), 3 rounds: < 90 s on an H100"
    )
    p.add_argument(
        "--tiny", action="store_true", help="tiny configs (for --device cpu: checks the code)"
    )
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--models", default=None, help="comma-separated subset of gpt2,llama")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds per row (default 5; 3 with --quick or --tiny)",
    )
    p.add_argument(
        "--tol", type=float, default=3e-2, help="gradient tolerance (relative to each tensor's max)"
    )
    p.add_argument(
        "--plan-timeout",
        type=float,
        default=90.0,
        help="seconds: after a plan took longer, the model's next plans are skipped",
    )
    p.add_argument("--no-profile", action="store_true", help="skip the GPU idle measurement")
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds (default 190; 80 with --quick; 0: none): a soft limit; past a model's "
        "share of it, plans, rounds (at least one) and profiling are cut short, and a "
        "model that cannot start in time is skipped; the tables say so",
    )
    p.add_argument(
        "--out", default=None, help="write the tables to FILE (markdown) and FILE's .json"
    )
    return p.parse_args(argv)


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def model_specs(args):
    """name -> (config kwargs, batch, seq, rounds)."""
    if args.tiny:
        gpt2 = dict(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
        llama = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        return {"gpt2": (gpt2, 2, 64, args.rounds or 3), "llama": (llama, 2, 64, args.rounds or 3)}
    gpt2 = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    llama = dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    if args.quick:
        return {"gpt2": (gpt2, 4, 1024, args.rounds or 3)}
    return {"gpt2": (gpt2, 8, 1024, args.rounds or 5), "llama": (llama, 8, 2048, args.rounds or 5)}


def build_model(name, cfg_kwargs, device, dtype):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(**cfg_kwargs, use_cache=False, attn_implementation="sdpa")
        with torch.device(device):
            model = transformers.GPT2LMHeadModel(cfg)
        layers = list(model.transformer.h)
    else:
        cfg = transformers.LlamaConfig(**cfg_kwargs, use_cache=False, attn_implementation="sdpa")
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg)
        layers = list(model.model.layers)
    model = model.to(dtype).train()
    return model, layers


# --------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------

_MATMUL_NAMES = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}


def matmul_policy_fn(ctx, op, *args, **kwargs):
    """PyTorch's SAC policy saving matmuls, convolutions and SDPA kernels
    (what torch_sac.policies.save_matmuls() saves), written for PyTorch."""
    from torch.utils.checkpoint import CheckpointPolicy

    name = op.name()
    if name in _MATMUL_NAMES or (
        name.startswith("aten::")
        and "backward" not in name
        and ("convolution" in name or "scaled_dot_product" in name)
    ):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def wrap_layers(layers, make):
    """Replaces each layer's forward (on the instance) by make(forward);
    returns the undo."""
    for layer in layers:
        layer.forward = make(layer.forward)

    def undo():
        for layer in layers:
            del layer.forward

    return undo


# A plan row's target: the peak measured for torch.utils.checkpoint per block.
PER_BLOCK = "per-block"


class Row:
    def __init__(self, name, install=None, plan_fraction=None, offload=False):
        self.name = name
        self.install = install  # model, layers -> undo (None: nothing to install)
        self.plan_fraction = plan_fraction
        self.plan_offload = offload  # a peak plan's plan_peak(offload=...)
        self.plan = None
        self.plan_target = None
        self.note = ""
        self.error = None
        self.peaks, self.peaks_above, self.times, self.walls = [], [], [], []
        self.grads = "-"
        self.grad_err = None
        self.idle = None
        self.offload = None  # torch_sac.offload.stats() moved by the last measured step


def make_rows():
    import torch.utils.checkpoint as tc

    import torch_sac

    def torch_ckpt(model, layers):
        return wrap_layers(
            layers, lambda f: functools.partial(tc.checkpoint, f, use_reentrant=False)
        )

    def torch_sac_baseline(model, layers):
        ctx = functools.partial(tc.create_selective_checkpoint_contexts, matmul_policy_fn)
        return wrap_layers(
            layers,
            lambda f: functools.partial(tc.checkpoint, f, use_reentrant=False, context_fn=ctx),
        )

    def in_context(context):
        """A layer wrapper running the layer's forward inside ``context()``."""

        def make(f):
            def forward(*a, **k):
                with context():
                    return f(*a, **k)

            return forward

        return make

    def region(policy_factory):
        def install(model, layers):
            policy = policy_factory()
            return wrap_layers(layers, in_context(lambda: torch_sac.sac_context(policy)))

        return install

    def dropin(policy_factory):
        def install(model, layers):
            ctx = functools.partial(
                torch_sac.create_selective_checkpoint_contexts, policy_factory()
            )
            return wrap_layers(
                layers,
                lambda f: functools.partial(tc.checkpoint, f, use_reentrant=False, context_fn=ctx),
            )

        return install

    def apply_sac(model, layers):
        handle = torch_sac.apply_sac(model, torch_sac.policies.save_matmuls())
        return handle.remove

    def save_on_cpu(model, layers):
        import torch

        return wrap_layers(
            layers,
            in_context(
                lambda: torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
            ),
        )

    def torchtune_style(model, layers):
        from offload_reference import OffloadEverything

        hooks = OffloadEverything()
        return wrap_layers(layers, in_context(lambda: hooks))

    return [
        Row("no checkpointing"),
        Row("torch.utils.checkpoint per block", torch_ckpt),
        Row("PyTorch SAC, save matmuls", torch_sac_baseline),
        Row("torch_sac region, save_matmuls", region(torch_sac.policies.save_matmuls)),
        Row("torch_sac region, recompute_all", region(torch_sac.policies.recompute_all)),
        Row(
            "drop-in (checkpoint + torch_sac ctx), save_matmuls",
            dropin(torch_sac.policies.save_matmuls),
        ),
        Row("apply_sac, save_matmuls", apply_sac),
        Row("save_on_cpu(pin_memory) per block", save_on_cpu),
        Row("torchtune-style offload per block (reference)", torchtune_style),
        Row("torch_sac region, offload_matmuls", region(torch_sac.policies.offload_matmuls)),
        Row("drop-in, offload_matmuls", dropin(torch_sac.policies.offload_matmuls)),
        Row("peak plan at per-block checkpoint's peak", plan_fraction=PER_BLOCK),
        Row("peak plan 0.5x no-ckpt peak", plan_fraction=0.5),
        Row("peak plan 0.35x no-ckpt peak", plan_fraction=0.35),
        Row("peak plan 0.25x no-ckpt peak", plan_fraction=0.25),
        Row("peak plan with offload 0.5x no-ckpt peak", plan_fraction=0.5, offload=True),
        Row("peak plan with offload 0.3x no-ckpt peak", plan_fraction=0.3, offload=True),
        Row("peak plan with offload 0.2x no-ckpt peak", plan_fraction=0.2, offload=True),
    ]


NONE, TORCH_SAC_ROW = "no checkpointing", "PyTorch SAC, save matmuls"
PER_BLOCK_ROW = "torch.utils.checkpoint per block"


# --------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------


class Device:
    """Memory and timing on CUDA (caching allocator, CUDA events) or, for
    --device cpu, torch_sac's counting allocator and the host clock."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = device.startswith("cuda")
        self.device = device
        if not self.cuda:
            import torch_sac.memory

            self.mem = torch_sac.memory
            self.mem.install_counting_allocator()

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def allocated(self):
        return (
            self.torch.cuda.memory_allocated()
            if self.cuda
            else self.mem.cpu_memory_stats()["allocated"]
        )

    def reset_peak(self):
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        else:
            self.mem.reset_peak()

    def peak(self):
        return (
            self.torch.cuda.max_memory_allocated()
            if self.cuda
            else self.mem.cpu_memory_stats()["peak"]
        )

    def name(self):
        if self.cuda:
            return self.torch.cuda.get_device_name()
        return f"CPU ({platform.processor() or platform.machine()}, {self.torch.get_num_threads()} threads)"


class Bench:
    def __init__(self, args, dev, name, model, layers, ids):
        self.args, self.dev, self.name = args, dev, name
        self.model, self.layers, self.ids = model, layers, ids

    def loss(self):
        return self.model(input_ids=self.ids, labels=self.ids, use_cache=False).loss

    @contextlib.contextmanager
    def installed(self, row):
        """The row's checkpointing installed on the model (outside any timed
        window: installing is not part of a step)."""
        undo = row.install(self.model, self.layers) if row.install is not None else None
        try:
            yield
        finally:
            if undo is not None:
                undo()

    def step(self, row):
        """One step of ``row`` (installed): forward + backward, grads left in .grad."""
        import torch
        import torch_sac

        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same dropout masks in every step and row
        if row.plan is not None:
            with torch_sac.sac_context(row.plan):
                loss = self.loss()
        else:
            loss = self.loss()
        loss.backward()
        return loss.detach()

    def run(self, row):
        with self.installed(row):
            return self.step(row)

    def measured(self, row):
        """One step; appends peak, peak above start, CUDA-event (or host)
        time and host wall time to the row."""
        import torch

        dev = self.dev
        with self.installed(row):
            self.model.zero_grad(set_to_none=True)
            dev.sync()
            dev.reset_peak()
            base = dev.allocated()
            if dev.cuda:
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
            import torch_sac

            torch_sac.offload.reset_peak_stats()
            before = torch_sac.offload.stats()
            t0 = time.perf_counter()
            self.step(row)
            if dev.cuda:
                end.record()
            dev.sync()
            wall = (time.perf_counter() - t0) * 1e3
            after = torch_sac.offload.stats()
            if after["offloaded_bytes"] > before["offloaded_bytes"]:
                row.offload = {
                    k: after[k] - before[k]
                    for k in ("offloaded_bytes", "reloaded_bytes", "late", "late_bytes")
                }
                row.offload["host_peak_bytes"] = after["host_peak_bytes"]
        row.times.append(start.elapsed_time(end) if dev.cuda else wall)
        row.walls.append(wall)
        row.peaks.append(dev.peak())
        row.peaks_above.append(dev.peak() - base)
        self.model.zero_grad(set_to_none=True)

    def grads(self):
        return {
            n: p.grad.detach().clone()
            for n, p in self.model.named_parameters()
            if p.grad is not None
        }

    def compare(self, ref):
        """(bitwise?, max over tensors of max|g - r| / max|r|) for the
        current .grad against ``ref``."""
        bitwise, worst = True, 0.0
        got = {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}
        if got.keys() != ref.keys():
            return False, float("inf")
        for n, r in ref.items():
            g = got[n]
            if torch_equal(g, r):
                continue
            bitwise = False
            scale = r.float().abs().max().item()
            err = (g.float() - r.float()).abs().max().item() / (scale if scale > 0 else 1.0)
            worst = max(worst, err)
        return bitwise, worst

    def gpu_busy_ms(self, row):
        """Milliseconds of one profiled step in which the GPU ran something
        (kernels, memcpy, memset), overlapping intervals merged."""
        from torch.profiler import ProfilerActivity, profile

        self.model.zero_grad(set_to_none=True)
        self.dev.sync()
        with self.installed(row), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                self.step(row)
                self.dev.sync()
        self.model.zero_grad(set_to_none=True)
        intervals = []
        for e in prof.profiler.kineto_results.events():
            # Kernels, memcpys and memsets; not the GPU projections of
            # record_function ranges (user annotations), which span idle time.
            if str(e.device_type()).endswith("CUDA") and not e.is_user_annotation():
                start = e.start_ns()
                intervals.append((start, start + e.duration_ns()))
        if not intervals:
            raise RuntimeError("the profiler recorded no GPU activity (CUPTI unavailable?)")
        intervals.sort()
        busy, cur_s, cur_e = 0, *intervals[0]
        for s, e in intervals[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        return busy / 1e6


def torch_equal(a, b):
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def first_line(exc):
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= 300 else text[:297] + "..."


def fmt_bytes(n):
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.2f} MiB"


def is_oom(exc):
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc)


def recover(dev):
    import gc

    gc.collect()
    if dev.cuda:
        dev.torch.cuda.empty_cache()


def bench_model(args, dev, name, spec, deadline):
    """Benchmarks one model; ``deadline`` (a perf_counter time or None) is
    this model's soft limit."""
    import torch

    import torch_sac

    cfg, batch, seq, rounds = spec
    started = time.perf_counter()
    cut = []  # what the deadline cut short

    def past(fraction=1.0):
        """Whether ``fraction`` of this model's time is used up."""
        return deadline is not None and time.perf_counter() > started + fraction * (
            deadline - started
        )

    dtype = torch.bfloat16
    log(f"[{name}] building (batch {batch}, seq {seq}, bf16)")
    model, layers = build_model(name, cfg, dev.device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(
        0, cfg["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(3)
    ).to(dev.device)
    b = Bench(args, dev, name, model, layers, ids)
    rows = make_rows()
    by_name = {r.name: r for r in rows}
    none = by_name[NONE]
    log(f"[{name}] {n_params / 1e6:.1f}M parameters, {len(layers)} layers; warm-up")

    # No checkpointing first: its step peak (above the memory allocated
    # before the step) sets the peak plans' targets.
    b.run(none)
    b.measured(none)
    plain_peak = none.peaks_above[-1]
    for samples in (none.peaks, none.peaks_above, none.times, none.walls):
        samples.clear()
    log(
        f"[{name}] no checkpointing: step peak {fmt_bytes(plain_peak)} above "
        f"{fmt_bytes(dev.peak() - plain_peak)} allocated before the step"
    )

    per_block_peak = None
    if any(r.plan_fraction == PER_BLOCK for r in rows):
        per_block = by_name[PER_BLOCK_ROW]
        b.measured(per_block)
        per_block_peak = per_block.peaks_above[-1]
        for samples in (per_block.peaks, per_block.peaks_above, per_block.times, per_block.walls):
            samples.clear()
        log(f"[{name}] {PER_BLOCK_ROW}: step peak {fmt_bytes(per_block_peak)}")

    plan_seconds = 0.0
    for row in rows:
        if row.plan_fraction is None:
            continue
        if row.plan_fraction == PER_BLOCK:
            target = per_block_peak
        else:
            target = int(plain_peak * row.plan_fraction)
        if past(0.45):
            row.error = "skipped: past the deadline's share for planning (--deadline)"
            cut.append(row.name)
            log(f"[{name}] {row.name}: {row.error}")
            continue
        if plan_seconds > args.plan_timeout:
            row.error = f"skipped: the previous plan took {plan_seconds:.0f} s (--plan-timeout {args.plan_timeout:.0f})"
            log(f"[{name}] {row.name}: {row.error}")
            continue
        log(f"[{name}] planning {row.name}: target {fmt_bytes(target)}")
        t = time.perf_counter()
        try:
            row.plan = torch_sac.policies.plan_peak(
                b.loss, peak_bytes=target, offload=row.plan_offload
            )
            row.plan_target = target
            plan_seconds = time.perf_counter() - t
            offloaded = len(row.plan.offloaded or ())
            row.note = (
                f"target {fmt_bytes(target)}, planned {fmt_bytes(row.plan.measured_peak)}; "
                f"{row.plan.solver}, {row.plan.replayed_ops} replays"
                + (f", {offloaded} calls offloaded" if row.plan_offload else "")
                + f"; planned in {plan_seconds:.1f} s"
            )
            log(f"[{name}] {row.name}: {row.note}")
        except Exception as exc:  # noqa: BLE001 - the row says why
            plan_seconds = time.perf_counter() - t
            row.error = f"planner: {first_line(exc)} ({plan_seconds:.1f} s)"
            log(f"[{name}] {row.name}: {row.error}")
            recover(dev)

    # Gradients (this pass is also every row's warm-up step).
    log(f"[{name}] gradient check")
    b.run(none)
    ref = b.grads()
    b.run(none)
    bitwise, noise = b.compare(ref)
    floor = "bitwise" if bitwise else f"{noise:.1e}"
    log(f"[{name}] noise floor (no checkpointing run twice): {floor}")
    for row in rows:
        if row is none or row.error:
            continue
        try:
            b.run(row)
            bitwise, err = b.compare(ref)
            row.grad_err = 0.0 if bitwise else err
            row.grads = "bitwise" if bitwise else f"{'ok' if err <= args.tol else 'DIFF'} {err:.1e}"
        except Exception as exc:  # noqa: BLE001 - the row says why
            row.error = "OOM" if is_oom(exc) else first_line(exc)
            recover(dev)
        log(f"[{name}] {row.name}: grads {row.grads}{' - ' + row.error if row.error else ''}")
        b.model.zero_grad(set_to_none=True)
    none.grads, none.grad_err = "reference", 0.0
    del ref
    recover(dev)

    live = [r for r in rows if not r.error]
    done = 0
    for i in range(rounds):
        t_round = time.perf_counter()
        order = live[i % len(live) :] + live[: i % len(live)]
        for row in order:
            try:
                b.measured(row)
            except Exception as exc:  # noqa: BLE001
                row.error = "OOM" if is_oom(exc) else first_line(exc)
                recover(dev)
        live = [r for r in live if not r.error]
        done += 1
        log(
            f"[{name}] round {i + 1}/{rounds}: "
            + ", ".join(f"{r.name.split(',')[0][:18]} {r.times[-1]:.0f}ms" for r in live[:3])
            + ", ..."
        )
        # Leave a round's time (and as much again for profiling) before the deadline.
        if (
            deadline is not None
            and i + 1 < rounds
            and time.perf_counter() + 3 * (time.perf_counter() - t_round) > deadline
        ):
            cut.append(f"rounds ({done} of {rounds})")
            log(f"[{name}] stopping after {done} rounds: deadline")
            break

    # One more step of each offloading row with its copies timed (timing
    # events around every copy and every wait on one): how long the copies
    # took, and how long compute waited for them (exposed).
    for row in live:
        if row.offload is None or past():
            continue
        import torch_sac

        try:
            with torch_sac.offload.using(time_copies=True):
                torch_sac.offload.synchronize()
                before = torch_sac.offload.stats()
                b.run(row)
                dev.sync()
                torch_sac.offload.synchronize()
                after = torch_sac.offload.stats()
        except Exception as exc:  # noqa: BLE001 - the row says why
            row.note = (row.note + "; " if row.note else "") + f"timed copies: {first_line(exc)}"
            recover(dev)
            continue
        row.offload["copy_ms"] = (
            sum(after[k] - before[k] for k in ("d2h_copy_ns", "h2d_copy_ns")) / 1e6
        )
        row.offload["waited_ms"] = (after["waited_ns"] - before["waited_ns"]) / 1e6

    if dev.cuda and not args.no_profile:
        for row in live:
            if past():
                cut.append("profiling")
                log(f"[{name}] profiling stopped: deadline")
                break
            try:
                busy = b.gpu_busy_ms(row)
                row.idle = max(0.0, 1.0 - busy / statistics.median(row.times))
            except Exception as exc:  # noqa: BLE001
                row.idle = None
                row.note = (row.note + "; " if row.note else "") + f"profiler: {first_line(exc)}"
        log(f"[{name}] profiled one step per row")

    header = dict(
        model=name,
        params_m=round(n_params / 1e6, 1),
        batch=batch,
        seq=seq,
        layers=len(layers),
        rounds=done,
        noise_floor=floor,
        no_ckpt_step_peak_gib=round(plain_peak / 2**30, 3),
        cut_short=", ".join(cut) or None,
        seconds=round(time.perf_counter() - started, 1),
    )
    del b, model, layers
    recover(dev)
    return header, rows


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def table(header, rows, args):
    med = {
        r.name: (statistics.median(r.peaks), statistics.median(r.times)) for r in rows if r.times
    }
    base = med.get(NONE)
    sac = med.get(TORCH_SAC_ROW)
    md = [
        f"### {header['model']}: {header['params_m']}M parameters, {header['layers']} layers, "
        f"batch {header['batch']} x seq {header['seq']}, bf16, {header['rounds']} rounds; "
        f"gradient noise floor (no checkpointing twice): {header['noise_floor']}; "
        f"{header['seconds']} s"
        + (f"; cut short by the deadline: {header['cut_short']}" if header["cut_short"] else ""),
        "",
        "| row | peak | vs none | vs PyTorch SAC | step ms | vs none | vs PyTorch SAC | GPU idle | grads | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    records = []
    for r in rows:
        rec = dict(row=r.name, error=r.error, note=r.note, grads=r.grads, grad_rel_err=r.grad_err)
        if r.name in med:
            peak, t = med[r.name]
            rec.update(
                peak_bytes=peak,
                step_peak_above_start_bytes=statistics.median(r.peaks_above),
                step_ms=t,
                step_ms_all=r.times,
                host_wall_ms=statistics.median(r.walls),
                gpu_idle=r.idle,
            )

            def ratio(x, y):
                return f"{x / y:.2f}x" if y else "-"

            rec.update(
                peak_vs_none=peak / base[0] if base else None,
                time_vs_none=t / base[1] if base else None,
                peak_vs_torch_sac=peak / sac[0] if sac else None,
                time_vs_torch_sac=t / sac[1] if sac else None,
            )
            idle = f"{100 * r.idle:.0f}%" if r.idle is not None else "n/a"
            note = r.note
            if r.offload is not None:
                o = r.offload
                note = (
                    f"offloaded {fmt_bytes(o['offloaded_bytes'])}, back {fmt_bytes(o['reloaded_bytes'])}, "
                    f"{o['late']} late ({fmt_bytes(o['late_bytes'])}), "
                    + (
                        f"copies {o['copy_ms']:.1f} ms, compute waited {o['waited_ms']:.2f} ms, "
                        if "waited_ms" in o
                        else ""
                    )
                    + f"host pool peak {fmt_bytes(o['host_peak_bytes'])}"
                    + ("; " + note if note else "")
                )
                rec.update(offload=o)
            if r.plan is not None:
                # A plan's target bounds the step's peak above what was
                # allocated before it (parameters, optimizer state), as the
                # planner measures; the peak column is absolute.
                above = max(r.peaks_above)
                within = "within" if above <= r.plan_target else "OVER"
                note = f"step peak above start {fmt_bytes(above)} ({within} target); " + note
                rec.update(
                    plan_target_bytes=r.plan_target, plan_within_target=above <= r.plan_target
                )
            md.append(
                f"| {r.name} | {fmt_bytes(peak)} | {ratio(peak, base[0]) if base else '-'} | "
                f"{ratio(peak, sac[0]) if sac else '-'} | {t:.1f} | {ratio(t, base[1]) if base else '-'} | "
                f"{ratio(t, sac[1]) if sac else '-'} | {idle} | {r.grads} | {note} |"
            )
        else:
            md.append(f"| {r.name} | - | - | - | - | - | - | - | - | {r.error or 'not run'} |")
        records.append(rec)
    return "\n".join(md), records


def host_bandwidth(dev, nbytes=256 << 20, reps=5):
    """Measured device-to-host and host-to-device bandwidth (GB/s, median of
    ``reps`` copies of ``nbytes`` between the device and pinned memory), the
    figure offloading lives by: it is far below the link's spec when ranks
    share the host. None on the CPU."""
    import torch

    if not dev.cuda:
        return None
    d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("d2h", h, d), ("h2d", d, h)):
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        out[name + "_gb_s"] = round(nbytes / statistics.median(times) / 1e9, 1)
    return out


def main(argv=None):
    args = parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device", flush=True)
        return 0
    import transformers

    import torch_sac

    if args.device.startswith("cuda"):
        # bf16 matmuls do not use TF32; fp32 parts (the loss) keep full precision.
        torch.backends.cuda.matmul.allow_tf32 = False
    dev = Device(args.device)
    if not dev.cuda:
        # The offload rows run their bookkeeping on the CPU stand-in: a check
        # of the code, not of the copies (torch_sac.offload).
        torch_sac.offload.set_options(cpu_stand_in=True, min_bytes=0, keep_last_bytes=0)
    specs = model_specs(args)
    if args.models:
        wanted = args.models.split(",")
        specs = {k: v for k, v in specs.items() if k in wanted}
    info = dict(
        device=dev.name(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        transformers=transformers.__version__,
        adapter=torch_sac.adapter(),
        python=platform.python_version(),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        args=vars(args),
        host_bandwidth=host_bandwidth(dev),
    )
    log(
        f"device: {info['device']}; torch {info['torch']} (CUDA {info['cuda']}); transformers "
        f"{info['transformers']}; torch_sac adapter {info['adapter']}; python {info['python']}"
    )
    out_md = [
        f"# torch_sac GPU benchmark\n\n{info['device']}, torch {info['torch']} (CUDA {info['cuda']}), "
        f"transformers {info['transformers']}, torch_sac adapter `{info['adapter']}`, {info['date']}.\n",
        "peak: torch.cuda.max_memory_allocated over one step (reset before it); step ms: CUDA "
        "events, median over interleaved rounds; GPU idle: 1 - GPU-busy time of one profiled step "
        "(torch.profiler CUDA activity) / median step time; grads vs no checkpointing: bitwise, or "
        f"max |diff| / max |ref| per tensor, ok if <= {args.tol:g} (bf16).\n",
        f"Host link measured (pinned, 256 MiB copies): {info['host_bandwidth']}; offload rows' "
        "notes: bytes copied each way in one step, reloads the consumer waited for (late), and "
        "the host pool's peak.\n",
    ]
    results = dict(info=info, models=[])
    deadline_s = args.deadline if args.deadline is not None else (80.0 if args.quick else 190.0)
    # Each model's share of the time left (the larger model gets the rest).
    shares = {"gpt2": 0.4, "llama": 1.0} if len(specs) > 1 else {}

    def write():
        if not args.out:
            return
        root, ext = os.path.splitext(args.out)
        md_path = args.out if ext.lower() in (".md", ".markdown") else root + ".md"
        os.makedirs(os.path.dirname(os.path.abspath(md_path)), exist_ok=True)
        with open(md_path, "w") as f:
            f.write("\n".join(out_md))
        with open(root + ".json", "w") as f:
            json.dump(results, f, indent=1, default=str)
        log(f"wrote {md_path} and {root}.json")

    for name, spec in specs.items():
        deadline = None
        if deadline_s > 0:
            end = T0 + deadline_s
            now = time.perf_counter()
            if end - now < 20:
                reason = f"skipped: {end - now:.0f} s left of --deadline {deadline_s:.0f}"
                log(f"[{name}] {reason}")
                out_md.append(f"### {name}: {reason}\n")
                results["models"].append(dict(model=name, error=reason))
                write()
                continue
            deadline = now + shares.get(name, 1.0) * (end - now)
        try:
            header, rows = bench_model(args, dev, name, spec, deadline)
        except Exception as exc:  # noqa: BLE001 - a model that fails leaves the others
            log(f"[{name}] failed: {first_line(exc)}")
            out_md.append(f"### {name}: failed: {first_line(exc)}\n")
            results["models"].append(dict(model=name, error=first_line(exc)))
            recover(dev)
            write()
            continue
        md, records = table(header, rows, args)
        print("\n" + md + "\n", flush=True)
        out_md.append(md + "\n")
        results["models"].append(dict(header, rows=records))
        write()  # after each model: a later timeout keeps what was measured
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
