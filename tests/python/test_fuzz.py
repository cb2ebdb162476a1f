"""Property-based fuzzing (hypothesis) of torch_sac's three engines against
plain autograd.

A generator writes short random programs (5-25 steps) over a few float64 /
float32 CPU tensors: leaves that require grad, constants from outside the
region (some passed as arguments, some closed over). The steps cover
elementwise ops, mm / bmm / 3-D and 4-D ``torch.matmul`` (``_unsafe_view``),
views (view/reshape, transpose, narrow, slicing, select, expand, unsqueeze,
chunk, detach), in-place ops on fresh intermediates, on views of them and on
outside constants (add_, mul_, masked_fill_, relu_, also under ``no_grad``),
random ops (dropout, rand_like, randn_like, bernoulli, bernoulli_, rand with
an explicit Generator), reductions (sum, mean, amax, max, softmax,
log_softmax, layer_norm), factory ops (ones, full, zeros_like, arange),
``torch.no_grad()`` islands, casts, cat/stack, where, ``.item()``, clone and
a custom ``autograd.Function``. Every program is written as Python source
(see ``Program.source``), so a failing example prints as a runnable function.
Shapes are checked while generating by running each step on meta tensors.

Each example runs the program twice with the same global RNG seed: once
plainly, once checkpointed by the engine under test with a drawn policy (a
callable answering from a drawn bit string indexed by its call counter,
fresh per region, or ``recompute_all`` / ``save_all`` / ``save_matmuls``):

* ``region``: ``with torch_sac.sac_context(policy): outs = program(...)``;
  or, drawn, two consecutive regions inside the program, or a region nested
  in one around the whole program;
* ``checkpoint``: ``torch_sac.checkpoint(program, ..., policy=policy)``;
* ``dropin``: ``torch.utils.checkpoint.checkpoint(program, ...,
  use_reentrant=False, context_fn=partial(
  torch_sac.create_selective_checkpoint_contexts, policy))``.

The loss (weighted sums of the outputs, computed outside the region) is
backpropagated once, or (drawn) twice with ``retain_graph=True``.

Property: the loss, every output, the gradient of every leaf, the outside
constants after the step and the global RNG state after it are bitwise equal
to the plain run's; after each run (also one that raised) no interceptor is
installed (``key_handler_depth() == 0``) and no dispatch mode is on. A
program plain autograd rejects (forward or backward raises) is discarded
with ``assume``. ``allow_cache_entry_mutation`` is always False.

The only accepted deviations are documented errors, each only when the
program does what the error says:

* region / checkpoint: "modified by an inplace operation" naming "an output
  the policy saved" (the program wrote in place to an intermediate the
  policy may have saved) or "a tensor from outside the sac_context region"
  (a region read a tensor from outside it that a write the region did not
  record, under no_grad or in another region, changed later).
* dropin: it follows PyTorch 2.13's SAC, holes included (a cached in-place
  output raises; a cached random op shifts later recomputed ones; recompute
  re-applies writes to outside tensors). When it does not match plain
  autograd it is run under PyTorch's own SAC with the same policy
  (``policy.to_torch()`` for built-ins): it must raise if that run raises,
  and otherwise every compared item must be bitwise equal to plain
  autograd's or to that run's. It may also refuse (raise) when an
  input of the function is read and then written in place, and, on torch
  <= 2.12, raise "Trying to backward an extra time" on a second backward
  where that torch's SAC hands out a leftover cache entry instead (as 2.13
  raises; the single backward is then checked). Ops drawing from
  an explicit Generator are not used with it (PyTorch's checkpoint restores
  only the default generators).

Profiles (env var ``TORCH_SAC_FUZZ_PROFILE``): ``ci`` (default: 60 examples
per engine, derandomized so CI is reproducible; ~10 s per adapter) and
``long`` (random, 5000 examples per engine, or ``TORCH_SAC_FUZZ_EXAMPLES``;
~2.5-3.5 min per 1000 examples per engine). Long run, per adapter:

    OMP_NUM_THREADS=1 TORCH_SAC_ADAPTER=key TORCH_SAC_FUZZ_PROFILE=long \\
        python -m pytest tests/python/test_fuzz.py -q -k fuzz \\
        --hypothesis-show-statistics

Bugs this fuzzer found have a minimal standalone repro at the end of this
file (``test_regression_*``). While a bug is open its test is marked
``xfail(strict=True)`` and, only if CI needs it, the fuzz test skips that
one pattern with an ``assume`` naming the test.
"""

import collections
import contextlib
import functools
import os
import re

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tc
from hypothesis import HealthCheck, Phase, assume, event, given, note, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import CheckpointPolicy

import torch_sac
from torch_sac import _compat
from models import ScaledTanhFn as ScaledTanh

P = torch_sac.Policy

# --------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------

_COMMON = dict(
    deadline=None,
    print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
)
settings.register_profile("ci", max_examples=60, derandomize=True, database=None, **_COMMON)
settings.register_profile(
    "long",
    max_examples=int(os.environ.get("TORCH_SAC_FUZZ_EXAMPLES", "5000")),
    derandomize=False,
    database=None,
    **_COMMON,
)
PROFILE = settings.get_profile(os.environ.get("TORCH_SAC_FUZZ_PROFILE", "ci"))

ENGINES = ("region", "checkpoint", "dropin")
POLICY_KINDS = ("bits", "recompute_all", "save_all", "save_matmuls")

# --------------------------------------------------------------------------
# Programs
# --------------------------------------------------------------------------


INPUT_SHAPES = [(4, 4), (3, 4), (4, 3), (2, 3, 4), (2, 4, 4), (2, 4, 3), (4,)]
DTYPES = {"f64": torch.float64, "f32": torch.float32}
MAX_NUMEL = 96


# What one line does to storages (named by their root value): the roots it
# reads, the root it writes in place (or None), whether that write ran under
# no_grad, the in-place op kind, and the roots read by the other operands of
# an in-place line (not its target).
LineInfo = collections.namedtuple("LineInfo", "reads write nograd op reads_other")


class Program:
    """A straight-line program: inputs v0..v{n-1}, one line (or ``with``
    block) per step, each defining the next ``v``; returns some of them."""

    def __init__(
        self, inputs, lines, outputs, written, matmul_roots, data_seed, line_info=(), home=None
    ):
        self.line_info = list(line_info)  # per line: LineInfo (storages read and written)
        self.home = home or {}  # root -> index of the line that made it
        # inputs: list of (name, kind, shape, dtype_name, as_arg); kind in leaf/const
        self.inputs = inputs
        self.lines = lines
        self.outputs = outputs
        self.written = written  # roots written in place: {"const", "inter", "nograd": set(name)}
        self.matmul_roots = matmul_roots  # roots produced by a matmul-like op
        self.data_seed = data_seed
        self._code = None

    @property
    def arg_names(self):
        return [name for name, kind, _, _, as_arg in self.inputs if kind == "leaf" or as_arg]

    @property
    def closure_names(self):
        return [name for name, kind, _, _, as_arg in self.inputs if kind == "const" and not as_arg]

    def layout_bounds(self, layout):
        """Where the region engine's ``with _region():`` blocks go: "one"
        (none: the caller wraps the whole call), "two" (lines[:k] and
        lines[k:] in two regions), "nested" (lines[a:b] in a region nested in
        one around everything)."""
        n = len(self.lines)
        if layout[0] == "two":
            return (1 + layout[1] % (n - 1),)
        if layout[0] == "nested":
            a = layout[1] % n
            return a, a + 1 + layout[2] % (n - a)
        return ()

    def region_of(self, i, layout):
        """Index of the region line i runs in (nested regions share one)."""
        if layout[0] == "two":
            return 0 if i < self.layout_bounds(layout)[0] else 1
        return 0

    def home_region(self, r, layout):
        """The region that recorded the op making root r; -1 for inputs and
        tensors made where nothing is recorded (no_grad, inside a custom
        Function's forward)."""
        return self.region_of(self.home[r], layout) if r in self.home else -1

    def write_after_read(self, layout, outside, nograd_writes=False):
        """Some line writes in place (with grad enabled, or also under no_grad
        with ``nograd_writes``) to a root that is ``outside(root, region)``
        its region, after an earlier op of that region read it: an earlier
        line, the mask of a ``masked_fill_`` computed from it, or, for a
        ``mul_`` by a tensor, autograd's clone of the original ``self``."""
        for w, info in enumerate(self.line_info):
            if info.write is None or (info.nograd and not nograd_writes):
                continue
            region = self.region_of(w, layout)
            if not outside(info.write, region):
                continue
            if info.op == "mul_t":
                return True
            if info.op == "masked_fill_" and info.write in info.reads_other:
                return True  # the mask (a separate op) reads it first
            if any(
                info.write in self.line_info[r].reads
                for r in range(w)
                if self.region_of(r, layout) == region
            ):
                return True
        return False

    def input_write_after_read(self):
        """The drop-in's refusal: an input of the checkpointed function read,
        then written in place (recompute, which re-runs every line, no_grad
        ones too, would read the new value)."""
        inputs = {name for name, *_ in self.inputs}
        return self.write_after_read(("one",), lambda r, region: r in inputs, nograd_writes=True)

    @property
    def uses_explicit_generator(self):
        return any("generator=gen" in line for line in self.lines)

    def unseen_outside_write(self, layout):
        """A region read a root from outside it that a write it did not
        record (under no_grad, or in another region) modified later: the
        documented "tensor from outside the region modified" error."""
        for i, info in enumerate(self.line_info):
            region = self.region_of(i, layout)
            for r in info.reads:
                if self.home_region(r, layout) == region:
                    continue
                for w in range(i + 1, len(self.line_info)):
                    wi = self.line_info[w]
                    if wi.write == r and (wi.nograd or self.region_of(w, layout) != region):
                        return True
        return False

    def body(self, layout=("one",)):
        def indent(lines, depth):
            return ["    " * depth + part for line in lines for part in line.split("\n")]

        out = [f"def program({', '.join(self.arg_names)}):"]
        bounds = self.layout_bounds(layout)
        if layout[0] == "two":
            (k,) = bounds
            out += ["    with _region():"] + indent(self.lines[:k], 2)
            out += ["    with _region():"] + indent(self.lines[k:], 2)
        elif layout[0] == "nested":
            a, b = bounds
            out += ["    with _region():"] + indent(self.lines[:a], 2)
            out += (
                ["        with _region():"] + indent(self.lines[a:b], 3) + indent(self.lines[b:], 2)
            )
        else:
            out += indent(self.lines, 1)
        out.append(f"    return ({', '.join(self.outputs)},)")
        return "\n".join(out)

    def setup(self):
        lines = [
            "import torch, torch.nn.functional as F",
            "from models import ScaledTanhFn as ScaledTanh  # tests/python on sys.path",
            "_item = lambda t: t.item()",
            f"g = torch.Generator().manual_seed({self.data_seed})",
        ]
        for name, kind, shape, dt, as_arg in self.inputs:
            grad = ".requires_grad_()" if kind == "leaf" else ""
            lines.append(
                f"{name} = torch.randn({shape}, generator=g, dtype={DTYPES[dt]}){grad}"
                f"  # {kind}{'' if kind == 'leaf' else (', argument' if as_arg else ', closure')}"
            )
        lines.append(
            "gen = torch.Generator().manual_seed(1234)  # explicit generator used by the program"
        )
        return "\n".join(lines)

    def source(self):
        return self.setup() + "\n\n" + self.body()

    def __repr__(self):
        return "\n" + self.source() + "\n"

    def compiled(self, layout=("one",)):
        key = (layout[0],) + self.layout_bounds(layout)
        if self._code is None:
            self._code = {}
        if key not in self._code:
            self._code[key] = compile(self.body(layout), "<fuzz program>", "exec")
        return self._code[key]


def _item_real(t):
    return t.item()


def _item_meta(t):
    return 0.75


def _namespace(meta):
    return {
        "torch": torch,
        "F": F,
        "ScaledTanh": ScaledTanh,
        "_item": _item_meta if meta else _item_real,
    }


def _fmt(x):
    return repr(float(x))


@st.composite
def programs(draw):
    dt_name = draw(st.sampled_from(sorted(DTYPES)))
    n_leaves = draw(st.integers(1, 3))
    n_consts = draw(st.integers(0, 2))
    inputs = []
    meta = {}  # name -> meta tensor (current value)
    names = []  # v-names in definition order
    root = {}  # name -> name of the value owning its storage
    origin = {}  # root name -> "leaf" / "const" / "inter"
    written = {"const": set(), "inter": set(), "nograd": set()}
    line_info = []  # per line: LineInfo
    home = {}  # root name -> index of the line that made it (inputs: absent)
    matmul_roots = set()
    for i in range(n_leaves + n_consts):
        name = f"v{i}"
        kind = "leaf" if i < n_leaves else "const"
        shape = draw(st.sampled_from(INPUT_SHAPES))
        # Mostly the program's dtype; sometimes the other one.
        dt = dt_name if draw(st.integers(0, 4)) else ("f32" if dt_name == "f64" else "f64")
        as_arg = kind == "leaf" or draw(st.booleans())
        inputs.append((name, kind, shape, dt, as_arg))
        t = torch.empty(shape, device="meta", dtype=DTYPES[dt])
        if kind == "leaf":
            t.requires_grad_()
        meta[name] = t
        names.append(name)
        root[name] = name
        origin[name] = kind
    ns_globals = _namespace(meta=True)
    ns_globals["gen"] = None

    def pick(cands):
        return draw(st.sampled_from(cands))

    def pickv(cands):
        """Operands: uniformly from all candidates, or (to build deep chains
        rather than dead code) from those needing grad, or the most recent."""

        def first(c):
            return c[0] if isinstance(c, tuple) else c

        def recency(c):
            return max(
                int(n[1:])
                for n in (c if isinstance(c, tuple) else (c,))
                if isinstance(n, str) and re.fullmatch(r"v\d+", n)
            )

        mode = draw(st.integers(0, 3))
        if mode >= 1:
            cands = [c for c in cands if meta[first(c)].requires_grad] or cands
        if mode >= 2:
            cands = sorted(cands, key=recency)[-4:]
        return draw(st.sampled_from(cands))

    def shape(n):
        return tuple(meta[n].shape)

    def fresh_ok(shape_):
        n = 1
        for s in shape_:
            n *= s
        return n <= MAX_NUMEL and len(shape_) <= 4

    def bcast(a, b):
        try:
            return tuple(torch.broadcast_shapes(a, b))
        except RuntimeError:
            return None

    n_steps = draw(st.integers(5, 25))
    lines = []
    attempts = 0
    while len(lines) < n_steps and attempts < 4 * n_steps:
        attempts += 1
        new = f"v{len(names)}"
        kind = draw(st.sampled_from(STEP_KINDS))
        line, view_of, write_root, is_matmul, nograd_write = None, None, None, False, False
        write_op = None
        ndims = {n: meta[n].dim() for n in names}
        if kind == "unary":
            i = pickv(names)
            fn = pick(["sin", "exp", "tanh", "relu", "sigmoid", "neg"])
            line = f"{new} = torch.{fn}({i})"
        elif kind == "affine":
            i = pickv(names)
            a, b = pick([0.5, -1.5, 2.0]), pick([0.0, 1.0, -0.25])
            line = f"{new} = {i} * {_fmt(a)} + {_fmt(b)}"
        elif kind == "binary":
            pairs = [
                (a, b)
                for a in names
                for b in names
                if bcast(shape(a), shape(b)) is not None and fresh_ok(bcast(shape(a), shape(b)))
            ]
            a, b = pickv(pairs)
            fn = pick(["add", "mul", "sub"])
            line = f"{new} = torch.{fn}({a}, {b})"
        elif kind == "where":
            pairs = [
                (a, b)
                for a in names
                for b in names
                if bcast(shape(a), shape(b)) is not None and fresh_ok(bcast(shape(a), shape(b)))
            ]
            a, b = pickv(pairs)
            line = f"{new} = torch.where({a} > 0, {a}, {b})"
        elif kind == "mm":
            cands = []
            for a in names:
                for b in names:
                    if ndims[a] != 2 or ndims[b] != 2 or meta[a].dtype != meta[b].dtype:
                        continue
                    for ta in (False, True):
                        for tb in (False, True):
                            sa = shape(a)[::-1] if ta else shape(a)
                            sb = shape(b)[::-1] if tb else shape(b)
                            if sa[1] == sb[0]:
                                cands.append((a, b, ta, tb))
            if cands:
                a, b, ta, tb = pickv(cands)
                line = f"{new} = torch.mm({a}{'.t()' if ta else ''}, {b}{'.t()' if tb else ''})"
                is_matmul = True
        elif kind == "bmm":
            cands = []
            for a in names:
                for b in names:
                    if ndims[a] != 3 or ndims[b] != 3 or meta[a].dtype != meta[b].dtype:
                        continue
                    if shape(a)[0] != shape(b)[0]:
                        continue
                    for tb in (False, True):
                        sb = (shape(b)[2], shape(b)[1]) if tb else shape(b)[1:]
                        if shape(a)[2] == sb[0]:
                            cands.append((a, b, tb))
            if cands:
                a, b, tb = pickv(cands)
                line = f"{new} = torch.bmm({a}, {b}{'.transpose(1, 2)' if tb else ''})"
                is_matmul = True
        elif kind == "matmul":
            # torch.matmul with a 3-D/4-D operand folds to mm/bmm and
            # returns an _unsafe_view of its output.
            cands = []
            for a in names:
                for b in names:
                    if meta[a].dtype != meta[b].dtype or ndims[a] not in (3, 4):
                        continue
                    k = shape(a)[-1]
                    if ndims[b] == 2 and shape(b)[0] == k:
                        cands.append((a, b, "nd@2d"))
                        if ndims[a] == 3:
                            cands.append((a, b, "4d@2d"))
                    if (
                        ndims[b] == 3
                        and ndims[a] == 3
                        and shape(b)[1] == k
                        and shape(b)[0] == shape(a)[0]
                    ):
                        cands.append((a, b, "4d@4d"))
            if cands:
                a, b, how = pickv(cands)
                if how == "nd@2d":
                    line = f"{new} = torch.matmul({a}, {b})"
                elif how == "4d@2d":
                    line = f"{new} = torch.matmul({a}.unsqueeze(0), {b})"
                else:
                    line = f"{new} = torch.matmul({a}.unsqueeze(0).expand(2, -1, -1, -1), {b}.unsqueeze(0))"
                is_matmul = True
        elif kind == "view":
            i = pickv(names)
            s = shape(i)
            opts = []
            if len(s) >= 2:
                opts += ["transpose", "flatten"]
            if len(s) >= 1 and s and s[-1] % 2 == 0 and len(s) < 4:
                opts.append("unflatten")
            if any(d >= 2 for d in s):
                opts += ["narrow", "slice", "chunk"]
            if len(s) >= 2:
                opts.append("select")
            if len(s) < 4 and fresh_ok((2,) + s):
                opts.append("expand")
            if len(s) < 4:
                opts.append("unsqueeze")
            opts.append("detach")
            v = pick(opts)
            if v == "transpose":
                d0, d1 = pick([(-1, -2), (0, 1)])
                expr = f"{i}.transpose({d0}, {d1})"
            elif v == "flatten":
                flat = s[:-2] + (s[-2] * s[-1],)
                meth = "view" if meta[i].is_contiguous() else "reshape"
                expr = f"{i}.{meth}({', '.join(map(str, flat))})"
            elif v == "unflatten":
                new_s = s[:-1] + (2, s[-1] // 2)
                meth = "view" if meta[i].is_contiguous() else "reshape"
                expr = f"{i}.{meth}({', '.join(map(str, new_s))})"
            elif v in ("narrow", "slice", "chunk"):
                d = pick([k for k, n in enumerate(s) if n >= 2])
                if v == "narrow":
                    start = pick(list(range(s[d] - 1)))
                    length = pick(list(range(1, s[d] - start + 1)))
                    expr = f"{i}.narrow({d}, {start}, {length})"
                elif v == "slice":
                    idx = ", ".join([":"] * d + [pick(["1:", "::2", ":-1"])])
                    expr = f"{i}[{idx}]"
                else:
                    expr = f"{i}.chunk(2, {d})[{pick([0, 1])}]"
            elif v == "select":
                expr = f"{i}[{pick([0, 1]) if s[0] >= 2 else 0}]"
            elif v == "expand":
                expr = (
                    f"{i}.unsqueeze(0).expand(2, {', '.join(map(str, s))})"
                    if s
                    else f"{i}.expand(2)"
                )
            elif v == "unsqueeze":
                expr = f"{i}.unsqueeze({pick(list(range(len(s) + 1)))})"
            else:
                expr = f"{i}.detach()"
                view_of = i  # shares the storage; not a view autograd knows about
            line = f"{new} = {expr}"
        elif kind == "inplace":
            targets = []
            for n in names:
                t = meta[n]
                r = root[n]
                if origin[r] == "leaf":
                    continue
                if any(st_ == 0 and sz > 1 for st_, sz in zip(t.stride(), t.shape)):
                    continue  # expanded: in-place is an error
                targets.append(n)
            if targets:
                tgt = pickv(targets)
                s = shape(tgt)
                others = [
                    n
                    for n in names
                    if n != tgt and bcast(shape(n), s) == s and meta[n].dtype == meta[tgt].dtype
                ]
                ops = ["add_s", "mul_s", "relu_"]
                if others:
                    ops += ["add_t", "mul_t", "masked_fill_"]
                op = pick(ops)
                if op == "add_s":
                    expr = f"{tgt}.add_({_fmt(pick([1.0, -0.5]))})"
                elif op == "mul_s":
                    expr = f"{tgt}.mul_({_fmt(pick([2.0, -0.5]))})"
                elif op == "relu_":
                    expr = f"{tgt}.relu_()"
                elif op == "add_t":
                    expr = f"{tgt}.add_({pickv(others)})"
                elif op == "mul_t":
                    expr = f"{tgt}.mul_({pickv(others)})"
                else:
                    expr = f"{tgt}.masked_fill_({pickv(others)} > 0, {_fmt(pick([0.0, 0.25]))})"
                nograd_write = draw(st.integers(0, 4)) == 0
                if nograd_write:
                    line = f"with torch.no_grad():\n    {new} = {expr}"
                else:
                    line = f"{new} = {expr}"
                view_of = tgt
                write_root = root[tgt]
                write_op = op
        elif kind == "random":
            i = pickv(names)
            r = pick(["dropout", "rand_like", "randn_like", "bernoulli", "bernoulli_", "gen_rand"])
            if r == "dropout":
                expr = f"F.dropout({i}, {_fmt(pick([0.25, 0.5]))}, training=True)"
            elif r == "rand_like":
                expr = f"{i} * torch.rand_like({i})"
            elif r == "randn_like":
                expr = f"{i} + torch.randn_like({i})"
            elif r == "bernoulli":
                expr = f"{i} * torch.bernoulli({i}.detach().sigmoid())"
            elif r == "bernoulli_":
                expr = f"{i} * torch.empty_like({i}).bernoulli_(0.5)"
            else:
                expr = f"{i} * torch.rand({shape(i)}, generator=gen, dtype={i}.dtype, device={i}.device)"
            line = f"{new} = {expr}"
        elif kind == "reduce":
            i = pickv(names)
            s = shape(i)
            opts = ["sum_all", "mean_all"]
            if s:
                opts += ["sum", "mean", "softmax", "log_softmax", "amax", "max"]
                if s[-1] >= 2:
                    opts.append("layer_norm")
            r = pick(opts)
            d = pick(list(range(-len(s), 0))) if s else None
            if r == "sum_all":
                expr = f"{i}.sum()"
            elif r == "mean_all":
                expr = f"{i}.mean()"
            elif r in ("sum", "mean", "amax"):
                expr = f"{i}.{r}({d}, keepdim={pick([False, True])})"
            elif r == "max":
                expr = f"{i}.max({d}).values"
            elif r in ("softmax", "log_softmax"):
                expr = f"torch.{r}({i}, {d})"
            else:
                expr = f"F.layer_norm({i}, ({s[-1]},))"
            line = f"{new} = {expr}"
        elif kind == "factory":
            i = pickv(names)
            s = shape(i)
            f = pick(["ones", "full", "zeros_like", "arange"])
            dt = str(meta[i].dtype)
            if f == "ones":
                expr = f"torch.ones({s}, dtype={dt})"
            elif f == "full":
                expr = f"torch.full({s}, 0.5, dtype={dt})"
            elif f == "zeros_like":
                expr = f"torch.zeros_like({i})"
            else:
                n = s[-1] if s else 3
                expr = f"torch.arange({n}, dtype={dt}) * 0.25"
            line = f"{new} = {expr}"
        elif kind == "no_grad":
            i = pickv(names)
            e = pick(["sin", "affine", "sum", "tanh_mul"])
            if e == "sin":
                expr = f"{i}.sin()"
            elif e == "affine":
                expr = f"{i} * 2.0 + 1.0"
            elif e == "sum":
                expr = f"{i}.sum(-1, keepdim=True)" if shape(i) else f"{i} * 1.0"
            else:
                expr = f"{i}.tanh() * {i}"
            line = f"with torch.no_grad():\n    {new} = {expr}"
        elif kind == "custom":
            pairs = [
                (a, b)
                for a in names
                for b in names
                if meta[a].dtype == meta[b].dtype and bcast(shape(a), shape(b)) == shape(a)
            ]
            a, b = pickv(pairs)
            line = f"{new} = ScaledTanh.apply({a}, {b})"
        elif kind == "cast":
            i = pickv(names)
            to = "float32" if meta[i].dtype == torch.float64 else "float64"
            line = f"{new} = {i}.to(torch.{to})"
        elif kind == "cat":
            pairs = [
                (a, b)
                for a in names
                for b in names
                if shape(a) == shape(b) and meta[a].dtype == meta[b].dtype and shape(a)
            ]
            if pairs:
                a, b = pickv(pairs)
                if pick(["cat", "stack"]) == "cat" and fresh_ok((2 * shape(a)[0],) + shape(a)[1:]):
                    line = f"{new} = torch.cat([{a}, {b}], 0)"
                elif fresh_ok((2,) + shape(a)):
                    line = f"{new} = torch.stack([{a}, {b}])"
        elif kind == "item":
            a, b = pickv(names), pickv(names)
            line = f"{new} = {b} * _item({a}.mean())"
        elif kind == "clone":
            i = pickv(names)
            line = f"{new} = {i}.{pick(['clone', 'contiguous'])}()"
        if line is None:
            continue
        # Shape-check the step on meta tensors; a step that fails is dropped.
        ns = dict(meta)
        try:
            exec(line, ns_globals, ns)
        except RuntimeError:
            continue
        out = ns[new]
        if not isinstance(out, torch.Tensor) or not fresh_ok(tuple(out.shape)):
            continue
        # Which earlier value's storage the result shares, if any (views,
        # in-place results, ops returning their input like contiguous()).
        alias = next((n for n in names if out is meta[n]), None)
        if alias is None and out._base is not None:
            alias = next((n for n in names if out._base is meta[n]), None)
        if alias is None:
            alias = view_of
        reads = {root[n] for n in re.findall(r"\bv\d+\b", line) if n != new}
        meta[new] = out
        names.append(new)
        lines.append(line)
        if alias is not None:
            root[new] = root[alias]
        else:
            root[new] = new
            origin[new] = "inter"
            if kind not in ("no_grad", "custom"):  # those run with grad off: not recorded
                home[new] = len(lines) - 1
        reads_other = {root[n] for n in re.findall(r"\bv\d+\b", line) if n not in (new, view_of)}
        line_info.append(
            LineInfo(
                frozenset(reads),
                write_root,
                nograd_write,
                write_op,
                frozenset(reads_other) if write_root is not None else frozenset(),
            )
        )
        if write_root is not None:
            written["const" if origin[write_root] == "const" else "inter"].add(write_root)
            if nograd_write:
                written["nograd"].add(write_root)
        if is_matmul:
            matmul_roots.add(root[new])
    assume(len(lines) >= 5)
    # Outputs: the last value and up to two more, preferably needing grad.
    grad_names = [n for n in names if meta[n].requires_grad]
    outputs = [names[-1]]
    extra = draw(st.lists(st.sampled_from(grad_names or names), max_size=2, unique=True))
    outputs += [n for n in extra if n not in outputs]
    if not any(meta[n].requires_grad for n in outputs):
        outputs.append(draw(st.sampled_from([n for n in grad_names if n not in outputs])))
    data_seed = draw(st.integers(0, 2**16))
    return Program(inputs, lines, outputs, written, matmul_roots, data_seed, line_info, home)


STEP_KINDS = [
    "unary",
    "affine",
    "binary",
    "where",
    "mm",
    "bmm",
    "matmul",
    "view",
    "view",
    "inplace",
    "inplace",
    "inplace",
    "random",
    "reduce",
    "factory",
    "no_grad",
    "custom",
    "cast",
    "cat",
    "item",
    "clone",
]


# --------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------


class BitsPolicy:
    """Answers the i-th policy call with bits[i] (SAVE) or PREFER_RECOMPUTE;
    calls past the end recompute. torch_sac, and PyTorch >= 2.12, call the
    policy once per op in forward only, so the counter indexes forward ops.
    PyTorch <= 2.11's SAC also asks in each recompute (ctx.is_recompute) and
    needs forward's answers there: recompute calls are counted apart, from 0
    in each recompute pass (per backward graph task, which is what PyTorch's
    checkpoint recomputes once for). Records the storages of the outputs it
    saved (forward, where ctx.op_output is given)."""

    def __init__(self, bits, flavour):
        self.bits = bits
        self.save, self.recompute = (
            (P.MUST_SAVE, P.PREFER_RECOMPUTE)
            if flavour == "torch_sac"
            else (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE)
        )
        # "offload": kept ops are offloaded instead (torch's enum, which
        # PyTorch's SAC, the drop-in's control, recomputes), run on the CPU
        # stand-in (see test_fuzz_engine_matches_plain_autograd).
        self.offload = CheckpointPolicy.PREFER_CPU_OFFLOAD if flavour == "offload" else None
        self.calls = 0
        self.recompute_pass = None
        self.recompute_calls = 0
        self.saved_storages = set()

    def __call__(self, ctx, op, *args, **kwargs):
        if ctx.is_recompute:
            task = torch._C._current_graph_task_id()
            if task != self.recompute_pass:
                self.recompute_pass, self.recompute_calls = task, 0
            i = self.recompute_calls
            self.recompute_calls += 1
            return self.decision(i) if i < len(self.bits) and self.bits[i] else self.recompute
        i = self.calls
        self.calls += 1
        if i < len(self.bits) and self.bits[i]:
            out = getattr(ctx, "op_output", None)
            for t in out if isinstance(out, (list, tuple)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.saved_storages.add(t.untyped_storage().data_ptr())
            return self.decision(i)
        return self.recompute

    def decision(self, i):
        return self.save if self.offload is None else self.offload


class PolicySpec:
    def __init__(self, kind, bits=(), flavour="torch_sac"):
        self.kind, self.bits, self.flavour = kind, tuple(bits), flavour

    def make(self):
        """A fresh policy object (the bits policy's counter restarts)."""
        if self.kind == "bits":
            return BitsPolicy(self.bits, self.flavour)
        return getattr(torch_sac.policies, self.kind)()

    def __repr__(self):
        if self.kind == "bits":
            return f"BitsPolicy(bits={''.join('1' if b else '0' for b in self.bits)!r}, {self.flavour})"
        return f"torch_sac.policies.{self.kind}()"


@st.composite
def policy_specs(draw):
    kind = draw(st.sampled_from(POLICY_KINDS))
    if kind != "bits":
        return PolicySpec(kind)
    bits = draw(st.lists(st.booleans(), max_size=80))
    flavour = draw(st.sampled_from(["torch_sac", "torch", "offload"]))
    return PolicySpec(kind, bits, flavour)


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------

RUN_SEED = 0
LOSS_SEED = 7


class Run:
    def __init__(self, loss, outputs, grads, consts, rng, stats):
        self.stats = stats
        self.loss, self.outputs, self.grads, self.consts, self.rng = (
            loss,
            outputs,
            grads,
            consts,
            rng,
        )


def interceptor_clean():
    """Nothing left installed: no torch_sac handler, no dispatch mode."""
    depth = torch_sac._C.key_handler_depth()
    modes = torch._C._len_torch_dispatch_stack()
    assert depth == 0, f"torch_sac key handler left installed (depth {depth})"
    assert modes == 0, f"torch dispatch mode left on (stack {modes})"


def make_inputs(prog):
    g = torch.Generator().manual_seed(prog.data_seed)
    vals = {}
    for name, kind, shape, dt, _ in prog.inputs:
        t = torch.randn(shape, generator=g, dtype=DTYPES[dt])
        if kind == "leaf":
            t.requires_grad_()
        vals[name] = t
    return vals


def run_program(
    prog, engine, spec=None, layout=("one",), twice=False, policies=None, replay_budget=None
):
    """One forward+backward (two with ``twice``: retain_graph, grads
    accumulate). engine: plain, region, checkpoint, dropin, torch (PyTorch's
    own SAC with the same policy). ``layout`` places the region engine's
    regions (see Program.body); ``replay_budget`` goes to the outermost
    region (the region and checkpoint engines). Policies made are appended to
    ``policies``."""
    policies = [] if policies is None else policies
    contexts = []

    def new_policy():
        policies.append(spec.make())
        return policies[-1]

    def region_block():
        if engine != "region":
            return contextlib.nullcontext()
        # The program enters it right away: outermost when no region is open.
        outermost = not torch_sac.region._stack()
        ctx = torch_sac.sac_context(
            new_policy(), replay_budget=replay_budget if outermost else None
        )
        contexts.append(ctx)
        return ctx

    vals = make_inputs(prog)
    ns = _namespace(meta=False)
    ns["gen"] = torch.Generator().manual_seed(1234)
    ns["_region"] = region_block
    for name in prog.closure_names:
        ns[name] = vals[name]
    exec(prog.compiled(layout if engine in ("plain", "region") else ("one",)), ns)
    fn = ns["program"]
    args = [vals[n] for n in prog.arg_names]
    torch.manual_seed(RUN_SEED)
    try:
        if engine == "plain":
            outs = fn(*args)
        elif engine == "region":
            if layout[0] == "one":
                with torch_sac.sac_context(new_policy(), replay_budget=replay_budget) as region:
                    outs = fn(*args)
                contexts.append(region)
            else:
                outs = fn(*args)
        elif engine == "checkpoint":
            outs = torch_sac.checkpoint(fn, *args, policy=new_policy(), replay_budget=replay_budget)
        elif engine == "dropin":
            policy = new_policy()

            def ctx_fn():
                pair = torch_sac.create_selective_checkpoint_contexts(policy)
                contexts.extend(pair)
                return pair

            outs = tc.checkpoint(fn, *args, use_reentrant=False, context_fn=ctx_fn)
        elif engine == "torch":
            # PyTorch's SAC only understands CheckpointPolicy values.
            policy = (
                BitsPolicy(spec.bits, "torch") if spec.kind == "bits" else new_policy().to_torch()
            )
            policies.append(policy)
            pol = policy
            ctx_fn = functools.partial(tc.create_selective_checkpoint_contexts, pol)
            outs = tc.checkpoint(fn, *args, use_reentrant=False, context_fn=ctx_fn)
        else:
            raise AssertionError(engine)
        del fn, ns
        g = torch.Generator().manual_seed(LOSS_SEED)
        loss = torch.zeros((), dtype=torch.float64)
        for o in outs:
            w = torch.randn(o.shape, generator=g, dtype=o.dtype)
            if o.requires_grad:
                loss = loss + (o * w).sum().double()
        if not loss.requires_grad:
            return None
        if twice:
            loss.backward(retain_graph=True)
        loss.backward()
    finally:
        interceptor_clean()
    leaves = [vals[n] for n, kind, *_ in prog.inputs if kind == "leaf"]
    stats = {}
    for c in contexts:
        for k, v in c.stats().items():
            stats[k] = stats.get(k, 0) + v
    return Run(
        loss.detach(),
        [o.detach().clone() for o in outs],
        [None if t.grad is None else t.grad.clone() for t in leaves],
        [vals[n].clone() for n, kind, *_ in prog.inputs if kind == "const"],
        torch.get_rng_state(),
        stats,
    )


def bitwise_equal(a, b):
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if torch.equal(a, b):
        return True
    if a.is_floating_point():  # NaNs from identical computations: compare bits
        ity = {torch.float64: torch.int64, torch.float32: torch.int32}[a.dtype]
        return torch.equal(a.contiguous().view(ity), b.contiguous().view(ity))
    return False


def differences(run, ref):
    """What differs between two runs: {item: description}; empty if bitwise equal."""
    diffs = {}

    def cmp(a, b, what):
        if not bitwise_equal(a, b):
            if a is None or b is None or a.shape != b.shape:
                diffs[what] = (
                    f"{what}: {None if a is None else tuple(a.shape)} vs "
                    f"{None if b is None else tuple(b.shape)}"
                )
            else:
                d = (a.double() - b.double()).abs().nan_to_num(nan=float("inf")).max().item()
                diffs[what] = f"{what}: max abs diff {d:.3g}"

    cmp(run.loss, ref.loss, "loss")
    for i, (a, b) in enumerate(zip(run.outputs, ref.outputs)):
        cmp(a, b, f"output {i}")
    for i, (a, b) in enumerate(zip(run.grads, ref.grads)):
        cmp(a, b, f"grad of leaf {i}")
    for i, (a, b) in enumerate(zip(run.consts, ref.consts)):
        cmp(a, b, f"outside constant {i} after the step")
    if not torch.equal(run.rng, ref.rng):
        diffs["rng"] = "global RNG state after the step"
    return diffs


# Documented region errors (sac_context docstring, README "Errors ...").
_SAVED_MUTATED = "an output the policy saved, which was modified in place"
_OUTSIDE_MUTATED = "a tensor from outside the sac_context region, which was modified in place"
# The drop-in refuses a region that reads an outside tensor and modifies it in
# place later (recompute would read the new value), even where PyTorch's SAC
# happens to get it right because the read's result is not needed.
_DROPIN_OUTSIDE_MUTATED = "read a tensor in forward that a later op of the checkpointed region"
_EXTRA_BACKWARD = "Trying to backward an extra time"


def _region_error_documented(err, prog, spec, policies, layout):
    msg = str(err)
    if _OUTSIDE_MUTATED in msg:
        # Writes the region records (in-place ops with grad enabled) to
        # tensors from outside it are replayed against a copy (README); only
        # a write it cannot see (under no_grad) to a tensor from outside the
        # region it runs in may make a replay fail.
        return prog.unseen_outside_write(layout)
    if _SAVED_MUTATED in msg:
        if spec.kind == "recompute_all" or not prog.written["inter"]:
            return False
        if spec.kind == "save_matmuls":
            return bool(prog.written["inter"] & prog.matmul_roots)
        if spec.kind == "bits":
            return any(p.saved_storages for p in policies)
        return True
    return False


def check_engine(prog, spec, engine, layout=("one",), twice=False, replay_budget=None):
    note(
        f"engine={engine} adapter={torch_sac.adapter()} policy={spec!r} "
        f"layout={layout} twice={twice} replay_budget={replay_budget}"
    )
    if layout[0] != "one":
        note("program as run by the region engine:\n" + prog.body(layout))
    try:
        ref = run_program(prog, "plain", layout=layout, twice=twice)
    except RuntimeError as e:
        event("rejected: plain autograd raises")
        note(f"plain raised: {e}")
        assume(False)
    assume(ref is not None)
    policies = []
    try:
        ours = run_program(prog, engine, spec, layout, twice, policies, replay_budget)
    except Exception as e:  # noqa: BLE001
        if engine in ("region", "checkpoint"):
            if isinstance(e, RuntimeError) and _region_error_documented(
                e, prog, spec, policies, layout
            ):
                event(f"{engine}: documented mutation error")
                return
            raise AssertionError(
                f"{engine} raised where plain autograd did not:\n{type(e).__name__}: {e}"
            ) from e
        # dropin: must raise exactly when PyTorch's SAC does.
        if (
            isinstance(e, RuntimeError)
            and _DROPIN_OUTSIDE_MUTATED in str(e)
            and prog.input_write_after_read()
        ):
            event("dropin: documented outside-mutation error")
            return
        try:
            run_program(prog, "torch", spec, twice=twice)
        except Exception as te:  # noqa: BLE001
            event("dropin: raises, as PyTorch's SAC does")
            note(f"torch SAC raised: {te}")
            return
        if (
            twice
            and _compat.TORCH_RELEASE < (2, 13)
            and isinstance(e, RuntimeError)
            and _EXTRA_BACKWARD in str(e)
        ):
            # PyTorch <= 2.12 keeps SAC's cache as one queue per op: a second
            # backward through a region takes the entries the first,
            # early-stopped recompute left (queued for later calls of the op,
            # so possibly another call's output) instead of raising. 2.13 keys
            # entries by call index and raises; the drop-in follows 2.13 on
            # every release. Its single backward must still check out.
            event("dropin: raises on a second backward, as PyTorch >= 2.13's SAC does")
            check_engine(prog, spec, engine, layout, twice=False)
            return
        raise AssertionError(
            f"dropin raised where PyTorch's SAC did not:\n{type(e).__name__}: {e}"
        ) from e
    replayed = ours.stats.get("replayed_ops", ours.stats.get("recomputed_ops"))
    if replayed is not None:
        event(f"{engine}: {'no' if replayed == 0 else 'some'} ops replayed/recomputed")
    diffs = differences(ours, ref)
    if not diffs:
        event(f"{engine}: equal to plain")
        return
    if engine == "dropin":
        try:
            theirs = run_program(prog, "torch", spec, twice=twice)
        except Exception as te:  # noqa: BLE001
            raise AssertionError(
                f"dropin differs from plain ({list(diffs.values())}) and PyTorch's SAC raises: {te}"
            ) from te
        # Each item equal to plain autograd's or to PyTorch's SAC's (the
        # drop-in keeps some of PyTorch's holes and closes others).
        vs_torch = differences(ours, theirs)
        if not set(diffs) & set(vs_torch):
            event("dropin: differs from plain only where PyTorch's SAC does too")
            return
        raise AssertionError(
            f"dropin differs from plain: {list(diffs.values())}; "
            f"from PyTorch's SAC: {list(vs_torch.values())}"
        )
    raise AssertionError(f"{engine} differs from plain autograd: {list(diffs.values())}")


# No budget, none at all (every rebuilt tensor is rebuilt again at its next
# unpack), budgets holding a few of the fuzzer's tensors, and budgets that
# also count the outputs the policy kept (a peak plan's).
REPLAY_BUDGETS = st.sampled_from(
    [None, 0, 200, 1000, torch_sac.ReplayBudget(200, True), torch_sac.ReplayBudget(1000, True)]
)

LAYOUTS = st.one_of(
    st.just(("one",)),
    st.tuples(st.just("two"), st.integers(0, 24)),
    st.tuples(st.just("nested"), st.integers(0, 24), st.integers(0, 24)),
)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ENGINES)
@PROFILE
@given(
    prog=programs(),
    spec=policy_specs(),
    layout=LAYOUTS,
    twice=st.booleans(),
    replay_budget=REPLAY_BUDGETS,
)
def test_fuzz_engine_matches_plain_autograd(engine, prog, spec, layout, twice, replay_budget):
    if engine != "region":
        layout = ("one",)  # regions placed inside the program: region engine only
    if engine == "dropin":
        # torch.utils.checkpoint restores only the default generators' state
        # for recompute (PyTorch does the same): ops drawing from an explicit
        # Generator are outside what the drop-in can reproduce.
        assume(not prog.uses_explicit_generator)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    offloading = (
        torch_sac.offload.using(cpu_stand_in=True, min_bytes=0, keep_last_bytes=0)
        if spec.flavour == "offload"
        else contextlib.nullcontext()
    )
    offloaded_before = torch_sac.offload.stats()["offloaded"]
    try:
        with offloading:
            check_engine(
                prog,
                spec,
                engine,
                layout,
                twice,
                replay_budget if engine in ("region", "checkpoint") else None,
            )
    finally:
        torch.set_num_threads(before)
    interceptor_clean()
    if spec.flavour == "offload":
        moved = torch_sac.offload.stats()["offloaded"] - offloaded_before
        # (No leak check here: a program's in-place write on a constant
        # keeps its graph, and the copies, alive as long as hypothesis keeps
        # the example; test_offload.py checks the pool after each test.)
        event(f"{engine}: offload policy, {'some' if moved else 'no'} storages offloaded")


# --------------------------------------------------------------------------
# Bugs the fuzzer found (fixed in 810e995): minimal repros
# --------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ["region", "checkpoint"])
def test_regression_region_outside_write_after_read(engine):
    """A dropped op read a tensor from outside the region, then an in-place
    op in the region wrote to it: the replay raised "a tensor from outside
    the sac_context region, which was modified in place" where plain
    autograd works."""

    def f(a, x):
        b = a + x  # dropped; its replay reads `a`
        a.add_(1.0)  # recorded in-place write to a tensor from outside the region
        return torch.sin(b)  # sin saves b

    def run(region):
        x = torch.randn(
            4,
            4,
            dtype=torch.float64,
            generator=torch.Generator().manual_seed(0),
            requires_grad=True,
        )
        a = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        if not region:
            out = f(a, x)
        elif engine == "region":
            with torch_sac.sac_context(torch_sac.policies.recompute_all()):
                out = f(a, x)
        else:
            out = torch_sac.checkpoint(f, a, x, policy=torch_sac.policies.recompute_all())
        out.sum().backward()
        return x.grad, a

    ref_grad, ref_a = run(False)
    try:
        grad, a = run(True)
    finally:
        interceptor_clean()
    assert torch.equal(grad, ref_grad) and torch.equal(a, ref_a)


def test_regression_region_mul_inplace_on_outside_tensor():
    """The same bug through autograd's clone of the original ``self`` before
    ``x.mul_(w)`` on a tensor from outside the region."""

    def run(region):
        x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        w = torch.randn(
            4,
            4,
            dtype=torch.float64,
            generator=torch.Generator().manual_seed(0),
            requires_grad=True,
        )
        policy = torch_sac.policies.recompute_all()
        with torch_sac.sac_context(policy) if region else contextlib.nullcontext():
            y = x.mul_(w)  # autograd clones x (for w's grad) before writing it
        y.sum().backward()
        return w.grad

    ref = run(False)
    try:
        assert torch.equal(run(True), ref)
    finally:
        interceptor_clean()


def test_regression_dropin_cached_random_op_then_invalidated_dropout():
    """Drop-in with save_all: rand_like was served from the cache in
    recompute (drawing nothing) while dropout's buffer, cached then written
    by bernoulli_, was recomputed: a different mask, silently wrong
    gradients (PyTorch's SAC raises here)."""

    def f(x):
        x * torch.rand_like(x)  # random op, cached by save_all (unused)
        return F.dropout(x, 0.25, training=True)  # empty_like (cached), then bernoulli_ writes it

    def run(ctx_fn):
        x = torch.randn(
            4,
            4,
            dtype=torch.float64,
            generator=torch.Generator().manual_seed(0),
            requires_grad=True,
        )
        torch.manual_seed(0)
        out = (
            f(x) if ctx_fn is None else tc.checkpoint(f, x, use_reentrant=False, context_fn=ctx_fn)
        )
        out.sum().backward()
        return x.grad

    ref = run(None)
    ctx_fn = functools.partial(
        torch_sac.create_selective_checkpoint_contexts, torch_sac.policies.save_all()
    )
    try:
        grad = run(ctx_fn)
    except RuntimeError:
        return  # raising, as PyTorch's SAC does, is fine
    finally:
        interceptor_clean()
    assert torch.equal(grad, ref)
