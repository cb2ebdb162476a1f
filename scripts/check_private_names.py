#!/usr/bin/env python3
"""Fails when a module of the torch_sac package uses another module's private name.

A name that starts with one underscore is private to the module that defines
it: other modules of the package reach it neither by ``from .memory import
_name`` nor by ``memory._name``. What several modules share is named without
the underscore (and left out of ``__all__`` when users should not see it).
Private *modules* (``_state``, ``_compat``, ...) are fine to import: the
underscore there says "not for users", and their public names are the
package's internal API. The extension module ``_C`` is exempt: its names are
bindings, not private helpers.

Subpackages (``torch_sac/planners/``) are read too: relative imports
(``from ..memory import _name``, ``from .budget_plan import _name``) and
dotted paths (``import torch_sac.planners.peak_search`` then
``torch_sac.planners.peak_search._name``) are resolved to the module they
name.

    python scripts/check_private_names.py [PACKAGE_DIR]   (default: torch_sac)

Prints each use as ``file:line: module.name`` and exits 1 if there is one.
"""

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_import_cycles import module_name, resolve  # noqa: E402


def is_private(name):
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def dotted(node):
    """``a.b.c`` as ["a", "b", "c"] for names and attributes only, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]


def violations(root):
    package = root.name
    paths = sorted(root.rglob("*.py"))
    modules = {module_name(package, p, root) for p in paths}
    # Extension modules are modules too (``from . import _C``).
    modules |= {f"{package}.{so.name.split('.')[0]}" for so in root.glob("*.so")}
    modules |= {f"{package}.{stub.stem}" for stub in root.glob("*.pyi")}
    found = []
    for path in paths:
        current = module_name(package, path, root)
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = {}  # local name -> a module of the package it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = resolve(current, is_package, node.level, node.module)
                if base.split(".")[0] != package:
                    continue
                for alias in node.names:
                    candidate = f"{base}.{alias.name}"
                    if candidate in modules:
                        aliases[alias.asname or alias.name] = candidate
                    elif is_private(alias.name) and base in modules and base != current:
                        found.append((path, node.lineno, f"{base}.{alias.name}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        aliases[alias.asname] = alias.name
                    elif alias.name.split(".")[0] == package and not alias.asname:
                        aliases[package] = package  # `import pkg.sub.mod` binds pkg
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not is_private(node.attr):
                continue
            parts = dotted(node.value)
            if not parts or parts[0] not in aliases:
                continue
            owner = ".".join([aliases[parts[0]]] + parts[1:])
            if (
                owner in modules
                and owner != current
                and not owner.endswith("._C")
                and f"{owner}.{node.attr}" not in modules  # a private module
            ):
                found.append((path, node.lineno, f"{owner}.{node.attr}"))
    return found


def main(argv):
    root = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parents[1] / "torch_sac")
    found = violations(root.resolve())
    for path, line, name in found:
        print(f"{path}:{line}: {name} is private to its module")
    if found:
        print(f"{len(found)} use(s) of another module's private name", file=sys.stderr)
        return 1
    print(f"no module of {root.name} uses another's private name")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
