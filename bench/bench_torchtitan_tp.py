"""Activation memory of torch_sac against torchtitan's own activation
checkpointing, on torchtitan's own Llama3 "debugmodel" under torchtitan's own
tensor parallel + sequence parallel, 2 gloo ranks on CPU: no AC, torchtitan
FullAC and SelectiveAC, ``apply_sac`` with ``recompute_all`` and
``save_matmuls``; activations (live after forward), peak, and whether loss
and gradients are bitwise those of no AC.

Not part of the test suite (torchtitan is no dependency of torch_sac).
Set-up, outside the environment you test in::

    pip download --no-deps torchtitan==0.3.0 spmd_types==0.2.3 -d wheels
    pip install --no-deps --target /tmp/tt_site wheels/*.whl

Run (it starts its 2 ranks itself, each under ``timeout 300``)::

    TORCHTITAN_SITE=/tmp/tt_site python bench/bench_torchtitan_tp.py \
        [--backend spmd_types|partial_dtensor]

What it changes in torchtitan's set-up, and why: FlexAttention has no
backward on CPU, so each layer's attention is torchtitan's own SDPA (as its
graph_trainer experiment does; the same causal mask for one document per
sequence); ``tyro`` (command-line parsing) and the MoE expert-parallel
kernels (``minimal_async_ep``, triton) are stubbed when missing; the meshes
are built on "cpu"; what ``update_from_config`` does is done by hand (it
imports the trainer's data stack). Measured 2026-12-06 (torch 2.13.0+cpu):
docs/distributed-compile.md, "torchtitan's own model".
"""

import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback

HERE = os.path.abspath(__file__)
SEED = 1234
BATCH, SEQ = 2, 64
VARIANTS = ["noAC", "titan_FullAC", "titan_SelectiveAC", "sac_recompute_all", "sac_save_matmuls"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def launcher(backend):
    port = free_port()
    env = dict(os.environ)
    site = os.environ.get("TORCHTITAN_SITE")
    if site:
        env["PYTHONPATH"] = site + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    outdir = os.path.join(tempfile.gettempdir(), "bench_torchtitan_tp_" + backend)
    os.makedirs(outdir, exist_ok=True)
    procs = []
    for r in range(2):
        cmd = [
            "timeout",
            "300",
            sys.executable,
            HERE,
            "--rank",
            str(r),
            "--port",
            str(port),
            "--backend",
            backend,
            "--out",
            os.path.join(outdir, f"rank{r}.json"),
        ]
        log = open(os.path.join(outdir, f"rank{r}.log"), "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    rcs = []
    for p, log in procs:
        rcs.append(p.wait())
        log.close()
    print("return codes:", rcs)
    res = []
    for r in range(2):
        path = os.path.join(outdir, f"rank{r}.json")
        res.append(json.load(open(path)) if os.path.exists(path) else None)
    report(res, backend)
    if any(rc != 0 for rc in rcs):
        for r in range(2):
            print(f"---- rank{r}.log tail ----")
            print(open(os.path.join(outdir, f"rank{r}.log")).read()[-6000:])


def report(res, backend):
    MiB = 1 << 20
    print(f"backend={backend}")
    for r, rr in enumerate(res):
        if rr is None:
            print(f"rank{r}: no results")
            continue
        print(f"rank {r}:")
        print(f"  {'variant':20s} {'act MiB':>9s} {'peak MiB':>9s} {'bitwise':>8s}  loss")
        for v in VARIANTS:
            d = rr.get(v)
            if d is None:
                continue
            if "error" in d:
                print(f"  {v:20s} ERROR: {d['error'].splitlines()[-1]}")
                continue
            print(
                f"  {v:20s} {d['act'] / MiB:9.3f} {d['peak'] / MiB:9.3f} {str(d['bitwise']):>8s}  {d['loss']!r}"
            )
        for v in ("sac_recompute_all", "sac_save_matmuls"):
            d = rr.get(v, {})
            if "stats" in d:
                print(f"  {v} stats.total: {d['stats']}")

        def g(v, rr=rr):
            return rr.get(v, {}).get("act")

        if g("sac_recompute_all") and g("titan_FullAC"):
            print(
                f"  ratio sac(recompute_all)/FullAC act = {g('sac_recompute_all') / g('titan_FullAC'):.4f}"
            )
        if g("sac_save_matmuls") and g("noAC"):
            print(f"  ratio sac(save_matmuls)/noAC act = {g('sac_save_matmuls') / g('noAC'):.4f}")


# ----------------------------------------------------------------------------- rank


def stub_modules():
    """Stubs for modules that are unrelated to the Llama3 model/TP/AC code paths."""
    import sys as _s
    from unittest import mock

    stubbed = []
    for name in [
        "tyro",
        "tyro.constructors",
        "tyro.conf",
        # MoE expert-parallel kernels (need triton); imported by
        # models/common/token_dispatcher.py, unused by dense Llama3.
        "torchtitan.distributed.minimal_async_ep",
        "torchtitan.distributed.minimal_async_ep.api",
    ]:
        try:
            __import__(name)
        except Exception:
            m = mock.MagicMock(name=name)
            m.__spec__ = None
            m.__path__ = []
            _s.modules[name] = m
            stubbed.append(name)
    return stubbed


def rank_main(rank, port, backend, out):
    import datetime

    import torch

    import torch_sac

    torch_sac.memory.install_counting_allocator()
    torch.set_num_threads(1)
    import torch.distributed as dist

    results = {"stubbed": None}

    def dump():
        with open(out, "w") as f:
            json.dump(results, f, indent=1)

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    results["stubbed"] = stub_modules()

    import dataclasses
    import torch.nn.functional as F

    import spmd_types as spmd
    import torchtitan.models.common.attention as tt_attn
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    # torchtitan.tools.utils.device_type falls back to "cuda" when no accelerator
    # exists; build the meshes on "cpu".
    import torchtitan.distributed.parallel_dims as tt_pd

    tt_pd.device_type = "cpu"
    dist_utils.set_spmd_backend(backend)
    parallelism = ParallelismConfig(
        tensor_parallel_degree=2, enable_sequence_parallel=True, spmd_backend=backend
    )
    parallel_dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2, spmd_backend=backend
    )
    parallel_dims.build_mesh()
    train_context = dist_utils.get_spmd_context(
        parallel_dims=parallel_dims, spmd_typechecking=False
    )

    def build(ac):
        spec = model_registry("debugmodel")  # attn_backend="flex" (default)
        cfg = spec.model
        # FlexAttention has no backward on CPU (torch raises NotImplementedError).
        # Same swap as torchtitan's experiments/graph_trainer/common_utils.py
        # ("sdpa"): torchtitan's ScaledDotProductAttention(is_causal=True),
        # identical to flex's causal mask for one document per sequence.
        for lc in cfg.layers:
            lc.attention.inner_attention = tt_attn.ScaledDotProductAttention.Config()
        # What Llama3Model.Config.update_from_config does (it imports the Trainer,
        # which needs the data stack): sharding config + RoPE cache = seq_len.
        set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)
        for lc in cfg.layers:
            lc.attention.rope = dataclasses.replace(lc.attention.rope, max_seq_len=SEQ)
        with torch.device("meta"):
            model = cfg.build()
        # parallelize_llama minus compile (off) and minus apply_fsdp_to_decoder
        # (dp_shard=1: would only install a MixedPrecisionPolicy wrapper).
        model.parallelize(parallel_dims)
        if ac is not None:
            ac.build(
                dump_folder=os.path.join(tempfile.gettempdir(), "bench_torchtitan_tp_dump")
            ).apply(model)
        model.to_empty(device="cpu")
        torch.manual_seed(SEED)
        with torch.no_grad(), train_context():
            model.init_weights(buffer_device=None)
        model.train()
        return model, cfg

    g = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, 2048, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, 2048, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ).contiguous()

    def prep_inputs(model):
        inputs, labs, extra = tokens.clone(), labels.clone(), {"positions": positions.clone()}
        # SDPA backend: no attention masks (trainer builds them only for Flex/Varlen).
        if backend == "spmd_types":
            from torchtitan.distributed.spmd_types import annotate_input_spmd_types

            inputs, labs, extra = annotate_input_spmd_types(parallel_dims, inputs, labs, extra)
        elif backend == "full_dtensor":
            from torchtitan.distributed import full_dtensor

            inputs, labs, extra = full_dtensor.parallelize_inputs(
                parallel_dims, inputs, labs, extra
            )
        return inputs, labs, extra

    def full_logits(pred):
        from torch.distributed.tensor import DTensor

        if isinstance(pred, DTensor):
            return pred.full_tensor()
        if backend == "spmd_types":
            from torchtitan.distributed.spmd_types import current_spmd_mesh

            # loss_parallel off: all-gather the vocab-sharded logits (as
            # torchtitan's compute_logprobs does) and use plain cross_entropy.
            return spmd.redistribute(
                pred, current_spmd_mesh().get_group("tp"), src=spmd.S(-1), dst=spmd.I
            )
        return pred

    ref = None
    for v in VARIANTS:
        try:
            handle = None
            ac = {"titan_FullAC": FullAC.Config(), "titan_SelectiveAC": SelectiveAC.Config()}.get(v)
            model, cfg = build(ac)
            if v == "sac_recompute_all":
                handle = torch_sac.apply_sac(model, torch_sac.policies.recompute_all())
            elif v == "sac_save_matmuls":
                handle = torch_sac.apply_sac(model, torch_sac.policies.save_matmuls())
            inputs, labs, extra = prep_inputs(model)
            # The earlier variants' models and graphs go first, and no
            # collection runs inside the window: one freeing them there
            # lowered a later variant's measured peak by up to 9 MiB.
            gc.collect()
            gc.disable()
            with train_context():
                with torch_sac.memory.track() as mpeak:
                    with torch_sac.memory.track() as mfwd:
                        pred = model(inputs, **extra)
                    act = mfwd.delta
                    logits = full_logits(pred)
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), labs.flatten(0, 1))
                    del pred, logits
                    with spmd.no_typecheck():
                        loss.backward()
            grads = {}
            for n, p in model.named_parameters():
                n = n.replace("_checkpoint_wrapped_module.", "")
                gr = p.grad
                if gr is not None and hasattr(gr, "to_local"):
                    gr = gr.to_local()
                grads[n] = gr.detach().clone() if gr is not None else None
            d = {
                "act": act,
                "peak": mpeak.peak,
                "loss": float(loss.detach()),
                "n_params_with_grad": sum(x is not None for x in grads.values()),
            }
            if v == "noAC":
                ref = (loss.detach().clone(), grads)
                d["bitwise"] = True
            else:
                ok = torch.equal(loss.detach(), ref[0]) and set(grads) == set(ref[1])
                bad = []
                for n, gr in grads.items():
                    r = ref[1].get(n)
                    if (gr is None) != (r is None) or (gr is not None and not torch.equal(gr, r)):
                        bad.append(n)
                d["bitwise"] = bool(ok and not bad)
                if bad:
                    d["mismatched"] = bad[:10]
            if handle is not None:
                d["stats"] = handle.stats()["total"]
                handle.remove()
            results[v] = d
            del model
        except Exception:
            results[v] = {"error": traceback.format_exc()}
        finally:
            gc.enable()
        dump()
        dist.barrier()
    dump()
    dist.destroy_process_group()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int)
    ap.add_argument("--port", type=int)
    ap.add_argument("--backend", default="spmd_types")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.rank is None:
        launcher(a.backend)
    else:
        rank_main(a.rank, a.port, a.backend, a.out)
