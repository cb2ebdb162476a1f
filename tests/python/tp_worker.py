"""One rank of test_tensor_parallel.py: a Llama-style model under tensor
parallel (torchtitan's plan, with or without sequence parallel), trained one
step under several checkpointing variants on the same data.

Run as a script, one process per rank (the test starts them):

    python tp_worker.py RANK WORLD PORT OUT_JSON CASE

Each variant's loss and gradients (this rank's local shards) are compared
bitwise with the run without checkpointing, in this process; its activation
bytes (live after forward, less before it; torch_sac's counting allocator)
are reported. The rank writes one JSON object to OUT_JSON.
"""

import contextlib
import faulthandler
import functools
import gc
import json
import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tc
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import torch_sac

# Hang limit of one rank (the whole file takes seconds); TP_LIMIT_S
# shortens it when chasing a hang by hand.
LIMIT_S = int(os.environ.get("TP_LIMIT_S", 240))
DIM, HEADS, HIDDEN, LAYERS, VOCAB, BATCH, SEQ = 64, 4, 128, 4, 64, 4, 16
aten = torch.ops.aten
SAVE_LIST = [
    aten.mm.default,
    aten.addmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
]
# gloo's own buffers move a rank's live bytes by a few KiB between runs.
GLOO_NOISE = 32 * 1024
COLLECTIVES = [
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
]


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # -1 heads: under tensor parallel q/k/v are this rank's heads only.
        q, k, v = (
            w(x).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(model, mesh, sequence_parallel):
    """torchtitan's Llama TP plan (sequence parallel on the norms, the
    sequence gathered before attention and the MLP); q/k/v stay local
    tensors, as CPU SDPA has no DTensor sharding rule."""
    if sequence_parallel:
        top = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        layer = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
    else:
        top = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        }
        layer = {"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    layer.update(
        {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        }
    )
    parallelize_module(model, mesh, top)
    for block in model.layers:
        parallelize_module(block, mesh, layer)
    return model


def build(mesh, sequence_parallel):
    torch.manual_seed(0)
    return parallelize(Llama(), mesh, sequence_parallel)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _torch_sac_list(ctx, op, *args, **kwargs):
    """PyTorch's SAC as users write it: a policy_fn over an op list."""
    return (
        tc.CheckpointPolicy.MUST_SAVE if op in SAVE_LIST else tc.CheckpointPolicy.PREFER_RECOMPUTE
    )


def _per_block(model, wrap):
    """Each block's forward wrapped by ``wrap(forward)``; returns an undo."""
    return _wrap_each(model.layers, wrap)


def _wrap_each(blocks, wrap):
    originals = [(b, b.forward) for b in blocks]
    for b in blocks:
        b.forward = wrap(b.forward)

    def undo():
        for b, f in originals:
            b.forward = f

    return undo


def variant(name, model):
    """Installs checkpointing variant ``name`` on ``model``; returns
    (undo, regions list filled during forward)."""
    regions = []
    if name == "none":
        return (lambda: None), regions
    if name.startswith("apply_sac, a policy per rank"):
        # Rank 0 keeps the matmuls, the others recompute everything; with
        # ", collectives saved", every rank saves the collectives' outputs.
        rank = dist.get_rank()
        saved = COLLECTIVES if name.endswith(", collectives saved") else []
        policy = torch_sac.policies.save_ops((SAVE_LIST if rank == 0 else []) + saved)
        return torch_sac.apply_sac(model, policy).remove, regions
    if name == "apply_sac recompute_all, rank 0 holds the linears' inputs":
        # Rank 0 keeps every linear's input alive (sequence parallel's
        # all-gathered block inputs among them): its unpacks of them are
        # served from the originals, rank 1's are rebuilt, replaying the
        # all-gathers. The ranks' replays must still run the same
        # collectives at the same points of backward.
        held = []
        hooks = []
        if dist.get_rank() == 0:
            for module in model.layers.modules():
                if isinstance(module, nn.Linear):
                    hooks.append(
                        module.register_forward_pre_hook(lambda m, args: held.append(args[0]))
                    )
        handle = torch_sac.apply_sac(model, torch_sac.policies.recompute_all())

        def undo():
            handle.remove()
            for h in hooks:
                h.remove()
            held.clear()

        return undo, regions
    if name.startswith("apply_sac "):
        policy = getattr(torch_sac.policies, name.split()[1])()
        handle = torch_sac.apply_sac(model, policy)
        return handle.remove, regions
    if name == "torch.utils.checkpoint per block":
        return _per_block(
            model, lambda f: lambda x: tc.checkpoint(f, x, use_reentrant=False)
        ), regions
    contexts = {
        "torch SAC, op list": (tc.create_selective_checkpoint_contexts, _torch_sac_list),
        "torch_sac drop-in, op list": (torch_sac.create_selective_checkpoint_contexts, SAVE_LIST),
    }
    if name in contexts:
        ctx_fn = functools.partial(*contexts[name])
        return _per_block(
            model,
            lambda f: lambda x: tc.checkpoint(f, x, use_reentrant=False, context_fn=ctx_fn),
        ), regions
    if name == "torch_sac region, op list":

        def wrap(f):
            def run(x):
                with torch_sac.sac_context(torch_sac.policies.save_ops(SAVE_LIST)) as r:
                    regions.append(r)
                    return f(x)

            return run

        return _per_block(model, wrap), regions
    raise ValueError(name)


VARIANTS = (
    "none",
    "apply_sac save_matmuls",
    "apply_sac recompute_all",
    "torch_sac region, op list",
    "torch SAC, op list",
    "torch_sac drop-in, op list",
    "torch.utils.checkpoint per block",
    "apply_sac recompute_all, rank 0 holds the linears' inputs",
)


class Stage(nn.Module):
    """Blocks ``layers[start:end]`` of a Llama (built whole, then split),
    with the embedding on the first stage and the head on the last."""

    def __init__(self, full, start, end):
        super().__init__()
        self.tok_embeddings = full.tok_embeddings if start == 0 else None
        self.layers = nn.ModuleList(full.layers[start:end])
        last = end == len(full.layers)
        self.norm = full.norm if last else None
        self.output = full.output if last else None

    def forward(self, h):
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers:
            h = layer(h)
        if self.output is not None:
            h = self.output(self.norm(h))
        return h


def _pipeline_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def run_pipeline(rank, world):
    """Each pipeline schedule (4 microbatches) with no checkpointing and
    with apply_sac on every stage: this rank's gradients compared."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    results = {}
    for schedule_name in PIPELINE_SCHEDULES:
        per_rank = 2 if schedule_name == "interleaved_1f1b" else 1
        n_stages = world * per_rank
        per_stage = LAYERS // n_stages
        ref = None
        for name in ("none", "apply_sac save_matmuls", "apply_sac recompute_all"):
            torch.manual_seed(0)
            full = Llama()
            # Stage i on rank i % world (the interleaved schedules' loop).
            indices = [rank + k * world for k in range(per_rank)]
            modules = [Stage(full, i * per_stage, (i + 1) * per_stage) for i in indices]
            handles = [
                torch_sac.apply_sac(
                    m, getattr(torch_sac.policies, name.split()[1])(), modules=Block
                )
                for m in modules
                if name != "none"
            ]
            stages = [
                PipelineStage(m, i, n_stages, torch.device("cpu")) for m, i in zip(modules, indices)
            ]
            if schedule_name == "interleaved_1f1b":
                schedule = ScheduleInterleaved1F1B(stages, 4, loss_fn=_pipeline_loss)
            else:
                kind = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
                schedule = kind(stages[0], 4, loss_fn=_pipeline_loss)
            torch.manual_seed(2)
            try:
                kwargs = {"target": tokens, "losses": []} if rank == world - 1 else {}
                if rank == 0:
                    schedule.step(tokens, **kwargs)
                else:
                    schedule.step(**kwargs)
            except RuntimeError as e:
                results[f"{schedule_name}: {name}"] = {"error": str(e).splitlines()[0][:500]}
                traceback.print_exc()
                continue
            replayed = sum(h.stats()["total"].get("replayed_ops", 0) for h in handles)
            for h in handles:
                h.remove()
            grads = [p.grad.clone() for m in modules for p in m.parameters()]
            if ref is None:
                ref = grads
                continue
            results[f"{schedule_name}: {name}"] = {
                "bitwise": len(grads) == len(ref)
                and all(torch.equal(a, b) for a, b in zip(grads, ref)),
                "replayed_ops": replayed,
            }
    return results


def build_fsdp_tp(mesh):
    """TP + sequence parallel on the mesh's "tp" dimension, then FSDP2 on
    its "dp" dimension (each block, then the model)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = parallelize(Llama(), mesh["tp"], True)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def run_plans(mesh, fsdp=False):
    """plan_peak at 0.8, 0.6 and 0.4 of no checkpointing's peak, and
    budget_for_model at 0.5, under TP + sequence parallel: each plan's JSON
    (every rank must make the same one) and whether the step under it is
    bitwise exact and fits, as planned and in use. With ``fsdp``, FSDP2 + TP
    and plan_peak at 0.8 only (this small model's blocks reach no lower)."""
    model = build_fsdp_tp(mesh) if fsdp else build(mesh, True)
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))

    def step():
        return F.cross_entropy(_local(model(tokens)).flatten(0, 1), tokens.flatten())

    def run(ctx):
        torch.manual_seed(2)
        with torch_sac.memory.track() as m:
            with ctx:
                loss = step()
            loss.backward()
        grads = [_local(p.grad).clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads, m.peak

    ref_loss, ref_grads, peak = run(contextlib.nullcontext())
    results = {}
    for fraction in (0.8,) if fsdp else (0.8, 0.6, 0.4):
        try:
            plan = torch_sac.policies.plan_peak(step, peak_bytes=int(peak * fraction))
        except ValueError as e:
            results[f"plan_peak {fraction}"] = {"refused": str(e).split(" (")[0]}
            continue
        loss, grads, got_peak = run(torch_sac.sac_context(plan))
        results[f"plan_peak {fraction}"] = {
            "plan": json.dumps(plan.to_dict(), sort_keys=True),
            "fits": plan.measured_peak <= plan.peak_bytes,
            # The step's peak in use, as the planner measured it: under
            # FSDP2 its planning runs once measured 8% under it.
            "fits_in_use": got_peak <= plan.peak_bytes + GLOO_NOISE,
            "peaks": [plan.measured_peak, got_peak, plan.peak_bytes],
            "bitwise": torch.equal(loss, ref_loss)
            and all(torch.equal(a, b) for a, b in zip(grads, ref_grads)),
        }
    if fsdp:
        return results
    budget = torch_sac.policies.budget_for_model(model, (tokens,), fraction=0.5)
    results["budget_for_model 0.5"] = {
        "plan": json.dumps(
            {name: sorted((str(op), i) for op, i in p.chosen) for name, p in budget.plans.items()},
            sort_keys=True,
        )
    }
    return results


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron-style tensor parallel: the partial sums of a row-parallel
    linear reduced in place with c10d's all_reduce in forward."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def _in_place_collectives(x):
    y = _ReduceFromTensorParallel.apply(x * 2)
    z = y.sin() * 3
    dist.all_reduce(z)  # on a tensor the region made, outside any Function
    return z.cos().sum()


def run_in_place_collectives(rank):
    """c10d's in-place all_reduce in forward, under each entry point:
    bitwise against no checkpointing (the region once rebuilt the reduced
    tensors without the reduction), and what the collective wrote kept
    anyway, itemised."""
    variants = {
        "sac_context": lambda f, x: _in_region(f, x),
        "torch_sac.checkpoint": lambda f, x: torch_sac.checkpoint(
            f, x, policy=torch_sac.policies.recompute_all()
        ),
        "drop-in": lambda f, x: tc.checkpoint(
            f,
            x,
            use_reentrant=False,
            context_fn=functools.partial(torch_sac.create_selective_checkpoint_contexts, []),
        ),
    }
    regions = []

    def _in_region(f, x):
        with torch_sac.sac_context(torch_sac.policies.recompute_all()) as region:
            regions.append(region)
            return f(x)

    def grad(run=None):
        torch.manual_seed(10 + rank)  # each rank its own partial sums
        x = torch.randn(16, 32, requires_grad=True)
        out = _in_place_collectives(x) if run is None else run(_in_place_collectives, x)
        out.backward()
        return x.grad

    want = grad()
    results = {name: {"bitwise": torch.equal(grad(run), want)} for name, run in variants.items()}
    rows = [r for r in regions[0].op_details() if r["kept_anyway"]]
    results["sac_context"]["kept_anyway"] = [(r["op"], r["kept_anyway"]) for r in rows]
    return results


class _GatherSequence(torch.autograd.Function):
    """Sequence parallel as torchtitan's default (spmd_types) backend does
    it on local tensors: c10d's all_gather_into_tensor into a fresh buffer
    in forward, reduce_scatter_tensor in backward."""

    @staticmethod
    def forward(ctx, x, async_op):
        world = dist.get_world_size()
        out = torch.empty((x.shape[0] * world, *x.shape[1:]), dtype=x.dtype)
        work = dist.all_gather_into_tensor(out, x.contiguous(), async_op=async_op)
        if async_op:
            work.wait()
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous())
        return out, None


class _ScatterSequence(torch.autograd.Function):
    """The row-parallel linear's partial sums, reduce-scattered over the
    sequence into a fresh buffer (all-gathered back in backward)."""

    @staticmethod
    def forward(ctx, x):
        out = x.new_empty((x.shape[0] // dist.get_world_size(), *x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty((grad.shape[0] * dist.get_world_size(), *grad.shape[1:]))
        dist.all_gather_into_tensor(out, grad.contiguous())
        return out


class C10dBlock(nn.Module):
    """A sequence-parallel feed-forward block on local tensors: norm on the
    sequence shard, gather, column- then row-parallel linears, scatter."""

    def __init__(self, async_op=False):
        super().__init__()
        world = dist.get_world_size()
        self.norm = RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN // world, bias=False)
        self.w2 = nn.Linear(HIDDEN // world, DIM, bias=False)
        self.async_op = async_op

    def forward(self, x):
        h = _GatherSequence.apply(self.norm(x), self.async_op)
        # A gate that saves the scatter's output, so rebuilds replay it too.
        return x + torch.sin(_ScatterSequence.apply(self.w2(F.silu(self.w1(h)))))


C10D_BUFFER_VARIANTS = (
    "none",
    # First: ranks agree on a process group's collectives once per process
    # (collective_agreement.h), and the variants after it would agree.
    "apply_sac recompute_all, a policy per rank",
    "torch.utils.checkpoint per block",
    "apply_sac recompute_all",
    "apply_sac recompute_all, async collectives",
    "torch_sac.checkpoint recompute_all",
    "apply_sac save_matmuls",
    "apply_sac save_matmuls, reduce-scatter saved",
)


def run_c10d_buffers(rank):
    """c10d's buffer-filling collectives (torchtitan's default TP backend)
    in forward, replayed in backward: bitwise against no checkpointing, and
    what each variant keeps, replays and is told."""
    results, steps = {}, {}
    for name in C10D_BUFFER_VARIANTS:
        gc.collect()  # the last variant's cycles: not to be freed inside this one's window
        torch.manual_seed(3)  # the same weights on every rank
        blocks = nn.Sequential(*(C10dBlock("async" in name) for _ in range(LAYERS)))
        torch.manual_seed(4 + rank)  # each rank its own sequence shard
        x = torch.randn(SEQ // dist.get_world_size(), BATCH, DIM, requires_grad=True)
        undo, handle = (lambda: None), None
        layers = list(blocks)
        if name == "torch.utils.checkpoint per block":
            undo = _wrap_each(
                layers, lambda f: functools.partial(tc.checkpoint, f, use_reentrant=False)
            )
        elif name == "torch_sac.checkpoint recompute_all":
            policy = torch_sac.policies.recompute_all()
            undo = _wrap_each(
                layers, lambda f: functools.partial(torch_sac.checkpoint, f, policy=policy)
            )
        elif name.startswith("apply_sac"):
            if "per rank" in name:
                # Rank 0 keeps the gathers, so it would never replay them.
                gathers = [torch.ops.c10d._allgather_base_.default]
                policy = torch_sac.policies.save_ops([] if rank else gathers)
            elif "saved" in name:
                policy = torch_sac.policies.save_ops(
                    [aten.mm.default, torch.ops.c10d._reduce_scatter_base_.default]
                )
            else:
                policy = getattr(torch_sac.policies, name.split()[1].rstrip(","))()
            handle = torch_sac.apply_sac(blocks, policy)
            undo = handle.remove
        try:
            with torch_sac.memory.track() as m:
                out = blocks(x)
                activations = m.delta
                loss = out.square().sum()
                loss.backward()
        except RuntimeError as e:
            results[name] = {
                "error": str(e).splitlines()[0][:1000],
                "in_region_after": torch_sac.region.in_region(),
            }
            undo()
            continue
        row = {"activations": activations, "peak": m.peak}
        if handle is not None:
            total = handle.stats()["total"]
            for key in ("collective_ops", "collective_replays", "dropped_bytes"):
                row[key] = total.get(key, 0)
            details = [d for rows in handle.op_details().values() for d in rows]
            row["kept_anyway"] = sorted({d["op"] for d in details if d["kept_anyway"]})
            row["collectives_saved"] = sum(
                d["saved"] for d in details if d["op"].startswith("c10d")
            )
            row["adapter"] = torch_sac.adapter()
        undo()
        steps[name] = (
            loss.detach(),
            [x.grad.clone()] + [p.grad.clone() for p in blocks.parameters()],
        )
        del out, loss  # the graph: not to be freed inside the next variant's window
        results[name] = row
    ref_loss, ref_grads = steps["none"]
    for name, (loss, grads) in steps.items():
        results[name]["bitwise"] = torch.equal(loss, ref_loss) and all(
            torch.equal(a, b) for a, b in zip(grads, ref_grads)
        )
    return results


def run_case(case, mesh, rank):
    if case == "c10d_in_place":
        return run_in_place_collectives(rank)
    if case == "c10d_buffers":
        return run_c10d_buffers(rank)
    if case == "pp":
        return run_pipeline(rank, dist.get_world_size())
    if case in ("plans", "fsdp_tp_plans"):
        return run_plans(mesh, fsdp=case == "fsdp_tp_plans")
    sequence_parallel = case in ("tp_sp", "fsdp_tp", "tp_sp_dropin_first", "tp_sp_policy_per_rank")
    if case == "fsdp_tp":
        names = VARIANTS[:4]
    elif case == "tp_sp_policy_per_rank":
        names = (
            "none",
            "apply_sac, a policy per rank",
            "apply_sac, a policy per rank, collectives saved",
        )
    elif case == "tp_sp_dropin_first":
        # DTensor's caches cold: its first calls run sharding propagation
        # (FakeTensorMode) inside the drop-in's forward only.
        names = ("torch_sac drop-in, op list", "none")
    else:
        names = VARIANTS
    torch.manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    results, steps = {}, {}
    for name in names:
        model = build_fsdp_tp(mesh) if case == "fsdp_tp" else build(mesh, sequence_parallel)
        undo, regions = variant(name, model)
        torch.manual_seed(2)
        try:
            with torch_sac.memory.track() as m:
                logits = model(tokens)
                activations = m.delta
                loss = F.cross_entropy(_local(logits).flatten(0, 1), tokens.flatten())
                loss.backward()
        except RuntimeError as e:
            # Every rank runs the same ops, so every rank fails alike.
            results[name] = {
                "error": str(e).splitlines()[0][:1000],
                # Nothing left installed by the failed step.
                "in_region_after": torch_sac.region.in_region(),
            }
            traceback.print_exc()  # the test shows the log of a failed rank
            continue
        finally:
            undo()
        steps[name] = (loss.detach(), [_local(p.grad).clone() for p in model.parameters()])
        row = {"activations": activations, "peak": m.peak}
        if regions:
            stats = [r.stats() for r in regions]
            row["dropped_bytes"] = sum(s["dropped_bytes"] for s in stats)
            row["replayed_ops"] = sum(s["replayed_ops"] for s in stats)
            row["collective_ops"] = sum(s["collective_ops"] for s in stats)
            row["collective_replays"] = sum(s["collective_replays"] for s in stats)
            row["kept_as_is"] = sum(s["kept_as_is"] for s in stats)
        results[name] = row
    ref_loss, ref_grads = steps["none"]
    for name, (loss, grads) in steps.items():
        if name != "none":
            results[name]["bitwise"] = torch.equal(loss, ref_loss) and all(
                torch.equal(a, b) for a, b in zip(grads, ref_grads)
            )
    return results


def main():
    rank, world, port, out, case = sys.argv[1:6]
    rank, world = int(rank), int(world)
    faulthandler.dump_traceback_later(LIMIT_S, exit=True)
    torch.set_num_threads(1)
    torch_sac.memory.install_counting_allocator()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=LIMIT_S / 2),
    )
    try:
        if case.startswith("fsdp_tp"):
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        result = {"rank": rank, "results": run_case(case, mesh, rank)}
    finally:
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    os.environ.setdefault("TORCH_SAC_QUIET", "1")
    main()
    # Results are written and the process group destroyed. Under torch 2.11
    # on a loaded 2-core machine, a rank sometimes aborted after this point,
    # in the interpreter's teardown ("terminate called without an active
    # exception": a joinable std::thread destroyed; torch_sac starts none),
    # twice in one CI run, never in eight runs alone: exit without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
