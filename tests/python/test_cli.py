"""python -m torch_sac: end to end on a tiny model, through main(argv) and once
as a subprocess."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT
from helpers import PROGRAM_LIMIT_S
from torch_sac import cli
from torch_sac._op_profile import format_bytes

TINY = [
    "--blocks",
    "1",
    "--dim",
    "16",
    "--heads",
    "2",
    "--seq",
    "8",
    "--batch",
    "2",
    "--vocab",
    "32",
    "--steps",
    "1",
]


def run_main(argv, capsys):
    code = cli.main(argv)
    return code, capsys.readouterr().out


@pytest.mark.slow
def test_all_policies_end_to_end(tmp_path, capsys):
    plot, js = tmp_path / "t.png", tmp_path / "t.json"
    threads = torch.get_num_threads()
    code, out = run_main(TINY + ["--plot", str(plot), "--json", str(js), "--threads", "1"], capsys)
    assert code == 0, out
    assert torch.get_num_threads() == threads  # --threads does not leak out of main()
    for name in cli.DEFAULT_POLICIES:
        # A peak this tiny model cannot reach is skipped, with the reason.
        assert f"\n{name} " in out or f"skipped {name}: peak_bytes=" in out, name
    assert "gradients bitwise equal to no checkpointing for every policy: True" in out
    assert "budget bounds hold: True" in out
    assert "per op, budget-0.5" in out and "aten::addmm.default" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    data = json.loads(js.read_text())
    assert data["ok"] and data["config"]["blocks"] == 1
    results = {r["policy"]: r for r in data["results"]}
    ran = [n for n in cli.DEFAULT_POLICIES if f"skipped {n}:" not in out]
    assert list(results) == ran
    for name, r in results.items():
        assert r["grad_bitwise_equal"] and r["grad_max_abs_diff"] == 0, name
        assert r["activation_bytes"] > 0 and r["peak_bytes"] >= r["activation_bytes"], name
        # The sampled step measures the same memory, up to re-wrapped Python
        # scalars the regions keep (8 bytes each; see test_profile.py).
        assert 0 <= r["sampled_activation_bytes"] - r["activation_bytes"] <= 64, name
        assert 0 <= r["sampled_peak_bytes"] - r["peak_bytes"] <= 64, name
    # "saved vs none" is the real saving: none's activations minus the
    # policy's; "dropped (not held)" is what the regions did not hold, which
    # is not read as saved (only policies with regions have it).
    lines = out.splitlines()
    table = _table(
        lines, next(i for i, line in enumerate(lines) if line.startswith("policy ")), len(results)
    )
    assert list(table) == list(results)
    assert "not a saving" in out
    for name, r in results.items():
        assert (
            r["saved_vs_none_bytes"] == results["none"]["activation_bytes"] - r["activation_bytes"]
        ), name
        cells = table[name]
        assert cells["activations"] == format_bytes(r["activation_bytes"]), (name, cells)
        assert cells["saved vs none"] == format_bytes(r["saved_vs_none_bytes"]), (name, cells)
        if name in ("none", "torch_checkpoint"):
            assert r["dropped_bytes"] is None and cells["dropped (not held)"] == "-", (name, cells)
        else:
            assert r["dropped_bytes"] > 0, name
            assert cells["dropped (not held)"] == format_bytes(r["dropped_bytes"]), (name, cells)
    assert results["none"]["saved_vs_none_bytes"] == 0
    # Dropped is not saved: recompute_all's regions drop more than
    # checkpointing saves (they also drop outputs autograd never kept).
    assert (
        results["recompute_all"]["dropped_bytes"]
        > results["recompute_all"]["saved_vs_none_bytes"]
        > 0
    )
    none, full = results["none"], results["recompute_all"]
    assert (
        full["activation_bytes"]
        < results["save_matmuls"]["activation_bytes"]
        < none["activation_bytes"]
    )
    assert results["torch_checkpoint"]["recompute_flops"] > 0
    assert full["replayed_ops"] > 0 and none["replayed_ops"] == 0
    for f in ("0.25", "0.5", "0.75"):
        b = results[f"budget-{f}"]["budget"]
        assert b["within_bound"] and b["planned_bytes_per_block"] <= b["budget_bytes_per_block"]
    assert set(data["profiles"]) == set(results)


def _table(lines, top, n_rows):
    """The comparison table starting at ``lines[top]`` as {policy: {title:
    cell}}; the dashed line under the titles gives each column's span."""
    spans = [m.span() for m in re.finditer(r"-+", lines[top + 1])]
    titles = [lines[top][a:b].strip() for a, b in spans]
    rows = [[line[a:b].strip() for a, b in spans] for line in lines[top + 2 : top + 2 + n_rows]]
    return {row[0]: dict(zip(titles, row)) for row in rows}


def test_policy_subset_adds_references_and_skips_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = run_main(
        TINY + ["--policies", "save_matmuls,budget-0.3", "--no-plot", "--details", "none"], capsys
    )
    assert code == 0, out
    assert "added 'none'" in out and "added 'recompute_all'" in out
    assert "budget-0.3" in out and "per op," not in out
    assert not os.listdir(tmp_path)


def test_peak_plan_policy_runs_the_whole_step_within_its_peak(tmp_path, capsys):
    js = tmp_path / "t.json"
    code, out = run_main(TINY + ["--policies", "peak-0.7", "--no-plot", "--json", str(js)], capsys)
    assert code == 0, out
    assert "peak bounds hold: True" in out and "gradients bitwise equal" in out
    results = {r["policy"]: r for r in json.loads(js.read_text())["results"]}
    plan = results["peak-0.7"]["peak_plan"]
    assert plan["within_bound"] and plan["planning_runs"] > 2
    assert (
        results["peak-0.7"]["peak_bytes"]
        <= plan["peak_budget_bytes"]
        < results["none"]["peak_bytes"]
    )
    assert results["peak-0.7"]["replayed_ops"] > 0 and results["peak-0.7"]["grad_bitwise_equal"]
    # The summary line says what the plan drops (it once said "nothing
    # dropped" for every plan over blocks).
    line = next(x for x in out.splitlines() if x.strip().startswith("peak-0.7") and "forward" in x)
    assert plan["dropped_calls"] > 0 and "nothing dropped" not in line, line
    assert f"drops {plan['dropped_calls']} " in line and plan["headline"] in line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--policies", "nope"], "unknown policy 'nope'"),
        (["--policies", "budget-x"], "bad budget policy"),
        (["--policies", "peak-x"], "bad peak policy"),
        (["--policies", "peak-0"], "must be > 0"),
        (["--dim", "30", "--heads", "4"], "divisible"),
        (["--steps", "0"], "--steps must be >= 1"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_python_dash_m(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "torch_sac"]
        + TINY
        + ["--policies", "none,recompute_all", "--no-plot"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=PROGRAM_LIMIT_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert "recompute_all" in proc.stdout and "bitwise" in proc.stdout
