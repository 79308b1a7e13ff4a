"""Several processes (torchrun, fedsub/distributed.py and engine/split_cohort.py).

In one process: the shares of a cohort, torchrun's environment, the device of each process,
and whole training runs whose rounds are computed share by share (every share of a world of
processes, in this one process) and concatenated: the model must be exactly the unsplit
run's. With real processes: ``torchrun --nproc-per-node 2 -m fedsub compare`` (gloo on the
CPU) writes the files one process writes, once, with exactly its models; a resume under
torchrun does too; and an error in one process ends the run at once, with its message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedsub.cli import commands as cli
from fedsub.distributed import Processes, from_environment, process_device
from fedsub.engine import split_cohort
from fedsub.engine.cohort_job import CohortJob
from fedsub.engine.execution import Execution
from fedsub.engine.features import torchrun_split
from fedsub.engine.in_process import train
from fedsub.engine.schedule import ClientStep, LocalWork, Schedule
from fedsub.errors import ConfigError, FedsubError
from fedsub.masking.capacity import Capacities
from fedsub.masking.schemes import Masking
from fedsub.models.base import ClosedFormGradients
from fedsub.submodel.index import SubmodelIndex

from .equivalence import algorithm_for
from .test_backends import DATASETS, model_for
from .test_model_capabilities import built
from .test_resume_matrix import dataset_for


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("members", [0, 1, 2, 5, 7, 9])
def test_shares_cut_the_cohort_into_contiguous_nearly_equal_pieces_in_rank_order(world, members):
    shares = [Processes(rank, world).share(members) for rank in range(world)]
    assert [m for share in shares for m in share] == list(range(members))
    sizes = [len(share) for share in shares]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_torchruns_environment_is_read_and_a_bad_variable_is_named():
    assert from_environment({}) == Processes(0, 1, 0)
    got = from_environment({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert got == Processes(3, 4, 1) and got.split and not got.writes
    assert str(got) == "process 3 of 4"
    with pytest.raises(FedsubError, match="RANK='x'"):
        from_environment({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(FedsubError, match="RANK=2, WORLD_SIZE=2"):
        from_environment({"RANK": "2", "WORLD_SIZE": "2"})


def test_each_process_takes_its_own_gpu_and_one_named_gpu_is_refused():
    two = Processes(1, 2, 1)
    assert process_device(torch.device("cpu"), two) == torch.device("cpu")
    assert process_device(torch.device("cuda", 1), Processes()) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r'execution\.device = "cuda:1" under torchrun'):
        process_device(torch.device("cuda", 1), two)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ConfigError, match="LOCAL_RANK 1 but this machine has"):
            process_device(torch.device("cuda"), two)
    else:
        assert process_device(torch.device("cuda"), two) == torch.device("cuda", 1)


def test_data_commands_are_refused_under_torchrun(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["data", "fetch"]) == 2
    assert "`fedsub data fetch` under torchrun: only `fedsub run` and" in capsys.readouterr().err


def in_shares(world: int):
    """``split_cohort``'s stand-in for one process: every process's share computed here, then
    concatenated in rank order (what the gather gives each process)."""

    def split(run_cohort, processes):
        def run(job: CohortJob):
            shares = [Processes(rank, world).share(len(job.cohort)) for rank in range(world)]
            parts = [split_cohort.run_share(run_cohort, s, job) for s in shares]
            return split_cohort.concatenated([p for p in parts if p is not None])

        return run

    return split


def train_split(monkeypatch, world, *args):
    """``train`` with its rounds split across ``world`` processes (emulated in this one)."""
    with monkeypatch.context() as patch:
        patch.setattr(torchrun_split.distributed, "joined", lambda: Processes(0, world))
        patch.setattr(torchrun_split, "split_cohort", in_shares(world))
        return train(*args)


def assert_same_model(got, expected, rtol: float = 0.0, atol: float = 0.0):
    got, expected = got.state_dict(), expected.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=rtol, atol=atol, msg=name)


# The batched backend's autograd loss is K times the mean over the cohort's K * B samples (the
# sum of the members' means, up to rounding), so a share of K' members rounds differently in
# the last bits; the sequential backend and closed-form gradients (sparse LR) are exact.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


@pytest.mark.parametrize(
    "backend,dtype",
    [("sequential", torch.float64), ("batched", torch.float64), ("batched", torch.float32)],
)
@pytest.mark.parametrize("algorithm", ["scaffold", "fedadam", "fedavg@scheme1"])
@pytest.mark.parametrize("data", ["synthetic", "two-tables-dense"])
def test_split_rounds_give_the_one_process_model(monkeypatch, backend, dtype, algorithm, data):
    dataset = DATASETS[data]()
    index = SubmodelIndex.build(dataset)
    model = model_for(dataset)
    schedule = Schedule(
        2,
        7,
        local=LocalWork(2, 3, ClientStep(lr=0.3)),
        seed=2,
        execution=Execution(dtype=dtype, backend=backend),
    )
    args = (model, algorithm_for(algorithm, dataset, index), dataset, index, schedule)
    whole = train(*args)
    exact = backend == "sequential" or isinstance(model, ClosedFormGradients)
    tolerance = 0.0 if exact else TOLERANCE[dtype]
    for world in (2, 3):
        assert_same_model(train_split(monkeypatch, world, *args), whole, tolerance, tolerance)


def test_a_cohort_smaller_than_the_processes_leaves_some_idle_and_the_same_model(monkeypatch):
    dataset = DATASETS["synthetic"]()
    index = SubmodelIndex.build(dataset)
    schedule = Schedule(
        2,
        2,
        local=LocalWork(2, 3, ClientStep(lr=0.3)),
        seed=2,
        execution=Execution(dtype=torch.float64),
    )
    args = (model_for(dataset), algorithm_for("scaffold", dataset, index), dataset, index, schedule)
    assert [len(Processes(r, 3).share(2)) for r in range(3)] == [1, 1, 0]
    assert_same_model(train_split(monkeypatch, 3, *args), train(*args), 1e-10, 1e-10)


def test_split_masked_rounds_give_exactly_the_one_process_model(monkeypatch, tmp_path):
    model, dataset = built("mlp", str(tmp_path))
    _, index = dataset_for("mlp", str(tmp_path))
    masking = Masking("rolling", Capacities((1.0, 0.5), (), "per-round"))
    schedule = Schedule(
        2,
        5,
        local=LocalWork(2, 3, ClientStep(lr=0.1)),
        seed=4,
        execution=Execution(dtype=torch.float64),
        settings=(masking,),
    )
    args = (model, algorithm_for("fedavg", dataset, index, 5), dataset, index, schedule)
    assert_same_model(train_split(monkeypatch, 2, *args), train(*args))


TINY = """
[data]
name = "synthetic-sparse"
num_users = 30
num_items = 20
mean_samples_per_user = 6

[train]
algorithms = ["fedsubavg", "scaffold"]
rounds = 4
clients_per_round = 5
local_steps = 2
batch_size = 4
lr = 0.2
checkpoint_every = 2
"""


def torchrun(
    folder: Path,
    *args: str,
    timeout: float = 120,
    path: Path | None = None,
    processes: int = 2,
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node PROCESSES -m fedsub ARGS`` (gloo on the CPU);
    ``path``: a further folder on PYTHONPATH (a user's module named by its import path)."""
    folders = [str(Path(cli.__file__).parents[2]), *([str(path)] if path else [])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(folders), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return subprocess.run(
        [*command, "--nproc-per-node", str(processes), "-m", "fedsub", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def files_of(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def assert_same_models(got: Path, expected: Path) -> None:
    for name in ("fedsubavg", "scaffold"):
        a, b = (
            load_file(got / name / "model.safetensors"),
            load_file(expected / name / "model.safetensors"),
        )
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name} {key}"


@pytest.mark.deployment  # 49 s, three torchrun launches: make test-deployment (test_sharding.py
# and test_reshard.py keep real torchrun process groups in make test)
def test_torchrun_writes_one_process_outputs_once_and_resumes_and_stops_on_an_error(
    tmp_path, capsys
):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY)
    one, two = tmp_path / "one", tmp_path / "two"
    assert cli.main(["compare", str(config), "--out", str(one), "--quiet"]) == 0
    alone = capsys.readouterr().out

    done = torchrun(tmp_path, "compare", str(config), "--out", str(two), "--quiet")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("| fedsubavg |") == 1 and done.stdout.count("| scaffold |") == 1
    assert done.stdout.splitlines()[-2:] == alone.splitlines()[-2:]  # the same final metrics
    assert files_of(two) == files_of(one)
    assert_same_models(two, one)

    # killed after its round-2 checkpoint: scaffold resumes from it, fedsubavg is read back
    (two / "scaffold" / "done").unlink()
    (two / "scaffold" / "model.safetensors").unlink()
    resumed = torchrun(tmp_path, "compare", "--resume", str(two), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert files_of(two) == files_of(one)
    assert_same_models(two, one)

    # only process 0 checks the folder: it refuses a taken one, and process 1 (waiting for
    # it) is not left hanging
    started = time.monotonic()
    refused = torchrun(tmp_path, "compare", str(config), "--out", str(two), "--quiet", timeout=90)
    assert refused.returncode != 0
    error = f"fedsub: error: output folder {two} already holds a run"
    lines = refused.stderr.splitlines()
    assert sum(line.startswith(error) for line in lines) == 1, refused.stderr
    # torchrun's failure report (its traceback, then the ChildFailedError block) is the last
    # thing printed; it ends with fedsub's one-line error, not a pointer to torch's docs
    last = next(line for line in reversed(lines) if line.strip().strip("="))
    assert last.strip().startswith("traceback : fedsub: error: "), refused.stderr[-2000:]
    assert time.monotonic() - started < 60
    assert files_of(two) == files_of(one)


TINY_DP = """
[data]
name = "synthetic-sparse"
num_users = 30
num_items = 20
mean_samples_per_user = 6

[train]
algorithms = ["fedsubavg", "fedavg"]
rounds = 4
clients_per_round = 5
local_steps = 2
batch_size = 4
lr = 0.2
dtype = "float64"

[eval]
every = 2

[dp]
mechanism = "gaussian"
noise_multiplier = 0.8
clip = 0.5
randomness = "seeded"  # compared with the one-process run (tests/test_dp_secret.py: secret)
"""


def test_torchrun_with_dp_gives_the_one_process_models_and_epsilons(tmp_path, capsys):
    """[dp] under torchrun (seeded): the noise is drawn on the host from (seed, round) after the
    gather, the same in every process, so the models equal the one-process run's bit for bit
    and the epsilons reported are the same numbers."""
    config = tmp_path / "dp.toml"
    config.write_text(TINY_DP)
    one, two = tmp_path / "one", tmp_path / "two"
    assert cli.main(["compare", str(config), "--out", str(one), "--quiet"]) == 0
    capsys.readouterr()
    done = torchrun(tmp_path, "compare", str(config), "--out", str(two), "--quiet")
    assert done.returncode == 0, done.stderr
    assert files_of(two) == files_of(one)
    for name in ("fedsubavg", "fedavg"):
        a = load_file(two / name / "model.safetensors")
        b = load_file(one / name / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        metrics = [json.loads(line) for line in (two / name / "metrics.jsonl").open()]
        alone = [json.loads(line) for line in (one / name / "metrics.jsonl").open()]
        assert [m["epsilon"] for m in metrics] == [m["epsilon"] for m in alone]
        assert metrics[-1]["epsilon"] > 0
    summary, alone_summary = (json.loads((f / "summary.json").read_text()) for f in (two, one))
    for name in ("fedsubavg", "fedavg"):
        record = summary["algorithms"][name]["dp"]
        assert record == alone_summary["algorithms"][name]["dp"] and record["epsilon"] > 0
