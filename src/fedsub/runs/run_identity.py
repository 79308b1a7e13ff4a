"""Which run a run folder holds, for every runtime: a new run's identity written when it takes
the folder, a resumed run's read back and checked against the config it was started with,
and the checkpoint it continues from, checked to be that run's.

``fedsub run``/``compare`` (runs/experiment.py) and the Flower ServerApp's out-dir
(flower/apps.py) both follow these rules on top of files/run_folder.py; what differs between
them is one ``StartedWith``: where the folder keeps the config text (config.toml, or a key of
run.json), what the run's config hash covers (the text as written, or with the Flower
settings that also decide the model) and how the runtime names its options in messages.

A resume hashes the config text as written (a run written before a key was added to fedsub
still resumes: the new key takes its default, which keeps the old behaviour) and checks that
the config given is that text's config as this fedsub reads it. A Flower out-dir written
before run.json kept its config holds only its hash: the config given is checked against it
as that fedsub wrote it (its moved keys back in ``[train]``, ``moved_keys.text_before_move``)
and taken with a warning when it does not match (it cannot be told apart from the same config
with keys added since).
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedsub import config as config_lib
from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.errors import FedsubError
from fedsub.files.atomic_files import write_atomic
from fedsub.files.run_folder import (
    CLI_FLAGS,
    RUN_FILE,
    Claim,
    Flags,
    RunIdentity,
    check_checkpoint,
    claim_existing,
    claim_new,
    hash_config,
    identity_of,
    new_identity,
    read_run_file,
)
from fedsub.moved_keys import in_sections, text_before_move

LOG = logging.getLogger("fedsub")
CONFIG_FILE = "config.toml"


def as_written(config_text: str) -> str:
    return config_text


@dataclass(frozen=True)
class StartedWith:
    """How a runtime's run folder keeps the config its run was started with: in the folder's
    config.toml (``key`` None) or under ``key`` in run.json; hashed into the run's identity
    through ``describe`` (with ``settings``, the runtime's own settings it adds, named for
    messages); ``flags``: how the runtime names the folder and its options."""

    key: str | None = None
    describe: Callable[[str], str] = as_written
    settings: str = ""
    flags: Flags = CLI_FLAGS

    def kept(self, folder: Path, record: dict) -> tuple[str | None, str]:
        """The config text the run in ``folder`` (``record``: its run.json) was started
        with, and where it is kept, for messages. config.toml missing reads as empty (it is
        written with run.json); run.json without ``key`` is an older out-dir's (None)."""
        if self.key is None:
            path = folder / CONFIG_FILE
            return (path.read_text(encoding="utf-8") if path.exists() else ""), str(path)
        written = record.get(self.key)
        where = f"{folder / RUN_FILE} ({self.key!r})"
        return (written if isinstance(written, str) else None), where


IN_CONFIG_FILE = StartedWith()


def claim_folder(folder: Path, resume: bool, overwrite: bool, flags: Flags = CLI_FLAGS) -> Claim:
    """The run's folder, held for the run: the folder of a run to resume, or one a new run
    may take (files/run_folder.py's rules)."""
    return claim_existing(folder) if resume else claim_new(folder, overwrite, flags)


def start_run(
    claim: Claim, config_text: str, record: dict, started: StartedWith = IN_CONFIG_FILE
) -> RunIdentity:
    """Make the claimed folder a new run's: run.json first (its identity, the manifest of what
    it writes in ``record``; a replaced run is moved aside), keeping ``config_text`` where
    ``started`` says."""
    identity = new_identity(started.describe(config_text))
    kept = {} if started.key is None else {started.key: config_text}
    claim.write_run_file({**identity.as_json(), **record, **kept})
    if started.key is None:
        write_atomic(claim.folder / CONFIG_FILE, config_text)
    return identity


def resumed_identity(
    folder: Path, config_text: str, started: StartedWith = IN_CONFIG_FILE
) -> RunIdentity:
    """The identity of the run in ``folder``, after two checks: the config text it keeps is
    the one its run.json was started with, and ``config_text`` (the config being resumed, as
    ``config.to_toml`` writes it) is that text's config as this fedsub reads it."""
    record = read_run_file(folder)
    identity = identity_of(record)
    written, where = started.kept(folder, record)
    if written is None:
        _check_unkept(folder, config_text, started, identity)
        return identity
    if hash_config(started.describe(written)) != identity.config_hash:
        raise FedsubError(
            f"{where}{started.settings} (hash {hash_config(started.describe(written))}) is not "
            f"the config its {RUN_FILE} was started with (hash {identity.config_hash}); was "
            "either edited? Start a new run instead"
        )
    raw = in_sections(tomllib.loads(written), where=where)
    if config_lib.to_toml(config_lib.parse(raw)) != config_text:
        raise FedsubError(
            f"the config given to resume {folder} is not the one in {where}; resume with that "
            "config, or start a new run"
        )
    return identity


def _check_unkept(
    folder: Path, config_text: str, started: StartedWith, identity: RunIdentity
) -> None:
    """A run.json written before it kept its config: ``config_text`` as that fedsub wrote it
    (keys back in ``[train]``) should hash to its config hash; taken with a warning when not."""
    if hash_config(started.describe(text_before_move(config_text))) != identity.config_hash:
        LOG.warning(
            "%s holds no config (written by an older fedsub) and the config given does not "
            "hash to its config hash %s (a key added since changes it): taken as that run's",
            folder / RUN_FILE,
            identity.config_hash,
        )


def newest_checkpoint(
    folder: Path, identity: RunIdentity, flags: Flags = CLI_FLAGS
) -> checkpoint_lib.Checkpoint | None:
    """The newest intact checkpoint in ``folder`` (None: none), refused when it is stamped
    with another run than ``identity``."""
    saved = checkpoint_lib.newest_intact(folder)
    if saved is not None:
        check_checkpoint(saved.path or folder, saved.run, identity, flags)
    return saved
