"""Which run a Flower out-dir holds, and the checkpoint a resumed ServerApp continues.

The round loop saves the checkpoints (engine/loop.py, as in process): every stage of the
server round, the population (``engine.membership.Membership``) and a private heat source's
heat, the evaluations and the runtime's per-round records. They are stamped with the run's
config hash: the hash of its description (the fedsub config as written, the algorithm, the
payload, the heat refresh period, the digest of an ``initial-model`` file's bytes when one is
given; ``FlowerSettings.description``), so ``resume = true`` refuses a checkpoint written
by another configuration.

The config as written is kept in the out-dir's run.json (key ``config``; the out-dir holds
the files its run.json lists, as before). As ``fedsub compare --resume`` does with its
config.toml (experiment._resumed_identity), a resume hashes that text as written (a run
written before a key was added to fedsub still resumes: the new key takes its default) and
checks that the config given is that text's config as this fedsub reads it. An out-dir
written before run.json kept the config holds only its hash: the config given is checked
against it as that fedsub wrote it (its moved keys back in ``[train]``,
``moved_keys.text_before_move``), and taken with a warning when it does not match (it cannot
be told apart from the same config with keys added since).
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Callable
from pathlib import Path

from fedsub import config as config_lib
from fedsub.config import Config
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.errors import FedsubError
from fedsub.files.run_folder import RUN_FILE, hash_config, identity_of, read_run_file
from fedsub.moved_keys import text_before_move

LOG = logging.getLogger("fedsub")
RUN_ID = "flower"  # Flower gives each `flwr run` a new run id: the config hash identifies it
CONFIG_KEY = "config"  # run.json's key of the fedsub config as written


def config_stamp(description: str) -> dict[str, str]:
    """The stamp of a run whose model is decided by ``description`` (text)."""
    return {"run_id": RUN_ID, "config_hash": hash_config(description)}


def resumed_stamp(out_dir: Path, config: Config, describe: Callable[[str], str]) -> dict[str, str]:
    """The stamp of the run in ``out_dir``, after checking that ``config`` is its config
    (``describe``: a config text's description, with this run's Flower settings)."""
    record = read_run_file(out_dir)
    identity, path = identity_of(record), out_dir / RUN_FILE
    given = config_lib.to_toml(config)
    written = record.get(CONFIG_KEY)
    if isinstance(written, str):
        if hash_config(describe(written)) != identity.config_hash:
            raise FedsubError(
                f"{path}: its config with this run config's algorithm, payload, "
                f"heat-refresh-every and initial-model (the file's bytes) is not the run it "
                f"was started with (config hash {identity.config_hash}); was either edited? "
                "Start a new run instead"
            )
        if config_lib.to_toml(config_lib.parse(tomllib.loads(written))) != given:
            raise FedsubError(
                f"the fedsub config given to resume {out_dir} is not the one in {path} "
                f"({CONFIG_KEY!r}); resume with that config, or start a new run"
            )
    elif hash_config(describe(text_before_move(given))) != identity.config_hash:
        LOG.warning(
            "%s holds no config (written by an older fedsub) and the config given does not "
            "hash to its config hash %s (a key added since changes it): taken as that run's",
            path,
            identity.config_hash,
        )
    return {"run_id": RUN_ID, "config_hash": identity.config_hash}


def latest(folder: Path, stamp: dict[str, str]) -> checkpoint_lib.Checkpoint:
    """The newest intact checkpoint in ``folder`` of the run ``stamp``; a clear error when
    there is none or when it was written by another configuration."""
    saved = checkpoint_lib.newest_intact(folder)
    if saved is None:
        raise FedsubError(
            f"Flower run config: resume = true, but {folder} holds no checkpoint "
            "(set checkpoint-every > 0 in the run to resume, or drop resume to start over)"
        )
    if saved.run.get("config_hash") != stamp.get("config_hash"):
        raise FedsubError(
            f"{saved.path}: written by another configuration (config hash "
            f"{saved.run.get('config_hash')!r}, this run's is "
            f"{stamp.get('config_hash')!r}); resume with the run config and fedsub "
            "config that wrote it, or use another out-dir to start over"
        )
    return saved
