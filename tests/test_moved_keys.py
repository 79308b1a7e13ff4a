"""Keys that moved out of ``[train]`` (moved_keys.py): every old key still loads, at its new
place and with a note; old and new together are refused; new runs write the new sections."""

from __future__ import annotations

import logging
import tomllib

import pytest

import fedsub
from fedsub import config as config_lib
from fedsub.cli import main
from fedsub.errors import ArgumentError, ConfigError
from fedsub.keys import key_names
from fedsub.library import config_of
from fedsub.moved_keys import ADDED_SINCE, MOVED, in_sections, text_before_move
from fedsub.runs.experiment import recorded_key, sweep

# Written out here (not read from MOVED): old [train] key -> new section, key, and a value
# other than the default (so that a key read at the wrong place, or not at all, shows).
PLACES = {
    "dtype": ("execution", "dtype", "float64"),
    "backend": ("execution", "backend", "sequential"),
    "device": ("execution", "device", "cpu"),
    "deterministic": ("execution", "deterministic", True),
    "table_placement": ("execution", "table_placement", "host"),
    "compile": ("execution", "compile", "on"),
    "threads": ("execution", "threads", 2),
    "privacy": ("privacy", "level", "heat"),
    "download": ("privacy", "download", "buckets"),
    "download_epsilon": ("privacy", "download_epsilon", 3.0),
    "download_keep": ("privacy", "download_keep", 0.5),
    "download_bucket": ("privacy", "download_bucket", 8),
    "secagg_clip": ("privacy", "secagg_clip", 2.0),
    "heat_source": ("privacy", "heat_source", "sketch"),
    "rr_epsilon": ("privacy", "rr_epsilon", 1.5),
    "sketch_eps": ("privacy", "sketch_eps", 0.01),
    "sketch_delta": ("privacy", "sketch_delta", 0.05),
    "secagg_group": ("privacy", "secagg_group", 7),
    "masking": ("masking", "scheme", "static"),
    "capacities": ("masking", "capacities", [1.0, 0.5]),
    "capacity_proportions": ("masking", "capacity_proportions", [1.0, 1.0, 2.0, 1.0, 1.0]),
    "capacity_assignment": ("masking", "capacity_assignment", "per-round"),
    "mask_average": ("masking", "average", "all"),
}


# what an old key's value applies to (config.check_inert refuses an option that does
# nothing): the key that switches it on, by its new place
SWITCHED_ON_BY = {
    **dict.fromkeys(
        ["capacities", "capacity_proportions", "capacity_assignment", "mask_average"],
        ("masking", "scheme", "static"),
    ),
    **dict.fromkeys(["download", "download_epsilon", "download_keep"],
                    ("privacy", "level", "download")),
    "download_bucket": ("privacy", "level", "download"),
    "secagg_clip": ("privacy", "level", "full"),
    "rr_epsilon": ("privacy", "heat_source", "randomized-response"),
    **dict.fromkeys(["sketch_eps", "sketch_delta"], ("privacy", "heat_source", "sketch")),
}  # fmt: skip


def loadable(old: str) -> dict:
    """The rest of a config in which ``old``'s value is allowed (masking needs a sliceable
    model; host tables a row-local algorithm, here FedAvg's SGD server; an option the
    setting it applies to)."""
    model = {"name": "mlp"} if old in ("masking", *SWITCHED_ON_BY) else {}
    raw: dict = {"model": model, "train": {"algorithms": ["fedavg"]}}
    if old in SWITCHED_ON_BY:
        section, key, value = SWITCHED_ON_BY[old]
        raw.setdefault(section, {})[key] = value
    if old == "download_bucket":
        raw["privacy"]["download"] = "buckets"
    return raw


def test_the_table_moves_every_key_it_names_and_no_other():
    assert {old: place[:2] for old, place in PLACES.items()} == MOVED
    new_fields = {
        (section, f)
        for section in ("execution", "privacy", "masking")
        for f in config_lib.SECTIONS[section].__dataclass_fields__  # type: ignore[union-attr]
    }
    # every key of the new sections moved there, but those added since (never in [train])
    assert set(MOVED.values()) == new_fields - set(ADDED_SINCE)
    assert not set(MOVED) & set(key_names(config_lib.TrainConfig))


@pytest.mark.parametrize("old", sorted(PLACES))
def test_an_old_key_loads_at_its_new_place_with_a_note(old, caplog):
    section, key, value = PLACES[old]
    raw = loadable(old)
    raw["train"][old] = value
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        config = config_lib.parse(raw)
    assert getattr(getattr(config, section), key) == value
    assert f"train.{old} is now {section}.{key}" in caplog.text
    new = loadable(old)
    new.setdefault(section, {})[key] = value
    assert config == config_lib.parse(new)


@pytest.mark.parametrize("old", ["dtype", "privacy", "masking", "mask_average"])
def test_the_old_and_the_new_key_together_are_refused_naming_both(old, tmp_path):
    section, key, value = PLACES[old]
    raw = loadable(old)
    raw["train"][old] = value
    raw.setdefault(section, {})[key] = value
    both = rf"train\.{old} and {section}\.{key} are the same setting"
    with pytest.raises(ConfigError, match=both):
        config_lib.parse(raw)
    path = tmp_path / "both.toml"
    path.write_text(f"[train]\n{old} = {config_lib.toml_value(value)}\n\n[{section}]\n"
                    f"{key} = {config_lib.toml_value(value)}\n")  # fmt: skip
    with pytest.raises(ConfigError, match=rf"{path}: {both}"):
        config_lib.load(path)


def test_set_of_an_old_key_works_with_a_note_and_overrides_the_new_section(tmp_path, caplog):
    path = tmp_path / "new.toml"
    path.write_text('[execution]\ndtype = "float32"\n')
    config = config_lib.load(path, ["train.dtype=float64"])
    assert config.execution.dtype == "float64"
    out = tmp_path / "out"
    sets = ["train.dtype=float64", "train.rounds=1", "data.num_users=20"]
    sets += ["train.clients_per_round=3", "eval.target_test_auc=none"]
    argv = ["compare", "--quiet", "--out", str(out)]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedsub"):
        assert main(argv + [a for s in sets for a in ("--set", s)]) == 0
    assert "--set: train.dtype is now execution.dtype (the old key still works)" in caplog.text
    written = (out / "config.toml").read_text()
    assert '[execution]\ndtype = "float64"' in written  # a new run writes the new sections
    train = written.split("[train]\n")[1].split("\n\n")[0]
    assert not {line.split(" = ")[0] for line in train.splitlines()} & set(MOVED)


def test_keyword_arguments_keep_their_names_and_errors_speak_of_them():
    config = config_of({"dtype": "float64", "privacy": "heat"}, ["fedavg"], None, None)
    assert config.execution.dtype == "float64" and config.privacy.level == "heat"
    with pytest.raises(ArgumentError, match=r"mask_average = 'most' is not allowed"):
        fedsub.train("sparse-lr", "synthetic-sparse", rounds=1, mask_average="most")


def test_privacy_takes_the_whole_privacy_table_and_refuses_a_key_given_twice():
    table = {"level": "download", "randomness": "seeded", "secagg_group": 8}
    config = config_of({"privacy": table, "download_keep": 0.5}, ["fedsubavg"], None, None)
    assert config.privacy.level == "download" and config.privacy.randomness == "seeded"
    assert config.privacy.secagg_group == 8 and config.privacy.download_keep == 0.5
    with pytest.raises(ArgumentError, match=r"\[privacy\] download_keep given twice"):
        config_of(
            {"privacy": {**table, "download_keep": 0.5}, "download_keep": 0.4},
            ["fedsubavg"], None, None,
        )  # fmt: skip
    with pytest.raises(ArgumentError, match=r"privacy\.randomness"):
        fedsub.train("sparse-lr", "synthetic-sparse", rounds=1, privacy={"randomness": "x"})


def test_the_text_before_the_move_has_every_moved_key_in_train_in_its_old_order():
    """What a Flower run's checkpoints are stamped with (flower/settings.py): the config as
    fedsub wrote it before the move, so checkpoints written then still resume."""
    raw = {"model": {"name": "mlp"}, "train": {"algorithms": ["fedavg"]}}
    raw["masking"] = {"scheme": "static", "capacities": [1.0, 0.5]}
    raw["execution"] = {"dtype": "float64"}
    config = config_lib.parse(raw)
    before = text_before_move(config_lib.to_toml(config))
    tables = tomllib.loads(before)
    assert not {"execution", "privacy", "masking"} & set(tables)
    train = list(tables["train"])
    assert train[8:16] == [  # in [train] between heat and lr_schedule, as fedsub wrote them
        "heat", "dtype", "backend", "device", "deterministic", "table_placement", "compile",
        "lr_schedule",
    ]  # fmt: skip
    assert train[-6:] == [
        "privacy", "download", "download_epsilon", "download_keep", "download_bucket",
        "secagg_clip",
    ]  # fmt: skip
    assert tables["train"]["masking"] == "static" and tables["train"]["dtype"] == "float64"
    assert config_lib.parse(tables, note=None) == config
    assert before.split("[train]")[0] == config_lib.to_toml(config).split("[train]")[0]


def test_a_sweep_started_over_an_old_key_resumes_under_its_new_name(tmp_path):
    """A sweep folder written before the move holds its base with the old keys and its
    values' folders under the old key: resumed under the new key (as `fedsub reproduce`
    names it now), it reads its finished values back from those folders."""
    old_base = {
        "data": {"num_users": 20},
        "train": {"rounds": 1, "clients_per_round": 3, "algorithms": ["fedavg"], "threads": 1},
        "eval": {"every": 1},
    }
    out = tmp_path / "sweep"
    first = sweep("train.backend", ["sequential", "batched"], old_base, out, where="test")
    folders = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert folders == ["train.backend=batched", "train.backend=sequential"]
    new_base = in_sections(old_base, note=None)
    assert new_base != old_base and "execution" in new_base
    again = sweep("execution.backend", ["sequential", "batched"], new_base, out, resume=True)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == folders
    assert again.summary == first.summary
    assert recorded_key(out, "execution.backend") == "train.backend"
    assert recorded_key(out, "execution.dtype") == "execution.dtype"


def test_a_key_added_since_the_move_is_left_out_only_at_its_old_behaviour():
    """``execution.table_sharding`` never was in [train]: at "none" (what every run written
    before it had) the text before the move leaves it out, at "rows" it stays in its section."""
    raw = {"model": {"name": "mlp"}, "train": {"algorithms": ["fedavg"]}}
    before = tomllib.loads(text_before_move(config_lib.to_toml(config_lib.parse(raw))))
    assert "execution" not in before and "table_sharding" not in before["train"]
    raw["execution"] = {"table_sharding": "rows"}
    sharded = tomllib.loads(text_before_move(config_lib.to_toml(config_lib.parse(raw))))
    assert sharded["execution"] == {"table_sharding": "rows"}


def test_an_old_keys_note_is_printed_once_per_command_and_call(tmp_path, caplog):
    """`fedsub run` reads its config more than once (to name its algorithm, then to run), a
    sweep once per value: the note comes once per command, and once per Python API call."""
    path = tmp_path / "old.toml"
    path.write_text('[data]\nnum_users = 20\n\n[train]\nrounds = 1\nclients_per_round = 3\n'
                    'algorithms = ["fedavg"]\ndtype = "float64"\n')  # fmt: skip
    note = "train.dtype is now execution.dtype"
    runs = [
        ["run", str(path), "--out", str(tmp_path / "a"), "--quiet"],
        ["compare", str(path), "--sweep", "train.lr=0.1,0.2", "--out", str(tmp_path / "b"),
         "--quiet", "--set", "eval.target_test_auc=none"],
    ]  # fmt: skip
    for argv in runs:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fedsub"):
            assert main(argv) == 0
        assert caplog.text.count(note) == 1, (argv, caplog.text)
    for _ in range(2):  # each call notes again, once
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fedsub"):
            fedsub.run(str(path))
        assert caplog.text.count(note) == 1, caplog.text
