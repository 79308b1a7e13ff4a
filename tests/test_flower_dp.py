"""Central differential privacy ([dp]) on Flower: the ServerApp runs the engine's round loop,
so a Flower run with [dp] clips, noises and accounts as the in-process run with the same seed
(the same model), and reports the epsilon spent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from flwr.app import Context, RecordDict
from safetensors.torch import load_file

from fedsub.dp.settings import DpSettings
from fedsub.flower.settings import FlowerSettings, Output, Replies

from .flower_rounds import wide
from .test_flower import OVERRIDES
from .test_flower_heat_exchange import AppGrid

# seeded: the Flower run is compared with the in-process run bit for bit
DP = ("dp.mechanism='gaussian'", "dp.noise_multiplier=0.8", "dp.clip=0.5", "dp.randomness='seeded'")


def in_process_model(overrides: tuple[str, ...], name: str) -> dict[str, torch.Tensor]:
    """The run on fedsub's own engine, with [dp] resolved as ``fedsub compare`` resolves it
    (tests/test_flower.py's reference, plus the schedule's dp)."""

    from fedsub import config as config_lib
    from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
    from fedsub.engine.in_process import train
    from fedsub.models.registry import build_model
    from fedsub.runs.run_setup import dp_of, load_data, schedule_of
    from fedsub.submodel.index import SubmodelIndex

    config = config_lib.load(None, overrides)
    dataset = load_data(config)
    index = SubmodelIndex.build(dataset)
    model = build_model("sparse-lr", dataset, {"init_std": 0.0})
    schedule = schedule_of(config).with_setting(DpSettings, dp_of(config, dataset.num_clients))
    context = AlgorithmContext(dataset, index, config.train.heat, schedule.clients_per_round)
    algorithm = build_algorithm(name, context, config.algorithm_options(name))
    return train(model, algorithm, dataset, index, schedule).state_dict()


pytestmark = pytest.mark.usefixtures("flower_task_identity")


def flower_run(out: Path, overrides: tuple[str, ...], eval_every: int) -> dict:
    """A Flower run of six nodes in process (the ServerApp and the ClientApps over a grid in
    this process) writing into ``out``; its flower-result.json."""
    from fedsub.flower.apps import make_client_app, make_server_app

    settings = FlowerSettings(
        overrides=overrides,
        eval_every=eval_every,
        output=Output(out_dir=str(out)),
        replies=Replies(round_timeout=30.0),
    )
    grid = AppGrid(make_client_app(settings), 6)
    make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
    return json.loads((out / "flower-result.json").read_text())


@pytest.mark.parametrize("name", ["fedavg", "fedsubavg"])
def test_a_flower_run_with_dp_is_the_in_process_run_with_dp(tmp_path, name):
    overrides = (*OVERRIDES, *DP, f"train.algorithms=['{name}']")
    result = flower_run(tmp_path, overrides, eval_every=1)
    flower = load_file(tmp_path / "model.safetensors")
    expected = in_process_model(overrides, name)
    for key, value in expected.items():
        torch.testing.assert_close(flower[key], value, rtol=0, atol=1e-5)
    plain = in_process_model((*OVERRIDES, f"train.algorithms=['{name}']"), name)
    assert any(not torch.allclose(v, plain[k], atol=1e-3) for k, v in expected.items())
    epsilons = [result["evaluations"][r]["epsilon"] for r in ("1", "2", "3")]
    assert 0 < epsilons[0] < epsilons[1] < epsilons[2]  # spent round by round
    assert result["dp_randomness"] == "seeded" and "NOT a privacy" in result["dp_not_a_guarantee"]


def test_a_flower_run_with_dp_draws_its_own_secret_by_default(tmp_path):
    """Without dp.randomness = "seeded" the ServerApp's noise and cohorts come from its own
    secret: not the seeded in-process model, and no "not a guarantee" label."""
    secret = tuple(o for o in DP if "randomness" not in o)
    overrides = (*OVERRIDES, *secret, "train.algorithms=['fedavg']")
    result = flower_run(tmp_path, overrides, eval_every=3)
    assert result["dp_randomness"] == "secret" and "dp_not_a_guarantee" not in result
    flower = load_file(tmp_path / "model.safetensors")
    seeded = in_process_model((*OVERRIDES, *DP, "train.algorithms=['fedavg']"), "fedavg")
    assert any(not torch.allclose(v, flower[k], atol=1e-3) for k, v in seeded.items())


def test_a_flower_run_stopped_by_its_budget_evaluates_the_model_it_ends_with(tmp_path):
    """The loop's budget stop evaluates the final model when that round was not due (as in
    process): a budget between epsilon after 1 and after 2 rounds stops before round 2, and
    eval-every = 2 would not have evaluated round 1."""
    from fedsub import config as config_lib
    from fedsub.runs.run_setup import dp_of

    dp = dp_of(config_lib.load(None, (*OVERRIDES, *DP)), 6)
    assert dp is not None
    budget = (dp.epsilon(1) + dp.epsilon(2)) / 2
    result = flower_run(tmp_path, (*OVERRIDES, *DP, f"dp.epsilon_budget={budget}"), eval_every=2)
    assert [r["round"] for r in result["rounds"]] == [1]
    assert list(result["evaluations"]) == ["1"]
    assert result["evaluations"]["1"]["epsilon"] == pytest.approx(dp.epsilon(1))


# -- distributed DP: [dp] at privacy.level full (each node adds its noise share) -------------

DISTRIBUTED = (
    "data.num_users=4",
    "train.clients_per_round=3",
    "train.rounds=2",
    "train.heat='samples'",
    "train.algorithms=['fedavg']",
    "privacy.level='full'",
    "privacy.secagg_group=2",
    "privacy.download='randomized-response'",
    "privacy.download_keep=0.8",
    "privacy.randomness='seeded'",  # the nodes' requests are the in-process run's
    "dp.mechanism='gaussian'",
    "dp.randomness='seeded'",  # the server's cohorts are the in-process run's
    "dp.noise_multiplier=1.5",
    "dp.clip=0.5",
    "dp.rows='all'",
    "dp.min_survivors=2",
)


def test_a_flower_run_with_distributed_dp_is_the_in_process_run(tmp_path):
    """The ServerApp and ClientApps at full with [dp] and ``dp-seeded-noise``: every node
    draws its noise share from the generator the in-process member draws from, so the models
    are the same numbers; without it the nodes' own randomness gives another model."""
    from fedsub.flower.apps import make_client_app, make_server_app

    runs = {}
    for seeded in (True, False):
        out = tmp_path / str(seeded)
        settings = FlowerSettings(
            overrides=DISTRIBUTED,
            dp_seeded_noise=seeded,
            output=Output(out_dir=str(out)),
            replies=Replies(round_timeout=30.0),
        )
        grid = AppGrid(make_client_app(settings), 4)
        make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
        runs[seeded] = load_file(out / "model.safetensors")
    expected = in_process_model(DISTRIBUTED, "fedavg")
    for key, value in expected.items():
        torch.testing.assert_close(runs[True][key], value, rtol=0, atol=1e-6)
    # by default each node's own secret randomness: other noise, another model
    assert any(not torch.allclose(v, runs[False][k], atol=1e-4) for k, v in expected.items())
    plain = in_process_model(DISTRIBUTED[:-6], "fedavg")  # the same run without [dp]
    assert any(not torch.allclose(v, plain[k], atol=1e-3) for k, v in expected.items())


def _stepped(grid_of, overrides=DISTRIBUTED):
    """The ServerApp's runtime (its schedule with [dp] resolved, as run_model resolves it)."""

    from fedsub.flower.apps import make_client_app
    from fedsub.runs.run_setup import dp_of

    from .flower_rounds import private_runtime

    settings = FlowerSettings(
        overrides=overrides, dp_seeded_noise=True, replies=Replies(round_timeout=30.0)
    )
    grid = grid_of(make_client_app(settings), 4)
    stepped = private_runtime(settings, grid)
    config = settings.fedsub_config()
    schedule = stepped.runtime.schedule
    stepped.runtime.schedule = schedule.with_setting(DpSettings, dp_of(config, 4))
    return stepped, grid


def test_the_server_decodes_the_clipped_sum_plus_noise_of_the_stated_variance(monkeypatch):
    """What the server decodes is the nodes' clipped vectors in fixed point plus discrete
    Gaussian noise of variance (survivors) sigma_share^2 per value (written out here from the
    vectors the nodes built), never the plain sum; the loop's ledger spends epsilon per round
    as the in-process run's settings say."""
    import numpy as np

    import fedsub.privacy.secure_rows_protocol as secure_rows
    from fedsub.dp.distributed import DiscreteNoise
    from fedsub.runs.run_setup import dp_of

    shares, totals = [], []
    member_share, decode_sums = DiscreteNoise.share, secure_rows.decode_sums

    def node_share(noise, values, rng):
        shares.append((values.copy(), noise))
        return member_share(noise, values, rng)

    def server_decode(slots, coding, total, clients):
        totals.append((total.copy(), clients))
        return decode_sums(slots, coding, total, clients)

    monkeypatch.setattr(DiscreteNoise, "share", node_share)
    monkeypatch.setattr(secure_rows, "decode_sums", server_decode)
    stepped, _ = _stepped(AppGrid)
    stepped.train(2)
    assert len(totals) == 2 and len(shares) == 6  # 3 nodes a round
    noise_per_value = []
    for r, (total, clients) in enumerate(totals):
        assert clients == 3
        plain = np.zeros(len(total) - 2, dtype=np.int64)
        for values, noise in shares[3 * r : 3 * r + 3]:
            x = values  # the real slots (privacy/sparse_secagg.noised_input zeroes the last two)
            factor = min(1.0, 0.5 / np.linalg.norm(x))  # dp.clip = 0.5, weight 1
            plain += np.rint(x * factor * noise.scale).astype(np.int64)
        signed = total[:-2].astype(np.int64)
        signed = np.where(signed >= 2**31, signed - 2**32, signed)
        noise_per_value.append((signed - plain) / noise.share_std)
        assert not (total[-2:]).any()  # no weight units, no clipped count
    e = np.concatenate(noise_per_value)
    assert len(e) > 400
    assert abs(e.mean()) < 4 * np.sqrt(3 / len(e))
    assert 0.9 * 3 < e.var() < 1.1 * 3  # 3 shares of variance sigma_share^2 each
    from fedsub.engine.features.dp import dp_round_of

    config = FlowerSettings(overrides=DISTRIBUTED).fedsub_config()
    settings = dp_of(config, 4)
    dp = dp_round_of(stepped.server.features)
    assert dp is not None and dp.mechanism is None  # the nodes add the noise
    assert dp.ledger.rounds == 2
    assert dp.ledger.epsilon() == settings.epsilon(2) > settings.epsilon(1) > 0


def _dropping(stage: str, nodes: set[int]):
    """An AppGrid whose ``nodes`` vanish at the secure row sum's ``stage``."""
    from flwr.app import ConfigRecord

    import fedsub.privacy.secure_rows_protocol as secure_rows
    from fedsub.flower.protocols import message_type

    class Dropping(AppGrid):
        def __init__(self, app, num_nodes):
            super().__init__(app, num_nodes)

            def drop(node, message):
                heat = message.content.get("heat")
                return (
                    message.metadata.message_type == message_type(secure_rows.SECURE_ROWS)
                    and isinstance(heat, ConfigRecord)
                    and heat["stage"] == stage
                    and node in nodes
                )

            self.drop = drop

    return Dropping


def test_dropouts_under_distributed_dp_abort_the_round_below_k_min(monkeypatch):
    """K = 3, K_min = 2: a node that drops after sending its masked share (before unmasking)
    still counts, so the sum decoded holds 3 shares; with K_min = 3 one node dropping before
    its masked share leaves 2 survivors, below the threshold K_min (the majority would be 2),
    and the round stops with secagg's error: no sum of fewer than K_min shares is decoded."""
    import fedsub.privacy.secure_rows_protocol as secure_rows
    from fedsub.privacy.secagg import SecAggError

    decoded, decode_sums = [], secure_rows.decode_sums
    monkeypatch.setattr(
        secure_rows, "decode_sums", lambda *a: decoded.append(a[-1]) or decode_sums(*a)
    )
    first, _ = _stepped(AppGrid)  # partition k is node wide(100 + k)
    member = wide(100 + int(first.open().begin(1).cohort.clients[0]))
    late, _ = _stepped(_dropping("unmask", {member}))
    late.step(1)
    assert decoded == [3] and late.rounds[0]["updated"]
    strict = (*DISTRIBUTED[:-1], "dp.min_survivors=3")
    early, _ = _stepped(_dropping("mask", {member}), strict)
    with pytest.raises(SecAggError, match=r"only 2 clients left.*t = 3"):
        early.step(1)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("dp-clip", 0.6, "dp.clip 0.6, this node's is 0.5"),
        ("dp-noise-multiplier", 1.0, "noise multiplier 1 below this node's 1.5"),
        ("dp-min-survivors", 1, "K_min 1 below this node's 2"),
    ],
)
def test_a_node_refuses_round_settings_with_less_noise_than_its_config(field, value, says):
    """A node rebuilds the round's noise from the server's public numbers and refuses any that
    would add less noise than its own copy of the run config states."""
    from flwr.app import ConfigRecord

    from fedsub import config as config_lib
    from fedsub.errors import FedsubError
    from fedsub.privacy.secure_rows_protocol import round_noise
    from fedsub.runs.run_setup import node_noise

    noise = node_noise(config_lib.load(None, DISTRIBUTED), 0)
    assert noise is not None
    fields = {"dp-clip": 0.5, "dp-noise-multiplier": 1.5, "dp-min-survivors": 2, "clients": 3}
    assert round_noise(noise, ConfigRecord(fields), 500, "node").share_std > 0
    with pytest.raises(FedsubError, match=says):
        round_noise(noise, ConfigRecord({**fields, field: value}), 500, "node")


def test_central_dp_at_download_on_flower_is_the_in_process_run(tmp_path):
    """[dp] keeps the heat exact (run_setup.heat_privacy_of), so the nodes register their S(k);
    with private download a round still asks the sampled nodes for their requests and sends
    those rows (before, it sent S(k) and every node refused the round)."""
    from fedsub.flower.apps import make_client_app, make_server_app

    overrides = (*DISTRIBUTED[:-1], "privacy.level='download'")
    settings = FlowerSettings(
        overrides=overrides,
        output=Output(out_dir=str(tmp_path)),
        replies=Replies(round_timeout=30.0),
    )
    grid = AppGrid(make_client_app(settings), 4)
    make_server_app(settings)(grid, Context(1, 0, {}, RecordDict(), {}))  # type: ignore[arg-type]
    flower = load_file(tmp_path / "model.safetensors")
    for key, value in in_process_model(overrides, "fedavg").items():
        torch.testing.assert_close(flower[key], value, rtol=0, atol=1e-6)


def test_seeded_noise_is_a_run_config_flag_off_by_default():
    assert not FlowerSettings.from_run_config({}).dp_seeded_noise
    assert FlowerSettings.from_run_config({"dp-seeded-noise": "true"}).dp_seeded_noise


# -- nodes going offline: the accounted sampling is the sampling that happened ----------------


class GoingOffline(AppGrid):
    """AppGrid whose nodes in ``off`` are not connected (absent from get_node_ids)."""

    def __init__(self, app, num_nodes: int) -> None:
        super().__init__(app, num_nodes)
        self.off: set[int] = set()

    def get_node_ids(self) -> list[int]:
        return sorted(set(self.contexts) - self.off)


def test_offline_nodes_are_dropouts_of_a_cohort_drawn_from_the_accounted_population():
    """Under [dp] the cohort is drawn from the N counted clients the accountant's rate K / N is
    over; a sampled node that is offline is sent nothing (a dropout). With half and then two
    thirds of the nodes offline, every round's epsilon is an independent dp-accounting
    computation at q = K / N within 1%, offline nodes are sampled at that rate (not only the
    online ones), and no message goes to an offline node."""
    import dp_accounting
    from flwr.app import MessageType

    from fedsub.flower.apps import make_client_app

    from .flower_rounds import private_runtime, recorded

    n, k, rounds = 12, 4, 8
    overrides = (
        f"data.num_users={n}",
        f"train.clients_per_round={k}",
        f"train.rounds={rounds}",
        "train.algorithms=['fedavg']",
        *DP,
    )
    settings = FlowerSettings(
        overrides=overrides, replies=Replies(round_timeout=30.0, max_failed_rounds=rounds)
    )
    grid = GoingOffline(make_client_app(settings), n)
    sent = recorded(grid)
    run = private_runtime(settings, grid)
    run.open()
    offline_sampled = 0
    for r in range(1, rounds + 1):
        grid.off = {wide(100 + j) for j in range(0 if r <= 2 else (6 if r <= 5 else 8))}
        before = len(sent)
        run.step(r)
        trained = {
            m.metadata.dst_node_id
            for m in sent[before:]
            if m.metadata.message_type == MessageType.TRAIN
        }
        assert trained.isdisjoint(grid.off), (r, trained)
        record = run.rounds[-1]
        assert record["sampled"] == k  # drawn from all N, online or not
        offline_sampled += sum(node in grid.off for node in record["nodes"])
        accountant = dp_accounting.rdp.RdpAccountant(
            neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
        )
        event = dp_accounting.SampledWithoutReplacementDpEvent(
            n, k, dp_accounting.GaussianDpEvent(0.8 / 2)
        )
        accountant.compose(event, r)
        assert record["epsilon"] == pytest.approx(accountant.get_epsilon(n**-1.1), rel=0.01)
    assert offline_sampled > 0  # the offline nodes were drawn, and dropped out


def test_flower_refuses_dp_when_round_1_counted_fewer_clients_than_accounted():
    from fedsub.errors import FedsubError
    from fedsub.flower.apps import make_client_app

    from .flower_rounds import private_runtime

    overrides = (
        "data.num_users=6",
        "train.clients_per_round=3",
        "train.algorithms=['fedavg']",
        *DP,
    )
    settings = FlowerSettings(overrides=overrides, replies=Replies(round_timeout=30.0))
    grid = GoingOffline(make_client_app(settings), 6)
    grid.off = {wide(104), wide(105)}
    run = private_runtime(settings, grid)
    run.runtime.joining.min_nodes = 4  # round 1 starts with 4 of the 6 nodes
    with pytest.raises(FedsubError, match="accounted over N = 6"):
        run.open()


def test_a_flower_run_with_dp_reports_epsilon_every_round_without_evaluating(tmp_path):
    overrides = (*OVERRIDES, *DP, "train.algorithms=['fedavg']")
    result = flower_run(tmp_path, overrides, eval_every=0)
    epsilons = [record["epsilon"] for record in result["rounds"]]
    assert len(epsilons) == 3 and 0 < epsilons[0] < epsilons[1] < epsilons[2]
    assert result["dp"]["epsilon"] == epsilons[-1]
    assert result["dp"]["noise_multiplier"] == 0.8 and result["dp"]["rounds"] == 3
    from fedsub.engine.round_records import round_line

    assert round_line(result["rounds"][0], 3).endswith(f"; epsilon {epsilons[0]:.4g}")


def test_seeded_noise_needs_seeded_randomness():
    """dp-seeded-noise draws the nodes' shares from train.seed: refused in a run whose
    dp.randomness is secret (its outputs would not say the epsilon is no guarantee)."""
    from fedsub.errors import ConfigError

    secret = tuple(o for o in DISTRIBUTED if "randomness" not in o)
    with pytest.raises(ConfigError, match="dp-seeded-noise = true draws the nodes' noise"):
        FlowerSettings(overrides=secret, dp_seeded_noise=True).fedsub_config()
    assert FlowerSettings(overrides=secret).fedsub_config().dp.trust.randomness == "secret"
    assert FlowerSettings(overrides=DISTRIBUTED, dp_seeded_noise=True).fedsub_config()
