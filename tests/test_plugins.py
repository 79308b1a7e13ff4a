"""Plugins through the real mechanism: a package's ``*.dist-info/entry_points.txt`` on
``sys.path`` in the ``fedsub.plugins`` group, read by importlib.metadata (fedsub/plugins.py).

The example package of ``examples/plugin-package`` is installed that way from its own
``pyproject.toml`` entry points: its model, dataset, aggregation rule and client transform
appear in the registries and in ``fedsub list`` with their package, a config trains with
them, and each computes what it says (the rule against FedSubAvg / FedAvg, the transform
against ``torch.sign``). A broken plugin is named and skipped, the rest still works."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from fedsub import plugins
from fedsub.algorithms.aggregation_rules import AGGREGATIONS, aggregation_names
from fedsub.algorithms.registry import PRESETS, Recipe, check_combination
from fedsub.cli import main
from fedsub.client.transforms import TRANSFORMS, transform_names
from fedsub.config import parse
from fedsub.data.registry import DATASETS, dataset_names, load_dataset
from fedsub.errors import ConfigError
from fedsub.models.registry import MODELS, build_model, model_names, model_spec

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plugin-package"
PACKAGE = "fedsub-example-plugin"


def install(
    site: Path, dist: str, entry_points: dict[str, str], sources: dict[str, str | Path]
) -> None:
    """Write ``dist``'s modules (name -> text, or a folder to copy) and its dist-info with
    ``entry_points`` (name -> "module:attribute") into ``site``, as pip would."""
    for name, source in sources.items():
        if isinstance(source, Path):
            shutil.copytree(source, site / name)
        else:
            (site / f"{name}.py").write_text(source)
    info = site / f"{dist.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1.0\n")
    lines = [f"{name} = {target}" for name, target in entry_points.items()]
    (info / "entry_points.txt").write_text("[fedsub.plugins]\n" + "\n".join(lines) + "\n")


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on sys.path for installed plugins; fedsub forgets them afterwards."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for name, module in list(sys.modules.items()):  # the plugins' modules only
        if str(getattr(module, "__file__", None) or "").startswith(str(folder)):
            del sys.modules[name]
    monkeypatch.undo()
    plugins.refresh()


def install_example(site: Path) -> None:
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    entry_points = project["project"]["entry-points"]["fedsub.plugins"]
    package = EXAMPLE / "src" / "fedsub_example_plugin"
    install(site, project["project"]["name"], entry_points, {package.name: package})
    importlib.invalidate_caches()
    plugins.refresh()


@pytest.fixture
def example(site):
    install_example(site)
    return site


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_example_package_adds_one_of_each_without_editing_fedsub(example):
    assert "id-bias-lr" in model_names()
    assert "toy-clicks" in dataset_names()
    assert "heat-power" in aggregation_names()
    assert "sign" in transform_names()
    for registry, name in [
        (MODELS, "id-bias-lr"),
        (DATASETS, "toy-clicks"),
        (AGGREGATIONS, "heat-power"),
        (TRANSFORMS, "sign"),
    ]:
        assert registry.origin(name) == f"plugin {PACKAGE} (entry point {name})"
    assert MODELS.origin("sparse-lr") == plugins.BUILT_IN
    assert plugins.problems() == []
    assert model_spec("id-bias-lr").capabilities() == ()  # no cohort head: vmapped


def test_without_the_package_its_names_are_unknown():
    assert "id-bias-lr" not in model_names()
    with pytest.raises(ConfigError, match=r"model\.name = 'id-bias-lr' is not allowed; choose"):
        parse({"model": {"name": "id-bias-lr"}})


@pytest.mark.parametrize(
    ("kind", "lines"),
    [
        ("models", ["id-bias-lr: logistic regression", "model.init_std: a number"]),
        ("datasets", ["toy-clicks: generated user x item", "data.num_items: an integer"]),
        ("algorithms", ["heat-power: FedSubAvg's mean", "heat_power: a number", "sign: Sign"]),
    ],
)
def test_fedsub_list_shows_the_plugins_and_their_package(example, capsys, kind, lines):
    code, out, err = run_cli(capsys, "list", kind)
    assert code == 0, err
    assert err == ""
    for line in lines:
        assert line in out
    assert f"[plugin {PACKAGE} (entry point " in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_a_config_trains_the_plugin_model_on_the_plugin_dataset_with_its_pieces(
    example, tmp_path, capsys
):
    config = tmp_path / "plugin.toml"
    config.write_text(
        '[data]\nname = "toy-clicks"\nnum_clients = 6\n'
        '[model]\nname = "id-bias-lr"\ninit_std = 0.01\n'
        '[train]\nalgorithms = ["fedavg", "powered-sign"]\nrounds = 12\nclients_per_round = 3\n'
        "local_steps = 3\nbatch_size = 4\nlr = 0.5\n"
        "[eval]\nevery = 12\n"
        '[algorithms.powered-sign]\naggregation = "heat-power"\nclient = ["sign"]\n'
        "heat_power = 0.5\nstep = 0.1\n"
    )
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "compare", str(config), "--out", str(out), "--quiet")
    assert code == 0, err
    for name in ("fedavg", "powered-sign"):
        metrics = (out / name / "metrics.jsonl").read_text().splitlines()
        losses = [json.loads(line)["train_loss"] for line in metrics]
        assert losses[-1] < losses[0], name
    assert 'name = "id-bias-lr"' in (out / "config.toml").read_text()


def _compare(algorithm_options, algorithms, heat="samples"):
    from fedsub.library import compare

    dataset = load_dataset("toy-clicks", DATASETS["toy-clicks"].options(), None, 0)
    model = build_model("id-bias-lr", dataset, {"init_std": 0.1})
    return compare(
        model,
        dataset,
        algorithms=algorithms,
        algorithm_options=algorithm_options,
        rounds=3,
        clients_per_round=3,
        local_steps=2,
        batch_size=4,
        lr=0.3,
        heat=heat,
        every=3,
    )


@pytest.mark.parametrize("heat", ["samples", "clients"])
def test_heat_power_one_is_fedsubavg_and_zero_is_fedavg(example, heat):
    """The plugin rule's formula: coefficient ** heat_power (1: FedSubAvg's coefficients,
    0: none, FedAvg), through config options, on the same schedule, bit for bit; 0.5 is
    neither."""
    options = {
        f"power-{p}": {"aggregation": "heat-power", "heat_power": p} for p in (0.0, 0.5, 1.0)
    }
    runs = _compare(options, ["fedavg", "fedsubavg", *options], heat)
    params = {name: run.params for name, run in runs.items()}
    assert all(p is not None for p in params.values())

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors(), strict=True))

    same_as_fedsubavg = same(params["power-1.0"], params["fedsubavg"])
    assert same_as_fedsubavg
    if heat == "samples":  # fedavg is sample-weighted; heat "clients" weights uniformly
        assert same(params["power-0.0"], params["fedavg"])
    assert not same(params["power-0.5"], params["fedsubavg"])
    assert not same(params["power-0.5"], params["power-0.0"])


def test_the_sign_transform_steps_by_the_sign_of_each_entry(example):
    sign = TRANSFORMS["sign"](step=0.25)
    grads = [torch.tensor([[-3.0, 0.0], [2.0, 1e-9]]), torch.tensor([0.5, -0.0])]
    updates, state = sign.update(grads, {}, grads, None)
    assert state == {}
    assert torch.equal(updates[0], torch.tensor([[-0.25, 0.0], [0.25, 0.25]]))
    assert torch.equal(updates[1], torch.tensor([0.25, 0.0]))


BROKEN = "import no_such_module_for_fedsub  # a plugin with a missing dependency\n"
NOT_A_PIECE = "VALUE = 42\n"
CLASH = (
    "import dataclasses\n"
    "from fedsub.models.registry import model_spec\n"
    "SPEC = dataclasses.replace(model_spec('sparse-lr'), description='a copy')\n"
)


@pytest.mark.filterwarnings("ignore::fedsub.plugins.PluginWarning")
def test_a_broken_plugin_is_named_and_the_rest_still_list_and_run(example, capsys, tmp_path):
    install(
        example,
        "broken-plugin",
        {"bad": "broken_mod:SPEC", "odd": "odd_mod:VALUE", "twice": "clash_mod:SPEC"},
        {"broken_mod": BROKEN, "odd_mod": NOT_A_PIECE, "clash_mod": CLASH},
    )
    importlib.invalidate_caches()
    plugins.refresh()
    code, out, err = run_cli(capsys, "list", "models")
    assert code == 0
    assert "id-bias-lr: logistic regression" in out  # the working plugin is still there
    assert "sparse-lr: logistic regression on sparse ids" in out  # not the clash's copy
    problems = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(problems) == 3, err
    prefix = "warning: fedsub plugin 'broken-plugin', entry point "
    assert f"{prefix}'bad' (group fedsub.plugins): loading 'broken_mod:SPEC' failed: " in err
    assert "ModuleNotFoundError: No module named 'no_such_module_for_fedsub'" in err
    assert f"{prefix}'odd' (group fedsub.plugins): 42 is none of: " in err
    assert f"{prefix}'twice' (group fedsub.plugins): model 'sparse-lr' is already defined" in err
    with pytest.warns(plugins.PluginWarning, match="'broken-plugin', entry point 'bad'"):
        plugins.refresh()
        model_names()
    assert parse({"model": {"name": "id-bias-lr"}}).model.name == "id-bias-lr"


RULE_WITHOUT_A_SUM = """
import dataclasses
from typing import ClassVar

from fedsub.algorithms.aggregation import weighted_sum


def halved(cohort, aggregation):
    update = weighted_sum(cohort, aggregation)
    tables = {t: dataclasses.replace(u, values=u.values * 0.5) for t, u in update.tables.items()}
    dense = {n: v * 0.5 for n, v in update.dense.items()}
    return dataclasses.replace(update, tables=tables, dense=dense)


@dataclasses.dataclass(frozen=True)
class Halved:
    name: ClassVar[str] = "halved"
    description: ClassVar[str] = "half the weighted mean, by its own combine step"
    pools_data: ClassVar[bool] = False
    needs_heat: ClassVar[bool] = False
    secure_sum_ok: ClassVar[bool] = False
    weights_sum_to_one: ClassVar[bool] = True

    def build(self, inputs, scheme):
        return dataclasses.replace(inputs.aggregation(scheme, "samples"), combine_step=halved)
"""


def test_a_rule_with_its_own_combine_step_runs_it_and_is_refused_where_a_sum_is_needed(
    example,
):
    """A rule's declared ``secure_sum_ok = False`` keeps it from private rounds and masking
    (no name is checked); its combine step is what the round applies: half the mean with
    server lr 1 is the mean with server lr 0.5, exactly."""
    sources = {"halved_rule": RULE_WITHOUT_A_SUM}
    install(example, "halved-rule", {"halved": "halved_rule:Halved"}, sources)
    importlib.invalidate_caches()
    plugins.refresh()
    recipe = Recipe("halved")
    for privacy in ("download", "full"):
        with pytest.raises(ConfigError, match="rule 'halved' does not combine by a weighted sum"):
            check_combination("mine", recipe, privacy=privacy)
    with pytest.raises(ConfigError, match="sub-model masking's slice average computes"):
        check_combination("mine", recipe, masking="static")
    check_combination("mine", recipe, privacy="heat")
    host = {"algorithms": ["mine"], "table_placement": "host"}
    with pytest.raises(ConfigError, match="'halved' does not combine by a weighted sum, and"):
        parse({"algorithms": {"mine": {"aggregation": "halved"}}, "train": host})
    options = {
        "halved-mean": {"aggregation": "halved"},
        "half-step": {"aggregation": "fedavg", "server_lr": 0.5},
    }
    runs = _compare(options, list(options))
    a, b = runs["halved-mean"].params, runs["half-step"].params
    assert a is not None and b is not None
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors(), strict=True))
    assert PRESETS["fedavg"].recipe.aggregation == "fedavg"


SERVER_PIECE = """
import dataclasses

from fedsub.algorithms.registry import ServerPiece
from fedsub.algorithms.server_optimizer import ServerSGD


@dataclasses.dataclass(frozen=True)
class StepOptions:
    step: float = dataclasses.field(default=1.0, metadata={"min_exclusive": 0.0})


PIECE = ServerPiece(
    "X += step * aggregate (a plugin's server SGD)",
    StepOptions,
    lambda context, options: lambda params: ServerSGD(options.step),
    row_local=lambda options: True,
    name="stepped-sgd",
)
"""


def test_a_plugin_server_optimizer_is_composed_with_its_options(site):
    """A ServerPiece from a plugin: its option is an [algorithms.<name>] key, and it computes
    what the built-in SGD with the same rate does, exactly."""
    install(
        site, "server-plugin", {"stepped": "server_piece:PIECE"}, {"server_piece": SERVER_PIECE}
    )
    importlib.invalidate_caches()
    plugins.refresh()
    options = {
        "stepped": {"server": "stepped-sgd", "step": 0.7},
        "plain": {"server": "sgd", "server_lr": 0.7},
        "plain-1": {"server": "sgd"},
    }
    from fedsub.data.synthetic_sparse import SyntheticSparseOptions
    from fedsub.library import compare

    dataset = load_dataset("synthetic-sparse", SyntheticSparseOptions(num_users=20), None, 0)
    model = build_model("sparse-lr", dataset, {"init_std": 0.1})
    runs = compare(
        model,
        dataset,
        algorithms=list(options),
        algorithm_options=options,
        rounds=2,
        clients_per_round=4,
        local_steps=2,
        batch_size=3,
        lr=0.2,
        every=2,
    )
    a, b, c = (runs[n].params for n in options)
    assert a is not None and b is not None and c is not None
    assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors(), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.tensors(), c.tensors(), strict=True))
