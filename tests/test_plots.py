"""curves.png: the target as a line (labelled with its value) on its metric's panel; sweeps
split into one row of panels per algorithm so that no panel holds more lines than there are
values; a diverged run's curve up to its divergence, and the round marked; whole rounds on
the x axis. The heat plot counts the untouched features it cannot show."""

from __future__ import annotations

import matplotlib.pyplot as plt

from fedsub.engine.loop import Evaluation
from fedsub.runs.report import Target, curves_figure, plot_curves


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
        if line.get_label() == f"target {value:g}" and set(line.get_ydata()) == {value}
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
        labels = [line.get_label() for ax in fig.axes for line in ax.get_lines()]
        assert not [label for label in labels if label.startswith("target")]
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
            curves = [line for line in ax.get_lines() if not line.get_label().startswith("target")]
            assert [line.get_label() for line in curves] == [f"lr={v}" for v in values]
            assert len(horizontal_at(ax, 0.5)) == 1
    finally:
        plt.close(fig)
    plot_curves(panels, tmp_path / "curves.png", "sweep of lr")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_a_diverged_run_is_drawn_up_to_its_divergence_and_the_round_is_marked():
    """The reported plot: a run that diverged at round 3 with one evaluation (round 0) had
    empty loss panels and an x axis of -0.04..0.04."""
    early = [Evaluation(0, {"train_loss": 0.69, "test_auc": 0.5}, 0.0)]
    nan = [*early, Evaluation(2, {"train_loss": float("nan"), "test_auc": float("nan")}, 0.0)]
    fig = curves_figure({"fedavg": early, "scaffold": nan}, "t", None, {"fedavg": 3, "scaffold": 2})
    try:
        ax = panel(fig, "train loss")
        curves = {line.get_label(): line for line in ax.get_lines()}
        assert list(curves["fedavg"].get_xdata()) == [0] and curves["fedavg"].get_marker() == "o"
        assert list(curves["scaffold"].get_ydata()) == [0.69]  # the NaN is not drawn
        marks = [curves["fedavg diverged at round 3"], curves["scaffold diverged at round 2"]]
        assert [list(m.get_xdata()) for m in marks] == [[3, 3], [2, 2]]
        assert marks[0].get_color() == curves["fedavg"].get_color()
        assert ax.get_xlim() == (0.0, 3.0)
    finally:
        plt.close(fig)


def test_short_runs_get_whole_round_ticks():
    fig = curves_figure({"fedavg": history(0.0)[:3]}, "t")  # rounds 0, 1, 2
    try:
        ticks = panel(fig, "train loss").get_xticks()
        assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks)
    finally:
        plt.close(fig)


def test_the_title_names_the_masking_scheme(tmp_path, monkeypatch):
    from fedsub.cli import main
    from fedsub.runs import experiment

    titles = []
    monkeypatch.setattr(experiment, "plot_curves", lambda h, path, title, *a: titles.append(title))
    sets = [
        'data.name="synthetic-li"',
        "data.num_devices=4",
        "data.dim=5",
        'model.name="mlp"',
        "model.widths=[4]",
        'masking.scheme="static"',
        'train.algorithms=["fedavg"]',
        "train.rounds=1",
        "train.clients_per_round=2",
        "train.local_steps=1",
        "eval.target_test_auc=none",
    ]
    argv = ["compare", "--out", str(tmp_path / "out"), "--quiet"]
    assert main([*argv, *(a for s in sets for a in ("--set", s))]) == 0
    assert titles == ["synthetic-li(0,0): fedavg (masking static)"]


def test_the_heat_plot_counts_untouched_features(tmp_path, monkeypatch):
    import numpy as np

    from fedsub.submodel import stats

    figures = []
    monkeypatch.setattr(stats, "save_figure_atomic", lambda fig, path: figures.append(fig))
    stats.plot_heat_distribution(np.array([1, 1, 2, 5]), tmp_path / "h.png", "t", untouched=7)
    (legend,) = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert legend == "4 touched features; 7 untouched (heat 0, not shown)"
    plt.close(figures[0])
