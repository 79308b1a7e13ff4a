"""Checkpoints of a Flower run, through engine/checkpoint.py's generic stage checkpoints.

A checkpoint after round r holds every stage of the server round (model, server optimizer,
any later stage) and the population (``flower.membership.Membership``: registered clients,
their nodes, counts and S(k)); its history holds the per-round records and the evaluations
so far. It is stamped with the hash of everything that decides the model (the resolved fedsub
config, the algorithm, the payload, the heat refresh period), so ``resume = true`` refuses a
checkpoint written by another configuration instead of continuing it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fedsub.engine import checkpoint as checkpoint_lib
from fedsub.errors import FedsubError
from fedsub.files.run_folder import hash_config
from fedsub.stateful import Stateful

RUN_ID = "flower"  # Flower gives each `flwr run` a new run id: the config hash identifies it


def config_stamp(description: str) -> dict[str, str]:
    """The stamp of a run whose model is decided by ``description`` (text)."""
    return {"run_id": RUN_ID, "config_hash": hash_config(description)}


@dataclass(frozen=True)
class FlowerCheckpoints:
    """Where and how often a Flower run saves its state, and whether it resumes from it."""

    folder: Path
    every: int = 0  # 0: never (a resume then starts from the newest there is)
    resume: bool = False
    stamp: dict[str, str] = field(default_factory=dict)

    def due(self, round_index: int, last: int) -> bool:
        """After round r, unless it is the last (the run is then complete)."""
        return bool(self.every) and round_index % self.every == 0 and round_index < last

    def save(self, round_index: int, stages: dict[str, Stateful], history: list[dict]) -> Path:
        return checkpoint_lib.save(
            self.folder,
            checkpoint_lib.Checkpoint(
                round=round_index,
                stages=checkpoint_lib.capture(stages),
                elapsed=0.0,
                history=history,
                run=self.stamp,
            ),
        )

    def latest(self) -> checkpoint_lib.Checkpoint:
        """The newest intact checkpoint of this configuration; a clear error when there is
        none or when it was written by another configuration."""
        saved = checkpoint_lib.newest_intact(self.folder)
        if saved is None:
            raise FedsubError(
                f"Flower run config: resume = true, but {self.folder} holds no checkpoint "
                "(set checkpoint-every > 0 in the run to resume, or drop resume to start over)"
            )
        if saved.run.get("config_hash") != self.stamp.get("config_hash"):
            raise FedsubError(
                f"{saved.path}: written by another configuration (config hash "
                f"{saved.run.get('config_hash')!r}, this run's is "
                f"{self.stamp.get('config_hash')!r}); resume with the run config and fedsub "
                "config that wrote it, or use another out-dir to start over"
            )
        return saved
