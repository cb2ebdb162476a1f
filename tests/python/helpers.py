"""Helpers shared by several test files (conftest.py holds the fixtures and
the helpers of the parity tests; models.py the small models; hf_tiny.py the
Hugging Face ones).

* A chain of Linear+tanh layers (:func:`tanh_chain`), the replay-budget's
  and peak planner's standard program.
* Bitwise comparison of gradient lists, and reading them off leaves.
* Checks that a run left nothing installed (:func:`assert_clean`).
* A weighted loss, backward in several ways (on another thread, twice with
  ``retain_graph``).
* The counting allocator's readings (:func:`allocated`, :func:`storage_bytes`).
* Hang detection that load cannot break (:data:`HANG_LIMIT_S`,
  :func:`run_isolated`).
"""

import contextlib
import os
import re
import subprocess
import sys
import threading
from typing import Callable, NamedTuple

import torch
import torch.nn as nn

import torch_sac
import torch_sac.region

aten = torch.ops.aten

# Policies by name: the random programs and budget tests draw from these.
POLICIES = {
    "recompute_all": torch_sac.policies.recompute_all,
    "save_matmuls": torch_sac.policies.save_matmuls,
    "save_all": torch_sac.policies.save_all,
    "every2": lambda: torch_sac.policies.every_nth([aten.tanh.default, aten.sin.default], 2),
}

# --------------------------------------------------------------------------
# The tanh chain
# --------------------------------------------------------------------------


class TanhChain(NamedTuple):
    """``layers, x, forward, step_bytes = tanh_chain(...)``."""

    layers: list
    x: torch.Tensor
    forward: Callable
    step_bytes: int  # one step's saved tensor (tanh's output), float32

    @property
    def leaves(self):
        """Every layer's parameters, then x."""
        return [p for layer in self.layers for p in layer.parameters()] + [self.x]


def tanh_chain(n, width=64, batch=32, seed=0, reads=None, scale=None):
    """x_i = tanh(linear_i(x_{i-1}) [+ x_j for j in reads(i)]): each step
    saves one tensor of the same size (tanh's output, read by its own
    backward and the next addmm's); ``reads`` adds skip connections.

    ``forward(inp=None, scale=scale)`` starts from ``inp`` (default x) and
    multiplies the output by ``scale`` unless it is None (one more op)."""
    torch.manual_seed(seed)
    layers = [nn.Linear(width, width) for _ in range(n)]
    x = torch.randn(batch, width, requires_grad=True)

    skips = [reads(i) if reads else [] for i in range(n + 1)]
    read_later = {j for js in skips for j in js}

    def forward(inp=None, scale=scale):
        h = x if inp is None else inp
        kept = {0: h}  # only the tensors a skip reads stay referenced
        for i, layer in enumerate(layers, 1):
            h = layer(h)
            for j in skips[i]:
                h = h + kept[j]
            h = torch.tanh(h)
            if i in read_later:
                kept[i] = h
        return h if scale is None else h * scale

    return TanhChain(layers, x, forward, batch * width * 4)


def scaled_tanh_chain(n=10, width=32, batch=64, seed=0):
    """``layers, x, leaves, fwd``: a tanh_chain whose ``fwd(inp=None,
    scale=1.0)`` always scales its output (the nested-region and peak-plan
    tests' chain)."""
    chain = tanh_chain(n, width, batch, seed, scale=1.0)
    return chain.layers, chain.x, chain.leaves, chain.forward


def measured(fn, leaves, ctx=None, seed=1):
    """Gradients of weighted(fn()) w.r.t. leaves (autograd.grad), the step's
    peak above its start, and the region ``ctx`` opened (None without)."""
    torch.manual_seed(seed)
    region = None
    with torch_sac.memory.track() as m:
        if ctx is None:
            out = fn()
        else:
            with ctx as region:
                out = fn()
        got = torch.autograd.grad(weighted(out), leaves, allow_unused=True)
        del out
    return got, m.peak, region


def tanh_row(region):
    """The region's op_details() row of aten::tanh.default."""
    (row,) = [r for r in region.op_details() if r["op"] == "aten::tanh.default"]
    return row


# --------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------


def leaves_grads(leaves):
    """Copies of the leaves' ``.grad`` (None where none), which are reset."""
    out = []
    for t in leaves:
        out.append(None if t.grad is None else t.grad.clone())
        t.grad = None
    return out


def assert_bitwise(got, want):
    """Two lists of gradients equal bitwise, element by element."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"gradient {i} differs"


def assert_same(got, want, what="gradient"):
    """Two lists of tensors (or Nones) equal bitwise, with shapes, dtypes and
    the largest difference in the message."""
    assert len(got) == len(want), f"{what}: {len(got)} vs {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None or g is None:
            assert g is None and w is None, f"{what} {i}: {g is None} vs {w is None}"
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what} {i}: {g.shape} vs {w.shape}"
        if not torch.equal(g, w):
            diff = (g.double() - w.double()).abs().max().item()
            raise AssertionError(f"{what} {i}: not bitwise equal (max abs diff {diff:.3g})")


def assert_clean():
    """No region open, no dispatch mode installed, grad mode on."""
    assert torch_sac.region._stack() == [], "a region stayed on the stack"
    assert torch._C._len_torch_dispatch_stack() == 0, "a dispatch mode stayed installed"
    assert torch.is_grad_enabled()


# --------------------------------------------------------------------------
# Losses and backward
# --------------------------------------------------------------------------


def weighted(out):
    """A loss: each output tensor times fixed random weights, summed (over
    tuples, lists and dict values too)."""
    if isinstance(out, dict):
        return sum(weighted(v) for v in out.values())
    if isinstance(out, (tuple, list)):
        return sum(weighted(o) for o in out)
    g = torch.Generator().manual_seed(7)
    return (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum()


# --------------------------------------------------------------------------
# Hang detection
# --------------------------------------------------------------------------

# A test that guards against a hang (a deadlock, a thread that never
# returns) waits this long for the guarded work before it calls it hung. It
# is not a timing: every piece of work guarded this way takes under a second
# on an idle 2-core machine, so the limit is over 100x that and a machine
# busy with other work cannot reach it, while a real deadlock, which never
# finishes, still fails the test (after this long).
HANG_LIMIT_S = 120.0

# A child interpreter gets this long to import torch and torch_sac before
# its guarded work starts: about 5-10 s on an idle 2-core machine, far
# longer when other processes share the cores. Import time is not what the
# tests guard, so it gets its own, larger limit.
IMPORT_LIMIT_S = 600.0

# A test that runs a whole program in a child interpreter (an example, the
# CLI, a script that imports torch_sac under another setting) gives it this
# long: the longest of them (examples/hf_llama_finetune.py) took 8 s on this
# 2-core machine while a C++ build used the other core (2026-11-28), and
# this is over 50x that.
PROGRAM_LIMIT_S = 600.0

_READY = "torch_sac-test: imported"
# What faulthandler.dump_traceback_later writes before it exits with 1.
_FAULTHANDLER_TIMEOUT = re.compile(
    r"^Timeout \(\d+:\d\d:\d\d(\.\d+)?\)!\n(Current thread|Thread) 0x", re.M
)


class ChildRun(NamedTuple):
    """How a child interpreter of :func:`run_isolated` ended: ``status`` is
    "ok" (exit 0), "error" (another exit code), "hang" (its work did not
    finish within the limit) or "import-hang"."""

    status: str
    stdout: str
    stderr: str


# The first matmul backward of a process gives gradients that differ in
# the last bits from every later run, in about a quarter of fresh processes
# (torch 2.13.0+cpu with MKL on this project's CPU machine; plain PyTorch,
# no torch_sac imported). A test whose reference is that first run would
# fail its bitwise check by chance. One small backward first fixes it
# (16 of 16 fresh processes; 4 of 12 differed without it).
WARM_UP = (
    "_w = torch.ones(64, 64, requires_grad=True)\n"
    "(torch.ones(32, 64) @ _w).sum().backward()\n"
    "del _w\n"
)


def warm_up_first_backward():
    """Runs :data:`WARM_UP` (once per process is enough)."""
    exec(WARM_UP, {"torch": torch})


def run_isolated(code, *, limit=HANG_LIMIT_S, cwd=None):
    """Runs ``code`` in a fresh interpreter and tells how it ended.

    The child imports torch and torch_sac first and says so; only then does
    the clock for ``code`` start (``limit`` seconds). If ``code`` does not
    finish in time, the child dumps every thread's Python stack to its stderr
    (``faulthandler``) and exits, so a hang fails with where it hung, not
    with a bare timeout. ``code`` runs as ``__main__`` with its own line
    numbers (file name ``<isolated>``).
    """
    launcher = (
        "import faulthandler, sys\n"
        "import torch, torch_sac\n" + WARM_UP + f"print({_READY!r}, flush=True)\n"
        f"faulthandler.dump_traceback_later({float(limit)!r}, exit=True)\n"
        "exec(compile(sys.argv[1], '<isolated>', 'exec'), {'__name__': '__main__'})\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", launcher, code],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",  # undecodable output must not stop the readers
    )
    out_lines, err_chunks = [], []
    ready = threading.Event()

    def read_stdout():
        try:
            for line in proc.stdout:
                if line.rstrip("\n") == _READY and not ready.is_set():
                    ready.set()
                    continue
                out_lines.append(line)
        finally:
            ready.set()  # exited before (or without) saying it imported

    readers = [
        threading.Thread(target=read_stdout, daemon=True),
        threading.Thread(target=lambda: err_chunks.append(proc.stderr.read()), daemon=True),
    ]
    for t in readers:
        t.start()
    status = None
    try:
        if not ready.wait(IMPORT_LIMIT_S):
            status = "import-hang"
        else:
            try:
                # The child's own faulthandler ends a hang at `limit`; the
                # slack only covers writing the stacks out.
                proc.wait(limit + 60)
            except subprocess.TimeoutExpired:
                status = "hang"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for t in readers:
            t.join()
        proc.stdout.close()
        proc.stderr.close()
    stderr = "".join(err_chunks)
    if status is None:
        if proc.returncode == 0:
            status = "ok"
        elif proc.returncode == 1 and _FAULTHANDLER_TIMEOUT.search(stderr):
            status = "hang"  # faulthandler's dump: the child timed itself out
        else:
            status = "error"
    return ChildRun(status, "".join(out_lines), stderr)


@contextlib.contextmanager
def on_threads(work, count=1, timeout=HANG_LIMIT_S):
    """Runs ``work(i)`` on ``count`` threads while the block runs; after it,
    fails if one of them hung and raises the first error one raised."""
    errors = []

    def target(i):
        try:
            work(i)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(e)

    # Daemon threads: one that hangs is reported below and must not keep
    # pytest from exiting.
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        for t in threads:
            t.join(timeout)
    assert not any(t.is_alive() for t in threads), "hung"
    if errors:
        raise errors[0]


def backward_on_a_thread(loss, **kwargs):
    """loss.backward() on another thread; its error, if any, is raised here."""
    with on_threads(lambda i: loss.backward(**kwargs)):
        pass


def backward(loss, how):
    """Backward as ``how`` says: "plain", "retain" (twice, retaining the graph
    the first time: gradients accumulate) or "thread" (on another thread)."""
    if how == "retain":
        loss.backward(retain_graph=True)
        loss.backward()
    elif how == "thread":
        backward_on_a_thread(loss)
    else:
        loss.backward()


# --------------------------------------------------------------------------
# The counting allocator
# --------------------------------------------------------------------------


def allocated():
    """Bytes the counting CPU allocator holds now."""
    return torch_sac.memory.cpu_memory_stats()["allocated"]


def storage_bytes(tensors):
    """Bytes of the distinct storages of ``tensors`` (None skipped)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if t is not None
    }
    return sum(storages.values())


# --------------------------------------------------------------------------
# Random programs
# --------------------------------------------------------------------------


def derandomized(env, default):
    """hypothesis settings of the random-program tests: ``max_examples``
    from the environment variable ``env`` (else ``default``), derandomized,
    no deadline, no example database, no health checks."""
    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=int(os.environ.get(env, str(default))),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


# --------------------------------------------------------------------------
# The source checks (scripts/check_import_cycles.py, check_private_names.py)
# --------------------------------------------------------------------------


def write_package(root, files):
    """Writes a package ``pkg`` under ``root``: ``files`` maps a path in it
    (``"sub/low.py"``) to the file's text. Returns the package's directory."""
    pkg = root / "pkg"
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def run_checker(script, package_dir):
    """Runs the checker ``script`` on the package in ``package_dir``."""
    return subprocess.run(
        [sys.executable, script, str(package_dir)],
        capture_output=True,
        text=True,
        timeout=PROGRAM_LIMIT_S,
    )
