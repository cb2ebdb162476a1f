"""The examples under examples/ run and check their own gradients."""

import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from helpers import PROGRAM_LIMIT_S

# Each example runs in a subprocess: seconds each (under a minute idle);
# PROGRAM_LIMIT_S only stops a hang.
pytestmark = pytest.mark.slow


def test_hf_llama_finetune_example():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "examples", "hf_llama_finetune.py")],
        capture_output=True,
        text=True,
        timeout=PROGRAM_LIMIT_S,
        env=env,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("gradients bitwise equal to no checkpointing") == 3, proc.stdout


def test_revolve_chain_example_runs_the_optimal_schedule():
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "examples", "revolve_chain.py"),
            "--steps",
            "12",
            "--slots",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=PROGRAM_LIMIT_S,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "schedule executed exactly" in proc.stdout


def test_peak_plan_example_fits_and_is_bitwise():
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "examples", "peak_plan.py"),
            "--depth",
            "4",
            "--fraction",
            "0.4",
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=PROGRAM_LIMIT_S,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("fits") == 2, proc.stdout
    assert proc.stdout.count("bitwise equal to no checkpointing") == 2, proc.stdout


def test_bench_frontier_quick_runs_and_reports_its_targets():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO_ROOT, "bench", "bench_frontier.py"),
            "--quick",
            "--models",
            "llama",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=PROGRAM_LIMIT_S,
        env=env,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "chain solver, 100 blocks x 10 options" in out
    assert "plan at each recipe's peak" in out and "checkpoint per block" in out
    assert "monotone (more memory never slower beyond 3 %)" in out


def test_bench_gpu_runs_tiny_on_the_cpu():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "bench", "bench_gpu.py"), "--device", "cpu"]
        + ["--tiny", "--models", "gpt2"],
        capture_output=True,
        text=True,
        timeout=PROGRAM_LIMIT_S,
        env=env,
        cwd=REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "peak plan at per-block checkpoint's peak" in proc.stdout
    assert "DIFF" not in proc.stdout.split("| row |")[-1], proc.stdout[-3000:]
