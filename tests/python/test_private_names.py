"""No module of the package uses another's private name
(scripts/check_private_names.py, also run by CI), and the checker finds one
when there is one."""

import os
import subprocess
import sys

import pytest

from conftest import REPO_ROOT
from helpers import PROGRAM_LIMIT_S

CHECKER = os.path.join(REPO_ROOT, "scripts", "check_private_names.py")

# A subprocess reads the package's sources: nothing runs under an adapter.
pytestmark = pytest.mark.adapter_independent


def _check(package_dir):
    return subprocess.run(
        [sys.executable, CHECKER, str(package_dir)],
        capture_output=True,
        text=True,
        timeout=PROGRAM_LIMIT_S,
    )


def _package(tmp_path, files):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for name, text in files.items():
        (pkg / name).write_text(text)
    return pkg


def test_torch_sac_uses_no_private_name_of_another_module():
    result = _check(os.path.join(REPO_ROOT, "torch_sac"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "uses another's private name" in result.stdout


@pytest.mark.parametrize(
    "user",
    [
        "from .low import _helper\n",
        "from . import low\n\ndef f():\n    return low._helper()\n",
        "import pkg.low as low\n\nx = low._helper\n",
    ],
    ids=["from-import", "attribute", "import-as"],
)
def test_checker_finds_a_private_name_used_across_modules(tmp_path, user):
    pkg = _package(
        tmp_path,
        {"__init__.py": "", "low.py": "def _helper():\n    return 1\n", "high.py": user},
    )
    result = _check(pkg)
    assert result.returncode == 1
    assert "pkg.low._helper is private to its module" in result.stdout


def test_checker_allows_private_modules_dunders_and_own_names(tmp_path):
    pkg = _package(
        tmp_path,
        {
            "__init__.py": "from . import _low\n",
            "_low.py": "def helper():\n    return 1\n\ndef _own():\n    return helper()\n",
            "high.py": (
                "from . import _low\nfrom ._low import helper\n\n"
                "def f():\n    return _low.helper(), _low.__name__, helper()\n"
            ),
        },
    )
    result = _check(pkg)
    assert result.returncode == 0, result.stdout + result.stderr
