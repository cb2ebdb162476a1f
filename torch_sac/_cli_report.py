"""What ``python -m torch_sac`` (``cli.py``) prints and draws: the table
comparing the policies and the memory-time trade-off figure."""

from torch_sac._op_profile import format_bytes
from torch_sac._profile_report import agg_figure, format_flops, plot_timelines

__all__ = ["plot_tradeoff", "print_table"]


def print_table(results, names, out):
    base = results["none"]
    header = [
        "policy",
        "activations",
        "vs none",
        "saved vs none",
        "dropped (not held)",
        "peak",
        "step ms",
        "vs none",
        "replayed",
        "replay ms",
        "recompute FLOPs",
        "grad max|diff|",
    ]
    rows = [header]
    for n in names:
        r = results[n]
        flops = format_flops(r["recompute_flops"])
        if not r["recompute_flops_exact"]:
            flops = "~" + flops
        replayed = "-" if n in ("none", "torch_checkpoint") else str(r["replayed_ops"])
        replay = "-" if n in ("none", "torch_checkpoint") else f"{r['replay_ns'] / 1e6:.2f}"
        rows.append(
            [
                n,
                format_bytes(r["activation_bytes"]),
                f"{r['activation_bytes'] / base['activation_bytes']:.2f}x",
                format_bytes(r["saved_vs_none_bytes"]),
                format_bytes(r["dropped_bytes"]),
                format_bytes(r["peak_bytes"]),
                f"{r['step_ms_median']:.1f}",
                f"{r['step_ms_median'] / base['step_ms_median']:.2f}x",
                replayed,
                replay,
                flops,
                ("0 (bitwise)" if r["grad_bitwise_equal"] else f"{r['grad_max_abs_diff']:.2g}"),
            ]
        )
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    out("")
    for i, row in enumerate(rows):
        out(
            "  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])])
        )
        if i == 0:
            out("  ".join("-" * w for w in widths))
    for line in (
        "activations: bytes live at the end of forward minus before it; saved vs none: none's "
        "activations minus the policy's",
        "dropped (not held): bytes of outputs the regions did not hold (- without regions); not a "
        "saving: autograd would not have kept all of them",
        "peak: over forward + backward; step: median wall time of forward + backward",
        "recompute FLOPs: matmul/attention FLOPs replayed (~: estimated from per-op replay counts), "
        "for torch_checkpoint the extra backward FLOPs",
    ):
        out(line)


def plot_tradeoff(results, names, profiles, path, args=None):
    """Left: step time against activation memory per policy. Right: memory
    over the profiled step, every policy."""
    fig = agg_figure(figsize=(13, 5))
    ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.4]})
    for n in names:
        r = results[n]
        x = r["activation_bytes"] / 2**20
        y = r["step_ms_median"]
        ax1.scatter([x], [y], s=40, zorder=3)
        ax1.annotate(n, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax1.set_xlabel("activation memory (MiB)")
    ax1.set_ylabel("step time, median (ms)")
    title = "Memory-time trade-off"
    if args is not None:
        title += f" (TinyGPT {args.blocks}x{args.dim}, seq {args.seq}, batch {args.batch})"
    ax1.set_title(title, fontsize=10)
    ax1.grid(alpha=0.3)
    shown = [n for n in names if n in ("none", "recompute_all", "save_matmuls")]
    budgets = [n for n in names if n.startswith("budget-")]
    if budgets:
        shown.append(budgets[len(budgets) // 2])
    shown += [n for n in names if n.startswith("peak-")][:1]  # with its replay-budget line
    shown = shown or names[:4]
    plot_timelines(ax2, {n: profiles[n].to_dict() for n in shown}, highlight=None)
    ax2.set_title("Memory over one profiled step (per-op sampling slows it down)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
