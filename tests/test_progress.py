"""Feedback on long work: named phases, a training bar that says which algorithm of how
many, and data errors reported before any bar is drawn."""

from __future__ import annotations

import io
from contextlib import contextmanager

from rich.console import Console

from fedsub import config as config_lib
from fedsub.cli import commands as cli
from fedsub.data.synthetic_sparse import SyntheticSparseOptions, generate
from fedsub.privacy.heat_sources import HeatPrivacy, estimate_heat
from fedsub.progress import Reporter, RichReporter, reporting, round_label
from fedsub.runs.experiment import compare
from fedsub.submodel.index import SubmodelIndex

TINY = [
    "data.num_users=30",
    "data.num_items=20",
    "data.mean_samples_per_user=8",
    "train.rounds=2",
    "train.clients_per_round=5",
    "train.local_steps=2",
    "eval.every=1",
    "eval.train_loss_samples=50",
    'train.algorithms=["fedavg", "fedsubavg", "fedprox"]',
]


class Recorder(Reporter):
    """Every event in order: ("phase", label, total), ("advance", label, n), ("end", label),
    ("training", plan), ("round", label, round)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    @contextmanager
    def phase(self, label, total=None):
        self.events.append(("phase", label, total))
        yield lambda steps=1: self.events.append(("advance", label, steps))
        self.events.append(("end", label))

    def training(self, plan):
        self.events.append(("training", list(plan)))

    def round(self, label, round_index):
        self.events.append(("round", label, round_index))


def test_round_label_names_the_algorithm_its_position_and_the_rounds():
    plan = [("fedavg", 50), ("fedsubavg", 50), ("fedprox", 50)]
    assert round_label(plan, "fedsubavg", 14) == ("fedsubavg (2/3) round 14/50", 64)
    assert round_label(plan, "fedavg", 1) == ("fedavg (1/3) round 1/50", 1)
    assert round_label(plan, "fedprox", 50) == ("fedprox (3/3) round 50/50", 150)


def test_compare_reports_phases_then_every_round_of_every_algorithm(tmp_path):
    recorder = Recorder()
    with reporting(recorder):
        compare(config_lib.load(None, TINY), tmp_path / "out")
    kinds = [e[0] for e in recorder.events]
    phases = [e[1] for e in recorder.events if e[0] == "phase"]
    assert phases[0] == "loading synthetic-sparse"
    assert "indexing the clients' rows" in phases
    assert "evaluating" in phases
    training = kinds.index("training")
    assert kinds.index("phase") < training  # data loaded before the bar
    plan = [("fedavg", 2), ("fedsubavg", 2), ("fedprox", 2)]
    assert recorder.events[training] == ("training", plan)
    rounds = [(e[1], e[2]) for e in recorder.events if e[0] == "round"]
    assert rounds == [(name, r) for name, _ in plan for r in (1, 2)]
    assert kinds.count("phase") == kinds.count("end")  # every phase closed


def test_secure_aggregation_reports_progress_per_client():
    dataset = generate(
        SyntheticSparseOptions(num_users=40, num_items=20, mean_samples_per_user=6), seed=1
    )
    index = SubmodelIndex.build(dataset)
    recorder = Recorder()
    with reporting(recorder):
        estimate_heat(dataset, index, "clients", HeatPrivacy("secagg", group_size=16))
    secure = [e for e in recorder.events if e[0] == "phase" and e[1].startswith("secagg ")]
    assert len(secure) == len(dataset.table_rows)
    for _, label, total in secure:
        assert total == dataset.num_clients
        steps = [e[2] for e in recorder.events if e[0] == "advance" and e[1] == label]
        assert steps == [16, 16, 8]  # groups of 16 over 40 clients


def test_the_rich_bar_shows_the_labelled_rounds(tmp_path, monkeypatch):
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, width=120)
    monkeypatch.setattr(cli, "RichReporter", lambda: RichReporter(console))
    argv = ["compare", "--out", str(tmp_path / "out")]
    assert cli.main(argv + [a for s in TINY for a in ("--set", s)]) == 0
    shown = stream.getvalue()
    assert "fedprox (3/3) round 2/2" in shown
    assert "fedavg (1/3) round 1/2" in shown


def test_a_data_error_comes_before_any_progress_output(tmp_path, monkeypatch, capsys):
    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, width=120)
    monkeypatch.setattr(cli, "RichReporter", lambda: RichReporter(console))
    missing = tmp_path / "nowhere.csv"
    argv = ["compare", "--set", 'data.name="table"', "--set", f'data.path="{missing}"']
    assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("fedsub: error:")
    assert "round" not in stream.getvalue() and "training" not in stream.getvalue()
