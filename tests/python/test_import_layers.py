"""The package's import graph has no cycle (scripts/check_import_cycles.py,
also run by CI), and the checker finds one when there is one."""

import os

import pytest

from conftest import REPO_ROOT
from helpers import run_checker, write_package

CHECKER = os.path.join(REPO_ROOT, "scripts", "check_import_cycles.py")

# A subprocess reads the package's sources: nothing runs under an adapter.
pytestmark = pytest.mark.adapter_independent


def _check(package_dir):
    return run_checker(CHECKER, package_dir)


def test_torch_sac_has_no_import_cycle():
    result = _check(os.path.join(REPO_ROOT, "torch_sac"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no import cycle" in result.stdout


@pytest.mark.parametrize(
    "files, cycle",
    [
        (
            {
                "__init__.py": "from . import low\n",
                "low.py": "def f():\n    from .high import g\n    return g\n",
                "high.py": "from .low import f\n\ndef g():\n    return f\n",
            },
            "pkg.high <-> pkg.low",
        ),
        (
            {
                "__init__.py": "from .sub import helper\nNAME = 1\n",
                "sub.py": "def helper():\n    from . import NAME\n    return NAME\n",
            },
            "pkg <-> pkg.sub",
        ),
        # sub/user.py imports ..low, which imports sub/helper.py: that runs
        # sub/__init__.py first, which imports sub/user.py, not yet done.
        (
            {
                "__init__.py": "",
                "low.py": "from .sub.helper import f\n\ndef h():\n    return f\n",
                "sub/__init__.py": "from .user import g\n",
                "sub/user.py": "from ..low import h\n\ndef g():\n    return h\n",
                "sub/helper.py": "def f():\n    return 1\n",
            },
            "pkg.low <-> pkg.sub <-> pkg.sub.user",
        ),
    ],
    ids=["import-inside-a-function", "import-of-the-package-itself", "through-a-subpackage-init"],
)
def test_checker_finds_a_cycle(tmp_path, files, cycle):
    result = _check(write_package(tmp_path, files))
    assert result.returncode == 1
    assert cycle in result.stdout


def test_checker_allows_a_subpackage_module_importing_its_siblings(tmp_path):
    pkg = write_package(
        tmp_path,
        {
            "__init__.py": "from .sub import g\n",
            "low.py": "def h():\n    return 1\n",
            "sub/__init__.py": "from .user import g\n",
            "sub/user.py": "from ..low import h\nfrom .helper import f\n\ndef g():\n    return h, f\n",
            "sub/helper.py": "from .. import low\n\ndef f():\n    return low\n",
        },
    )
    result = _check(pkg)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "pkg: 5 modules, no import cycle" in result.stdout
