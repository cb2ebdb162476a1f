#!/usr/bin/env python3
"""Fails when the modules of the torch_sac package import each other in a cycle.

Every import counts, the ones inside functions included: an import inside a
function closes a cycle as surely as one at the top, it only hides it until
the function runs. A submodule importing the package itself (``from . import
X`` where X is defined in ``__init__.py``, ``import torch_sac``) is an edge to
``torch_sac``, whose ``__init__`` imports the submodules: a cycle too. The
extension module ``_C`` is a leaf.

Subpackages (``torch_sac/planners/``) are read too, their modules named
``torch_sac.planners.budget_plan``. Importing a module of a subpackage first
runs the subpackage's ``__init__``: ``from .planners.step_state import X`` in
``region`` is an edge to ``torch_sac.planners`` as well (a cycle if that
``__init__`` imports ``region``), except from a module inside that
subpackage, which its ``__init__`` has started already.

    python scripts/check_import_cycles.py [PACKAGE_DIR]   (default: torch_sac)

Prints the import graph's cycles (strongly connected components of more
than one module, or a module importing itself) and exits 1 if there is one;
with ``--graph`` it prints every module's imports, bottom layer first.
"""

import ast
import sys
from pathlib import Path


def module_name(package, path, root):
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package] + parts)


def resolve(current, is_package, level, target):
    """The absolute name a relative import refers to."""
    if level == 0:
        return target
    base = current.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def enclosing_packages(name, current):
    """The packages whose ``__init__`` importing ``name`` from ``current`` runs:
    those above ``name``, the top one and those above ``current`` left out
    (their ``__init__`` runs before ``current``)."""
    parts = name.split(".")
    above = {".".join(parts[:i]) for i in range(2, len(parts))}
    current_parts = current.split(".")
    started = {".".join(current_parts[:i]) for i in range(1, len(current_parts) + 1)}
    return above - started


def imports_of(tree, current, is_package, modules):
    """Modules of the package that ``tree`` imports, anywhere in it."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == current.split(".")[0]:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = resolve(current, is_package, node.level, node.module)
            if base.split(".")[0] != current.split(".")[0]:
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                # `from . import memory` imports a module; `from . import
                # IGNORED_OPS` imports a name of the package.
                found.add(candidate if candidate in modules else base)
    found |= {p for m in list(found) for p in enclosing_packages(m, current)}
    return {m for m in found if m in modules and m != current} | (
        {current} if current in found and current.count(".") else set()
    )


def strongly_connected(graph):
    """Tarjan's algorithm, iterative."""
    index, low, on_stack, stack, result = {}, {}, set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                result.append(sorted(component))
    return result


def main(argv):
    show_graph = "--graph" in argv
    args = [a for a in argv if a != "--graph"]
    root = Path(args[0] if args else Path(__file__).resolve().parent.parent / "torch_sac")
    package = root.name
    files = {module_name(package, p, root): p for p in sorted(root.rglob("*.py"))}
    extensions = {f"{package}.{p.name.split('.')[0]}" for p in root.glob("*.so")} | {
        f"{package}._C"
    }
    modules = set(files) | extensions
    graph = {name: set() for name in extensions}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = imports_of(tree, name, path.name == "__init__.py", modules)
    # The package's __init__ imports its submodules: an edge back to the
    # package from a submodule is a cycle through it.
    cycles = [c for c in strongly_connected(graph) if len(c) > 1 or c[0] in graph[c[0]]]
    if show_graph:
        for component in reversed(strongly_connected(graph)):
            for name in component:
                print(f"{name}: {', '.join(sorted(graph[name])) or '-'}")
    if cycles:
        print(f"import cycles in {package}:")
        for cycle in cycles:
            print("  " + " <-> ".join(cycle))
            for name in cycle:
                inside = sorted(graph[name] & set(cycle))
                print(f"    {name} imports {', '.join(inside)}")
        return 1
    print(f"{package}: {len(files)} modules, no import cycle")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
