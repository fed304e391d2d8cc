"""Training curves as a PNG: reward, entropy and the S2T masked fraction over optimizer steps."""

from __future__ import annotations

from pathlib import Path

PANELS = (
    ("reward", "mean reward", None, 1.0),
    ("entropy", "mean token entropy (nats)", 0.0, 1.0),
    ("s2t/masked_fraction", "S2T masked fraction (%)", 0.0, 100.0),
)
"""(metric, title, lowest value the axis shows, scale) of each panel."""


def read_metrics(path: str | Path) -> list[dict]:
    """The training records of a `metrics.jsonl` file (the final summary record is left out; a last line cut off
    mid-write is left out with a warning)."""
    from .jsonl import read_json_lines

    return [record for record in read_json_lines(path) if "train_runtime" not in record]


def training_curve_panels(records: list[dict], label: str = "run") -> list:
    """The panels of `training_curves.png` (reward, entropy, masked fraction), as the report builds them."""
    from .diagnostics.report import LinePanel, metric_series

    panels = []
    for key, title, y_floor, scale in PANELS:
        found = metric_series([record for record in records if "step" in record], key, label, scale)
        panel = LinePanel(title=title, series=[found] if found is not None else [], y_floor=y_floor)
        if found is None:
            panel.notes.append("not logged by this run")
        panels.append(panel)
    return panels


def plot_training_curves(records: list[dict], path: str | Path, title: str | None = None) -> Path:
    """Write a three-panel PNG of reward, entropy and masked fraction against the step. Renders headless (Agg).

    A metric that the run did not log (for example the mask of a GRPO run) leaves its panel with a note.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .diagnostics.report import draw_line_panel

    panels = training_curve_panels(records)
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), constrained_layout=True)
    for axis, panel in zip(axes, panels, strict=True):
        draw_line_panel(axis, panel)
    if title:
        figure.suptitle(title, fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
