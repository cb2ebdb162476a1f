"""torch_sac/_C.pyi matches the extension, and the version is written once.

The stub is written by hand from csrc/python/*.cpp; these tests fail when a
binding is added, removed or renamed without the stub following. They compare
names (module level, and the members of each class) and parameter names,
which pybind11 reports in each function's signature line. Types are not
compared.
"""

import ast
import importlib.metadata
import inspect
import re
import sys
from pathlib import Path

import pytest

import torch_sac
from torch_sac import _C

ROOT = Path(__file__).resolve().parents[2]
STUB = Path(torch_sac.__file__).resolve().parent / "_C.pyi"

# Members every pybind11 class has; not part of torch_sac's bindings.
PYBIND11_INTERNALS = {"_pybind11_conduit_v1_"}

# The stub against the bindings and the version: no op is intercepted.
pytestmark = pytest.mark.adapter_independent


def _stub_tree():
    return ast.parse(STUB.read_text(), filename=str(STUB))


def _public(names):
    return {n for n in names if not n.startswith("_")}


def _stub_module_names(tree):
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _stub_classes(tree):
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _stub_functions(body):
    return {node.name: node for node in body if isinstance(node, ast.FunctionDef)}


def _members(cls):
    """Names a class of _C defines itself, minus dunders and pybind11's."""
    return {
        n
        for n in vars(cls)
        if not (n.startswith("__") and n.endswith("__")) and n not in PYBIND11_INTERNALS
    }


def _stub_members(node):
    names = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            names.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def _split_top_level(text):
    """Splits a parameter list at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if text[start:].strip():
        parts.append(text[start:])
    return [p.strip() for p in parts]


def _bound_parameters(obj, name):
    """[(name, has_default)] from pybind11's signature line, or None when the
    object has none (a C method, a function added from Python)."""
    doc = getattr(obj, "__doc__", None) or ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    if not first.startswith(name + "("):
        return None
    # The parameter list: from after "name(" to its matching ")".
    depth, end = 0, None
    for i, ch in enumerate(first[len(name) :], start=len(name)):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                end = i
                break
    params = []
    for part in _split_top_level(first[len(name) + 1 : end]):
        pname = part.split(":", 1)[0].split("=", 1)[0].strip()
        params.append((pname, "=" in part))
    return params


def _stub_parameters(fn):
    """[(name, has_default, positional_only)] of a stub function."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    only = [True] * len(a.posonlyargs) + [False] * len(a.args)
    params = [(p.arg, d, o) for p, d, o in zip(positional, defaults, only)]
    params += [(p.arg, d is not None, False) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    return params


def _check_parameters(qualname, name, obj, stub_fn):
    if inspect.isfunction(obj):  # added from Python (OpPolicy.to_torch)
        bound = [
            (p.name, p.default is not p.empty) for p in inspect.signature(obj).parameters.values()
        ]
    else:
        bound = _bound_parameters(obj, name)
    if bound is None:  # a C method (HandlerModeBase): no signature to compare
        return []
    stub = _stub_parameters(stub_fn)
    if len(bound) != len(stub):
        return [f"{qualname}: bound as {bound}, stub has {[s[0] for s in stub]}"]
    problems = []
    for (bname, bdefault), (sname, sdefault, sonly) in zip(bound, stub):
        if re.fullmatch(r"arg\d+", bname):
            # Bound without py::arg: positional only; the stub may name it.
            if not sonly:
                problems.append(f"{qualname}: {sname!r} is bound without a name (positional only)")
        elif bname != sname:
            problems.append(f"{qualname}: parameter {sname!r} is bound as {bname!r}")
        elif sonly and bname != "self":
            problems.append(f"{qualname}: {bname!r} is bound by name, not positional only")
        if bdefault != sdefault:
            problems.append(f"{qualname}: {bname!r} has a default in one of them only")
    return problems


def test_stub_is_installed_with_the_package():
    pkg = Path(torch_sac.__file__).resolve().parent
    assert (pkg / "_C.pyi").is_file()
    assert (pkg / "py.typed").is_file()
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'torch_sac\s*=\s*\[[^\]]*"_C\.pyi"', text)
    assert re.search(r'torch_sac\s*=\s*\[[^\]]*"py\.typed"', text)


def test_every_subpackage_is_installed_with_the_package():
    # pyproject.toml's [tool.setuptools] packages names packages, not trees: a
    # subpackage it leaves out (torch_sac/planners/) is missing from the wheel.
    text = (ROOT / "pyproject.toml").read_text()
    listed = re.search(r"^packages\s*=\s*\[([^\]]*)\]", text, re.M).group(1)
    source = ROOT / "torch_sac"
    found = {
        ".".join(("torch_sac",) + init.parent.relative_to(source).parts)
        for init in source.rglob("__init__.py")
    }
    assert set(re.findall(r'"([\w.]+)"', listed)) == found


def test_every_export_is_in_the_stub_and_back():
    stub_names = _stub_module_names(_stub_tree())
    exported = _public(dir(_C))
    assert sorted(exported - stub_names) == [], "exported by torch_sac._C, missing from _C.pyi"
    assert sorted(_public(stub_names) - exported) == [], "in _C.pyi, not exported by torch_sac._C"
    assert "__version__" in stub_names


def test_class_members_match():
    classes = _stub_classes(_stub_tree())
    problems = []
    for name in sorted(classes):
        cls = getattr(_C, name)
        assert inspect.isclass(cls), name
        members, stub = _members(cls), _stub_members(classes[name])
        if members - stub:
            problems.append(f"{name}: missing from the stub: {sorted(members - stub)}")
        if stub - members:
            problems.append(f"{name}: not on the class: {sorted(stub - members)}")
        bases = [b.id for b in classes[name].bases if isinstance(b, ast.Name)]
        runtime_bases = [b.__name__ for b in cls.__bases__ if b.__module__ == _C.__name__]
        if bases != runtime_bases:
            problems.append(f"{name}: stub bases {bases}, runtime bases {runtime_bases}")
    assert problems == []


def test_parameter_names_match_the_bindings():
    tree = _stub_tree()
    functions = _stub_functions(tree.body)
    problems = []
    for name, fn in sorted(functions.items()):
        problems += _check_parameters(name, name, getattr(_C, name), fn)
    for cname, node in sorted(_stub_classes(tree).items()):
        cls = getattr(_C, cname)
        for mname, fn in sorted(_stub_functions(node.body).items()):
            member = vars(cls).get(mname)
            if member is None or isinstance(member, property):
                continue
            problems += _check_parameters(f"{cname}.{mname}", mname, member, fn)
    assert problems == []


def _pyproject_version():
    if sys.version_info >= (3, 11):
        import tomllib

        with open(ROOT / "pyproject.toml", "rb") as f:
            return tomllib.load(f)["project"]["version"]
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^\[project\][^\[]*?^version\s*=\s*"([^"]+)"', text, re.M | re.S).group(1)


def test_version_is_pyprojects():
    version = _pyproject_version()
    assert torch_sac.__version__ == version
    # The C++ side: TORCH_SAC_VERSION of the generated torch_sac/version.h.
    assert _C.__version__ == version


def test_version_matches_the_installed_metadata():
    try:
        installed = importlib.metadata.version("torch_sac")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("torch_sac is not installed (run from the source tree)")
    assert installed == torch_sac.__version__, (
        "pip's metadata is from an older pyproject.toml: reinstall "
        "(pip install --no-build-isolation -e .)"
    )


def test_generated_version_header_matches():
    header = ROOT / "build" / "cmake" / "generated" / "include" / "torch_sac" / "version.h"
    if not header.is_file():
        pytest.skip("no CMake build tree at build/cmake")
    match = re.search(r'#define TORCH_SAC_VERSION "([^"]+)"', header.read_text())
    assert match and match.group(1) == torch_sac.__version__
