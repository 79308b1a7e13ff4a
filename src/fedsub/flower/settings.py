"""The settings of a fedsub run on Flower, read from its run config (``[tool.flwr.app.config]``)
by fedsub/keys.py, the one path every option goes through, and grouped by concern. Every key
and its meaning: docs/tutorials/flower.md, "Run-config keys" (a test keeps the two in step)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from fedsub import config as config_lib
from fedsub.algorithms.compose import recipe_of
from fedsub.algorithms.registry import check_combination, split_name
from fedsub.algorithms.schemes import SCHEMES
from fedsub.clock.settings import REAL_TIME, real_time_refusals
from fedsub.config import Config
from fedsub.errors import ConfigError, FedsubError
from fedsub.files.run_folder import Flags, check_new_folder
from fedsub.flower.runtime import FLOWER
from fedsub.keys import check_spelled, parse_spelled
from fedsub.runs.initial_model import described

Payload = Literal["submodel", "full"]
WHERE = "Flower run config"
INITIAL_MODEL = f"{WHERE}: initial-model"  # how errors about the model file name it
# How the run config names the out-dir and its options (run_folder's messages use them).
OUT_DIR_FLAGS = Flags(
    folder="out-dir",
    example='out-dir = "~/fedsub-flower-out/NAME"',
    overwrite="overwrite = true",
    resume="resume = true",
    cwd_rule=False,
)
AT_LEAST_0, AT_LEAST_1, SECONDS = {"min": 0}, {"min": 1}, {"min_exclusive": 0}


@dataclass(frozen=True)
class Replies:
    """A round's replies: how few still update the model, how long a round waits for them,
    how many short rounds in a row stop the run; a node's delay before it replies."""

    min_replies: int = field(default=1, metadata=AT_LEAST_1)
    max_failed_rounds: int = field(default=3, metadata=AT_LEAST_1)
    round_timeout: float = field(default=600.0, metadata=SECONDS)
    train_delay: float = field(default=0.0, metadata=AT_LEAST_0)


@dataclass(frozen=True)
class Nodes:
    """Membership: the nodes round 1 waits for, how long, and how often the heat
    coefficients are rebuilt over the clients registered since."""

    min_nodes: int = field(default=0, metadata=AT_LEAST_0)
    node_wait: float = field(default=600.0, metadata=SECONDS)
    heat_refresh_every: int = field(default=1, metadata=AT_LEAST_1)


@dataclass(frozen=True)
class Deployment:
    """Node-local data: the run's feature spec, how many nodes hold data, the server's own
    test file ("": the nodes hold partitions of the config's dataset); and the server's
    model file the run starts from ("": the seeded initial draw)."""

    feature_spec: str = ""
    num_nodes: int = field(default=0, metadata=AT_LEAST_0)
    server_test_file: str = ""
    initial_model: str = ""

    def __post_init__(self) -> None:
        if self.feature_spec and self.num_nodes < 2:
            raise ConfigError(
                f"{WHERE}: num-nodes = {self.num_nodes}; with a feature-spec the server knows "
                "the population only from it: give the number of nodes (>= 2)"
            )
        if self.server_test_file and not self.feature_spec:
            raise ConfigError(
                f"{WHERE}: server-test-file = {self.server_test_file!r} needs a feature-spec "
                "to read it with"
            )


@dataclass(frozen=True)
class Output:
    """The out-dir and what goes there: checkpoints, resume or overwrite, the transcript."""

    out_dir: str = ""
    checkpoint_every: int = field(default=0, metadata=AT_LEAST_0)
    resume: bool = False
    overwrite: bool = False
    heat_transcript: bool = False

    def __post_init__(self) -> None:
        if self.resume and self.overwrite:
            raise ConfigError(
                f"{WHERE}: resume = true continues the run in out-dir, overwrite = true "
                "replaces it; set one of them"
            )
        wanted = (("checkpoint-every", self.checkpoint_every), ("resume", self.resume))
        for key, value in (*wanted, ("overwrite", self.overwrite)):
            if value and not self.out_dir:
                raise ConfigError(
                    f"{WHERE}: {key} needs out-dir (checkpoints go to <out-dir>/checkpoints)"
                )


@dataclass(frozen=True)
class FlowerSettings:
    config: str = ""
    overrides: tuple[str, ...] = field(default_factory=tuple)
    algorithm: str = ""
    payload: Payload = "submodel"
    eval_every: int = field(default=0, metadata=AT_LEAST_0)
    dp_seeded_noise: bool = False
    replies: Replies = field(default_factory=Replies)
    nodes: Nodes = field(default_factory=Nodes)
    deployment: Deployment = field(default_factory=Deployment)
    output: Output = field(default_factory=Output)

    def __post_init__(self) -> None:  # ranges: also for settings built in code
        check_spelled(WHERE, self)

    @staticmethod
    def from_run_config(run_config: dict[str, Any]) -> FlowerSettings:
        """The settings a run config gives, every key checked by fedsub/keys.py; ``set``
        (overrides separated by ``;``) split, paths with ``~`` expanded."""
        settings = parse_spelled(FlowerSettings, WHERE, run_config, apart={"set": "overrides"})
        text = str(run_config.get("set", ""))
        output, deployment = settings.output, settings.deployment
        return replace(
            settings,
            overrides=tuple(part.strip() for part in text.split(";") if part.strip()),
            output=replace(output, out_dir=output_folder(output.out_dir)),
            deployment=replace(
                deployment,
                feature_spec=_path(deployment.feature_spec),
                server_test_file=_path(deployment.server_test_file),
                initial_model=_path(deployment.initial_model),
            ),
        )

    def check_against(self, config: Config) -> None:
        """min-replies above the cohort size could never be met: refuse it before round 1."""
        min_replies, deployment = self.replies.min_replies, self.deployment
        if min_replies > config.train.clients_per_round:
            raise ConfigError(
                f"{WHERE}: min-replies = {min_replies} exceeds "
                f"train.clients_per_round = {config.train.clients_per_round}; no round could "
                "ever update the model"
            )
        if config.privacy.level == "full" and self.eval_every and not deployment.server_test_file:
            raise ConfigError(
                f"{WHERE}: eval-every = {self.eval_every} with privacy.level = "
                "'full': federated evaluation would send each node's sums (its sample counts "
                "among them) in the clear, which this level keeps inside the secure sum, so "
                "the nodes are not asked; give the server its own test file (server-test-file, "
                "with feature-spec) or set eval-every = 0"
            )
        if deployment.feature_spec and config.train.clients_per_round > deployment.num_nodes:
            raise ConfigError(
                f"train.clients_per_round = {config.train.clients_per_round} is more than the "
                f"population: {WHERE} num-nodes = {deployment.num_nodes}"
            )

    def description(self, config_text: str, algorithm: str) -> str:
        """Everything that decides the model a run ends with (hashed into its checkpoints),
        with the fedsub config as written (``config_text``); with ``initial-model``, the
        digest of the file's bytes (only then: a run from the initial draw keeps the hash it
        had before the key existed, and resumes)."""
        text = (
            f"{config_text}\n# flower\nalgorithm = {algorithm!r}\n"
            f"payload = {self.payload!r}\nheat-refresh-every = {self.nodes.heat_refresh_every}\n"
        )
        return described(text, self.deployment.initial_model, INITIAL_MODEL)

    def fedsub_config(self) -> Config:
        config = config_lib.load(Path(self.config) if self.config else None, self.overrides)
        if config.masking.scheme != "none":
            FLOWER.require("masking", f"masking.scheme = {config.masking.scheme!r}")
        if config.clock.on:  # [clock] (issue 51): FedBuff in real time only (fedbuff_server.py)
            if config.clock.mode != "fedbuff":
                FLOWER.require("virtual-clock", f"clock.mode = {config.clock.mode!r}")
            for key in real_time_refusals(config.clock):
                raise ConfigError(f'{key} with clock.mode = "fedbuff" on Flower: {REAL_TIME}')
        if config.execution.device != "cpu":
            FLOWER.require("devices", f"execution.device = {config.execution.device!r}")
        heat = config.privacy.effective_heat_source
        if config.privacy.randomness == "seeded" and heat == "randomized-response":
            raise ConfigError(
                "privacy.randomness = 'seeded' with the 'randomized-response' heat on "
                "Flower: each node draws its randomized-response bits from its own OS entropy "
                "(the simulator's seeded coins are one stream across all clients, with no "
                "per-node form), so this heat cannot be seeded; set privacy.randomness = "
                "'secret', or privacy.heat_source = 'secagg' for an exact private heat"
            )
        if config.dp.mechanism != "none":  # never run without the DP the config asks for
            FLOWER.require("differential-privacy", f"[dp] mechanism = {config.dp.mechanism!r}")
            if self.dp_seeded_noise and config.dp.trust.randomness != "seeded":
                raise ConfigError(
                    f"{WHERE}: dp-seeded-noise = true draws the nodes' noise shares from "
                    "train.seed, which anyone holding the config can redraw; it needs "
                    "dp.randomness = 'seeded' (a reproduction, whose epsilon is not a "
                    "guarantee), or set dp-seeded-noise = false"
                )
        return config

    def algorithm_name(self, config: Config) -> str:
        """The algorithm to run (a preset or one composed in the config), refused here when
        one of its pieces needs what Flower does not support (registry.check_combination
        reads flower/runtime.py's declared capabilities)."""
        name = self.algorithm or config.train.algorithms[-1]
        try:
            _, scheme = split_name(name, config.composed_names())
        except ValueError as error:
            raise ConfigError(f"{WHERE}: algorithm = {name!r}: {error}") from None
        check_combination(
            name,
            recipe_of(name, config.algorithms),
            scheme=scheme,
            runtime=FLOWER,
            privacy=config.privacy.level,
        )
        needs_counts = SCHEMES[scheme].sampling != "uniform" or SCHEMES[scheme].scale_lr_by_pn
        if config.privacy.effective_heat_source != "exact" and needs_counts:
            raise ConfigError(
                f"{WHERE}: algorithm = {name!r}: scheme {scheme!r} needs every "
                "client's sample count on the server, which privacy.heat_source = "
                f"{config.privacy.heat_source!r} keeps private; use another scheme or exact heat"
            )
        return name


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
            f"{WHERE}: out-dir = {text!r} is relative, so the results would be "
            "written inside the app folder (and shipped to every node by the next flwr run); "
            "give an absolute path or one starting with ~"
        )
    try:
        check_new_folder(path, OUT_DIR_FLAGS)
    except FedsubError as error:
        raise ConfigError(f"{WHERE}: {error}") from None
    return str(path)
