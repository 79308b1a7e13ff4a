"""Dataset statistics in the shape of seed 001's Table 1, and the feature heat histogram."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from fedsub.data.federated import FederatedDataset
from fedsub.files.atomic_files import save_figure_atomic
from fedsub.submodel.heat import client_heat, dispersion
from fedsub.submodel.index import SubmodelIndex


def feature_heat(dataset: FederatedDataset, index: SubmodelIndex) -> np.ndarray:
    """n_m of every row of every table that some client touches, concatenated."""
    heats = [client_heat(index.rows[t], rows) for t, rows in dataset.table_rows.items()]
    all_heat = np.concatenate(heats) if heats else np.zeros(0, dtype=np.int64)
    return all_heat[all_heat > 0]


def table1_row(dataset: FederatedDataset, index: SubmodelIndex) -> dict[str, float]:
    """Heat entries are NaN for a dataset without embedding tables (dense features only)."""
    heat = feature_heat(dataset, index)
    counts = dataset.sample_counts()
    no_heat = len(heat) == 0
    return {
        "clients": dataset.num_clients,
        "samples": len(dataset.train) + len(dataset.test),
        "train_samples": len(dataset.train),
        "test_samples": len(dataset.test),
        "samples_per_client": float(counts.mean()),
        "features": int(sum(dataset.table_rows.values())),
        "features_touched": len(heat),
        "heat_min": math.nan if no_heat else int(heat.min()),
        "heat_max": math.nan if no_heat else int(heat.max()),
        "heat_dispersion": dispersion(heat),
        "label_mean": float(dataset.train.labels.mean()),
    }


def plot_heat_distribution(heat: np.ndarray, path: Path, title: str, untouched: int = 0) -> None:
    """Number of features at each heat, log-log (seed 002, figure 5); ``untouched`` features
    (heat 0, which a log axis cannot show) are counted in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values, counts = np.unique(heat, return_counts=True)
    fig, ax = plt.subplots(figsize=(5.5, 4))
    label = f"{len(heat):,} touched features; {untouched:,} untouched (heat 0, not shown)"
    ax.loglog(values, counts, "o", markersize=3, label=label)
    ax.set_xlabel("feature heat (clients involving the feature)")
    ax.set_ylabel("number of features")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize="small")
    fig.tight_layout()
    save_figure_atomic(fig, path)
