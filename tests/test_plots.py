"""curves.png: the target as a line on its metric's panel; sweeps split into one row of
panels per algorithm so that no panel holds more lines than there are values."""

from __future__ import annotations

import matplotlib.pyplot as plt

from fedsub.engine.loop import Evaluation
from fedsub.report import Target, curves_figure, plot_curves


def history(offset: float) -> list[Evaluation]:
    return [
        Evaluation(r, {"train_loss": 1.0 - 0.1 * r + offset, "test_auc": 0.5 + 0.05 * r}, 0.0)
        for r in range(5)
    ]


def panel(fig, ylabel: str, row: int = 0):
    panels = [ax for ax in fig.axes if ax.get_ylabel() == ylabel]
    return panels[row]


def horizontal_at(ax, value: float) -> list:
    return [
        line
        for line in ax.get_lines()
        if line.get_label() == "target" and set(line.get_ydata()) == {value}
    ]


def test_the_target_is_a_horizontal_line_on_its_metrics_panel_only():
    histories = {"fedavg": history(0.0), "fedsubavg": history(-0.1)}
    fig = curves_figure(histories, "t", Target(train_loss=0.7))
    try:
        assert len(horizontal_at(panel(fig, "train loss"), 0.7)) == 1
        auc_lines = panel(fig, "test AUC").get_lines()
        assert [line.get_label() for line in auc_lines] == ["fedavg", "fedsubavg"]
    finally:
        plt.close(fig)
    fig = curves_figure(histories, "t", Target(test_auc=0.6))
    try:
        assert len(horizontal_at(panel(fig, "test AUC"), 0.6)) == 1
        assert not horizontal_at(panel(fig, "train loss"), 0.6)
    finally:
        plt.close(fig)


def test_no_target_no_line():
    fig = curves_figure({"fedavg": history(0.0)}, "t", Target())
    try:
        assert all(line.get_label() != "target" for ax in fig.axes for line in ax.get_lines())
    finally:
        plt.close(fig)


def test_a_sweep_of_nine_lines_gets_one_row_per_algorithm(tmp_path):
    values = ["0.01", "0.1", "1"]
    panels = {
        name: {f"lr={v}": history(i * 0.01 + j) for j, v in enumerate(values)}
        for i, name in enumerate(["fedavg", "fedsubavg", "fedprox"])
    }
    fig = curves_figure(panels, "sweep of lr", Target(train_loss=0.5))
    try:
        train_panels = [ax for ax in fig.axes if ax.get_ylabel() == "train loss"]
        assert [ax.get_title() for ax in train_panels] == ["fedavg", "fedsubavg", "fedprox"]
        for ax in train_panels:
            curves = [line for line in ax.get_lines() if line.get_label() != "target"]
            assert [line.get_label() for line in curves] == [f"lr={v}" for v in values]
            assert len(horizontal_at(ax, 0.5)) == 1
    finally:
        plt.close(fig)
    plot_curves(panels, tmp_path / "curves.png", "sweep of lr")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
