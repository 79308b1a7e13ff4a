"""Parameters that are valid alone but impossible for the loaded data, refused before training.

``config.py`` checks every key on its own (types, ranges); only once the dataset is loaded is
it known whether, e.g., 60 clients per round can be drawn from 40 clients. Each refusal names
the key, its value and the dataset's size; what is allowed but surprising is a warning.
"""

from __future__ import annotations

import logging

from fedsub.config import Config
from fedsub.data.federated import FederatedDataset
from fedsub.errors import ConfigError
from fedsub.models.base import Model, SliceableModel

LOG = logging.getLogger("fedsub")
GROUPED_HEAT_SOURCES = ("secagg", "sketch")  # heat summed by secure aggregation in groups


def check_against_dataset(config: Config, dataset: FederatedDataset, model: Model) -> None:
    """Raise ``ConfigError`` for a parameter the data cannot meet; warn where data make a
    parameter act differently than its name says."""
    t, e = config.train, config.eval
    n = dataset.num_clients
    about = f"dataset {dataset.name} has {n} clients"
    if n < 2:
        raise ConfigError(f"{about}; federated training needs at least 2")
    if t.clients_per_round > n:
        raise ConfigError(
            f"train.clients_per_round = {t.clients_per_round} is more than the population: "
            f"{about}; set it to at most {n}"
        )
    p = config.privacy
    source = p.effective_heat_source  # privacy.level may make it secagg
    if source in GROUPED_HEAT_SOURCES and p.secagg_group > n:
        why = f"privacy.heat_source = {source!r}"
        if source != p.heat_source:
            why = f"privacy.level = {p.level!r} makes the heat source {source!r}"
        raise ConfigError(
            f"privacy.secagg_group = {p.secagg_group} is larger than the population "
            f"({why}): {about}; set it to at most {n}"
        )
    if config.masking.scheme != "none":
        _check_capacities(config, model, n)
    if e.target_test_auc is not None:
        if len(dataset.test) == 0:
            fraction = getattr(config.data.options, "test_fraction", None)
            why = f" (data.test_fraction = {fraction:g})" if fraction == 0 else ""
            raise ConfigError(
                f"eval.target_test_auc = {e.target_test_auc:g} is set but dataset "
                f"{dataset.name} has no test split{why}; the target could never be reached "
                "(unset it: --set eval.target_test_auc=none"
                + (", or give data.test_fraction > 0)" if why else ")")
            )
        if model.task != "binary":
            raise ConfigError(
                f"eval.target_test_auc = {e.target_test_auc:g} needs a binary task, but model "
                f"{config.model.name!r} on {dataset.name} is {model.task}: no AUC is computed "
                "(unset it: --set eval.target_test_auc=none)"
            )
    largest = int(dataset.sample_counts().max())
    if t.batch_size > largest:
        LOG.warning(
            "train.batch_size = %d is more than the largest client's %d samples of %s: "
            "every local batch repeats samples (clients cycle through their data)",
            t.batch_size,
            largest,
            dataset.name,
        )
    if e.train_loss_samples > len(dataset.train):
        LOG.info(
            "eval.train_loss_samples = %d > the %d training samples: the train loss uses all",
            e.train_loss_samples,
            len(dataset.train),
        )


def _check_capacities(config: Config, model: Model, num_clients: int) -> None:
    """Warn where capacities act differently than configured: levels no client gets, and
    capacities too small for a layer (a sub-model keeps at least one channel per group)."""
    m = config.masking
    if m.capacity_assignment == "fixed" and len(m.capacities) > num_clients:
        LOG.warning(
            "masking.capacities lists %d levels but there are only %d clients: with "
            "masking.capacity_assignment = 'fixed' some levels have no client",
            len(m.capacities),
            num_clients,
        )
    if not isinstance(model, SliceableModel):
        return
    slicing = model.slicing
    for capacity in m.capacities:
        narrow = {g: c for g, c in slicing.groups.items() if c * capacity < 1}
        if narrow:
            group, channels = next(iter(narrow.items()))
            LOG.warning(
                "masking.capacities entry %g keeps less than one of the %d channels of %r "
                "(and %d more groups); such a sub-model keeps 1 channel, a larger share",
                capacity,
                channels,
                group,
                len(narrow) - 1,
            )
