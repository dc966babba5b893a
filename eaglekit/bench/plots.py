"""PNG plots of an ``eaglekit bench`` report: speedup per method, acceptance per depth, speedup per category,
and (``batch_sizes=``) speedup vs batch size.

matplotlib is optional (``pip install 'eaglekit[bench]'``): without it each plot prints a note and
returns None. Files are written under a temporary name, then renamed.
"""
from __future__ import annotations

from pathlib import Path

from eaglekit.fileio import atomic_write


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install 'eaglekit[bench]'): no PNG written")
        return None
    return plt


def _title(report: dict) -> str:
    c = report["config"]
    return f"{c['target']} — {c['head'] or c['draft'] or 'no drafter'} — {c['dataset']}"


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    try:
        return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    finally:
        plt.close(fig)


def plot(report: dict, path: Path) -> Path | None:
    """Speedup vs plain per method, one bar per temperature, τ annotated."""
    plt = _pyplot()
    if plt is None:
        return None
    temps = list(report["results"])
    names = list(report["results"][temps[0]])
    fig, ax = plt.subplots(figsize=(1.6 * len(names) + 2, 4))
    width = 0.8 / len(temps)
    for j, temp in enumerate(temps):
        vals = [report["results"][temp][n]["speedup_vs_plain"] for n in names]
        bars = ax.bar([i + j * width for i in range(len(names))], vals, width, label=f"T={temp}")
        for b, n in zip(bars, names):
            tau = report["results"][temp][n]["tau"]
            if tau:
                ax.annotate(f"τ={tau:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                            va="bottom", fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([i + width * (len(temps) - 1) / 2 for i in range(len(names))], names, rotation=20)
    ax.set_ylabel("speedup vs plain (tokens/s ratio)")
    ax.set_title(_title(report), fontsize=9)
    ax.legend()
    return _save(plt, fig, path)


def plot_acceptance(report: dict, path: Path) -> Path | None:
    """``ours`` acceptance rate per draft depth (DecodeStats.acceptance_per_depth), a line per temperature."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.set_xticks(range(1, max(map(len, report["acceptance_per_depth"].values()), default=0) + 1))
    for temp, rates in report["acceptance_per_depth"].items():
        depths = [d for d, r in enumerate(rates, 1) if r is not None]  # None: no step reached that depth
        ax.plot(depths, [rates[d - 1] for d in depths], marker="o", label=f"T={temp}")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft depth d")
    ax.set_ylabel("P(depth d accepted | depth d-1 accepted)")
    ax.set_title(_title(report), fontsize=9)
    ax.legend()
    return _save(plt, fig, path)


def plot_categories(report: dict, path: Path) -> Path | None:
    """``ours`` speedup vs plain per prompt category, one bar group per temperature."""
    plt = _pyplot()
    if plt is None:
        return None
    per_temp = report["speedup_per_category"]
    temps = list(per_temp)
    cats = list(dict.fromkeys(c for t in temps for c in per_temp[t]))
    fig, ax = plt.subplots(figsize=(min(1.2 * len(cats) * len(temps) + 2, 14), 4))
    width = 0.8 / len(cats)
    for k, cat in enumerate(cats):
        xs = [j + k * width for j in range(len(temps))]
        ax.bar(xs, [per_temp[t].get(cat, 0.0) for t in temps], width, label=cat)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + width * (len(cats) - 1) / 2 for j in range(len(temps))], [f"T={t}" for t in temps])
    ax.set_ylabel("speedup vs plain (tokens/s ratio)")
    ax.set_title(_title(report), fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    return _save(plt, fig, path)


def plot_batch(report: dict, path: Path) -> Path | None:
    """Speedup over plain batched decoding vs batch size, a line per method and temperature: the decode phase
    (solid, τ annotated), end to end with the prefill (dashed), and the speedup expected from the measured
    acceptance and step costs (dotted)."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for temp, per_b in report["results"].items():
        sizes = [int(b) for b in per_b]
        for name in per_b[str(sizes[0])]:
            if name == "plain":
                continue
            rows = [per_b[str(b)][name] for b in sizes]
            line, = ax.plot(sizes, [r["decode_speedup_vs_plain"] for r in rows], marker="o", label=f"{name}, T={temp}")
            ax.plot(sizes, [r["speedup_vs_plain"] for r in rows], ls="--", color=line.get_color())
            ax.plot(sizes, [r["expected_speedup"] for r in rows], ls=":", color=line.get_color())
            for b, r in zip(sizes, rows):
                if r["tau"]:
                    ax.annotate(f"τ={r['tau']:.2f}", (b, r["decode_speedup_vs_plain"]), fontsize=6, ha="center",
                                va="bottom")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B (prompts decoded together)")
    ax.set_ylabel("speedup vs plain batched decoding")
    ax.set_title(_title(report) + "\nsolid: decode phase, dashed: with prefill, dotted: expected", fontsize=8)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)
