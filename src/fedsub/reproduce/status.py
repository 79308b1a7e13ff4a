"""What of the registry can run here: a part's data (generated, at ``--data-path``, in the
download cache), its config, and the listing of ``fedsub reproduce`` without an id.

Kept apart from running.py (and free of torch, numpy and the config's pieces) so that the
listing is quick: `fedsub reproduce` imports only this.
"""

from __future__ import annotations

from pathlib import Path

from fedsub.data.fetch import DEBIAN_FASHION, DOWNLOADS, cache_dir
from fedsub.errors import ConfigError
from fedsub.reproduce.registry import (
    EXPERIMENTS,
    GENERATED,
    Data,
    Part,
    Run,
    Settings,
    Stats,
    configs_folder,
)


def data_present(data: Data, data_path: str | None) -> bool:
    """Whether the part's data can be read here: generated, at ``data_path``, in fedsub's
    download cache, or (Fashion-MNIST) where Debian installs it."""
    if data is GENERATED:
        return True
    if data_path is not None:
        return Path(data_path).exists()
    if data.name in DOWNLOADS:
        folder = cache_dir() / data.name
        if all((folder / d.filename).exists() for d in DOWNLOADS[data.name]):
            return True
    return data.name == "fashion-mnist" and DEBIAN_FASHION.exists()


def needs(data: Data) -> str:
    if data.fetch is None:
        return f"needs dataset {data.name} ({data.note})"
    return f"needs dataset {data.name}: `{data.fetch}`" + (f" ({data.note})" if data.note else "")


def config_missing(part: Part, configs: Path) -> str | None:
    """Why the part's config is not in ``configs`` (None when it is, or needs none)."""
    if not isinstance(part.action, Run | Stats | Settings):
        return None
    name = part.action.config
    if (configs / name).exists():
        return None
    return f"{name} is not in {configs.name}/" + (f" ({part.note})" if part.note else "")


def status_here(part: Part, configs: Path, data_path: str | None = None) -> str:
    """'runs here', or why not."""
    if part.action is None:
        return f"cannot run: needs dataset {part.data.name} ({part.data.note})"
    missing = config_missing(part, configs)
    if missing:
        return f"cannot run yet: {missing}"
    if isinstance(part.action, Settings) or data_present(part.data, data_path):
        return "runs here"
    return needs(part.data)


def listing(configs: Path | None = None) -> list[str]:
    """``fedsub reproduce`` with no id: every experiment, its parts, data, time, status."""
    configs = configs or configs_folder()
    lines = ["Tables and figures of the seeds (fedsub reproduce ID [--part NAME] --out DIR):", ""]
    for e in EXPERIMENTS.values():
        lines.append(f"{e.id}  {e.shows}")
        if e.note:
            lines.append(f"    ({e.note})")
        for p in e.parts:
            took = f"; {p.minutes}" if p.minutes else ""
            lines.append(f"    {p.name}: {status_here(p, configs)}{took}")
    return lines


def configs_given(configs: Path | None) -> Path:
    """``--configs`` (checked to be a folder), or the checkout's configs/."""
    if configs is None:
        return configs_folder()
    if not configs.is_dir():
        what = "is not a folder" if configs.exists() else "does not exist"
        raise ConfigError(
            f"--configs {configs} {what}; give the folder holding fedsub's configs "
            "(configs/ of a checkout), or drop --configs"
        )
    return configs
