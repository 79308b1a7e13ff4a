"""Parameters valid alone but impossible for the loaded data are refused before training."""

from __future__ import annotations

import logging

import pytest

from fedsub import config as config_lib
from fedsub.cli import main
from fedsub.errors import ConfigError
from fedsub.runs.checks import check_against_dataset
from fedsub.runs.run_setup import model_of

TINY = ["data.num_users=40", "data.num_items=30", "data.mean_samples_per_user=8"]


def check(dataset, *overrides: str) -> None:
    config = config_lib.load(None, [*TINY, *overrides])
    check_against_dataset(config, dataset, model_of(config, dataset))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["train.clients_per_round=41"],
            "train.clients_per_round = 41 is more than the population: dataset "
            "synthetic-sparse has 40 clients; set it to at most 40",
        ),
        (
            ['privacy.heat_source="secagg"', "privacy.secagg_group=50"],
            "privacy.secagg_group = 50 is larger than the population "
            "(privacy.heat_source = 'secagg'): dataset synthetic-sparse has 40 clients",
        ),
        (
            [
                'privacy.heat_source="sketch"',
                "privacy.secagg_group=41",
                "train.clients_per_round=5",
            ],
            "privacy.secagg_group = 41 is larger than the population",
        ),
    ],
)
def test_impossible_parameters_name_key_value_and_dataset_size(small_synthetic, overrides, message):
    with pytest.raises(ConfigError) as error:
        check(small_synthetic, "train.clients_per_round=5", *overrides)
    assert message in str(error.value)


def test_feasible_parameters_pass_and_surprising_ones_warn(small_synthetic, caplog):
    check(small_synthetic, "train.clients_per_round=40", "privacy.secagg_group=41")  # exact heat
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        check(small_synthetic, "train.clients_per_round=5", "train.batch_size=500")
    assert "train.batch_size = 500 is more than the largest client's" in caplog.text


def test_the_cli_refuses_before_training_with_exit_2(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["compare", "--out", str(out), "--quiet", *(f"--set={o}" for o in TINY)]
    assert main([*argv, "--set=train.clients_per_round=60"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedsub: error: train.clients_per_round = 60 is more than")
    assert "Traceback" not in err
    assert not any(out.glob("*/metrics.jsonl"))  # no training happened
