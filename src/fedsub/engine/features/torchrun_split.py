"""The torchrun split as a feature: in a joined torchrun group, each process trains its share
of the cohort and the shares' updates are gathered (engine/split_cohort.py). Row-sharded tables
split the cohort their own way (``row_sharding``), so the split stays out of them."""

from __future__ import annotations

import functools

from fedsub import distributed
from fedsub.engine.contribution import Feature, RoundContribution, RoundSetup
from fedsub.engine.split_cohort import split_cohort

NAME = "torchrun_split"


def contribute(setup: RoundSetup) -> RoundContribution | None:
    if setup.schedule.execution.table_sharding == "rows":
        return None
    processes = distributed.joined()
    if processes is None:
        return None
    return RoundContribution(
        NAME, client_stage=functools.partial(split_cohort, processes=processes)
    )


FEATURE = Feature(NAME, contribute)
