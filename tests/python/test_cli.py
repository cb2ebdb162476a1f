"""python -m torch_sac: end to end on a tiny model, through main(argv) and once
as a subprocess."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT
from torch_sac import cli

TINY = ["--blocks", "1", "--dim", "16", "--heads", "2", "--seq", "8", "--batch", "2", "--vocab", "32",
        "--steps", "1"]


def run_main(argv, capsys):
    code = cli.main(argv)
    return code, capsys.readouterr().out


def test_all_policies_end_to_end(tmp_path, capsys):
    plot, js = tmp_path / "t.png", tmp_path / "t.json"
    threads = torch.get_num_threads()
    code, out = run_main(TINY + ["--plot", str(plot), "--json", str(js), "--threads", "1"], capsys)
    assert code == 0, out
    assert torch.get_num_threads() == threads  # --threads does not leak out of main()
    for name in cli.DEFAULT_POLICIES:
        assert f"\n{name} " in out, name
    assert "gradients bitwise equal to no checkpointing for every policy: True" in out
    assert "budget bounds hold: True" in out
    assert "per op, budget-0.5" in out and "aten::addmm.default" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    data = json.loads(js.read_text())
    assert data["ok"] and data["config"]["blocks"] == 1
    results = {r["policy"]: r for r in data["results"]}
    assert list(results) == list(cli.DEFAULT_POLICIES)
    for name, r in results.items():
        assert r["grad_bitwise_equal"] and r["grad_max_abs_diff"] == 0, name
        assert r["activation_bytes"] > 0 and r["peak_bytes"] >= r["activation_bytes"], name
        # The sampled step measures the same memory, up to re-wrapped Python
        # scalars the regions keep (8 bytes each; see test_profile.py).
        assert 0 <= r["sampled_activation_bytes"] - r["activation_bytes"] <= 64, name
        assert 0 <= r["sampled_peak_bytes"] - r["peak_bytes"] <= 64, name
    none, full = results["none"], results["recompute_all"]
    assert full["activation_bytes"] < results["save_matmuls"]["activation_bytes"] < none["activation_bytes"]
    assert results["torch_checkpoint"]["recompute_flops"] > 0
    assert full["replayed_ops"] > 0 and none["replayed_ops"] == 0
    for f in ("0.25", "0.5", "0.75"):
        b = results[f"budget-{f}"]["budget"]
        assert b["within_bound"] and b["planned_bytes_per_block"] <= b["budget_bytes_per_block"]
    assert set(data["profiles"]) == set(results)


def test_policy_subset_adds_references_and_skips_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_main(TINY + ["--policies", "save_matmuls,budget-0.3", "--no-plot", "--details", "none"],
                         capsys)
    assert code == 0, out
    assert "added 'none'" in out and "added 'recompute_all'" in out
    assert "budget-0.3" in out and "per op," not in out
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("argv, message", [
    (["--policies", "nope"], "unknown policy 'nope'"),
    (["--policies", "budget-x"], "bad budget policy"),
    (["--dim", "30", "--heads", "4"], "divisible"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_python_dash_m(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "torch_sac"] + TINY + ["--policies", "none,recompute_all", "--no-plot"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "recompute_all" in proc.stdout and "bitwise" in proc.stdout
