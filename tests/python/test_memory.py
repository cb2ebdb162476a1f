"""torch_sac.memory: the counting CPU allocator and track().

Byte counts are asserted exactly (tolerance 0): the allocator counts the
requested size of every CPU allocation made through torch's CPU allocator,
and on CPU the ops used here (addmm, relu, ...) allocate nothing through it
but their outputs (BLAS/oneDNN scratch space does not go through it, or is
freed before the op returns). Python's cyclic garbage collector is paused in
these tests so that garbage from earlier tests cannot be freed mid-window.
"""

import copy
import functools
import gc
import pickle
import threading

import pytest
import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

import torch_sac
from conftest import forward, loss_of
from helpers import allocated, storage_bytes
from models import MODEL_BUILDERS
from torch_sac import memory
from torch_sac.memory import _CudaWindow, track

F32 = 4  # bytes per float32


@pytest.fixture(autouse=True)
def counting_allocator():
    memory.install_counting_allocator()
    gc.collect()
    gc.disable()
    yield
    gc.enable()


class SavedStorages:
    """saved_tensors_hooks pack hook noting the storages autograd saves.

    Records storages by data pointer (it keeps no tensor alive itself) and
    skips the storages in ``outside`` (inputs and parameters).
    """

    def __init__(self, outside):
        self.outside = {t.untyped_storage().data_ptr() for t in outside}
        self.storages = {}

    def pack(self, t):
        s = t.untyped_storage()
        if s.data_ptr() not in self.outside:
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t

    @property
    def nbytes(self):
        return sum(self.storages.values())


def mlp(inplace):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(inplace), nn.Linear(64, 64), nn.ReLU(inplace), nn.Linear(64, 16)
    )


BATCH = 8
HIDDEN_BYTES = BATCH * 64 * F32  # one hidden activation
OUT_BYTES = BATCH * 16 * F32


# --------------------------------------------------------------------------
# Install and stats
# --------------------------------------------------------------------------


@pytest.mark.adapter_independent
def test_install_is_idempotent():
    before = memory.cpu_memory_stats()
    memory.install_counting_allocator()
    memory.install_counting_allocator()
    assert memory.is_counting_allocator_installed()
    after = memory.cpu_memory_stats()
    assert after["allocated"] == before["allocated"]
    assert set(after) == {"allocated", "peak", "num_allocs", "num_frees"}


@pytest.mark.adapter_independent
def test_stats_exact_after_allocating_and_freeing():
    before = memory.cpu_memory_stats()
    a = torch.empty(1000)
    b = torch.empty(3, 5, dtype=torch.float64)
    c = torch.zeros(7, dtype=torch.uint8)
    mid = memory.cpu_memory_stats()
    assert mid["allocated"] - before["allocated"] == 4000 + 120 + 7
    assert mid["num_allocs"] - before["num_allocs"] == 3
    v = a.view(10, 100)[2:5]  # views share the storage
    assert allocated() == mid["allocated"]
    del a
    assert allocated() == mid["allocated"]  # v keeps the storage alive
    del v, b
    assert allocated() - before["allocated"] == 7
    del c
    after = memory.cpu_memory_stats()
    assert after["allocated"] == before["allocated"]
    assert after["num_frees"] - before["num_frees"] == 3


@pytest.mark.adapter_independent
def test_peak_tracks_the_maximum_and_resets():
    memory.reset_peak()
    base = allocated()
    assert memory.cpu_memory_stats()["peak"] == base
    a = torch.empty(250)  # 1000 B
    b = torch.empty(500)  # 2000 B
    del a
    c = torch.empty(125)  # 500 B
    assert memory.cpu_memory_stats()["peak"] - base == 3000
    memory.reset_peak()
    assert memory.cpu_memory_stats()["peak"] - base == 2500
    del b, c
    assert memory.cpu_memory_stats()["peak"] - base == 2500
    assert allocated() == base


@pytest.mark.adapter_independent
def test_concurrent_threads_sum_exactly():
    base = memory.cpu_memory_stats()
    kept = [[] for _ in range(4)]

    def work(i):
        for n in range(1, 201):
            scratch = torch.empty(n, dtype=torch.uint8)  # noqa: F841  (freed at once)
            if n % 50 == 0:
                kept[i].append(torch.empty(i + 1))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = memory.cpu_memory_stats()
    assert after["allocated"] - base["allocated"] == sum(4 * (i + 1) * F32 for i in range(4))
    assert after["num_allocs"] - base["num_allocs"] == 4 * 200 + 16
    kept.clear()
    assert allocated() == base["allocated"]


# --------------------------------------------------------------------------
# track()
# --------------------------------------------------------------------------


@pytest.mark.adapter_independent
def test_track_delta_and_peak_of_a_block():
    with track("cpu") as m:
        assert m.delta == 0 and m.peak == 0
        a = torch.empty(100)  # 400 B
        b = torch.empty(50)  # 200 B
        assert (m.delta, m.peak) == (600, 600)  # live values inside the block
        del a
    assert (m.delta, m.peak) == (200, 600)
    del b
    assert (m.delta, m.peak) == (200, 600)  # frozen after the block
    assert m.start == allocated()


@pytest.mark.adapter_independent
def test_track_counts_frees_of_earlier_tensors():
    earlier = torch.empty(1000)
    with track() as m:
        del earlier
        x = torch.empty(10)  # noqa: F841
    assert m.delta == 40 - 4000
    assert m.peak == 0  # never above the level at entry


@pytest.mark.adapter_independent
def test_tracks_nest_and_leave_the_global_peak_alone():
    memory.reset_peak()
    with track() as outer:
        a = torch.empty(250)  # 1000 B
        with track(torch.device("cpu")) as inner:
            b = torch.empty(125)  # 500 B
            del a
        c = torch.empty(1000)  # 4000 B
    assert (inner.delta, inner.peak) == (-500, 500)
    assert (outer.delta, outer.peak) == (4500, 4500)
    assert memory.cpu_memory_stats()["peak"] - outer.start == 4500
    del b, c


@pytest.mark.adapter_independent
def test_tracker_reuse_and_errors():
    m = track()
    with pytest.raises(RuntimeError, match="nothing measured yet"):
        m.delta
    with m:
        with pytest.raises(RuntimeError, match="already active"):
            m.__enter__()
        x = torch.empty(4)  # noqa: F841
    assert m.delta == 16
    with m:  # a second block starts afresh
        pass
    assert m.delta == 0
    assert "done" in repr(m)


@pytest.mark.slow
@pytest.mark.adapter_independent
@pytest.mark.parametrize(
    "device, error",
    [
        ("foo", ValueError),
        ("cuda:x", ValueError),
        ("meta", ValueError),
        (torch.device("meta"), ValueError),
        (1.5, TypeError),
        (True, TypeError),
        (None, TypeError),
        (-1, ValueError),
    ],
)
def test_bad_devices_raise_clear_errors(device, error):
    with pytest.raises(error, match="torch_sac.memory"):
        track(device)


@pytest.mark.adapter_independent
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", 0])
def test_cuda_without_cuda_raises(device):
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        track(device)


# --------------------------------------------------------------------------
# Autograd: what forward keeps is what autograd saved
# --------------------------------------------------------------------------


@pytest.mark.parametrize("inplace", [False, True], ids=["relu", "relu_inplace"])
def test_forward_delta_is_saved_tensors_plus_output(inplace):
    model = mlp(inplace)
    x = torch.randn(BATCH, 32)
    saved = SavedStorages(outside=[x, *model.parameters()])
    with saved_tensors_hooks(saved.pack, saved.unpack), track() as m:
        out = model(x)
    # Autograd keeps each ReLU output (addmm saves its input and weight,
    # which are the previous ReLU output, x and parameters).
    assert saved.nbytes == 2 * HIDDEN_BYTES
    expected = storage_bytes([out]) + saved.nbytes
    assert m.delta == expected  # tolerance 0, see the module docstring
    if inplace:
        # relu_ writes into the Linear output: nothing else is ever live.
        assert m.peak == m.delta
    else:
        # The second ReLU runs with the first ReLU's output (saved), the
        # second Linear's output (its input) and its own output all live.
        assert m.peak == 3 * HIDDEN_BYTES


def test_backward_frees_saved_tensors_and_leaves_grads():
    model = mlp(False)
    x = torch.randn(BATCH, 32)
    params = list(model.parameters())
    with track() as m:
        out = model(x)
        kept = m.delta
        out.square().sum().backward()
        del out
    assert kept == 2 * HIDDEN_BYTES + OUT_BYTES
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert storage_bytes([p.grad for p in params]) == param_bytes
    assert m.delta == param_bytes  # only the gradients remain
    model.zero_grad(set_to_none=True)
    assert allocated() == m.start


def test_deleting_the_graph_frees_saved_tensors():
    model = mlp(False)
    x = torch.randn(BATCH, 32)
    with track() as m:
        out = model(x)
        assert m.delta == 2 * HIDDEN_BYTES + OUT_BYTES
        del out  # the graph and its saved tensors go with the output
    assert m.delta == 0
    assert m.peak == 3 * HIDDEN_BYTES


@pytest.mark.parametrize("flavour", ["torch_sac", "torch"])
def test_checkpoint_keeps_only_what_the_policy_saves(flavour):
    model = mlp(False)
    x = torch.randn(BATCH, 32)
    if flavour == "torch_sac":
        make = functools.partial(
            torch_sac.create_selective_checkpoint_contexts,
            torch_sac.policies.save_ops([torch.ops.aten.addmm]),
        )
    else:
        make = functools.partial(
            torch.utils.checkpoint.create_selective_checkpoint_contexts,
            [torch.ops.aten.addmm.default],
        )
    contexts = []

    def context_fn():
        contexts.append(make())
        return contexts[-1]

    with track() as m:
        out = torch.utils.checkpoint.checkpoint(
            model, x, use_reentrant=False, context_fn=context_fn
        )
    # The three addmm outputs are cached (the last one is `out` itself); the
    # ReLU outputs autograd would have kept are dropped. checkpoint() also
    # stashes the CPU RNG state (a 5056-byte tensor) to replay it.
    rng_state_bytes = torch.get_rng_state().nbytes
    assert m.delta == 2 * HIDDEN_BYTES + OUT_BYTES + rng_state_bytes
    if flavour == "torch_sac":
        assert contexts[0][0].stats()["saved_bytes"] == 2 * HIDDEN_BYTES + OUT_BYTES
    grads = sum(p.numel() * F32 for p in model.parameters())
    with track() as m2:
        out.sum().backward()
        del out
        # Recompute stops once backward has what it needs, before the last
        # addmm: its cache entry lives as long as the contexts (as in PyTorch).
        assert m2.delta == grads - m.delta + OUT_BYTES
        contexts.clear()
    assert m2.delta == grads - m.delta  # the cache and the RNG state are gone


# --------------------------------------------------------------------------
# No leaks over many training steps
# --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")  # speed only: the leak check does not depend on it
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "torch_sac_sac"])
@pytest.mark.parametrize("model_name", sorted(MODEL_BUILDERS))
def test_no_growth_over_200_training_steps(model_name, checkpointed):
    module, make_input = MODEL_BUILDERS[model_name]()
    opt = torch.optim.SGD(module.parameters(), lr=1e-3, momentum=0.9)
    context_fn = None
    if checkpointed:
        context_fn = functools.partial(
            torch_sac.create_selective_checkpoint_contexts, torch_sac.policies.save_matmuls()
        )

    def step():
        loss_of(forward(module, make_input(), context_fn)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # the optimizer creates its momentum buffers
        step()
    deltas, peaks = [], []
    for _ in range(200):
        with track() as m:
            step()
        deltas.append(m.delta)
        peaks.append(m.peak)
    assert deltas == [0] * 200, f"memory grew: {[d for d in deltas if d][:5]}"
    assert min(peaks) == max(peaks) > 0  # the same allocations every step


# --------------------------------------------------------------------------
# torch features that treat DataPtrs specially keep working and counting
# --------------------------------------------------------------------------


@pytest.mark.adapter_independent
def test_lazy_clone_and_materialization():
    a = torch.arange(1000, dtype=torch.float32)
    with track() as m:
        b = torch._lazy_clone(a)  # shares a's memory: copy-on-write
        assert m.delta == 0
        b.mul_(2)  # materializes a private copy
        assert m.delta == 4000
    assert a[7].item() == 7 and b[7].item() == 14


@pytest.mark.adapter_independent
def test_resize_counts_the_new_allocation():
    with track() as m:
        a = torch.empty(10)
        a.resize_(1000)
    assert m.delta == 4000 and m.peak == 4040
    del a


@pytest.mark.adapter_independent
def test_share_memory_moves_the_bytes_out_of_the_count():
    a = torch.ones(1000)
    with track() as m:
        a.share_memory_()
    assert a.is_shared() and a.sum().item() == 1000
    assert m.delta == -4000  # the data now lives in a shared-memory segment


@pytest.mark.adapter_independent
def test_python_storage_constructors_bypass_the_allocator():
    """Known caveat (torch 2.13): storages made by torch's Python storage
    code (``torch.UntypedStorage(n)``, unpickling, ``copy.deepcopy`` of a
    plain tensor) use c10::GetDefaultCPUAllocator() directly. They are valid,
    just not counted; a deep-copied Parameter is cloned by ATen and counted."""
    t = torch.ones(1000)
    with track() as m:
        s = torch.UntypedStorage(100)
        p = pickle.loads(pickle.dumps(t))
        d = copy.deepcopy(t)
    assert torch.equal(p, t) and torch.equal(d, t) and s.nbytes() == 100
    assert m.delta == 0
    with track() as m:
        w = copy.deepcopy(nn.Parameter(t))
    assert torch.equal(w, t) and m.delta == 4000


# --------------------------------------------------------------------------
# CUDA, through a fake torch.cuda (no GPU here)
# --------------------------------------------------------------------------


class FakeCuda:
    """The four torch.cuda statistics functions track() uses, on fake devices."""

    def __init__(self):
        self.allocated = {0: 1000, 1: 0}
        self.max = {0: 9000, 1: 0}

    def alloc(self, n, device=0):
        self.allocated[device] += n
        self.max[device] = max(self.max[device], self.allocated[device])

    def free(self, n, device=0):
        self.allocated[device] -= n

    def memory_allocated(self, device):
        return self.allocated[device]

    def max_memory_allocated(self, device):
        return self.max[device]

    def reset_peak_memory_stats(self, device):
        self.max[device] = self.allocated[device]


@pytest.mark.adapter_independent
def test_cuda_windows_nest_despite_a_single_device_peak():
    cuda = FakeCuda()
    outer = _CudaWindow(0, cuda)
    assert (outer.start, outer.peak) == (1000, 1000)  # the old 9000 is gone
    cuda.alloc(3000)
    cuda.free(3000)
    inner = _CudaWindow(0, cuda)  # resets the device peak to 1000
    cuda.alloc(500)
    assert inner.peak - inner.start == 500
    inner.close()
    cuda.alloc(100)
    assert (inner.current - inner.start, inner.peak - inner.start) == (500, 500)  # frozen
    assert outer.peak == 4000  # kept although torch's peak was reset
    cuda.alloc(5000, device=1)  # other devices do not count
    outer.close()
    assert (outer.current - outer.start, outer.peak) == (600, 4000)


@pytest.mark.adapter_independent
def test_track_on_cuda_with_a_fake_device(monkeypatch):
    cuda = FakeCuda()
    for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    m = track("cuda")
    assert m.device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="no CUDA device 2"):
        track("cuda:2")
    with m:
        cuda.alloc(2048, device=1)
        cuda.free(1024, device=1)
    assert (m.delta, m.peak) == (1024, 2048)
    with track(0) as m0:
        cuda.alloc(512)
    assert (m0.delta, m0.peak) == (512, 512)
