"""The Flower run config's out-dir: results go outside the app folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedsub.errors import ConfigError
from fedsub.flower.settings import FlowerSettings, Output, Replies


def test_out_dir_expands_home_and_keeps_absolute_paths(tmp_path):
    home = FlowerSettings.from_run_config({"out-dir": "~/fedsub-flower-out"})
    assert home.output.out_dir == str(Path.home() / "fedsub-flower-out")
    assert FlowerSettings.from_run_config({"out-dir": str(tmp_path)}).output.out_dir == str(
        tmp_path
    )
    assert FlowerSettings.from_run_config({}).output.out_dir == ""


@pytest.mark.parametrize("relative", ["flower-out", "./results", "../out"])
def test_a_relative_out_dir_is_refused_naming_the_key_and_value(relative):
    with pytest.raises(ConfigError, match=rf"out-dir = '{relative}' is relative"):
        FlowerSettings.from_run_config({"out-dir": relative})


def test_the_example_app_writes_outside_its_folder():
    import tomllib

    example = Path(__file__).parents[1] / "examples" / "flower-fedsubavg"
    config = tomllib.loads((example / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    settings = FlowerSettings.from_run_config(config["config"])
    assert settings.output.out_dir and not Path(settings.output.out_dir).is_relative_to(example)


def test_folders_no_run_may_write_into_are_refused_naming_the_key(tmp_path):
    for folder, reason in (
        (Path.home(), "is your home folder"),
        (Path("/"), "is a filesystem root"),
    ):
        with pytest.raises(ConfigError, match=f"out-dir {folder} {reason}"):
            FlowerSettings.from_run_config({"out-dir": str(folder)})
    (tmp_path / "file").write_text("mine")
    with pytest.raises(ConfigError, match="is a file"):
        FlowerSettings.from_run_config({"out-dir": str(tmp_path / "file")})
    for name in ("a", "b"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "run.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"out-dir .*runs holds other runs \(a, b\)"):
        FlowerSettings.from_run_config({"out-dir": str(tmp_path / "runs")})


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("min-replies", "two", "must be an integer"),
        ("round-timeout", "soon", "must be a number"),
        ("eval-every", 1.5, "must be an integer"),
        ("num-nodes", True, "must be an integer"),
        ("node-wait", "nan", "must be a finite number"),
        ("eval-every", -1, "= -1 is out of range; expected >= 0"),
        ("train-delay", -2.0, "= -2.0 is out of range; expected >= 0"),
    ],
)
def test_run_config_values_of_the_wrong_type_name_the_key(key, value, expected):
    with pytest.raises(ConfigError, match=rf"Flower run config: {key} .*{expected}"):
        FlowerSettings.from_run_config({key: value})


def test_run_config_text_values_group_keys_and_set_are_read_in_one_pass(tmp_path):
    """Keys of every group, given as a command line's text, are the TOML values they spell;
    ``set`` is split at ``;``; an unknown key is named as written, with every allowed key."""
    settings = FlowerSettings.from_run_config(
        {
            "min-replies": "2",
            "node-wait": "1.5",
            "resume": "true",
            "out-dir": str(tmp_path),
            "eval-every": "3",
            "set": " train.rounds=2 ;; data.num_users=4 ",
        }
    )
    assert (settings.replies.min_replies, settings.nodes.node_wait) == (2, 1.5)
    assert settings.output.resume is True and settings.eval_every == 3
    assert settings.overrides == ("train.rounds=2", "data.num_users=4")
    for key in ("min_replys", "overrides", "replies"):
        with pytest.raises(
            ConfigError,
            match=rf"^Flower run config: unknown key '{key}'; allowed keys: algorithm, "
            r"checkpoint-every, .*min-replies, .*out-dir, .*set, train-delay$",
        ):
            FlowerSettings.from_run_config({key: 1})


def test_settings_built_in_code_are_range_checked_naming_the_run_config_key():
    with pytest.raises(ConfigError, match=r"^Flower run config: min-replies = 0 is out of range"):
        FlowerSettings(replies=Replies(min_replies=0))
    with pytest.raises(ConfigError, match=r"^Flower run config: eval-every = -1 is out of range"):
        FlowerSettings(eval_every=-1)


@pytest.mark.usefixtures("flower_task_identity")
def test_the_server_app_holds_its_out_dir_like_fedsub_run(tmp_path):
    """A second run into an out-dir that holds one is refused unless overwrite = true, which
    replaces only what the first wrote; a run failing before its result leaves the folder as
    it was; the folder is locked while a run holds it."""
    from flwr.app import Context, RecordDict

    from fedsub.errors import FedsubError
    from fedsub.files.folder_lock import FolderLock
    from fedsub.flower.apps import make_client_app, make_server_app

    from .test_flower_heat_exchange import AppGrid
    from .test_flower_private_download import BASE

    out = tmp_path / "out"

    def serve(overwrite: bool = False, *extra: str) -> None:
        overrides = (*BASE, "train.rounds=1", *extra)
        settings = FlowerSettings(
            overrides=overrides,
            output=Output(out_dir=str(out), overwrite=overwrite),
            replies=Replies(round_timeout=30.0),
        )
        grid = AppGrid(make_client_app(settings), 4)
        make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]

    serve()
    first = (out / "flower-result.json").read_text()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FedsubError, match="already holds a run; pass overwrite = true"):
        serve()
    lock = FolderLock.acquire(out)
    try:
        with pytest.raises(FedsubError, match=f"output folder {out} is in use by another"):
            serve(True)
    finally:
        lock.release()
    with pytest.raises(FedsubError):  # fails before any round: the first run stays
        serve(True, "train.clients_per_round=100")
    assert (out / "flower-result.json").read_text() == first
    serve(True, "train.lr=0.3")
    assert (out / "flower-result.json").read_text() != first
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == [
        "flower-result.json",
        "heat.safetensors",
        "model.safetensors",
        "notes.txt",
        "progress.jsonl",
        "run.json",
    ]


@pytest.mark.usefixtures("flower_task_identity")
def test_each_round_goes_to_flowers_log_which_stream_shows(tmp_path, monkeypatch):
    """`flwr run --stream` shows what the ServerApp writes to stdout / stderr, where Flower's
    logger writes: each round and each evaluation is logged there."""
    import logging

    from flwr.app import Context, RecordDict
    from flwr.common.logger import FLOWER_LOGGER

    from fedsub.flower.apps import make_client_app, make_server_app

    from .test_flower_heat_exchange import AppGrid
    from .test_flower_private_download import BASE

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    FLOWER_LOGGER.addHandler(handler)
    try:
        settings = FlowerSettings(
            overrides=(*BASE, "train.rounds=2"),
            eval_every=1,
            output=Output(out_dir=str(tmp_path / "o")),
        )
        grid = AppGrid(make_client_app(settings), 4)
        make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    rounds = [r for r in records if r.startswith("fedsub round")]
    assert rounds[0] == "fedsub round 1/2: 2 of 2 sampled nodes replied; model updated"
    assert any(r.startswith("fedsub round 1: evaluation: train_loss ") for r in rounds)
    assert any(r.startswith("fedsub round 2/2: ") for r in rounds)


@pytest.mark.parametrize("left", ["flower-result.json", "progress.jsonl"])
def test_an_out_dir_a_fedsub_before_run_json_wrote_is_refused_not_mixed_into(tmp_path, left):
    """An out-dir with a Flower run's results but no run.json (fedsub before run.json) holds a
    run: a new run is refused, and overwrite too (it removes only files a run listed), so its
    checkpoints can never be resumed as the new run's."""
    from fedsub.errors import FedsubError
    from fedsub.runs.run_identity import claim_folder

    from .test_flower_dp import flower_run

    out = tmp_path / "old"
    (out / "checkpoints" / "round-000002").mkdir(parents=True)
    (out / left).write_text("{}\n")
    with pytest.raises(FedsubError, match="already holds a run; pass overwrite = true"):
        flower_run(out, (), eval_every=0)
    with pytest.raises(FedsubError, match="written by an older fedsub"):
        claim_folder(out, resume=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(["checkpoints", left])


class _Lost(Exception):
    """The ServerApp losing its SuperLink while it pushes round 2's training."""


@pytest.mark.usefixtures("flower_task_identity")
def test_a_run_failing_after_its_first_round_keeps_what_it_wrote_and_says_how_to_resume(
    tmp_path, caplog
):
    """As `fedsub run` does: a run that fails once a round completed keeps run.json, its
    progress and checkpoints (a private run at ``full`` with secagg heat, on node ids across
    the uint64 range), logs the round it stopped after and how to resume; the resumed run
    finishes; a failure before round 1 leaves nothing."""
    import json
    import logging

    from flwr.app import Context, MessageType, RecordDict

    from fedsub.flower.apps import make_client_app, make_server_app

    from .test_flower_heat_exchange import AppGrid
    from .test_flower_private_download import BASE, BUCKETS, FULL

    out = tmp_path / "out"
    overrides = (*BASE, *FULL, *BUCKETS, "privacy.heat_source='secagg'", "train.rounds=3")

    class LosesItsSuperLink(AppGrid):
        def push_messages(self, messages):
            messages = list(messages)
            if any(
                m.metadata.message_type == MessageType.TRAIN and m.metadata.group_id == "2"
                for m in messages
            ):
                raise _Lost("connection to the SuperLink lost")
            return super().push_messages(messages)

    def serve(grid_type, resume: bool = False, *extra: str) -> None:
        settings = FlowerSettings(
            overrides=(*overrides, *extra),
            output=Output(out_dir=str(out), checkpoint_every=1, resume=resume),
            replies=Replies(round_timeout=30.0),
        )
        grid = grid_type(make_client_app(settings), 4)
        make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]

    with pytest.raises(ConfigError), caplog.at_level(logging.ERROR, logger="fedsub"):
        serve(AppGrid, False, "privacy.secagg_group=10")  # refused before round 1
    assert not out.exists() or not any(out.iterdir())
    with pytest.raises(_Lost), caplog.at_level(logging.ERROR, logger="fedsub"):
        serve(LosesItsSuperLink)
    assert {"run.json", "progress.jsonl", "checkpoints"} <= {p.name for p in out.iterdir()}
    assert (out / "checkpoints" / "round-000001").is_dir()
    stopped = [r.getMessage() for r in caplog.records if "the run stopped" in r.getMessage()]
    assert len(stopped) == 1 and stopped[0].startswith(
        "fedsub: the run stopped after round 1 (_Lost: connection to the SuperLink lost); "
        f"{out} keeps what the run wrote: to continue after its newest checkpoint "
        "(round-000001), run `flwr run` again with the same run config and resume=true"
    )
    serve(AppGrid, True)
    result = json.loads((out / "flower-result.json").read_text())
    assert result["succeeded"] and [r["round"] for r in result["rounds"]] == [1, 2, 3]


@pytest.mark.usefixtures("flower_task_identity")
def test_a_config_the_server_app_refuses_is_one_fedsub_error_line_in_flowers_log():
    """Flower logs a ServerApp's exception with its traceback; a config fedsub refuses
    (``privacy.secagg_group`` above the population) is one ``fedsub: error:`` line instead,
    and a bug (any other exception) keeps its traceback."""
    import logging

    from flwr.app import Context, RecordDict
    from flwr.common.logger import FLOWER_LOGGER

    from fedsub.flower.apps import make_client_app, make_server_app

    from .test_flower_heat_exchange import AppGrid
    from .test_flower_private_download import BASE

    lines: list[str] = []
    handler = logging.Handler()
    handler.setFormatter(logging.Formatter("%(levelname)s : %(message)s"))
    handler.emit = lambda record: lines.append(handler.format(record))  # type: ignore[method-assign]
    settings = FlowerSettings(overrides=(*BASE, "train.rounds=1", "privacy.secagg_group=10"))
    FLOWER_LOGGER.addHandler(handler)
    try:
        with pytest.raises(ConfigError) as refused:
            make_server_app(settings)(
                AppGrid(make_client_app(settings), 4), Context(1, 0, {}, RecordDict(), {})
            )  # type: ignore[arg-type]
        # what flwr's run_serverapp does with the ServerApp's exception
        FLOWER_LOGGER.error("%s raised an exception", "ServerApp", exc_info=refused.value)
        FLOWER_LOGGER.error("%s raised an exception", "ServerApp", exc_info=ValueError("bug"))
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    refusal, bug = lines[-2:]
    assert refusal == (
        "ERROR : fedsub: error: privacy.secagg_group = 10 is larger than the population "
        "(privacy.level = 'download' makes the heat source 'secagg'): dataset "
        "synthetic-sparse has 4 clients; set it to at most 4"
    )
    assert bug.startswith("ERROR : ServerApp raised an exception\n") and "ValueError: bug" in bug
