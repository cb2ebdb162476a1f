"""The package's import graph has no cycle (scripts/check_import_cycles.py,
also run by CI), and the checker finds one when there is one."""

import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from helpers import PROGRAM_LIMIT_S

CHECKER = os.path.join(REPO_ROOT, "scripts", "check_import_cycles.py")

# A subprocess reads the package's sources: nothing runs under an adapter.
pytestmark = pytest.mark.adapter_independent


def _check(package_dir):
    return subprocess.run(
        [sys.executable, CHECKER, str(package_dir)],
        capture_output=True,
        text=True,
        timeout=PROGRAM_LIMIT_S,
    )


def test_torch_sac_has_no_import_cycle():
    result = _check(os.path.join(REPO_ROOT, "torch_sac"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no import cycle" in result.stdout


def test_checker_finds_a_cycle_through_an_import_inside_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import low\n")
    (pkg / "low.py").write_text("def f():\n    from .high import g\n    return g\n")
    (pkg / "high.py").write_text("from .low import f\n\ndef g():\n    return f\n")
    result = _check(pkg)
    assert result.returncode == 1
    assert "pkg.high <-> pkg.low" in result.stdout


def test_checker_counts_an_import_of_the_package_itself(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .sub import helper\nNAME = 1\n")
    (pkg / "sub.py").write_text("def helper():\n    from . import NAME\n    return NAME\n")
    result = _check(pkg)
    assert result.returncode == 1
    assert "pkg <-> pkg.sub" in result.stdout
