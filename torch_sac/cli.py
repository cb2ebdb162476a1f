"""``python -m torch_sac``: one training step of a GPT-style model under
several checkpointing policies, profiled side by side.
(``python -m torch_sac frontier``: the trade-off curve of such a step, see
``torch_sac._cli_frontier``.)

For every policy the step (forward + backward, no optimizer) runs on the
same batch with the same dropout seed: a warm-up, ``--steps`` timed steps
(variants interleaved round robin, so machine load hits all alike) and one
step with per-op memory sampling and FLOP counting (``torch_sac.profile``).
The table compares activation memory (bytes live at the end of forward minus
before it), the memory each policy saved against no checkpointing (``none``'s
activations minus the policy's), the bytes the regions dropped (outputs they
did not hold: not a saving, since autograd would not have kept all of them),
peak memory over the step, the median step time, what backward replayed and
the gradients against the run without checkpointing.

Policies (``--policies``, comma-separated):

* ``none``: no checkpointing (the reference; always run);
* ``torch_checkpoint``: ``torch.utils.checkpoint`` per block (full recompute);
* ``recompute_all``, ``save_matmuls``: ``torch_sac.sac_context`` per block
  with that built-in policy;
* ``budget-F``: ``torch_sac.policies.budget_for_region(block, (x,), fraction=F)`` planned
  on the first block (every block has the same structure and shapes) and
  used as the region policy for every block. ``F`` is a fraction of one
  block's un-checkpointed activation memory.

* ``peak-F``: one ``sac_context`` around the whole step (model and loss)
  with the peak plan ``torch_sac.policies.plan_peak(step, peak_bytes=F *
  peak(none))``: what forward keeps and how backward rebuilds, multiple
  recomputation included, for the measured peak of the step. The check
  printed for it is ``peak(peak-F) <= F * peak(none)``; a fraction below
  the least peak the planner measured is reported and skipped.

The budget bounds what each region keeps; the check printed for it is
``activations(budget-F) <= activations(recompute_all) + blocks * budget``:
what checkpointing keeps anyway (block inputs, un-checkpointed embedding,
head and loss, what recompute_all's replays need) plus at most the budget
per region.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import torch_sac
from torch_sac._cli_frontier import add_model_arguments
from torch_sac._cli_frontier import main as frontier_main
from torch_sac._cli_report import plot_tradeoff, print_table
from torch_sac._op_profile import format_bytes
from torch_sac.models import TinyGPT

__all__ = ["main", "run"]

DEFAULT_POLICIES = (
    "none",
    "torch_checkpoint",
    "recompute_all",
    "save_matmuls",
    "budget-0.25",
    "budget-0.5",
    "budget-0.75",
    "peak-0.4",
)
_FIXED = {
    "none": "no checkpointing",
    "torch_checkpoint": "torch.utils.checkpoint (full recompute)",
    "recompute_all": "sac_context(recompute_all)",
    "save_matmuls": "sac_context(save_matmuls)",
}


def _parse_policies(text):
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no policy given")
    out = []
    for n in names:
        if n.startswith("budget-"):
            try:
                f = float(n[len("budget-") :])
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"bad budget policy {n!r}: use budget-F, e.g. budget-0.5"
                )
            if not (f >= 0):
                raise argparse.ArgumentTypeError(f"bad budget fraction in {n!r}: must be >= 0")
        elif n.startswith("peak-"):
            try:
                f = float(n[len("peak-") :])
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"bad peak policy {n!r}: use peak-F, e.g. peak-0.5"
                )
            if not (0 < f):
                raise argparse.ArgumentTypeError(f"bad peak fraction in {n!r}: must be > 0")
        elif n not in _FIXED:
            raise argparse.ArgumentTypeError(
                f"unknown policy {n!r}; choose from {', '.join(_FIXED)}, budget-F or peak-F"
            )
        if n not in out:
            out.append(n)
    return out


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m torch_sac",
        description="Profile one training step of a GPT-style model under several "
        "activation-checkpointing policies: memory, time, recompute, gradients.",
        epilog="Policies: none, torch_checkpoint, recompute_all, save_matmuls, budget-F "
        "(F: fraction of a block's un-checkpointed activation memory), peak-F (one region "
        "around the step, planned for F times the step's peak without checkpointing). "
        "Example: python -m torch_sac --blocks 2 --policies none,save_matmuls,budget-0.5",
    )
    add_model_arguments(p, blocks=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps per policy (default 5)")
    p.add_argument(
        "--policies",
        type=_parse_policies,
        default=list(DEFAULT_POLICIES),
        help="comma-separated subset (default: all of " + ",".join(DEFAULT_POLICIES) + ")",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: timings do not depend on core contention)",
    )
    p.add_argument(
        "--plot",
        default="sac_tradeoff.png",
        help="memory-time trade-off plot (PNG; default sac_tradeoff.png)",
    )
    p.add_argument("--no-plot", action="store_true", help="do not write the plot")
    p.add_argument(
        "--json", default=None, help="also write all results (and per-policy profiles) here"
    )
    p.add_argument(
        "--details",
        default=None,
        help="print the per-op profile table of this policy (default: the middle budget, "
        "else save_matmuls); 'none' to skip",
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def _check_args(p, args):
    for name in ("blocks", "dim", "heads", "seq", "batch", "vocab", "steps", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.dim % args.heads:
        p.error(f"--dim ({args.dim}) must be divisible by --heads ({args.heads})")
    if not 0 <= args.dropout < 1:
        p.error("--dropout must be in [0, 1)")


class _Setup:
    """The model, a batch and how to run one block under each policy."""

    def __init__(self, args):
        torch.manual_seed(args.seed)
        self.model = TinyGPT(
            vocab=args.vocab,
            dim=args.dim,
            heads=args.heads,
            depth=args.blocks,
            dropout=args.dropout,
        )
        g = torch.Generator().manual_seed(args.seed + 1)
        self.tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        self.targets = self.tokens.roll(-1, 1)
        self.blocks = args.blocks
        self.dropout_seed = args.seed + 2
        self.plans = {}
        self.peak_plans = {}
        self._plain_peak = None

    def block_input(self):
        with torch.no_grad():
            x = self.model.embed(self.tokens)
        return x.requires_grad_(True)

    def plan(self, fraction):
        if not self.plans:
            block = self.model.blocks[0]
            self._base_plan = torch_sac.policies.budget_for_region(
                block, (self.block_input(),), fraction=fraction
            )
            self.plans[fraction] = self._base_plan
        if fraction not in self.plans:
            self.plans[fraction] = self._base_plan.with_budget(fraction=fraction)
        return self.plans[fraction]

    def loss(self, wrap=None):
        logits = self.model(self.tokens, wrap)
        return F.cross_entropy(logits.flatten(0, 1), self.targets.flatten())

    def peak_plan(self, fraction):
        """The peak plan for ``fraction`` of the step's peak without
        checkpointing (a torch_sac.PeakPlan), or the planner's ValueError."""
        if fraction not in self.peak_plans:
            if self._plain_peak is None:
                self._plain_peak = torch_sac.policies.plan_peak(
                    self.loss, peak_bytes=1 << 62
                ).no_checkpoint_peak
            try:
                self.peak_plans[fraction] = torch_sac.policies.plan_peak(
                    self.loss, peak_bytes=int(fraction * self._plain_peak)
                )
            except ValueError as e:
                self.peak_plans[fraction] = e
        return self.peak_plans[fraction]

    def wrapper(self, name):
        if name == "none":
            return None
        if name.startswith("peak-"):
            return _WholeStep(self.peak_plan(float(name[len("peak-") :])))
        if name == "torch_checkpoint":
            return lambda block, x: checkpoint(block, x, use_reentrant=False)
        if name == "recompute_all":
            policy = torch_sac.policies.recompute_all()
        elif name == "save_matmuls":
            policy = torch_sac.policies.save_matmuls()
        else:
            policy = self.plan(float(name[len("budget-") :]))

        def wrap(block, x):
            with torch_sac.sac_context(policy):
                return block(x)

        return wrap

    def step(self, wrap, *, timeline, label=None):
        """One forward + backward under a profile; returns (profile, grads)."""
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(self.dropout_seed)
        with torch_sac.profile(timeline=timeline, flops=timeline, label=label) as prof:
            if isinstance(wrap, _WholeStep):
                with torch_sac.sac_context(wrap.plan):
                    loss = self.loss()
            else:
                loss = self.loss(wrap)
            prof.end_forward()
            loss.backward()
            del loss
        grads = [p.grad for p in self.model.parameters()]
        return prof, grads


class _WholeStep:
    """A peak plan: one region around the whole step, not a per-block wrap."""

    def __init__(self, plan):
        self.plan = plan


def _grad_diff(grads, ref):
    worst, bitwise = 0.0, True
    for g, r in zip(grads, ref):
        if g is None or r is None:
            if (g is None) != (r is None):
                return float("inf"), False
            continue
        if not torch.equal(g, r):
            bitwise = False
            worst = max(worst, (g.double() - r.double()).abs().max().item())
    return worst, bitwise


def run(args: argparse.Namespace, out: Callable[[str], object] = print) -> dict[str, Any]:
    """Runs the comparison for parsed ``args``; returns the results dict."""
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, out)
    finally:
        torch.set_num_threads(threads)


def _run(args, out):
    torch_sac.memory.install_counting_allocator()
    names = list(args.policies)
    notes = []
    if "none" not in names:
        names.insert(0, "none")
        notes.append("added 'none': the reference for ratios and gradients")
    budgets = [n for n in names if n.startswith("budget-")]
    if budgets and "recompute_all" not in names:
        names.insert(1, "recompute_all")
        notes.append("added 'recompute_all': the reference for the budget bound")
    setup = _Setup(args)
    wraps = {n: setup.wrapper(n) for n in names}  # plans the budgets (one profiling run)
    for n in [n for n in names if n.startswith("peak-")]:
        if isinstance(wraps[n].plan, ValueError):
            notes.append(f"skipped {n}: {str(wraps[n].plan).split(': ', 1)[1]}")
            names.remove(n)
            del wraps[n]
    peaks = [n for n in names if n.startswith("peak-")]

    out(
        f"torch {torch.__version__}, torch_sac adapter {torch_sac.adapter()}, {args.threads} thread(s); "
        f"TinyGPT: {args.blocks} blocks, dim {args.dim}, {args.heads} heads, seq {args.seq}, "
        f"batch {args.batch}, vocab {args.vocab}, dropout {args.dropout}"
    )
    for note in notes:
        out(f"note: {note}")

    started = time.perf_counter()
    results = {n: {"policy": n, "step_ns": []} for n in names}
    for n in names:  # warm-up
        setup.step(wraps[n], timeline=False)
    for _ in range(args.steps):
        for n in names:
            prof, _ = setup.step(wraps[n], timeline=False)
            t = prof.totals
            r = results[n]
            r["step_ns"].append(t["step_ns"])
            r["activation_bytes"] = t["activation_bytes"]
            r["peak_bytes"] = t["peak_bytes"]
            # Outputs the regions did not hold; None without regions.
            r["dropped_bytes"] = t["dropped_bytes"] if t["regions"] else None
    profiles = {}
    ref_grads = None
    for n in names:
        prof, grads = setup.step(wraps[n], timeline=True, label=n)
        profiles[n] = prof
        grads = [None if g is None else g.clone() for g in grads]
        if n == "none":
            ref_grads = grads
        r = results[n]
        r["grad_max_abs_diff"], r["grad_bitwise_equal"] = _grad_diff(grads, ref_grads)
        t = prof.totals
        r["replayed_ops"] = t["replayed_ops"]
        r["replay_ns"] = t["replay_ns"]
        r["record_ns"] = t["record_ns"]
        r["forward_flops"] = t["forward_flops"]
        r["backward_flops"] = t["backward_flops"]
        # Memory does not depend on the sampling (it allocates no tensors).
        r["sampled_activation_bytes"] = t["activation_bytes"]
        r["sampled_peak_bytes"] = t["peak_bytes"]
    base = profiles["none"].totals
    for n in names:
        r, t = results[n], profiles[n].totals
        r["step_ms_median"] = statistics.median(r["step_ns"]) / 1e6
        # What checkpointing saved: no checkpointing's activations minus this
        # policy's (unlike dropped_bytes, a real saving).
        r["saved_vs_none_bytes"] = results["none"]["activation_bytes"] - r["activation_bytes"]
        if n == "torch_checkpoint":
            # Its recompute re-runs the blocks in backward, where the profile
            # counts it: the extra backward FLOPs are the recompute.
            r["recompute_flops"], r["recompute_flops_exact"] = (
                t["backward_flops"] - base["backward_flops"],
                True,
            )
        else:
            r["recompute_flops"], r["recompute_flops_exact"] = (
                t["replay_flops"],
                t["replay_flops_exact"],
            )
    for n in budgets:
        plan = setup.plan(float(n[len("budget-") :]))
        bound = results["recompute_all"]["activation_bytes"] + setup.blocks * plan.budget_bytes
        results[n]["budget"] = {
            "fraction": plan.fraction,
            "budget_bytes_per_block": plan.budget_bytes,
            "planned_bytes_per_block": plan.saved_bytes,
            "block_activation_bytes": plan.activation_bytes,
            "saved_calls_per_block": len(plan.chosen),
            "solver": plan.solver,
            "optimal": plan.optimal,
            "bound_bytes": bound,
            "within_bound": results[n]["activation_bytes"] <= bound,
        }
    for n in peaks:
        plan = wraps[n].plan
        results[n]["peak_plan"] = {
            "fraction": float(n[len("peak-") :]),
            "peak_budget_bytes": plan.peak_bytes,
            "planned_peak_bytes": plan.measured_peak,
            "replay_budget_bytes": plan.replay_budget.bytes if plan.replay_budget else None,
            "saved_calls": None if plan.saved is None else len(plan.saved),
            "dropped_calls": plan.dropped_ops,
            "blocks": plan.blocks,
            "headline": plan.headline(),
            "solver": plan.solver,
            "optimal": plan.optimal,
            "planning_runs": plan.planning_runs,
            "within_bound": results[n]["peak_bytes"] <= plan.peak_bytes,
        }
    elapsed = time.perf_counter() - started

    print_table(results, names, out)
    if budgets:
        out("")
        out(
            "budget plans (per block; one plan for every block) and the bound "
            "activations <= activations(recompute_all) + blocks x budget:"
        )
        for n in budgets:
            b = results[n]["budget"]
            out(
                f"  {n:<13} budget {format_bytes(b['budget_bytes_per_block'])} of "
                f"{format_bytes(b['block_activation_bytes'])}: saves {b['saved_calls_per_block']} op calls, "
                f"{format_bytes(b['planned_bytes_per_block'])} ({b['solver']}"
                f"{', optimal' if b['optimal'] else ''}); measured "
                f"{format_bytes(results[n]['activation_bytes'])} <= {format_bytes(b['bound_bytes'])}: "
                f"{'ok' if b['within_bound'] else 'EXCEEDED'}"
            )
    if peaks:
        out("")
        out(
            "peak plans (one region around the step: model and loss) and the bound "
            "peak <= F x peak(none):"
        )
        for n in peaks:
            b = results[n]["peak_plan"]
            out(
                f"  {n:<13} {b['headline']}"
                + (
                    f", backward holds at most {format_bytes(b['replay_budget_bytes'])}"
                    if b["replay_budget_bytes"] is not None
                    else ""
                )
                + f" ({b['solver']}"
                f"{', optimal' if b['optimal'] else ''}; {b['planning_runs']} planning runs); "
                f"measured peak {format_bytes(results[n]['peak_bytes'])} <= "
                f"{format_bytes(b['peak_budget_bytes'])}: "
                f"{'ok' if b['within_bound'] else 'EXCEEDED'}"
            )
    details = args.details
    if details is None:
        details = (
            budgets[len(budgets) // 2]
            if budgets
            else ("save_matmuls" if "save_matmuls" in names else "none")
        )
    if details != "none":
        if details not in profiles:
            out(f"\n--details {details}: not among the policies run")
        else:
            out(f"\nper op, {details} (profiled step):")
            out(profiles[details].table(max_rows=10))
    ok = (
        all(r["grad_bitwise_equal"] for r in results.values())
        and all(results[n]["budget"]["within_bound"] for n in budgets)
        and all(results[n]["peak_plan"]["within_bound"] for n in peaks)
    )
    out("")
    out(
        f"gradients bitwise equal to no checkpointing for every policy: "
        f"{all(r['grad_bitwise_equal'] for r in results.values())}"
        + (
            f"; budget bounds hold: {all(results[n]['budget']['within_bound'] for n in budgets)}"
            if budgets
            else ""
        )
        + (
            f"; peak bounds hold: {all(results[n]['peak_plan']['within_bound'] for n in peaks)}"
            if peaks
            else ""
        )
        + f" ({elapsed:.1f} s)"
    )
    data = {
        "config": {
            k: getattr(args, k)
            for k in (
                "blocks",
                "dim",
                "heads",
                "seq",
                "batch",
                "vocab",
                "dropout",
                "steps",
                "threads",
                "seed",
            )
        },
        "torch": torch.__version__,
        "adapter": torch_sac.adapter(),
        "policies": names,
        "results": [results[n] for n in names],
        "ok": ok,
    }
    if not args.no_plot:
        path = plot_tradeoff(results, names, profiles, args.plot, args)
        out(f"plot: {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(data, profiles={n: p.to_dict() for n, p in profiles.items()}), f, indent=1
            )
            f.write("\n")
        out(f"json: {args.json}")
    data["profiles"] = profiles
    return data


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["frontier"]:
        return frontier_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    data = run(args)
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
