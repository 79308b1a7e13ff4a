"""Configuration loading: defaults, overrides, and a clear message for every kind of bad input."""

from pathlib import Path

import pytest

from fedsub import config as config_lib
from fedsub.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_embedded_default_loads_and_round_trips_through_toml(tmp_path):
    config = config_lib.load(None)
    assert config.data.name == "synthetic-sparse"
    assert config.train.algorithms == ["fedavg", "fedsubavg"]
    again = config_lib.load(write(tmp_path, config_lib.to_toml(config)))
    assert again == config


def test_overrides_take_toml_values_and_plain_strings(tmp_path):
    path = write(tmp_path, "[train]\nrounds = 3\n")
    config = config_lib.load(
        path,
        [
            "train.lr=0.25",
            "train.heat=clients",
            'train.algorithms=["fedavg"]',
            "data.num_users=50",
            "eval.target_test_auc=0.7",
        ],
    )
    assert config.train.rounds == 3
    assert config.train.client_step.lr == 0.25
    assert config.train.heat == "clients"
    assert config.train.algorithms == ["fedavg"]
    assert config.data.options.num_users == 50
    assert config.eval.target_test_auc == 0.7


@pytest.mark.parametrize(
    "text, message",
    [
        ("[train]\nlrr = 0.1\n", "[train] unknown key 'lrr'; allowed keys: algorithms, rounds"),
        ("[train]\nrounds = 'ten'\n", "train.rounds must be an integer, got 'ten'"),
        ("[train]\nrounds = 2.5\n", "train.rounds must be an integer, got 2.5"),
        ("[train]\nrounds = true\n", "train.rounds must be an integer, got True"),
        ("[train]\nrounds = 0\n", "train.rounds = 0 is out of range; expected >= 1"),
        ("[train]\nlr = -1\n", "train.lr = -1.0 is out of range; expected > 0.0"),
        ("[train]\nalgorithms = []\n", "train.algorithms must not be empty"),
        (
            "[train]\nalgorithms = ['fedsgd']\n",
            "train.algorithms = 'fedsgd' is not allowed: unknown algorithm 'fedsgd'; choose from "
            "central-sgd, fedadagrad, fedadagrad-lazy, fedadam, fedadam-lazy, fedavg, fedprox",
        ),
        ("[train]\nheat = 'rows'\n", "train.heat = 'rows' is not allowed; choose from clients"),
        (
            "[eval]\ntarget_test_auc = 1.5\n",
            "eval.target_test_auc = 1.5 is out of range; expected <= 1.0",
        ),
        ("[data]\nname = 'nope'\n", "data.name = 'nope' is not allowed; choose from"),
        (
            "[data]\nnum_usrs = 5\n",
            "[data] unknown key 'num_usrs' (neither a common key nor an option of dataset "
            "'synthetic-sparse')",
        ),
        ("[data]\nnum_users = 1\n", "data.num_users = 1 is out of range; expected >= 2"),
        ("[trian]\nrounds = 1\n", "unknown section [trian]; allowed sections: data, model"),
        ("train = 3\n", "train must be a [section] table, got 3"),
        ("[train\n", "not valid TOML"),
        ("[train]\nlr = nan\n", "train.lr must be a finite number, got nan"),
        ("[eval]\ntarget_train_loss = inf\n", "eval.target_train_loss must be a finite number"),
        (
            "[eval]\ntarget_train_loss = 'best'\n",
            "eval.target_train_loss = 'best' is not allowed; choose from central-min",
        ),
        ("[algorithms.fedprox]\nmu = -1\n", "algorithms.fedprox.mu = -1.0 is out of range"),
        ("[algorithms.fedsgd]\nlr = 1\n", "[algorithms.fedsgd] is not an algorithm"),
        ("[algorithms.fedadam]\nbeta = 0.9\n", "[algorithms.fedadam] unknown key 'beta'"),
        ("[train]\nalgorithms = ['fedavg@scheme9']\n", "unknown scheme 'scheme9'"),
        ("[train]\nalgorithms = ['central-sgd@scheme1']\n", "central-sgd samples no clients"),
    ],
)
def test_bad_config_names_the_key_and_what_is_allowed(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as error:
        config_lib.load(path)
    assert message in str(error.value)
    assert str(path) in str(error.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rounds=3", "the key must be section.key"),
        ("train.rounds", "expected section.key=value"),
        ("optim.lr=1", "the key must be section.key with section one of data, model"),
        ("train.rounds=abc", "train.rounds must be an integer, got 'abc'"),
    ],
)
def test_bad_override_is_explained(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        config_lib.load(None, [override])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        config_lib.load(tmp_path / "absent.toml")


def test_set_none_unsets_a_key_and_a_quoted_none_is_the_string():
    """The reported case: the embedded default's eval.target_test_auc = 0.8 could not be
    removed from the command line."""
    assert config_lib.load(None).eval.target_test_auc == 0.8
    assert config_lib.load(None, ["eval.target_test_auc=none"]).eval.target_test_auc is None
    unset = config_lib.load(None, ["train.rounds=7", "train.rounds=None"])
    assert unset.train.rounds == config_lib.TrainConfig().rounds  # the built-in default
    assert config_lib.load(None, ['masking.scheme="none"']).masking.scheme == "none"
    composed = config_lib.load(None, ["algorithms.fedprox.mu=0.5", "algorithms.fedprox.mu=none"])
    assert composed.algorithms["fedprox"].mu == 0.01


def test_an_auc_target_on_a_dataset_without_auc_says_how_to_unset_it(tmp_path, capsys):
    from fedsub.cli import main

    sets = [
        "data.name=synthetic-li",
        "data.num_devices=4",
        "model.name=softmax-regression",
        "train.clients_per_round=2",
        "train.rounds=1",
    ]
    argv = ["run", "--algorithm", "fedavg", "--quiet", "--out", str(tmp_path / "o")]
    argv += [a for s in sets for a in ("--set", s)]
    assert main(argv) == 2
    assert "(unset it: --set eval.target_test_auc=none)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main([*argv, "--set", "eval.target_test_auc=none"]) == 0


def test_model_keys_are_the_options_of_the_chosen_models_spec():
    """[model] keys other than name are the model's own options (its ModelSpec's dataclass):
    checked by type and range, an unknown key refused naming the model; the keys every model
    took before (init_std, embedding_dim, widths, scaler) are still accepted and ignored by a
    model without them, so older configs and run folders load."""
    from fedsub.models.registry import WidthOptions

    config = config_lib.parse({"model": {"name": "cnn", "init_std": 0.1, "widths": [4]}})
    assert config.model.options == WidthOptions(widths=[4], scaler=True)
    with pytest.raises(ConfigError, match=r"\[model\] unknown key 'foo' \(not an option of model"):
        config_lib.parse({"model": {"name": "sparse-lr", "foo": 1}})
    with pytest.raises(ConfigError, match=r"model\.init_std = -1\.0 is out of range"):
        config_lib.parse({"model": {"name": "sparse-lr", "init_std": -1}})
    assert 'name = "cnn"\nwidths = [4]\nscaler = true' in config_lib.to_toml(config)


def test_a_groups_keys_stay_flat_in_their_section(tmp_path):
    # [train]'s client step and [dp]'s row selection / adaptive clipping are groups of keys
    # (fedsub/keys.py): read, written and refused as the section's own keys
    text = (
        "[train]\nrounds = 3\nmomentum = 0.5\nlr = 0.2\nalgorithms = ['fedavg']\n[dp]\n"
        "mechanism = 'gaussian'\nnoise_multiplier = 1.0\nclip_lr = 0.3\nrows = 'all'\n"
    )
    config = config_lib.load(write(tmp_path, text))
    assert (config.train.rounds, config.train.client_step.momentum) == (3, 0.5)
    assert config.train.client_step.lr == 0.2
    assert config.dp.adaptive_clipping.clip_lr == 0.3
    assert config.dp.row_selection.rows == "all"
    written = config_lib.to_toml(config)
    assert "momentum = 0.5\n" in written and "clip_lr = 0.3\n" in written
    assert "client_step" not in written and "adaptive_clipping" not in written
    assert config_lib.load(write(tmp_path, written)) == config
    with pytest.raises(ConfigError, match=r"train\.momentum = 2\.0 is out of range; expected <= 1"):
        config_lib.load(None, ["train.momentum=2.0"])
    with pytest.raises(ConfigError, match=r"\[train\] unknown key 'client_step'.*lr, lr_sched"):
        config_lib.load(write(tmp_path, "[train]\nclient_step = {lr = 0.1}\n"))


def test_a_groups_keys_as_keyword_arguments_are_named_bare():
    from dataclasses import dataclass, field

    from fedsub.errors import ArgumentError
    from fedsub.keys import key_names, parse_section

    @dataclass(frozen=True)
    class Inner:
        b: int = field(default=1, metadata={"min": 0})
        c: str = "x"

    @dataclass(frozen=True)
    class Outer:
        a: int
        inner: Inner = field(default_factory=Inner)
        d: float = 0.0

    assert key_names(Outer) == ["a", "b", "c", "d"]
    assert parse_section(Outer, "", {"a": 2, "c": "y"}) == Outer(2, Inner(1, "y"))
    with pytest.raises(ArgumentError, match=r"^b = -1 is out of range; expected >= 0$"):
        parse_section(Outer, "", {"a": 2, "b": -1})
    with pytest.raises(ArgumentError, match=r"^a is required \(it is not given\)"):
        parse_section(Outer, "", {"b": 1})


def test_a_directory_given_as_the_config_is_named_as_one(tmp_path):
    """``Config.from_toml("some/dir")`` and ``fedsub run DIR``: the folder is said to be one
    (with its config.toml when it is a run folder), not parsed as TOML text."""
    folder = tmp_path / "run"
    folder.mkdir()
    with pytest.raises(ConfigError, match=rf"^{folder} is a directory, not a config file"):
        config_lib.Config.from_toml(str(folder))
    (folder / "config.toml").write_text("[train]\nrounds = 2\n")
    with pytest.raises(ConfigError, match=r"a run folder's config is .*run/config.toml"):
        config_lib.Config.from_toml(folder)
