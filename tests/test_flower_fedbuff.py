"""FedBuff over Flower nodes (flower/fedbuff_server.py): the real ServerApp and ClientApp on an
in-process grid whose replies come one at a time in the order their messages were sent
(``OneByOne``), against the in-process FedBuff (clock/fedbuff.py) with every client as fast
(so its clients finish in the order they started: the same staleness pattern); and the
[clock] keys refused on Flower."""

from __future__ import annotations

import json
from collections.abc import Iterable

import pytest
import torch
from safetensors.torch import load_file

import fedsub
from fedsub.errors import ConfigError
from fedsub.flower.settings import FlowerSettings, Output, Replies
from fedsub.runs.experiment import compare

from .test_flower import OVERRIDES
from .test_flower_heat_exchange import AppGrid

pytestmark = pytest.mark.usefixtures("flower_task_identity")

FEDBUFF = ("clock.mode='fedbuff'", "clock.concurrency=3", "clock.buffer_size=2")
# the virtual clock with every client equally fast (same bytes, same speeds): finishing
# order = starting order, ties broken by the draw's number, as OneByOne delivers replies
SAME_SPEED = (
    "clock.transfer='whole-model'",
    "clock.compute_sigma=0.0",
    "clock.download_sigma=0.0",
    "clock.upload_sigma=0.0",
)


class OneByOne(AppGrid):
    """An AppGrid whose pulls return one reply: the earliest sent of those asked for."""

    def pull_messages(self, message_ids: Iterable[str]) -> list:
        wanted = set(message_ids)
        for message_id in list(self.arrived):
            if message_id in wanted and self.arrived[message_id]:
                return self.arrived.pop(message_id)
        return []


def in_process(overrides: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The final model of the config's (last) algorithm, trained in process."""
    config = fedsub.Config.from_toml(None, overrides)
    params = compare(config, None).params[config.train.algorithms[-1]]
    return params.state_dict()  # type: ignore[union-attr]


def flower_run(tmp_path, overrides: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], dict]:
    from flwr.app import Context, RecordDict

    from fedsub.flower.apps import make_client_app, make_server_app

    settings = FlowerSettings(
        overrides=overrides,
        output=Output(out_dir=str(tmp_path)),
        replies=Replies(round_timeout=30.0),
    )
    grid = OneByOne(make_client_app(settings), 6)
    make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
    result = json.loads((tmp_path / "flower-result.json").read_text())
    return load_file(tmp_path / "model.safetensors"), result


@pytest.mark.parametrize("algorithm", ["fedsubavg", "fedavg"])
def test_fedbuff_on_flower_is_the_in_process_fedbuff(tmp_path, algorithm):
    """Four steps of B = 2 with C = 3 of 6 nodes: the model equals the virtual clock's FedBuff
    with the same staleness pattern (fedsubavg: the staleness-aware heat; fedavg: FedBuff's
    plain rule), and the steps did combine stale updates."""
    overrides = (
        *OVERRIDES,
        "train.rounds=4",
        f"train.algorithms=['{algorithm}']",
        *FEDBUFF,
    )
    flower, result = flower_run(tmp_path, overrides)
    expected = in_process((*overrides, *SAME_SPEED))
    for name, value in expected.items():
        torch.testing.assert_close(flower[name], value, rtol=0, atol=1e-7)
    rounds = result["rounds"]
    assert [r["replies"] for r in rounds] == [2, 2, 2, 2]
    staleness = [tau for r in rounds for tau in r["staleness"]]
    assert staleness[:2] == [0, 0] and max(staleness) >= 1  # stale updates were combined
    assert all(r["updated"] for r in rounds)
    # not the model four synchronous rounds of the algorithm give
    synchronous = in_process((*OVERRIDES, "train.rounds=4", f"train.algorithms=['{algorithm}']"))
    assert any(not torch.allclose(flower[n], v, atol=1e-4) for n, v in synchronous.items())


@pytest.mark.parametrize(
    "extra, key",
    [
        ("clock.compute_sigma=0.0", "clock.compute_sigma"),
        ("clock.trace='devices.csv'", "clock.trace"),
        ("clock.availability='markov'", "clock.availability"),
        ("clock.transfer='submodel'", "clock.transfer"),
    ],
)
def test_virtual_time_keys_are_refused_on_flower(extra, key):
    settings = FlowerSettings(overrides=(*OVERRIDES, *FEDBUFF, extra))
    with pytest.raises(ConfigError, match=rf"{key} with clock.mode = \"fedbuff\" on Flower"):
        settings.fedsub_config()


def test_synchronous_clock_is_refused_on_flower():
    settings = FlowerSettings(overrides=(*OVERRIDES, "clock.mode='synchronous'"))
    with pytest.raises(ConfigError, match=r"synchronous rounds .* in-process only"):
        settings.fedsub_config()


def test_fedbuff_keys_are_accepted_on_flower():
    config = FlowerSettings(overrides=(*OVERRIDES, *FEDBUFF)).fedsub_config()
    assert config.clock.buffered.buffer_size == 2


class _Lost(Exception):
    pass


def test_a_resumed_fedbuff_run_sends_afresh_and_continues_the_draws(tmp_path):
    """A FedBuff ServerApp that loses its SuperLink as step 3 sends its first message keeps
    its checkpoints (after steps 1 and 2); resumed, it finishes, its step 3 combines only
    fresh work (the updates in flight when it stopped are not waited for: staleness 0), and
    its first send is the draw that follows the checkpoint's count."""
    from flwr.app import Context, MessageType, RecordDict

    from fedsub.clock.fedbuff import draw_client
    from fedsub.flower.apps import make_client_app, make_server_app

    out = tmp_path / "out"
    overrides = (*OVERRIDES, "train.rounds=4", *FEDBUFF)

    class LosesItsSuperLink(OneByOne):
        def push_messages(self, messages):
            messages = list(messages)
            if any(
                m.metadata.message_type == MessageType.TRAIN and m.metadata.group_id == "3"
                for m in messages
            ):
                raise _Lost("connection to the SuperLink lost")
            return super().push_messages(messages)

    def serve(grid_type, resume: bool = False) -> None:
        settings = FlowerSettings(
            overrides=overrides,
            output=Output(out_dir=str(out), checkpoint_every=1, resume=resume),
            replies=Replies(round_timeout=30.0),
        )
        grid = grid_type(make_client_app(settings), 6)
        make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]

    with pytest.raises(_Lost):
        serve(LosesItsSuperLink)
    progress = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    closed = [p for p in progress if "staleness" in p]
    assert [p["round"] for p in closed] == [1, 2]
    draws = sum(len(p["sent_to"]) for p in closed)
    serve(OneByOne, True)
    result = json.loads((out / "flower-result.json").read_text())
    assert result["succeeded"] and [r["round"] for r in result["rounds"]] == [1, 2, 3, 4]
    step3 = result["rounds"][2]
    assert step3["staleness"] == [0, 0]
    seed = fedsub.Config.from_toml(None, overrides).train.seed
    first = draw_client(seed, draws, torch.arange(6).numpy())  # nothing in flight: all 6 free
    assert step3["sent_to"][0] == first
