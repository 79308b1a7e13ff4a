"""fedsub: federated submodel training (FedSubAvg and friends) for sparse models.

The Python API (``fedsub.library``): ``load_dataset``, ``train``, ``compare``, ``run``,
``sweep`` and ``Config``; datasets from Python objects (``samples``, ``from_clients``,
``from_dataframe``, ``from_partitioner``); after-round hooks (``RunCallback``,
``TensorBoardWriter``, ``MlflowWriter``). Those names are imported on first use (PEP 562),
so ``import fedsub`` and ``fedsub --help`` stay fast: torch is imported only when an API
name is used.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any

from fedsub.errors import ArgumentError, ConfigError, DataError, FedsubError

if TYPE_CHECKING:
    from fedsub.config import Config
    from fedsub.data.federated import FederatedDataset, SampleSet
    from fedsub.data.from_python import from_clients, from_dataframe, from_partitioner, samples
    from fedsub.library import (
        Comparison,
        Sweep,
        TrainResult,
        compare,
        load_dataset,
        run,
        sweep,
        train,
    )
    from fedsub.runs.tracking import MlflowWriter, RunCallback, TensorBoardWriter, TrackedRun

__all__ = [
    "ArgumentError",
    "Comparison",
    "Config",
    "ConfigError",
    "DataError",
    "FederatedDataset",
    "FedsubError",
    "MlflowWriter",
    "RunCallback",
    "SampleSet",
    "Sweep",
    "TensorBoardWriter",
    "TrackedRun",
    "TrainResult",
    "compare",
    "from_clients",
    "from_dataframe",
    "from_partitioner",
    "load_dataset",
    "run",
    "samples",
    "sweep",
    "train",
]
__version__ = "0.1.0"

_LIBRARY = {
    "Comparison",
    "Sweep",
    "TrainResult",
    "compare",
    "load_dataset",
    "run",
    "sweep",
    "train",
}
_FROM_PYTHON = {"from_clients", "from_dataframe", "from_partitioner", "samples"}
_DATASETS = {"FederatedDataset", "SampleSet"}
_TRACKING = {"MlflowWriter", "RunCallback", "TensorBoardWriter", "TrackedRun"}


def __getattr__(name: str) -> Any:
    """An API name, imported the first time it is used (and kept in the module after)."""
    module: ModuleType
    if name in _LIBRARY:
        from fedsub import library

        module = library
    elif name in _FROM_PYTHON:
        from fedsub.data import from_python

        module = from_python
    elif name in _DATASETS:
        from fedsub.data import federated

        module = federated
    elif name in _TRACKING:
        from fedsub.runs import tracking

        module = tracking
    elif name == "Config":
        from fedsub import config

        module = config
    else:
        raise AttributeError(f"module 'fedsub' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
