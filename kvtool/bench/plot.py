"""The Pareto plot: ratio against single-thread compression speed, one panel per cache file.

Each recipe is a labelled point; the recipes no other beats on both axes are
joined by a line; the order-0 limits of the data are dashed lines. Needs
matplotlib (extra ``kvtool[bench]``); drawn with the Agg backend, to a PNG.
"""

from __future__ import annotations

from pathlib import Path

from kvtool.bench.bounds import LABELS
from kvtool.bench.matrix import OK, Report
from kvtool.bench.recipes import BASELINES
from kvtool.bench.report import label
from kvtool.errors import UnavailableError

SHOWN_LIMITS = ("byte_planes", "sign_exp_per_channel", "fields_per_channel")


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats in both speed and ratio, fastest first."""
    front, best_ratio = [], float("-inf")
    for speed, ratio in sorted(points, key=lambda p: (-p[0], -p[1])):
        if ratio > best_ratio:
            front.append((speed, ratio))
            best_ratio = ratio
    return front


def require_matplotlib():
    """matplotlib, or ``UnavailableError`` saying how to get it (checked before a long run, not after)."""
    try:
        import matplotlib
    except ImportError:
        raise UnavailableError("the plot needs matplotlib: pip install 'kvtool[bench]'") from None
    return matplotlib


def plot(report: Report, out: Path) -> None:
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    files = report.files
    fig, axes = plt.subplots(1, len(files), figsize=(7.5 * len(files), 6.5), squeeze=False, sharey=True)
    for ax, file in zip(axes[0], files):
        ok = [r for r in file.results if r.status == OK]
        for i, r in enumerate(ok):
            x, y = r.compress_mbps["1"], r.ratio
            baseline = r.recipe in BASELINES
            ax.scatter([x], [y], s=36, color="0.55" if baseline else "C0", zorder=3)
            ax.annotate(label(r), (x, y), xytext=(5, 6 if i % 2 else -11), textcoords="offset points",
                        fontsize=7, color="0.35" if baseline else "black")
        front = pareto([(r.compress_mbps["1"], r.ratio) for r in ok if r.ratio is not None])  # every OK result has one
        if len(front) > 1:
            ax.plot(*zip(*front), color="C1", lw=1.2, zorder=2, label="Pareto front")
        for j, name in enumerate(SHOWN_LIMITS):
            limit = file.limits["all"].get(name)
            if limit:
                ax.axhline(limit, ls="--", lw=0.9, color=f"C{j + 2}", label=f"limit: {LABELS[name]} {limit:.3f}x")
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("compress MB/s, 1 thread (log scale)")
        ax.set_title(f"{Path(file.path).name}: {file.dtype}, {file.tokens} tokens", fontsize=10)
        ax.grid(True, which="both", lw=0.3, alpha=0.6)
        ax.legend(fontsize=7, loc="lower left")
    axes[0][0].set_ylabel("compression ratio")
    settings = report.settings
    fig.suptitle(
        f"kvtool bench: chunks of {settings['chunk_tokens']} tokens, best of {settings['repeat']}, "
        f"{report.machine['cpu']} ({report.machine['cores']} cores)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
