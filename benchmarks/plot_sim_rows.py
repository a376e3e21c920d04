"""DIR/predicted.png from DIR/rows.jsonl (benchmarks/sim_llama_layer.py's rows): the simulator's
time for the Llama-8B-size layer per topology, one bar per label, in the order they were run.

    python benchmarks/plot_sim_rows.py benchmarks/results/v22/sim
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TOPOLOGIES = ["1x2", "2x4", "2x8"]
SPAN = 0.8  # of each topology's slot, shared by the labels


def main(where: Path) -> None:
    rows = [json.loads(line) for line in (where / "rows.jsonl").read_text().splitlines()]
    labels = list(dict.fromkeys(r["label"] for r in rows))  # in the order they were run
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, label in enumerate(labels):
        ys = [
            next(r["predicted_ms"] for r in rows if r["label"] == label and r["topology"] == t)
            for t in TOPOLOGIES
        ]
        width = SPAN / len(labels)
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(TOPOLOGIES))]
        ax.bar(xs, ys, width, label=label)
        for x, y in zip(xs, ys, strict=True):
            ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(TOPOLOGIES)))
    ax.set_xticklabels(TOPOLOGIES)
    ax.set_ylabel("predicted ms (simulator, H200 profile)")
    ax.set_title("Llama-8B-size layer, TP+SP, bf16, S=4096: predicted, not measured")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(where / "predicted.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
