"""[dp] on a GPU: every central mechanism's seeded run on ``execution.device = "cuda"`` trains
the CPU run's model (float64, 1e-9), and a windowed DP-FTRL run stopped mid-window on the GPU
resumes bit for bit.

The noise is drawn on the host from the keyed streams and moved to the table's device, and the
dense forms sum into the table-sized tensor with ``index_add_`` there: these tests are the
device check of both, and of the DP-FTRL checkpoint loader (its tensors come back to the CPU
before the numpy that reads them). The CUDA cases skip without a GPU; the ``cpu`` case of the
first test runs the same comparison against itself so the harness runs on every machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedsub.config import Config
from fedsub.runs import experiment

from .test_dp import DP, SMALL
from .test_dp_ftrl_resume import BLT, WINDOWED, lines
from .test_dp_secret import straight_and_stopped

CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")),
]
# the dense form (DP-FedAvg) and the private-rows form (DP-FedSubAvg) of each central
# mechanism (the FTRL one with the window and the selection's refresh, the heaviest state)
FORMS = {
    "gaussian-dense": ["dp.rows='all'"],
    "gaussian-private": ["dp.rows='private'", "dp.selection_threshold=1.0"],
    "ftrl-tree-dense": ["dp.mechanism='ftrl-tree'", "dp.rows='all'", "dp.min_separation=2"],
    "ftrl-tree-windowed": [
        "dp.mechanism='ftrl-tree'",
        *[o for o in WINDOWED if o.startswith("dp.") and "noise_multiplier" not in o],
    ],
    "ftrl-blt-dense": [*BLT, "dp.rows='all'", "dp.min_separation=2"],
}
# the one form whose comparison also runs on the CPU against itself: the harness on every machine
CPU_CASE = "ftrl-tree-windowed"


def model(c: Config, folder: Path) -> dict[str, torch.Tensor]:
    experiment.compare(c, folder)
    (algorithm,) = c.train.algorithms
    return load_file(str(folder / algorithm / "model.safetensors"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_seeded_dp_run_on_the_device_trains_the_cpu_model(tmp_path, form, device):
    if device == "cpu" and form != CPU_CASE:
        pytest.skip("the CPU case runs one form (the GPU case runs every one)")
    if "blt" in form:
        pytest.importorskip("jax_privacy", reason="ftrl-blt's strategy is jax-privacy's")
    algorithm = "fedavg" if form.endswith("dense") else "fedsubavg"  # dense DP-FedAvg
    common = [*SMALL, "train.rounds=6", f"train.algorithms=['{algorithm}']", *DP, *FORMS[form]]
    on_cpu = model(Config.from_toml(None, common), tmp_path / "cpu")
    there = model(
        Config.from_toml(None, [*common, f"execution.device='{device}'"]), tmp_path / "there"
    )
    assert set(there) == set(on_cpu)
    for name, value in on_cpu.items():
        assert torch.allclose(there[name].cpu(), value, rtol=0, atol=1e-9), name
    # the noise reached the model: a run without [dp] trains another one
    plain = model(
        Config.from_toml(None, [*SMALL, "train.rounds=6", f"train.algorithms=['{algorithm}']"]),
        tmp_path / "plain",
    )
    assert any(not torch.allclose(plain[n], on_cpu[n], atol=1e-6) for n in on_cpu)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_windowed_dp_ftrl_run_stopped_on_the_device_resumes_bit_for_bit(tmp_path):
    """The checkpoint loader's tensors meet numpy on the CPU: stopped after round 5 (window 2
    half gathered) on the GPU and resumed there, the model file and the epsilon lines equal the
    uninterrupted GPU run's, byte for byte."""
    c = Config.from_toml(
        None,
        [*SMALL, *WINDOWED, "dp.mechanism='ftrl-tree'", "execution.device='cuda'"],
    )
    straight_and_stopped(c, tmp_path, 5)
    experiment.compare(c, tmp_path / "stopped", resume=True)
    a, b = (tmp_path / run / "fedsubavg" for run in ("straight", "stopped"))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert lines(a) == lines(b) and len(lines(b)) == 9
