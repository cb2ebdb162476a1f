"""The examples under examples/ run and check their own gradients; the benches' quick
paths run and report what they measure."""

import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from helpers import PROGRAM_LIMIT_S

# Each example runs in a subprocess: seconds each (under a minute idle);
# PROGRAM_LIMIT_S only stops a hang.
pytestmark = pytest.mark.slow


def run_program(path, *args, env=None):
    """``python path args...`` from the repository root, bounded by
    PROGRAM_LIMIT_S; asserts it exits 0 and returns its stdout."""
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, *path.split("/")), *args],
        capture_output=True,
        text=True,
        timeout=PROGRAM_LIMIT_S,
        env=env,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# What the programs that load Hugging Face models run with: nothing
# downloaded, one intra-op thread.
OFFLINE = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def test_hf_llama_finetune_example():
    out = run_program("examples/hf_llama_finetune.py", env=OFFLINE)
    assert out.count("gradients bitwise equal to no checkpointing") == 3, out


def test_revolve_chain_example_runs_the_optimal_schedule():
    out = run_program("examples/revolve_chain.py", "--steps", "12", "--slots", "3")
    assert "schedule executed exactly" in out


def test_peak_plan_example_fits_and_is_bitwise():
    out = run_program("examples/peak_plan.py", "--depth", "4", "--fraction", "0.4", "--steps", "2")
    assert out.count("fits") == 2, out
    assert out.count("bitwise equal to no checkpointing") == 2, out


def test_bench_frontier_quick_runs_and_reports_its_targets():
    out = run_program(
        "bench/bench_frontier.py", "--quick", "--models", "llama", "--rounds", "1", env=OFFLINE
    )
    assert "chain solver, 100 blocks x 10 options" in out
    assert "plan at each recipe's peak" in out and "checkpoint per block" in out
    assert "monotone (more memory never slower beyond 3 % and the noise)" in out
    assert "] of the recipe's time: " in out


def test_bench_segments_quick_reports_the_fitted_slowdown():
    out = run_program("bench/bench_segments.py", "--quick", "--models", "llama", env=OFFLINE)
    assert "segments of 2" in out and "segments of 4" in out and "per block" in out
    assert "fitted slowdown: " in out and "the planner assumes 0.22 on cpu" in out


def test_bench_gpu_runs_tiny_on_the_cpu():
    out = run_program(
        "bench/bench_gpu.py", "--device", "cpu", "--tiny", "--models", "gpt2", env=OFFLINE
    )
    assert "peak plan at per-block checkpoint's peak" in out
    assert "DIFF" not in out.split("| row |")[-1], out[-3000:]
    # The offload rows ran their bookkeeping on the CPU stand-in.
    (row,) = [
        line for line in out.splitlines() if line.startswith("| torch_sac region, offload_matmuls")
    ]
    assert "offloaded" in row and "bitwise" in row, row
    assert "| torchtune-style offload per block (reference) |" in out
    assert "| peak plan with offload 0.5x no-ckpt peak |" in out


# The benches run a worker per adapter themselves: once is enough.
@pytest.mark.adapter_independent
def test_bench_stages_quick_reports_every_stage_under_both_adapters():
    out = run_program("bench/bench_stages.py", "--quick", "--workloads", "gpt")
    for stage in ("adapter hop", "saved-tensor hooks", "policy + record", "unpack + planning"):
        assert stage in out
    assert "key µs/step" in out and "python µs/step" in out


@pytest.mark.adapter_independent
def test_bench_overhead_quick_reports_the_region_and_the_sac_cost():
    out = run_program("bench/bench_overhead.py", "--quick", "--workloads", "gpt")
    assert "torch_sac region, save_ops" in out
    assert "SAC cost over eager" in out and "plain checkpoint" in out
