"""What a call of a step changes besides its outputs (module buffers, the
``.grad`` of parameters and inputs), saved before the first planning run of
:func:`torch_sac.policies.plan_peak` and put back after every run."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import numbers
import threading
import types

import torch

__all__ = ["StepState"]


# Containers and objects looked into for the modules and tensors fn refers
# to: this many levels below fn, this many items each, this many in all.
_REFERENCE_DEPTH = 4
_REFERENCE_ITEMS = 256
_REFERENCE_OBJECTS = 10_000


def _referenced(roots):
    """The modules and tensors reachable from ``roots`` (fn and its
    arguments): a function's closure, defaults and the globals its code
    names, a partial's arguments, a bound method's object, containers, and
    the attributes of plain objects (a trainer holding the model), a few
    levels deep. Found before the first run, their state is saved before
    anything changes it; modules reached only through other objects are
    found when they run (the forward pre-hook of :class:`StepState`)."""
    modules, tensors, seen = [], [], set()
    stack = [(r, 0) for r in roots]
    while stack and len(seen) < _REFERENCE_OBJECTS:
        obj, depth = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            modules.append(obj)
            continue
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            continue
        if depth >= _REFERENCE_DEPTH or isinstance(
            obj, (type, types.ModuleType, str, bytes, numbers.Number)
        ):
            continue
        if isinstance(obj, types.MethodType):
            children = [obj.__func__, obj.__self__]
        elif isinstance(obj, types.FunctionType):
            children = [_cell_contents(c) for c in obj.__closure__ or ()]
            names = _code_names(obj.__code__)
            children += [obj.__globals__[n] for n in names if n in obj.__globals__]
            children += list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
        elif isinstance(obj, functools.partial):
            children = [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = list(obj)[:_REFERENCE_ITEMS]
        elif isinstance(obj, dict):
            children = list(obj.values())[:_REFERENCE_ITEMS]
        else:
            try:
                attributes = vars(obj)
            except Exception:  # no __dict__ (or a __getattr__ that raises): nothing to see
                attributes = {}
            children = list(attributes.values())[:_REFERENCE_ITEMS]
        stack.extend((c, depth + 1) for c in children)
    return modules, tensors


def _cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet bound
        return None


def _code_names(code):
    """The global names ``code`` and the functions it defines use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


class _HostCopy:
    """A tensor's values in host memory torch does not allocate (a Python
    buffer), so a copy taken while a run is measured adds nothing to its
    peak; tensors that are not plain dense ones are cloned."""

    def __init__(self, t):
        t = t.detach()
        self.buffer = None
        if (
            t.layout == torch.strided
            and t.is_contiguous()
            and not t.is_quantized
            and not t.is_conj()
            and not t.is_neg()
            and t.device.type in ("cpu", "cuda")
            and type(t) is torch.Tensor
        ):
            host = t.cpu()
            self.buffer = bytearray(host.numel() * host.element_size())
            if self.buffer:
                ctypes.memmove(
                    (ctypes.c_char * len(self.buffer)).from_buffer(self.buffer),
                    host.data_ptr(),
                    len(self.buffer),
                )
        else:
            self.clone = t.clone()

    def copy_to(self, t):
        with torch.no_grad():
            if self.buffer is None:
                t.copy_(self.clone)
            elif self.buffer:
                t.copy_(torch.frombuffer(self.buffer, dtype=t.dtype).view(t.shape))


class StepState:
    """What a call of fn changes besides its outputs, put back after every
    planning run (and when planning ends, by a refusal or an error too):

    * the buffers of the modules fn calls (BatchNorm's running statistics
      and ``num_batches_tracked``): their values are copied when the module
      is first seen (before the first run for the modules fn refers to, in
      its forward pre-hook for the others) and copied back after each run;
    * the ``.grad`` of those modules' parameters and of the tensors fn is
      passed or refers to: while planning they are ``None`` (a step that
      calls ``backward`` makes fresh ones, counted in its peak as in a
      step after ``zero_grad(set_to_none=True)``), and at the end each is
      the tensor it was, untouched;
    * their post-accumulate-grad hooks (an optimizer step in backward):
      not run while planning, back at the end.

    So every run measures the same step, and the model is left as it was.
    The RNG is forked by each run (``_measure`` in ``peak_search.py``).
    """

    def __init__(self):
        self.buffers = []  # (module, name, tensor, copy)
        self.grads = {}  # id(tensor) -> (tensor, its .grad before planning)
        self.hooks = []  # (a tensor's post-accumulate-grad hooks, their entries)
        self.modules = set()
        # The outermost modules found: those fn refers to, then those a run
        # calls that are not inside one already found (a parent's pre-hook
        # runs before its children's).
        self.roots = []
        self.keep = []  # what the ids above refer to, kept alive
        self.thread = threading.get_ident()

    def find(self, fn, args, kwargs):
        """Saves the state of what fn refers to, before the first run."""
        modules, tensors = _referenced((fn, args, kwargs))
        self.roots = list(modules)
        for module in modules:
            self.add_module(module)
        for t in tensors:
            self.add_tensor(t)

    def add_module(self, module):
        for m in module.modules():
            if id(m) in self.modules:
                continue
            self.modules.add(id(m))
            self.keep.append(m)
            for name, b in m._buffers.items():
                if b is not None:
                    self.buffers.append((m, name, b, _HostCopy(b)))
            for p in m._parameters.values():
                if p is not None:
                    self.add_tensor(p)

    def add_tensor(self, t):
        if id(t) in self.grads or not t.is_leaf:
            return
        self.grads[id(t)] = (t, t.grad)
        self.keep.append(t)
        t.grad = None
        # Planning runs backward into .grad: a hook run once a gradient is
        # accumulated (an optimizer step in backward, also called by FSDP2)
        # would change the parameters. Emptied until restore(); the dict
        # itself stays, as autograd holds it.
        hooks = getattr(t, "_post_accumulate_grad_hooks", None)
        if hooks:
            self.hooks.append((hooks, dict(hooks)))
            hooks.clear()

    def ran_backward(self):
        """Whether a gradient was made during this run (fn ran its own
        backward into the tensors planning tracks)."""
        return any(t.grad is not None for t, _ in self.grads.values())

    def _pre_hook(self, module, args):
        if id(module) not in self.modules and threading.get_ident() == self.thread:
            self.roots.append(module)
            self.add_module(module)

    @contextlib.contextmanager
    def run(self):
        """One run: finds the modules fn calls, then puts the state back."""
        handle = torch.nn.modules.module.register_module_forward_pre_hook(self._pre_hook)
        try:
            yield
        finally:
            handle.remove()
            self.reset()

    def reset(self):
        """Buffers back to their values before planning (copied back every
        time: a kernel that updates running statistics in place need not
        bump their version counter), no ``.grad``."""
        for m, name, b, copy in self.buffers:
            if m._buffers.get(name) is not b:
                m._buffers[name] = b
            copy.copy_to(b)
        for t, _ in self.grads.values():
            t.grad = None

    def restore(self):
        """Everything as it was before planning."""
        self.reset()
        for t, grad in self.grads.values():
            t.grad = grad
        for hooks, entries in self.hooks:
            hooks.update(entries)
        self.hooks.clear()
