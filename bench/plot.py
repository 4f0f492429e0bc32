#!/usr/bin/python3
"""Renders ghostlink-bench --json output as one chart: for every metric, how
many times better ghostlink is than each baseline (log scale; 1x = parity,
above the line = ghostlink better).

    /usr/bin/python3 bench/plot.py docs/bench-results.json docs/bench-results.svg

Needs matplotlib (Debian: python3-matplotlib).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BASELINES = ["rwlock", "mutex", "strand_only"]
COLORS = {"rwlock": "#4c72b0", "mutex": "#dd8452", "strand_only": "#55a868"}


def ratios(metric):
    """ghostlink's advantage over each baseline, or None where not measured."""
    values = metric["values"]
    g = values.get("ghostlink")
    out = {}
    for b in BASELINES:
        v = values.get(b)
        if not g or not v:
            out[b] = None
        else:
            out[b] = g / v if metric["higher_is_better"] else v / g
    return out


def main(source, target):
    with open(source) as f:
        data = json.load(f)
    metrics = [m for m in data["metrics"] if "ghostlink" in m["values"] and
               any(b in m["values"] for b in BASELINES)]
    labels = [f'{m["scenario"]}\n{m["metric"]}' for m in metrics]
    fig, ax = plt.subplots(figsize=(max(10, 0.9 * len(metrics)), 6))
    width = 0.8 / len(BASELINES)
    for i, b in enumerate(BASELINES):
        xs, ys = [], []
        for x, m in enumerate(metrics):
            r = ratios(m)[b]
            if r:
                xs.append(x + (i - 1) * width)
                ys.append(r)
        ax.bar(xs, ys, width, label=f"vs {b}", color=COLORS[b])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("ghostlink advantage (x, log scale; >1 = ghostlink better)")
    ax.set_xticks(range(len(metrics)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    opts = data["options"]
    ax.set_title(f'ghostlink-bench: {opts["tokens"]} tokens x {opts["heads"]} heads x {opts["head_dim"]} dims, '
                 f'median of {opts["runs"]} runs, {opts["threads"]} threads')
    ax.legend()
    fig.tight_layout()
    fig.savefig(target)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
