"""Markdown tables for BENCHMARKS.md from `kvtool bench accuracy --json` output.

    python benchmarks/lossy_tables.py ACCURACY.json [LAYERS.json]

ACCURACY.json: a run over recipes (pooled and per-text tables, targets);
LAYERS.json: a run with --layers-of (the most sensitive layers, and K against V).
"""

from __future__ import annotations

import json
import sys
from statistics import mean


def pct(value: float) -> str:
    return f"{100 * value:.1f}"


def effect(e: dict | None, key: str) -> str:
    if e is None:
        return ""
    return pct(e["top1"]) if key == "top1" else f"{e[key]:+.2f}"


def recipes(report: dict) -> None:
    s = report["settings"]
    print(f"{len(report['texts'])} texts, {s['prefix']}-token prefix each, {s['positions']} teacher-forced positions "
          f"and {s['greedy']} greedy tokens per text; pooled over the texts (greedy: the least over them).\n")
    print("| recipe | lossy | ratio | top-1 agreement % | ppl change % | KL (nats) | identical greedy | "
          "K only: ppl % / top-1 % | V only: ppl % / top-1 % | max abs error | rel. RMS error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["pooled"]:
        k, v = r["keys_only"], r["values_only"]
        print(f"| `{r['recipe'].replace('|', chr(92) + '|')}` | {'yes' if r['lossy'] else 'no'} | {r['ratio']:.3f} | "
              f"{pct(r['top1'])} | {r['ppl_change_pct']:+.2f} | {r['kl']:.2e} | {r['greedy_identical']}/{r['greedy_tokens']} | "
              f"{effect(k, 'ppl_change_pct')} / {effect(k, 'top1')} | {effect(v, 'ppl_change_pct')} / {effect(v, 'top1')} | "
              f"{r['max_abs_error']:.3g} | {r['rel_rms_error']:.3g} |")
    print("\nPer text (reference perplexity of the lossless cache: "
          + ", ".join(f"{t['text'].rsplit('/', 1)[-1]} {t['reference_ppl']:.3f}" for t in report["texts"]) + ")\n")
    texts = list(dict.fromkeys(r["text"] for r in report["rows"]))
    print("| recipe | " + " | ".join(f"{t}: ratio / top-1 % / ppl % / greedy" for t in texts) + " |")
    print("|---|" + "---|" * len(texts))
    for spec in dict.fromkeys(r["recipe"] for r in report["rows"]):
        cells = []
        for text in texts:
            r = next(x for x in report["rows"] if x["recipe"] == spec and x["text"] == text)
            cells.append(f"{r['ratio']:.2f} / {pct(r['top1'])} / {r['ppl_change_pct']:+.2f} / {r['greedy_identical']}")
        print(f"| `{spec.replace('|', chr(92) + '|')}` | " + " | ".join(cells) + " |")
    print()
    for t in report["targets"]:
        met = ", ".join(f"`{m}`" for m in t["met_by"])
        print(f"- {t['target']}: " + (f"met by {met}" if met else "missed"))


def layers(report: dict) -> None:
    rows = report["layers"]
    s = report["settings"]
    print(f"\n`{s['layers_of']}` on one layer's keys (K) or values (V) at a time, the rest lossless; "
          f"{rows[0]['text']}, {s['prefix']}-token prefix, {s['positions']} positions.\n")
    for kind in ("k", "v"):
        of_kind = [r for r in rows if r["kind"] == kind]
        print(f"- {kind.upper()}: mean KL {mean(r['kl'] for r in of_kind):.2e}, "
              f"mean ppl change {mean(r['ppl_change_pct'] for r in of_kind):+.3f}%")
    print("\n| layer | K/V | KL (nats) | ppl change % | top-1 agreement % |\n|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: -r["kl"])[:12]:
        print(f"| {r['layer']} | {r['kind'].upper()} | {r['kl']:.2e} | {r['ppl_change_pct']:+.3f} | {pct(r['top1'])} |")


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        recipes(json.load(f))
    if len(sys.argv) > 2:
        with open(sys.argv[2], encoding="utf-8") as f:
            layers(json.load(f))


if __name__ == "__main__":
    main()
