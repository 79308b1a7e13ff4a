"""The settings of a fedsub run on Flower, read from a Flower run config.

Keys of ``[tool.flwr.app.config]`` (all optional):

- ``config``: path of a fedsub TOML config ("" = fedsub's embedded default);
- ``set``: fedsub overrides, ``section.key=value`` separated by ``;``;
- ``algorithm``: which of the config's algorithms to run (default: the last one listed);
- ``payload``: ``submodel`` (rows S(k) only) or ``full`` (every row, as stock FedAvg would);
- ``min-replies``: fewest replies with which a round still updates the model (default 1);
- ``max-failed-rounds``: consecutive rounds short of ``min-replies`` after which the run stops
  with an error (default 3);
- ``round-timeout``: seconds to wait for a round's replies (default 600);
- ``min-nodes``: nodes that must register before round 1 (0, the default: one per client of
  the config's dataset, i.e. everyone, so the run is the in-process engine's);
- ``node-wait``: seconds round 1 waits for ``min-nodes`` nodes to connect (default 600);
- ``heat-refresh-every``: R; the heat coefficients are rebuilt over the registered clients at
  rounds 1, 1 + R, ... when clients registered since (default 1: at the next round);
- ``checkpoint-every``: save the server state into ``out-dir``/checkpoints every n rounds
  (0 = never);
- ``resume``: true continues the newest checkpoint in ``out-dir``/checkpoints (written with
  the same configuration);
- ``overwrite``: true replaces the earlier run in ``out-dir`` (only what that run wrote, as
  ``fedsub run --overwrite``); without it (or ``resume``) an out-dir holding a run is refused;
- ``eval-every``: every n rounds (and after the last), federated evaluation of the global
  model on every node's held-out samples, plus the ``server-test-file`` if given (0 = never;
  at ``privacy.level = "full"`` the server's test file only: a node's sums would name its
  sample counts);
- ``feature-spec``: the run's feature spec (data/feature_spec.py), read by the ServerApp: the
  model is sized from it and every node must hold the same spec ("" = the nodes hold
  partitions of the fedsub config's dataset, ``partition-id`` of ``num-partitions``);
- ``num-nodes``: how many nodes hold data (required with ``feature-spec``);
- ``server-test-file``: a test file the ServerApp reads with the feature spec and evaluates
  the global model on (optional; never a client's training data);
- ``out-dir``: where the ServerApp writes ``flower-result.json`` and the final model: an
  absolute path or one starting with ``~`` ("" = write nothing). A relative path is refused:
  it would land inside the app folder, which the next ``flwr run .`` ships to every node; so
  are the folders no run may write into (fedsub.files.run_folder: a filesystem root, the home
  folder, a file, a folder holding other runs). The ServerApp holds the folder's lock while
  it runs;
- ``train-delay``: seconds each node waits before replying (to test faults; default 0);
- ``heat-transcript``: with a private ``privacy.heat_source``, write everything the server
  received in the query round, the heat exchange and the secure row sums (``replies``) and
  in the train replies (``train_replies``) to ``out-dir/heat-transcript.json`` (to inspect
  what the server learns; default false);
- ``dp-seeded-noise``: with ``[dp]`` at ``privacy.level = "full"`` (distributed DP), each node
  draws its noise share from the generator keyed by (``train.seed``, round, partition) that
  the in-process run uses, so the run repeats it bit for bit, but whoever knows the seed (the
  server) can redraw the shares; false (the default): from its own secret randomness.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from fedsub import config as config_lib
from fedsub.algorithms.compose import recipe_of
from fedsub.algorithms.registry import check_combination, split_name
from fedsub.algorithms.schemes import SCHEMES
from fedsub.config import Config
from fedsub.errors import ConfigError, FedsubError
from fedsub.files.run_folder import Flags, check_new_folder
from fedsub.flower.runtime import FLOWER
from fedsub.privacy.levels import heat_source_for

Payload = Literal["submodel", "full"]
# How the run config names the out-dir and its options (run_folder's messages use them).
OUT_DIR_FLAGS = Flags(
    folder="out-dir",
    example='out-dir = "~/fedsub-flower-out/NAME"',
    overwrite="overwrite = true",
    resume="resume = true",
    cwd_rule=False,
)


@dataclass(frozen=True)
class FlowerSettings:
    config: str = ""
    overrides: tuple[str, ...] = field(default_factory=tuple)
    algorithm: str = ""
    payload: Payload = "submodel"
    min_replies: int = 1
    max_failed_rounds: int = 3
    round_timeout: float = 600.0
    eval_every: int = 0
    out_dir: str = ""
    train_delay: float = 0.0
    heat_transcript: bool = False
    dp_seeded_noise: bool = False
    feature_spec: str = ""
    num_nodes: int = 0
    server_test_file: str = ""
    min_nodes: int = 0
    node_wait: float = 600.0
    heat_refresh_every: int = 1
    checkpoint_every: int = 0
    resume: bool = False
    overwrite: bool = False

    @staticmethod
    def from_run_config(run_config: dict[str, Any]) -> FlowerSettings:
        known = {
            "config", "set", "algorithm", "payload", "min-replies", "max-failed-rounds",
            "round-timeout", "eval-every", "out-dir", "train-delay", "heat-transcript",
            "feature-spec", "num-nodes", "server-test-file", "min-nodes", "node-wait",
            "heat-refresh-every", "checkpoint-every", "resume", "overwrite", "dp-seeded-noise",
        }  # fmt: skip
        unknown = sorted(set(run_config) - known)
        if unknown:
            allowed = ", ".join(sorted(known))
            raise ConfigError(f"Flower run config: unknown key {unknown[0]!r}; allowed: {allowed}")
        payload = str(run_config.get("payload", "submodel"))
        if payload not in ("submodel", "full"):
            raise ConfigError(f"Flower run config: payload = {payload!r}; use submodel or full")
        text = str(run_config.get("set", ""))
        settings = FlowerSettings(
            config=str(run_config.get("config", "")),
            overrides=tuple(part.strip() for part in text.split(";") if part.strip()),
            algorithm=str(run_config.get("algorithm", "")),
            payload=cast(Payload, payload),  # checked against Payload's values above
            min_replies=_number(run_config, "min-replies", 1, int),
            max_failed_rounds=_number(run_config, "max-failed-rounds", 3, int),
            round_timeout=_number(run_config, "round-timeout", 600.0, float),
            eval_every=_number(run_config, "eval-every", 0, int),
            out_dir=output_folder(str(run_config.get("out-dir", ""))),
            train_delay=_number(run_config, "train-delay", 0.0, float),
            heat_transcript=_flag(run_config.get("heat-transcript", False), "heat-transcript"),
            dp_seeded_noise=_flag(run_config.get("dp-seeded-noise", False), "dp-seeded-noise"),
            feature_spec=_path(str(run_config.get("feature-spec", ""))),
            num_nodes=_number(run_config, "num-nodes", 0, int),
            server_test_file=_path(str(run_config.get("server-test-file", ""))),
            min_nodes=_number(run_config, "min-nodes", 0, int),
            node_wait=_number(run_config, "node-wait", 600.0, float),
            heat_refresh_every=_number(run_config, "heat-refresh-every", 1, int),
            checkpoint_every=_number(run_config, "checkpoint-every", 0, int),
            resume=_flag(run_config.get("resume", False), "resume"),
            overwrite=_flag(run_config.get("overwrite", False), "overwrite"),
        )
        settings.check()
        return settings

    def check(self) -> None:
        """Refuse settings with which no run could succeed."""
        for key, value, lowest in (
            ("min-replies", self.min_replies, 1),
            ("max-failed-rounds", self.max_failed_rounds, 1),
            ("heat-refresh-every", self.heat_refresh_every, 1),
            ("min-nodes", self.min_nodes, 0),
            ("checkpoint-every", self.checkpoint_every, 0),
            ("eval-every", self.eval_every, 0),
            ("num-nodes", self.num_nodes, 0),
        ):
            if value < lowest:
                raise ConfigError(
                    f"Flower run config: {key} = {value}; expected an integer >= {lowest}"
                )
        for key, seconds in (("round-timeout", self.round_timeout), ("node-wait", self.node_wait)):
            if not seconds > 0:
                raise ConfigError(f"Flower run config: {key} = {seconds:g}; expected seconds > 0")
        if not self.train_delay >= 0:
            raise ConfigError(
                f"Flower run config: train-delay = {self.train_delay:g}; expected seconds >= 0"
            )
        if self.resume and self.overwrite:
            raise ConfigError(
                "Flower run config: resume = true continues the run in out-dir, overwrite = "
                "true replaces it; set one of them"
            )
        wanted_keys = (
            ("checkpoint-every", self.checkpoint_every),
            ("resume", self.resume),
            ("overwrite", self.overwrite),
        )
        for key, wanted in wanted_keys:
            if wanted and not self.out_dir:
                raise ConfigError(
                    f"Flower run config: {key} needs out-dir (checkpoints go to "
                    "<out-dir>/checkpoints)"
                )
        if self.feature_spec and self.num_nodes < 2:
            raise ConfigError(
                f"Flower run config: num-nodes = {self.num_nodes}; with a feature-spec the "
                "server knows the population only from it: give the number of nodes (>= 2)"
            )
        if self.server_test_file and not self.feature_spec:
            raise ConfigError(
                f"Flower run config: server-test-file = {self.server_test_file!r} needs a "
                "feature-spec to read it with"
            )

    def check_against(self, config: Config) -> None:
        """min-replies above the cohort size could never be met: refuse it before round 1."""
        self.check()
        if self.min_replies > config.train.clients_per_round:
            raise ConfigError(
                f"Flower run config: min-replies = {self.min_replies} exceeds "
                f"train.clients_per_round = {config.train.clients_per_round}; no round could "
                "ever update the model"
            )
        if config.privacy.level == "full" and self.eval_every and not self.server_test_file:
            raise ConfigError(
                f"Flower run config: eval-every = {self.eval_every} with privacy.level = "
                "'full': federated evaluation would send each node's sums (its sample counts "
                "among them) in the clear, which this level keeps inside the secure sum, so "
                "the nodes are not asked; give the server its own test file (server-test-file, "
                "with feature-spec) or set eval-every = 0"
            )
        if self.feature_spec and config.train.clients_per_round > self.num_nodes:
            raise ConfigError(
                f"train.clients_per_round = {config.train.clients_per_round} is more than the "
                f"population: Flower run config num-nodes = {self.num_nodes}"
            )

    def description(self, config_text: str, algorithm: str) -> str:
        """Everything that decides the model a run ends with (hashed into its checkpoints),
        with the fedsub config as written (``config_text``)."""
        return (
            f"{config_text}\n# flower\nalgorithm = {algorithm!r}\n"
            f"payload = {self.payload!r}\nheat-refresh-every = {self.heat_refresh_every}\n"
        )

    def fedsub_config(self) -> Config:
        config = config_lib.load(Path(self.config) if self.config else None, self.overrides)
        if config.masking.scheme != "none":
            FLOWER.require("masking", f"masking.scheme = {config.masking.scheme!r}")
        if config.execution.device != "cpu":
            FLOWER.require("devices", f"execution.device = {config.execution.device!r}")
        if config.dp.mechanism != "none":  # never run without the DP the config asks for
            FLOWER.require("differential-privacy", f"[dp] mechanism = {config.dp.mechanism!r}")
        return config

    def algorithm_name(self, config: Config) -> str:
        """The algorithm to run (a preset or one composed in the config), refused here when
        one of its pieces needs what Flower does not support (registry.check_combination
        reads flower/runtime.py's declared capabilities)."""
        name = self.algorithm or config.train.algorithms[-1]
        try:
            _, scheme = split_name(name, config.composed_names())
        except ValueError as error:
            raise ConfigError(f"Flower run config: algorithm = {name!r}: {error}") from None
        check_combination(
            name,
            recipe_of(name, config.algorithms),
            scheme=scheme,
            runtime=FLOWER,
            privacy=config.privacy.level,
        )
        needs_counts = SCHEMES[scheme].sampling != "uniform" or SCHEMES[scheme].scale_lr_by_pn
        if (
            heat_source_for(config.privacy.level, config.privacy.heat_source) != "exact"
            and needs_counts
        ):
            raise ConfigError(
                f"Flower run config: algorithm = {name!r}: scheme {scheme!r} needs every "
                "client's sample count on the server, which privacy.heat_source = "
                f"{config.privacy.heat_source!r} keeps private; use another scheme or exact heat"
            )
        return name


def _number(run_config: dict[str, Any], key: str, default: float, kind: type) -> Any:
    """A run config number (``kind`` int or float): a TOML number, or its text (from
    --run-config); anything else is refused naming the key and the value."""
    value = run_config.get(key, default)
    try:
        if isinstance(value, bool) or (kind is int and isinstance(value, float)):
            raise ValueError
        number = kind(value)
    except (TypeError, ValueError, OverflowError):
        expected = "a whole number" if kind is int else "a number"
        raise ConfigError(f"Flower run config: {key} = {value!r}; expected {expected}") from None
    if kind is float and number != number:  # NaN passes every comparison: refuse it here
        raise ConfigError(f"Flower run config: {key} = {value!r}; expected a number")
    return number


def _flag(value: object, key: str) -> bool:
    """A run config flag: a TOML boolean, or the text true / false (from --run-config)."""
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ConfigError(f"Flower run config: {key} = {value!r}; expected true or false")


def _path(text: str) -> str:
    return str(Path(text).expanduser()) if text else ""


def output_folder(text: str) -> str:
    """The run config's ``out-dir`` with ``~`` expanded; a relative path is refused, since
    the ServerApp runs inside the app folder and ``flwr run .`` would ship the results on;
    so is a folder no run may write into (run_folder.check_new_folder)."""
    if not text.strip():
        return ""
    path = Path(text).expanduser()
    if not path.is_absolute():
        raise ConfigError(
            f"Flower run config: out-dir = {text!r} is relative, so the results would be "
            "written inside the app folder (and shipped to every node by the next flwr run); "
            "give an absolute path or one starting with ~"
        )
    try:
        check_new_folder(path, OUT_DIR_FLAGS)
    except FedsubError as error:
        raise ConfigError(f"Flower run config: {error}") from None
    return str(path)
