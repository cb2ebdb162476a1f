"""What torch_sac does differently per torch release (torch_sac/_compat.py,
csrc/core/torch_compat.h), checked on whichever release runs the suite."""

import os
import subprocess
import sys
import types

import pytest
import torch
import torch.utils.checkpoint as tc

import torch_sac
from torch_sac import _C, _compat

from conftest import REPO_ROOT
from helpers import PROGRAM_LIMIT_S


@pytest.mark.adapter_independent
def test_release_is_supported():
    assert _compat.TORCH_RELEASE[:2] in _compat.SUPPORTED_RELEASES, (
        f"torch {torch.__version__} is outside the supported range; add it to "
        "SUPPORTED_RELEASES once the suite passes on it"
    )


@pytest.mark.adapter_independent
def test_built_with_the_running_torch():
    assert _compat._release(_C.built_with_torch()) == _compat.TORCH_RELEASE


@pytest.mark.adapter_independent
def test_another_release_is_refused_naming_both():
    with pytest.raises(ImportError) as info:
        _compat.check_built_with("2.9.1")
    message = str(info.value)
    assert "2.9.1" in message and torch.__version__ in message
    assert "pip install --no-build-isolation" in message
    # A local tag (+cpu, +cu130) is the same release.
    release = ".".join(str(n) for n in _compat.TORCH_RELEASE)
    _compat.check_built_with(release + "+cu130")


@pytest.mark.slow
@pytest.mark.adapter_independent
def test_import_refuses_a_build_for_another_release(tmp_path):
    """The check runs before the extension loads: a fake _build_info naming
    another release stops the import with both releases in the message."""
    package = os.path.join(REPO_ROOT, "torch_sac")
    shadow = tmp_path / "torch_sac"
    shadow.mkdir()
    for name in os.listdir(package):
        if name not in ("_build_info.py", "__pycache__"):
            os.symlink(os.path.join(package, name), shadow / name)
    (shadow / "_build_info.py").write_text("BUILT_WITH_TORCH = '2.9.1'\n")
    result = subprocess.run(
        [sys.executable, "-c", "import torch_sac"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=PROGRAM_LIMIT_S,
    )
    assert result.returncode != 0
    assert "ImportError" in result.stderr
    assert "built against torch 2.9.1" in result.stderr
    assert torch.__version__ in result.stderr


@pytest.mark.adapter_independent
def test_torchs_ignored_ops_are_ignored():
    """torch's own SAC_IGNORED_OPS, read at import, is part of the set
    (torch 2.15 adds prim.layout.default)."""
    assert set(tc.SAC_IGNORED_OPS) <= set(torch_sac.IGNORED_OPS)


def test_adapter_choice_follows_the_key_position():
    requested = os.environ.get("TORCH_SAC_ADAPTER", "auto") or "auto"
    reason = torch_sac.adapter_reason()
    assert reason
    if requested == "auto":
        expected = "key" if _C.key_adapter_runs_below_modes() else "python"
        assert torch_sac.adapter() == expected, reason
    else:
        assert torch_sac.adapter() == requested, reason
    # The dispatch key order of torch 2.13+ puts the key below Python.
    assert _C.key_adapter_runs_below_modes() == (_compat.TORCH_RELEASE >= (2, 13))


@pytest.mark.adapter_independent
def test_policy_output_known_from_torchs_signature():
    ctx_params = tc.SelectiveCheckpointContext.__init__.__code__.co_varnames
    assert _compat.sac_policy_sees_output() == ("op_output" in ctx_params)


@pytest.mark.adapter_independent
def test_is_compiling_false_in_eager():
    assert not _compat.is_compiling()


@pytest.mark.adapter_independent
def test_fsdp_param_groups_both_layouts():
    group = object()
    assert _compat.fsdp_param_groups(types.SimpleNamespace(_fsdp_param_groups=[group])) == [group]
    assert _compat.fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group=group)) == [group]
    assert _compat.fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group=None)) == []


class _Calls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records (op name, dtype, numel) of each aten op called under it."""

    def __init__(self):
        super().__init__()
        self.calls = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if args and isinstance(args[0], torch.Tensor):
            self.calls.add((func.overloadpacket.__name__, args[0].dtype, args[0].numel()))
        return out


@pytest.mark.adapter_independent
def test_mkl_vml_functions_are_each_called_once_on_one_element_per_dtype():
    """oneMKL 2024.2 picks a VML function's kernel on its first call; a first
    call on several threads can run a low-accuracy kernel on one thread's
    share (pytorch/pytorch#188792: a first ``sin`` off by 1e-4 in half a
    tensor, which failed a bitwise gradient check by chance). Settling calls
    every such function on one element, float and double, on one thread."""
    with _Calls() as seen:
        _compat.settle_mkl_vml_dispatch()
    if not torch.backends.mkl.is_available():
        assert seen.calls == set()
        return
    for name in _compat._VML_FUNCTIONS:
        for dtype in (torch.float32, torch.float64):
            assert (name, dtype, 1) in seen.calls, (name, dtype)


@pytest.mark.adapter_independent
def test_importing_torch_sac_settles_mkl_vml_before_the_users_ops():
    """The import does it, before any op of the program that imports it."""
    code = (
        "import torch\n"
        "from torch.utils._python_dispatch import TorchDispatchMode\n"
        "class Calls(TorchDispatchMode):\n"
        "    seen = set()\n"
        "    def __torch_dispatch__(self, func, types, args=(), kwargs=None):\n"
        "        if args and isinstance(args[0], torch.Tensor):\n"
        "            self.seen.add((func.overloadpacket.__name__, args[0].dtype))\n"
        "        return func(*args, **(kwargs or {}))\n"
        "with Calls():\n"
        "    import torch_sac\n"
        "if torch.backends.mkl.is_available():\n"
        "    assert ('sin', torch.float32) in Calls.seen, Calls.seen\n"
        "    assert ('tanh', torch.float64) in Calls.seen, Calls.seen\n"
        "print('ok')\n"
    )
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=PROGRAM_LIMIT_S,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
