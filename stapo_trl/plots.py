"""Training curves as a PNG: reward, entropy and the S2T masked fraction over optimizer steps."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = (
    ("reward", "mean reward"),
    ("entropy", "mean token entropy (nats)"),
    ("s2t/masked_fraction", "S2T masked fraction (%)"),
)


def read_metrics(path: str | Path) -> list[dict]:
    """The training records of a `metrics.jsonl` file (the final summary record is left out)."""
    records = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if "train_runtime" not in record:
                records.append(record)
    return records


def plot_training_curves(records: list[dict], path: str | Path, title: str | None = None) -> Path:
    """Write a three-panel PNG of reward, entropy and masked fraction against the step. Renders headless (Agg).

    A metric that the run did not log (for example the mask of a GRPO run) leaves its panel with a note.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.2), constrained_layout=True)
    for axis, (key, label) in zip(axes, PANELS, strict=True):
        points = [(record["step"], record[key]) for record in records if record.get(key) is not None]
        if key == "s2t/masked_fraction":
            points = [(step, 100 * value) for step, value in points]
        if points:
            steps, values = zip(*points, strict=True)
            axis.plot(steps, values, marker="o", markersize=3, linewidth=1.5)
        else:
            axis.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=axis.transAxes)
        axis.set_xlabel("optimizer step")
        axis.set_title(label, fontsize=10)
        axis.grid(alpha=0.3)
    if title:
        figure.suptitle(title, fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
