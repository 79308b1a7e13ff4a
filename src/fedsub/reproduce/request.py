"""What ``fedsub reproduce ID`` is asked, checked against the experiment's parts before any
of them runs: the part chosen, every override loaded with each part's config (and each value
of its sweep), and each option refused where no chosen part can use it (``--set`` on a closed
form, ``--data-path`` on generated data, ``--resume`` with nothing to resume), naming the
option and the part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from fedsub import config as config_lib
from fedsub.errors import ConfigError
from fedsub.moved_keys import current_name
from fedsub.reproduce.registry import (
    GENERATED,
    SMOKE,
    ClosedForm,
    Experiment,
    Part,
    Run,
    Settings,
    Stats,
    data_overrides,
)
from fedsub.reproduce.status import config_missing


@dataclass(frozen=True)
class Request:
    """What ``fedsub reproduce ID`` was asked beside the id (``configs_named``: --configs
    was given, so a part that reads no config refuses it)."""

    smoke: bool
    data_path: str | None
    overrides: list[str]
    configs: Path
    configs_named: bool = False
    seeds: int = 1


def chosen_parts(e: Experiment, part: str | None) -> list[Part]:
    """The part ``--part`` names, or every part; an empty name or one the experiment lacks
    is refused with the choices, an experiment with nothing to run says so."""
    if not e.parts:
        raise ConfigError(f"{e.id} ({e.shows}): {e.note or 'nothing to run'}")
    if part is None:
        return list(e.parts)
    names = ", ".join(p.name for p in e.parts)
    for p in e.parts:
        if p.name == part:
            return [p]
    shown = "is empty" if not part.strip() else f"{part}: {e.id} has no part {part!r}"
    raise ConfigError(f"--part {shown}; {e.id}'s parts: {names} (without --part every part runs)")


def _reads_no_config(part: Part) -> str | None:
    """Why ``--set`` means nothing to the part (None: it loads a config and trains or counts)."""
    action = part.action
    if action is None:
        return f"has nothing fedsub can run ({part.data.note})"
    if isinstance(action, ClosedForm):
        return "is a closed form checked against the paper's formula (it reads no config)"
    if isinstance(action, Settings):
        return f"compares {action.config}'s settings as shipped with the paper's (no run)"
    return None


def _reads_no_config_file(part: Part) -> str | None:
    """Why ``--configs`` means nothing to the part (settings read their config file)."""
    if isinstance(part.action, Settings):
        return None
    return _reads_no_config(part)


def _reads_no_data(part: Part) -> str | None:
    """Why ``--data-path`` means nothing to the part (None: it reads a dataset's files)."""
    refused = _reads_no_config(part)
    if refused is not None:
        return refused
    if part.data is GENERATED:
        return "trains on data fedsub generates (it reads no data file)"
    return None


def _trains_nothing(part: Part) -> str | None:
    """Why ``--seeds`` means nothing to the part (None: it trains)."""
    if isinstance(part.action, Run):
        return None
    return _reads_no_config(part) or "counts its dataset (no training, nothing seeded to repeat)"


def _refuse_unused(
    e: Experiment, chosen: list[Part], flag: str, why: Callable[[Part], str | None]
) -> None:
    """``flag`` refused when a chosen part that runs does not use it (or none runs at all);
    parts with nothing to run are passed over when others run, so a table's flags still
    reach its runnable rows."""
    runnable = [p for p in chosen if p.action is not None] or chosen
    for p in runnable:
        reason = why(p)
        if reason is not None:
            raise ConfigError(f"{flag}: {e.id}'s part {p.name} {reason}; drop {flag}")


def check_request(e: Experiment, chosen: list[Part], request: Request) -> None:
    """Every option of the request against the chosen parts, before any of them runs."""
    if request.overrides:
        _refuse_unused(e, chosen, f"--set {request.overrides[0]}", _reads_no_config)
    if request.configs_named:
        _refuse_unused(e, chosen, f"--configs {request.configs}", _reads_no_config_file)
    if request.data_path is not None:
        _check_data_path(e, chosen, request.data_path)
    if request.seeds < 1:
        raise ConfigError(f"--seeds {request.seeds}: give 1 or more runs per part")
    if request.seeds > 1:
        _refuse_unused(e, chosen, f"--seeds {request.seeds}", _trains_nothing)
    for p in chosen:
        if isinstance(p.action, Run | Stats) and config_missing(p, request.configs) is None:
            _check_config(e, p, request)


def _check_data_path(e: Experiment, chosen: list[Part], data_path: str) -> None:
    _refuse_unused(e, chosen, f"--data-path {data_path}", _reads_no_data)
    if len({p.data for p in chosen}) > 1:
        raise ConfigError(
            f"--data-path is one dataset's, but {e.id}'s parts read several "
            f"({', '.join(sorted({p.data.name for p in chosen}))}); add --part NAME"
        )
    if not Path(data_path).exists():
        raise ConfigError(
            f"--data-path {data_path} does not exist; give {chosen[0].data.describe()}'s "
            "file or folder"
        )


def _check_config(e: Experiment, part: Part, request: Request) -> None:
    """The part's config with every override (and each value of its sweep) loads; a --set
    of the key the part sweeps is refused (the sweep's values would replace it)."""
    action = part.action
    assert isinstance(action, Run | Stats)
    path = request.configs / action.config
    smoke = (*SMOKE, *action.smoke) if isinstance(action, Run) else action.smoke
    sets = [*action.overrides, *(smoke if request.smoke else ())]
    sets += data_overrides(part.data, request.data_path)
    sets += request.overrides
    sweep = action.sweep if isinstance(action, Run) else None
    values: Sequence[str | None] = [None]
    if sweep is not None:
        for text in request.overrides:
            section, key, _ = config_lib.parse_override(text)
            if current_name(f"{section}.{key}") == current_name(sweep[0]):
                raise ConfigError(
                    f"--set {text}: {e.id}'s part {part.name} sweeps {sweep[0]} over "
                    f"{', '.join(sweep[1])}; drop --set"
                )
        smoke_values = action.smoke_values if isinstance(action, Run) else None
        values = list(smoke_values if request.smoke and smoke_values else sweep[1])
    for value in values:
        swept = [] if value is None or sweep is None else [f"{sweep[0]}={value}"]
        try:
            config_lib.load(path, [*sets, *swept])
        except ConfigError as error:
            raise ConfigError(f"{e.id}'s part {part.name}: {error}") from None


def refuse_nothing_to_resume(e: Experiment, chosen: list[Part], out: Path) -> None:
    """``--resume`` continues runs in ``out``; with none of the chosen parts' runs there it
    is refused (as ``fedsub compare --resume`` is), not started afresh."""
    if any((out / p.name / "run.json").exists() for p in chosen if isinstance(p.action, Run)):
        return
    names = ", ".join(p.name for p in chosen)
    raise ConfigError(
        f"--resume: nothing to resume in {out}: no run of {e.id}'s {names} is there; "
        "drop --resume to start (or give the --out of the stopped run)"
    )
