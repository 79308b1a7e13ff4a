"""Algorithms composed in [algorithms.<name>] from pieces (fedsub.algorithms.compose): the
presets are the same pieces, FedSubAvg + FedProx against FedProx where every heat coefficient
is 1, one place refusing incompatible pieces, and the errors naming the key and the file."""

import dataclasses

import pytest
import torch

from fedsub import config as config_lib
from fedsub.algorithms.compose import options_class_of
from fedsub.algorithms.registry import (
    PRESETS,
    AlgorithmContext,
    build_algorithm,
    heat_coefficients,
)
from fedsub.data.synthetic_sparse import SyntheticSparseOptions, generate
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.errors import ConfigError
from fedsub.flower.settings import FlowerSettings
from fedsub.models.sparse_lr import SparseLogisticRegression
from fedsub.submodel.index import SubmodelIndex

from .conftest import make_dataset


def parse(text: str) -> config_lib.Config:
    return config_lib.parse(config_lib.tomllib.loads(text))


def run(config: config_lib.Config, name: str, dataset, rounds: int = 3):
    index = SubmodelIndex.build(dataset)
    context = AlgorithmContext(dataset, index, "samples", 4)
    algorithm = build_algorithm(name, context, config.algorithm_options(name))
    model = SparseLogisticRegression(dict(dataset.table_rows))
    float64 = Execution(dtype=torch.float64)
    schedule = Schedule(rounds, 4, LocalWork(3, 4, ClientStep(0.3)), seed=1, execution=float64)
    return train(model, algorithm, dataset, index, schedule)


def composed_like(preset: str) -> str:
    """``[algorithms.my-<preset>]``: the preset's pieces and its (non-default) options."""
    recipe = PRESETS[preset].recipe
    client = ", ".join(f'"{c}"' for c in recipe.client)
    lines = [
        f"[algorithms.my-{preset}]",
        f'aggregation = "{recipe.aggregation}"',
        f"client = [{client}]",
        f'server = "{recipe.server}"',
    ]
    options = {"mu": 0.2, "server_lr": 0.05, "beta1": 0.8, "server_momentum": None}
    names = {f.name for f in dataclasses.fields(PRESETS[preset].options)}
    takes = {f.name for f in dataclasses.fields(options_class_of(recipe))}  # adagrad: no betas
    lines += [f"{k} = {v}" for k, v in options.items() if k in takes & names and v is not None]
    lines += [f"{k} = {str(v).lower()}" for k, v in PRESETS[preset].fixed]
    preset_options = [f"{k} = {v}" for k, v in options.items() if k in names and v is not None]
    return "\n".join([*lines, f"[algorithms.{preset}]", *preset_options]) + "\n"


@pytest.fixture(scope="module")
def sparse():
    return generate(SyntheticSparseOptions(num_users=16, num_items=20, mean_samples_per_user=8), 2)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_equals_the_same_pieces_composed_in_the_config(sparse, preset):
    """E.g. FedSubAvg + server Adam (or Yogi) from a config is fedsubavg-adam (-yogi), bit
    for bit, with the same options."""
    config = parse(f'[train]\nalgorithms = ["{preset}", "my-{preset}"]\n' + composed_like(preset))
    ours = run(config, f"my-{preset}", sparse).state_dict()
    reference = run(config, preset, sparse).state_dict()
    for name, value in reference.items():
        assert torch.equal(ours[name], value), name


def test_fedsubavg_with_prox_equals_fedprox_when_every_heat_coefficient_is_one():
    """Every client's samples touch every row: each row's heat is the total, coefficient 1,
    and FedSubAvg + FedProx must be FedProx (reference: tests/test_local_sgd.py checks
    FedProx's client steps against torch.optim.SGD). With one cold row it must differ."""
    everywhere = [[[0, 1, 2, 3], [1], [2, 3]], [[0, 1, 2, 3], [0, 2]], [[3, 2, 1, 0]] * 3]
    config = parse(
        '[algorithms.sub-prox]\naggregation = "fedsubavg"\nclient = ["prox"]\nmu = 0.7\n'
        "[algorithms.fedprox]\nmu = 0.7\n"
    )
    dataset = make_dataset(everywhere * 2, table_rows=4)
    context = AlgorithmContext(dataset, SubmodelIndex.build(dataset), "samples")
    assert torch.equal(heat_coefficients(context)["t"], torch.ones(4, dtype=torch.float64))
    composed, fedprox = run(config, "sub-prox", dataset), run(config, "fedprox", dataset)
    torch.testing.assert_close(composed.tables["t"], fedprox.tables["t"], rtol=0, atol=1e-12)
    plain = run(config, "fedsubavg", dataset)
    assert (composed.tables["t"] - plain.tables["t"]).abs().max() > 1e-4  # mu does act

    cold = make_dataset([*everywhere * 2, [[4]]], table_rows=5)  # row 4: one client only
    composed, fedprox = run(config, "sub-prox", cold), run(config, "fedprox", cold)
    assert not torch.allclose(composed.tables["t"], fedprox.tables["t"])


def test_composed_algorithm_with_client_adam_runs_from_the_command_line(tmp_path, capsys):
    from fedsub.cli import main

    path = tmp_path / "c.toml"
    path.write_text(
        '[train]\nalgorithms = ["fedavg", "sub-adam@scheme2"]\nrounds = 2\nclients_per_round = 4\n'
        "[data]\nnum_users = 12\n"
        '[algorithms.sub-adam]\naggregation = "fedsubavg"\nclient = ["adam", "prox"]\n'
        'server = "yogi"\nmu = 0.1\nclient_beta1 = 0.5\n'
    )
    assert main(["compare", str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    saved = config_lib.load(tmp_path / "out" / "config.toml")  # the resolved config reads back
    assert saved.algorithms == config_lib.load(path).algorithms
    assert (tmp_path / "out" / "sub-adam@scheme2" / "metrics.jsonl").exists()


BASE = '[train]\nalgorithms = ["x"]\n'


@pytest.mark.parametrize(
    "text, message",
    [
        (
            '[algorithms.x]\naggregation = "fedsubavg"\nbeta1 = 0.9\n',
            "[algorithms.x] key 'beta1' is an option of server 'adam' and server 'adagrad' and "
            "server 'yogi', "
            "which x does not use (aggregation fedsubavg, client [-], server sgd)",
        ),
        ('[algorithms.x]\nclient = ["adam"]\nmu = 0.1\n', "key 'mu' is an option of client"),
        ('[algorithms.x]\nserver = "adamw"\n', "algorithms.x.server = 'adamw' is not allowed"),
        ('[algorithms.x]\nclient = ["nesterov"]\n', "algorithms.x.client = 'nesterov'"),
        ('[algorithms.x]\nclient = "prox"\n', "algorithms.x.client must be a list"),
        ('[algorithms.x]\naggregation = "median"\n', "algorithms.x.aggregation = 'median'"),
        ('[algorithms.x]\nclient = ["prox"]\nfoo = 1\n', "[algorithms.x] unknown key 'foo'"),
        ('[algorithms.x]\nclient = ["prox"]\nmu = -1\n', "algorithms.x.mu = -1.0 is out of"),
        (
            '[algorithms.x]\nclient = ["adam"]\nclient_beta2 = 1.0\n',
            "algorithms.x.client_beta2 = 1.0 is out of range; expected < 1.0",
        ),
        ('[algorithms.x]\nclient = ["prox", "prox"]\n', "client piece 'prox' is named twice"),
        (
            BASE + 'momentum = 0.9\n[algorithms.x]\nclient = ["adam"]\n',
            "algorithm 'x': train.momentum = 0.9 is SGD's momentum; client piece 'adam' makes",
        ),
        ('[algorithms.fedavg]\nserver = "adam"\n', "[algorithms.fedavg] is a preset"),
        ('[algorithms.y]\nclient = ["prox"]\n', "train.algorithms = 'x' is not allowed"),
        (
            '[train]\nalgorithms = ["x@scheme1"]\n[algorithms.x]\naggregation = "central"\n',
            "x samples no clients (its aggregation 'central' pools the data)",
        ),
        (  # SCAFFOLD's correction on one pooled client is zero: central-sgd's model exactly
            '[algorithms.x]\naggregation = "central"\nclient = ["scaffold"]\n',
            "algorithm 'x': its client piece 'scaffold' keeps per-client state to correct each "
            "client's drift from the others, but its aggregation 'central' pools the data",
        ),
        (
            BASE + 'masking = "static"\n[model]\nname = "cnn"\n[data]\nname = "synthetic-li"\n'
            '[algorithms.x]\nclient = ["scaffold"]\n',
            "masking.scheme = 'static' cannot be combined with algorithm 'x': its client piece "
            "'scaffold' keeps per-client state",
        ),
        *(
            (
                f'[train]\nalgorithms = ["fedavg@{scheme}"]\nmasking = "static"\n'
                '[model]\nname = "cnn"\n[data]\nname = "synthetic-li"\n',
                f"masking.scheme = 'static' cannot be combined with algorithm 'fedavg@{scheme}': "
                f"scheme {scheme!r} weights clients by weights that do not sum to 1",
            )
            for scheme in ("scheme2", "scheme2-delta", "original")
        ),
    ],
)
def test_bad_compositions_name_the_key_the_pieces_and_the_file(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text if text.startswith("[train]") else BASE + text)
    with pytest.raises(ConfigError) as error:
        config_lib.load(path)
    assert message in str(error.value)
    assert str(path) in str(error.value)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_masking_and_flower_refuse_the_same_pieces(name):
    """One rule (the pieces' declared properties) for both: per-client state or pooled data."""
    masked = f'[train]\nalgorithms = ["{name}"]\nmasking = "static"\n[model]\nname = "cnn"\n'
    refused_by_masking = refused_by_flower = False
    try:
        parse(masked + '[data]\nname = "synthetic-li"\n')
    except ConfigError:
        refused_by_masking = True
    try:
        FlowerSettings(algorithm=name).algorithm_name(parse(""))
    except ConfigError as error:
        refused_by_flower = True
        assert "cannot run on Flower" in str(error)
    refused = ("scaffold", "scaffold-submodel", "central-sgd")
    assert refused_by_masking == refused_by_flower == (name in refused)


def test_flower_refuses_a_composed_algorithm_with_per_client_state():
    config = parse('[algorithms.drift]\naggregation = "fedsubavg"\nclient = ["scaffold"]\n')
    with pytest.raises(ConfigError, match="client piece 'scaffold' keeps per-client state"):
        FlowerSettings(algorithm="drift").algorithm_name(config)
    ok = parse('[algorithms.sub-prox]\naggregation = "fedsubavg"\nclient = ["prox"]\n')
    assert FlowerSettings(algorithm="sub-prox@scheme2").algorithm_name(ok) == "sub-prox@scheme2"


def test_list_algorithms_shows_presets_as_pieces_and_every_piece(capsys):
    from fedsub.cli import main

    assert main(["list", "algorithms"]) == 0
    out = capsys.readouterr().out
    assert "= aggregation fedsubavg, client [-], server adam" in out  # fedsubavg-adam
    assert "= aggregation fedavg, client [prox], server sgd" in out  # fedprox
    for piece in ("fedavg:", "fedsubavg:", "central:", "prox:", "adam:", "scaffold:", "yogi:"):
        assert f"\n  {piece}" in out
    assert "    client_beta1: a number, default 0.9, >= 0.0, < 1.0" in out
    assert "    server_momentum: a number (optional), default unset" in out
