"""No module of the package uses another's private name
(scripts/check_private_names.py, also run by CI), and the checker finds one
when there is one."""

import os

import pytest

from conftest import REPO_ROOT
from helpers import run_checker, write_package

CHECKER = os.path.join(REPO_ROOT, "scripts", "check_private_names.py")

# A subprocess reads the package's sources: nothing runs under an adapter.
pytestmark = pytest.mark.adapter_independent


def _check(package_dir):
    return run_checker(CHECKER, package_dir)


def test_torch_sac_uses_no_private_name_of_another_module():
    result = _check(os.path.join(REPO_ROOT, "torch_sac"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "uses another's private name" in result.stdout


@pytest.mark.parametrize(
    "where, user, owner",
    [
        ("high.py", "from .low import _helper\n", "pkg.low"),
        ("high.py", "from . import low\n\ndef f():\n    return low._helper()\n", "pkg.low"),
        ("high.py", "import pkg.low as low\n\nx = low._helper\n", "pkg.low"),
        ("high.py", "from .sub.low import _helper\n", "pkg.sub.low"),
        ("high.py", "from .sub import low\n\nx = low._helper\n", "pkg.sub.low"),
        ("high.py", "import pkg.sub.low\n\nx = pkg.sub.low._helper\n", "pkg.sub.low"),
        ("sub/other.py", "from .low import _helper\n", "pkg.sub.low"),
        ("sub/other.py", "from . import low\n\nx = low._helper\n", "pkg.sub.low"),
        ("sub/other.py", "from ..low import _helper\n", "pkg.low"),
        ("sub/__init__.py", "from . import low\n\nx = low._helper\n", "pkg.sub.low"),
        ("sub/deeper/user.py", "from ..low import _helper\n", "pkg.sub.low"),
    ],
    ids=[
        "from-import",
        "attribute",
        "import-as",
        "from-subpackage-module",
        "subpackage-module-attribute",
        "dotted-path",
        "sibling",
        "sibling-attribute",
        "up-a-level",
        "subpackage-init",
        "two-levels-up",
    ],
)
def test_checker_finds_a_private_name_used_across_modules(tmp_path, where, user, owner):
    helper = "def _helper():\n    return 1\n"
    files = {"__init__.py": "", "low.py": helper, "sub/__init__.py": "", "sub/low.py": helper}
    files.update({"sub/deeper/__init__.py": "", where: user})
    result = _check(write_package(tmp_path, files))
    assert result.returncode == 1
    assert f"{owner}._helper is private to its module" in result.stdout


@pytest.mark.parametrize(
    "files",
    [
        {
            "__init__.py": "from . import _low\n",
            "_low.py": "def helper():\n    return 1\n\ndef _own():\n    return helper()\n",
            "high.py": (
                "from . import _low\nfrom ._low import helper\n\n"
                "def f():\n    return _low.helper(), _low.__name__, helper()\n"
            ),
        },
        {
            "__init__.py": "from .sub import helper\n",
            "sub/__init__.py": "from ._low import helper\n\n_OWN = 1\n\nx = _OWN\n",
            "sub/_low.py": "def helper():\n    return 1\n",
            "high.py": (
                "import pkg.sub._low\nfrom .sub import _low\n\n"
                "def f():\n    return pkg.sub._low.helper(), _low.helper()\n"
            ),
        },
    ],
    ids=["modules", "subpackages"],
)
def test_checker_allows_private_modules_dunders_and_own_names(tmp_path, files):
    result = _check(write_package(tmp_path, files))
    assert result.returncode == 0, result.stdout + result.stderr
