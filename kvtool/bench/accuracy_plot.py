"""The accuracy plot: compression ratio against what a lossy recipe costs the model.

Two panels share the ratio axis: the perplexity change on the texts'
continuations, and the share of next-token predictions that differ from the
lossless cache's (100 - top-1 agreement). Each recipe is a labelled point
pooled over the texts, with each text's own result as a small grey dot; the
targets are dashed lines. Needs matplotlib (extra ``kvtool[bench]``).
"""

from __future__ import annotations

from pathlib import Path

from kvtool.bench.accuracy import TARGETS, Report
from kvtool.bench.plot import require_matplotlib

TICKS = [-30, -10, -3, -1, -0.5, 0, 0.5, 1, 3, 10, 30, 100]


def plot_accuracy(report: Report, out: Path) -> None:
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 6.2), sharex=True)
    panels = (
        (left, lambda r: r.ppl_change_pct, "perplexity change (%)", [t.ppl_change_pct for t in TARGETS]),
        (right, lambda r: 100 * (1 - r.top1), "next-token predictions changed (%, 100 - top-1 agreement)",
         [100 * (1 - t.top1) for t in TARGETS if t.top1 is not None]),
    )
    for ax, value, label, limits in panels:
        ax.scatter([r.ratio for r in report.rows], [value(r) for r in report.rows], s=10, color="0.7", zorder=2,
                   label="one text")
        for i, r in enumerate(report.pooled):
            ax.scatter([r.ratio], [value(r)], s=40, color="C3" if r.lossy else "C0", zorder=3)
            ax.annotate(r.recipe, (r.ratio, value(r)), xytext=(5, 7 if i % 2 else -12), textcoords="offset points", fontsize=7)
        for limit in sorted(set(limits)):
            ax.axhline(limit, ls="--", lw=0.9, color="C1")
        for target in TARGETS:
            ax.axvline(target.ratio, ls=":", lw=0.9, color="C2")
        ax.margins(x=0.12)  # room for the labels of the rightmost points
        ax.set_yscale("symlog", linthresh=1.0)
        ax.yaxis.set_major_locator(FixedLocator(TICKS))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("compression ratio (bf16 cache bytes / .kvz bytes)")
        ax.set_ylabel(label)
        ax.grid(True, lw=0.3, alpha=0.6)
    left.legend(fontsize=7, loc="upper left")
    s = report.settings
    fig.suptitle(
        f"kvtool bench accuracy: {s['model']}, {len(report.texts)} texts, prefix {s['prefix']} tokens, "
        f"{s['positions']} positions each\ndashed: targets ({'; '.join(t.describe() for t in TARGETS)})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
