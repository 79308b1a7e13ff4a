"""``execution.table_placement = "host"``: the tables stay on the host, only each round's union of
the cohort's rows travels to the device (engine/placement.py).

On the CPU both placements run the same kernels, so their models are equal bit for bit; the
memory claim is checked structurally (what the backends receive is the union's rows only, and
the bytes moved per round are those rows times dim times the item size). CUDA tests skip
without a GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fedsub import config as config_lib
from fedsub import device as device_lib
from fedsub.algorithms.registry import AlgorithmContext, build_algorithm
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.engine import placement
from fedsub.engine.execution import Execution
from fedsub.engine.in_process import train
from fedsub.engine.loop import Interrupted, RunControl
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.errors import ConfigError
from fedsub.runs.run_setup import schedule_of
from fedsub.submodel.index import SubmodelIndex

from .equivalence import with_execution
from .test_backends import run, setup

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
# row-local server steps: plain averaging (with and without heat coefficients), lazy
# adaptive servers (per-row state on the host), one pooled client
ROW_LOCAL = ["fedavg", "fedsubavg", "fedadam-lazy", "fedyogi-lazy", "central-sgd"]


def test_train_table_placement_is_a_config_key_of_the_schedule():
    assert schedule_of(config_lib.load(None)).execution.table_placement == "device"
    config = config_lib.load(None, ['execution.table_placement="host"'])
    assert schedule_of(config).execution.table_placement == "host"
    with pytest.raises(ConfigError, match=r"execution\.table_placement = 'disk' is not allowed"):
        config_lib.load(None, ['execution.table_placement="disk"'])


CASES = [
    *((algorithm, "batched", False) for algorithm in ROW_LOCAL),
    ("fedsubavg", "sequential", False),
    ("fedsubavg", "batched", True),  # with the CPU fast paths
    # Scheme II's model average rescales every host row (O(M) on the host, none to the device)
    ("fedsubavg@scheme2", "batched", False),
]


@pytest.mark.parametrize("algorithm,backend,fast", CASES)
@pytest.mark.parametrize("data", ["synthetic", "two-tables-dense"])
def test_host_placement_equals_device_placement_bit_for_bit(
    monkeypatch, data, algorithm, backend, fast
):
    monkeypatch.setattr(device_lib, "CPU_FAST_PATHS", fast)
    schedule = Schedule(
        3,
        6,
        LocalWork(3, 2, ClientStep(0.3)),
        seed=1,
        execution=Execution(dtype=torch.float64, backend=backend),
    )
    on_device = run(data, algorithm, schedule)
    on_host = run(data, algorithm, with_execution(schedule, table_placement="host"))
    for name, expected in on_device.state_dict().items():
        assert expected.abs().max() > 1e-3, name
        assert torch.equal(on_host.state_dict()[name], expected), name


def reference_union(index: SubmodelIndex, table: str, clients: np.ndarray) -> set[int]:
    return {int(r) for k in clients for r in index.client_rows(table, int(k))}


@pytest.mark.parametrize("data", ["synthetic", "two-tables-dense"])
def test_only_the_union_of_the_cohorts_rows_travels(monkeypatch, data):
    dataset, index, model = setup(data)
    stage, rounds = placement.HostTables.stage, []

    def recording(host, params, index_, cohort):
        staged = stage(host, params, index_, cohort)
        now = {t: params.tables[t][staged.rows[t]].clone() for t in params.tables}
        traffic = dataclasses.replace(host.traffic)
        rounds.append((cohort.clients.copy(), staged, traffic, params, now))
        return staged

    monkeypatch.setattr(placement.HostTables, "stage", recording)
    schedule = Schedule(
        3,
        4,
        LocalWork(2, 2, ClientStep(0.3)),
        seed=2,
        execution=Execution(dtype=torch.float32, table_placement="host"),
    )
    algo = build_algorithm("fedsubavg", AlgorithmContext(dataset, index, "samples", 4))
    trained = train(model, algo, dataset, index, schedule)
    assert len(rounds) == 3
    sliced = False  # some round moved a slice of a table, not the table
    for clients, staged, traffic, global_params, rows_then in rounds:
        expected_bytes = 0
        for table, rows in staged.rows.items():
            union = reference_union(index, table, clients)
            assert rows.tolist() == sorted(union)
            assert staged.tables[table].shape == (len(union), global_params.tables[table].shape[1])
            sliced |= len(union) < dataset.table_rows[table]
            assert torch.equal(staged.tables[table], rows_then[table])
            expected_bytes += len(union) * staged.tables[table].shape[1] * 4
        assert traffic.to_device == expected_bytes
        assert traffic.rows == {t: len(r) for t, r in staged.rows.items()}
        # the global tables the server updates in place are the run's result
        for table, values in global_params.tables.items():
            assert values.data_ptr() == trained.tables[table].data_ptr()
    assert sliced


@pytest.mark.parametrize("algorithm", ["fedadam", "fedyogi", "scaffold-approx", "scaffold"])
def test_the_config_refuses_a_server_step_that_is_not_row_local(algorithm, tmp_path):
    settings = ['execution.table_placement="host"', f'train.algorithms=["{algorithm}"]']
    with pytest.raises(ConfigError) as error:
        config_lib.load(None, settings)
    message = str(error.value)
    assert 'execution.table_placement = "host"' in message and repr(algorithm) in message
    assert 'execution.table_placement = "device"' in message
    row_local = tmp_path / "row-local.toml"  # lazy adaptive servers, presets or composed
    row_local.write_text(
        '[train]\ntable_placement = "host"\n'
        'algorithms = ["mine", "fedsubavg", "fedyogi-lazy", "central-sgd"]\n'
        '[algorithms.mine]\nserver = "adam"\nlazy = true\n'
    )
    assert config_lib.load(row_local).execution.table_placement == "host"


@pytest.mark.parametrize("algorithm", ["fedadam", "fedyogi", "scaffold-approx", "scaffold"])
def test_a_server_step_that_is_not_row_local_is_refused_naming_the_key(algorithm):
    schedule = Schedule(
        2, 6, LocalWork(2, 2, ClientStep(0.3)), seed=1, execution=Execution(table_placement="host")
    )
    with pytest.raises(ConfigError) as error:
        run("synthetic", algorithm, schedule)
    message = str(error.value)
    assert 'execution.table_placement = "host"' in message and repr(algorithm) in message
    assert 'execution.table_placement = "device"' in message


def test_a_host_placed_run_killed_and_resumed_equals_an_uninterrupted_one(tmp_path):
    schedule = Schedule(
        3,
        6,
        LocalWork(3, 2, ClientStep(0.3)),
        seed=2,
        execution=Execution(dtype=torch.float64, table_placement="host"),
    )
    straight = run("synthetic", "fedadam-lazy", schedule)
    rounds_done: list[int] = []
    stop = RunControl(checkpoints=tmp_path, stop_requested=lambda: rounds_done[-1] >= 1)
    with pytest.raises(Interrupted) as stopped:
        run("synthetic", "fedadam-lazy", schedule, control=stop, on_round=rounds_done.append)
    saved = checkpoint_lib.load(stopped.value.checkpoint)
    resumed = run("synthetic", "fedadam-lazy", schedule, control=RunControl(resume=saved))
    for name, expected in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], expected), name


# --- CUDA (skipped without a GPU)


@needs_cuda
@pytest.mark.parametrize("algorithm", ["fedsubavg", "fedadam-lazy"])
@pytest.mark.parametrize("data", ["synthetic", "two-tables-dense"])
def test_cuda_host_placement_keeps_the_tables_on_the_host_and_equals_the_device_run(
    data, algorithm
):
    cuda = torch.device("cuda")
    schedule = Schedule(
        3,
        6,
        LocalWork(3, 2, ClientStep(0.3)),
        seed=1,
        execution=Execution(dtype=torch.float64, device=cuda),
    )
    on_device = run(data, algorithm, schedule)
    on_host = run(data, algorithm, with_execution(schedule, table_placement="host"))
    for table in on_host.tables.values():
        assert table.device.type == "cpu"
    assert all(p.is_cuda for p in on_host.dense.values())
    for name, expected in on_device.state_dict().items():
        torch.testing.assert_close(
            on_host.state_dict()[name].cpu(), expected.cpu(), rtol=0, atol=1e-12
        )


@pytest.mark.parametrize("algorithm", ["fedsubavg", "fedavg"])
def test_host_placement_at_privacy_level_none_equals_the_device_run_without_privacy(algorithm):
    """Every run from a config has a privacy level; at ``none`` the private rounds' feature
    builds the round's combine from the aggregation host tables adjust (no override), so the
    host's coefficients are applied once, on the host: the model is the plain device run's."""
    from fedsub.privacy.levels import Privacy

    schedule = Schedule(
        3, 6, LocalWork(3, 2, ClientStep(0.3)), seed=1, execution=Execution(dtype=torch.float64)
    )
    on_device = run("synthetic", algorithm, schedule)
    private_none = schedule.with_setting(Privacy, Privacy("none"))
    on_host = run("synthetic", algorithm, with_execution(private_none, table_placement="host"))
    for name, expected in on_device.state_dict().items():
        assert expected.abs().max() > 1e-3, name
        assert torch.equal(on_host.state_dict()[name], expected), name
