"""What a finished ``torch_sac.profile`` shows: its text table and its
figures (matplotlib, Agg backend), from the plain data of
:meth:`torch_sac.profile.to_dict`; used by the profile and by ``python -m
torch_sac`` (``cli.py``)."""

from ._engines import ENGINES, REGION
from ._op_profile import format_bytes

__all__ = ["agg_figure", "format_flops", "format_table", "plot_kept_dropped", "plot_timelines"]


def _ms(ns):
    return "-" if ns is None else f"{ns / 1e6:.2f} ms"


def format_flops(f):
    if f is None:
        return "-"
    for unit, scale in (("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(f) >= scale:
            return f"{f / scale:.3g} {unit}"
    return f"{f:.0f} FLOP"


def format_table(data, max_rows, sort_by):
    t = data["totals"]
    lines = []
    title = "torch_sac.profile" + (f" [{data['label']}]" if data["label"] else "")
    by_engine = {e: sum(r.get("engine") == e for r in data["regions"]) for e in ENGINES}
    regions = f"{t['regions']} region(s)"
    if t["regions"]:
        regions += " (engine: " + ", ".join(f"{n} {e}" for e, n in by_engine.items() if n) + ")"
    lines.append(f"{title}: {regions}, device {data['device']}, adapter {data['adapter']}")
    rows = [
        r
        for r in data["ops"]
        if r["saved"]
        or r["dropped"]
        or r["replayed"]
        or r.get("copy_ns")
        or r.get("waited_ns")
        or r.get("kept_anyway")
    ]
    hidden = len(data["ops"]) - len(rows)
    keys = {
        "bytes": lambda r: -(r["saved_bytes"] + r["dropped_bytes"]),
        "replay_ns": lambda r: -r["replay_ns"],
        "replayed": lambda r: -r["replayed"],
    }
    if sort_by in keys:
        rows = sorted(rows, key=keys[sort_by])
    shown = rows if max_rows is None else rows[:max_rows]
    flops = t["forward_flops"] is not None
    if not data["ops"]:
        lines.append(
            "no sac_context region or drop-in context was entered while profiling: no per-op rows "
            "(memory, time and FLOP totals below cover the whole block)"
        )
    else:
        # Multiple recomputation (a replay budget or schedule): the most
        # times one call was replayed, per op.
        most = any(r.get("most_replays", 0) > 1 for r in data["ops"])
        offloads = any(
            r.get("offloaded") or r.get("copy_ns") or r.get("waited_ns") for r in data["ops"]
        )
        header = ["op", "saved", "dropped", "kept", "dropped", "replayed"]
        units = ["", "calls", "calls", "bytes", "bytes", ""]
        kept_anyway = [r for r in data["ops"] if r.get("kept_anyway")]
        if kept_anyway:
            header[5:5] = ["kept anyway"]
            units[5:5] = ["bytes"]
        if offloads:
            header[3:3] = ["offloaded", "offloaded", "copies", "waited"]
            units[3:3] = ["calls", "bytes", "", "(exposed)"]
        if most:
            header.append("most")
            units.append("per call")
        header.append("replay time")
        units.append("")
        if flops:
            header.append("replay FLOPs")
            units.append("")
        table = [header, units]

        def fmt(r):
            cells = [
                r["op"],
                str(r["saved"]),
                str(r["dropped"]),
                format_bytes(r["saved_bytes"]),
                format_bytes(r["dropped_bytes"]),
                str(r["replayed"]),
            ]
            if kept_anyway:
                cells[5:5] = [format_bytes(r.get("kept_anyway_bytes", 0))]
            if offloads:
                cells[3:3] = [
                    str(r["offloaded"]),
                    format_bytes(r["offloaded_bytes"]),
                    _ms(r.get("copy_ns", 0)),
                    _ms(r.get("waited_ns", 0)),
                ]
            if most:
                cells.append(str(r["most_replays"]) if "most_replays" in r else "")
            cells.append(_ms(r["replay_ns"]))
            if flops:
                est = format_flops(r["replay_flops"])
                cells.append(est if r["replay_flops_exact"] else "~" + est)
            return cells

        table += [fmt(r) for r in shown]
        total = {
            "op": "total",
            "saved": t["saved_ops"],
            "dropped": t["dropped_ops"],
            "saved_bytes": t["saved_bytes"],
            "dropped_bytes": t["dropped_bytes"],
            "kept_anyway_bytes": sum(r.get("kept_anyway_bytes", 0) for r in data["ops"]),
            "offloaded": t.get("offloaded_ops", 0),
            "offloaded_bytes": t.get("offloaded_bytes", 0),
            "copy_ns": sum(r.get("copy_ns", 0) for r in data["ops"]),
            "waited_ns": sum(r.get("waited_ns", 0) for r in data["ops"]),
            "replayed": t["replayed_ops"],
            "replay_ns": t["replay_ns"],
            "replay_flops": t["replay_flops"],
            "replay_flops_exact": t["replay_flops_exact"],
        }
        table.append(fmt(total))
        widths = [max(len(r[c]) for r in table) for c in range(len(header))]
        out = []
        for i, r in enumerate(table):
            cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
            out.append("  ".join(cells).rstrip())
            if i == 1 or i == len(table) - 2:
                out.append("  ".join("-" * w for w in widths))
        lines += out
        notes = []
        if len(shown) < len(rows):
            notes.append(f"{len(rows) - len(shown)} more op rows not shown")
        if hidden:
            notes.append(
                f"{hidden} ops that allocated nothing and were never replayed (views) not shown"
            )
        if notes:
            lines.append("(" + "; ".join(notes) + ")")
        for r in kept_anyway:
            lines.append(
                f"kept anyway: {r['op']}: {r['kept_anyway']} saved tensors, "
                f"{format_bytes(r['kept_anyway_bytes'])}, that the policy would recompute: "
                f"{r['kept_why']}"
            )
    lines.append(
        f"memory:  activations {format_bytes(t['activation_bytes'])} (allocated in forward, "
        f"still live at its end{'' if t['activation_bytes'] is not None else ': forward end unknown, call end_forward()'}), "
        f"peak {format_bytes(t['peak_bytes'])} (forward {format_bytes(t['forward_peak_bytes'])}, "
        f"backward {format_bytes(t['backward_peak_bytes'])}), left at exit {format_bytes(t['end_bytes'])}"
    )
    if data["ops"]:
        lines.append(
            f"regions: {t['policy_calls']} policy calls; kept {format_bytes(t['saved_bytes'])} "
            f"({t['saved_ops']} ops), dropped {format_bytes(t['dropped_bytes'])} ({t['dropped_ops']} ops)"
            + (
                f", offloaded {format_bytes(t['offloaded_bytes'])} ({t['offloaded_ops']} ops)"
                if t.get("offloaded_ops")
                else ""
            )
            + (
                f"; autograd saved {t['packed_kept']} tensors as is and {t['packed_dropped']} as "
                "references"
                if by_engine[REGION]
                else ""
            )
            + (f"; held copies {format_bytes(t['held_bytes'])}" if t["held_bytes"] else "")
        )
    off = t.get("offload")
    if off:
        lines.append(
            f"offload: {format_bytes(off['offloaded_bytes'])} copied to host memory, "
            f"{format_bytes(off['reloaded_bytes'])} back ({off['prefetched']} ahead of use, "
            f"{off['late']} late: {format_bytes(off['late_bytes'])}), "
            + (
                f"copies {_ms(off['d2h_copy_ns'] + off['h2d_copy_ns'])}, compute waited "
                f"{_ms(off['waited_ns'])} for them, "
                if "waited_ns" in off
                else ""
            )
            + f"{format_bytes(off['kept_last_bytes'])} kept on the device (used first in "
            f"backward); host pool peak {format_bytes(off['host_peak_bytes'])}; device memory "
            f"held by copies: {format_bytes(off['peak_copying_bytes'])} to host, "
            f"{format_bytes(off['peak_prefetched_bytes'])} prefetched (peaks)"
        )
    lines.append(
        f"time:    step {_ms(t['step_ns'])} (forward {_ms(t['forward_ns'])}, backward "
        f"{_ms(t['backward_ns'])}); replay {_ms(t['replay_ns'])} ({t['replayed_ops']} ops); "
        f"recording overhead {_ms(t['record_ns'])}"
        + (
            "; per-op sampling adds Python time to the step"
            if data["timeline_sampling"] == "op"
            else ""
        )
    )
    if flops:
        replay = format_flops(t["replay_flops"])
        if not t["replay_flops_exact"]:
            replay = (
                f"~{replay} (estimate: {format_flops(t['replay_flops_low'])} to "
                f"{format_flops(t['replay_flops_high'])})"
            )
        pct = ""
        if t["region_forward_flops"]:
            pct = f", {100.0 * t['replay_flops'] / t['region_forward_flops']:.0f}% of the regions' forward"
        lines.append(
            f"FLOPs:   forward {format_flops(t['forward_flops'])}, backward "
            f"{format_flops(t['backward_flops'])}, replayed {replay}{pct}"
        )
    return "\n".join(lines)


def agg_figure(**kwargs):
    """A matplotlib Figure rendered by Agg, without pyplot: nothing global
    (the user's backend, open figures) is touched and no window opens."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "torch_sac.profile.plot needs matplotlib: pip install matplotlib "
            "(or pip install -r requirements-dev.txt)"
        ) from e
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _mib(values):
    return [v / 2**20 for v in values]


def plot_timelines(ax, curves, highlight):
    """Memory against time, one curve per finished profile's data. The
    ``highlight`` curve is drawn thicker, with its regions shaded; op-level
    peaks are drawn thin when there are at most two curves."""
    peaks = len(curves) <= 2
    for name, data in curves.items():
        tl = data["timeline"]
        t_ms = [t / 1e6 for t in tl["t_ns"]]
        width = 2.0 if name == highlight or name == "none" else 1.3
        (line,) = ax.plot(t_ms, _mib(tl["bytes"]), lw=width, label=name, drawstyle="steps-post")
        if any(tl.get("host_bytes") or ()):
            # Offloaded activations: host memory, beside the device's.
            ax.plot(
                t_ms,
                _mib(tl["host_bytes"]),
                lw=1,
                ls="--",
                color=line.get_color(),
                label=f"{name}: host (offloaded)",
                drawstyle="steps-post",
            )
        if peaks and data["timeline_sampling"] == "op":
            ax.plot(t_ms, _mib(tl["peak_bytes"]), lw=0.6, color=line.get_color(), alpha=0.45)
        fe = data["forward_end"]
        if fe is not None:
            ax.axvline(t_ms[fe["sample"]], color=line.get_color(), ls=":", lw=1)
            # Rebuilt tensors held in backward stay under the budgets: above
            # what forward left, memory for them stays below this. A budget
            # that counts saved outputs includes what its region left.
            budgets = [
                max(r["replay_budget"] - (r.get("forward_delta_bytes") or 0), 0)
                if r.get("replay_budget_counts_saved")
                else r["replay_budget"]
                for r in data["regions"]
                if r.get("replay_budget") is not None
            ]
            if budgets:
                level = tl["bytes"][fe["sample"]] + sum(budgets)
                ax.axhline(
                    level / 2**20,
                    color=line.get_color(),
                    ls="--",
                    lw=1,
                    label=f"{name}: forward end + replay budget",
                )
        if name == highlight:
            for r in data["regions"]:
                if r["exit_sample"] is not None:
                    ax.axvspan(
                        t_ms[r["enter_sample"]],
                        t_ms[r["exit_sample"]],
                        color=line.get_color(),
                        alpha=0.07,
                        lw=0,
                    )
    what = ["dotted: end of forward"]
    if highlight is not None and curves.get(highlight, {}).get("regions"):
        what.append("shaded: regions")
    ax.set_xlabel(f"time since step start (ms; {', '.join(what)})")
    ax.set_ylabel("tensor memory above start (MiB)")
    ax.set_title("Memory over the step" + (" (thin: peak within each op)" if peaks else ""))
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)


def plot_kept_dropped(ax, data, max_ops=20):
    rows = [r for r in data["ops"] if r["saved_bytes"] or r["dropped_bytes"]]
    rows = sorted(rows, key=lambda r: -(r["saved_bytes"] + r["dropped_bytes"]))[:max_ops]
    rows.reverse()
    names = [r["op"].replace("aten::", "") for r in rows]
    kept = [r["saved_bytes"] / 2**20 for r in rows]
    dropped = [r["dropped_bytes"] / 2**20 for r in rows]
    y = range(len(rows))
    ax.barh(y, kept, color="tab:blue", label="kept (saved)")
    ax.barh(y, dropped, left=kept, color="tab:orange", label="dropped (recompute)")
    ax.set_yticks(list(y))
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlabel("MiB (new outputs, summed over regions)")
    ax.set_title("Bytes kept vs dropped per op")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="x", alpha=0.3)
