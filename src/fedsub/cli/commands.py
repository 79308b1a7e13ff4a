"""fedsub: run, compare and inspect federated submodel training (FedSubAvg,
FedAvg and baselines) from the command line. `fedsub list keys` shows every
config key."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Protocol

from fedsub import __version__, distributed, profiling
from fedsub.errors import ConfigError, FedsubError
from fedsub.moved_keys import notes_once
from fedsub.progress import Reporter, RichReporter, reporting

if TYPE_CHECKING:
    from fedsub import config as config_lib
    from fedsub.engine.loop import Interrupted

# The config, the engine and rich are imported by the commands that use them, not here:
# `fedsub --version`, `--help`, `fedsub reproduce` (the list) must not pay torch's import
# (tests/test_cli.py checks that importing this module imports no torch).

SET_NOTE = """\
--set SECTION.KEY=VALUE overrides one config key and may be repeated; VALUE is
read as TOML (numbers, true/false, "strings", [lists]; a bare word is taken as a
string); VALUE none unsets the key (it takes fedsub's built-in default: unset,
for optional keys such as eval.target_test_auc). `fedsub list keys` shows
every key with its default and allowed values; `fedsub list
algorithms|datasets|models` shows those and their options."""
DEFAULT_OUT = "runs/latest"
REPRODUCE_OUT = "runs/reproduce"
REPRODUCE_EXIT = """
Every option is checked against the parts first; one a part cannot use (e.g. --set on a
closed form, --data-path on generated data) is refused. Exit status: 0 every part asked for
ran, 1 a part did not (data not here, not public or unreadable; the report is written and
the last line names each such part and why), 2 an option refused (nothing ran).
"""


def _config(args: argparse.Namespace, algorithms: list[str] | None = None) -> config_lib.Config:
    """The config the arguments give; ``algorithms`` (from --algorithm / --algorithms)
    replaces train.algorithms, and an error it causes names that flag."""
    from fedsub import config as config_lib

    path = Path(args.config) if args.config else None
    extra, named = _algorithms_override(args, algorithms)
    return config_lib.load(path, [*args.set, *extra], named)


def _algorithms_override(
    args: argparse.Namespace, algorithms: list[str] | None
) -> tuple[list[str], dict[str, str]]:
    """--algorithm(s) as a train.algorithms override, and how to name it in an error."""
    if not algorithms:
        return [], {}
    text = "train.algorithms=" + json.dumps(algorithms)
    flag = "--algorithm" if getattr(args, "algorithm", None) else "--algorithms"
    return [text], {text: f"{flag} {','.join(algorithms)}"}


def _out_folder(args: argparse.Namespace, default: str = DEFAULT_OUT) -> Path:
    """--out as given (``default`` when not given); nothing (empty, blank text) refused."""
    from fedsub.files.run_folder import check_folder_text

    if args.out is None:
        return Path(default)
    check_folder_text(args.out, "--out")
    return Path(args.out)


# What each text option names, for the error when it is given empty or blank (an empty
# path would otherwise read as "not given", or as the current folder).
TEXT_OPTIONS = {
    "config": ("CONFIG", "a config file (e.g. configs/li-synthetic.toml), or leave it out"),
    "out": ("--out", "the folder for the results, e.g. --out runs/NAME"),
    "resume": ("--resume", "the folder of the run to continue, e.g. --resume runs/NAME"),
    "configs": ("--configs", "the folder holding fedsub's configs, or leave it out"),
    "data_path": ("--data-path", "the dataset's file or folder"),
    "url": ("--url", "the mirror's address, or leave it out for the official one"),
    "checksum": ("--checksum", "sha256:<hex> or md5:<hex>, or leave it out for the pin"),
    "initial_model": (
        "--initial-model",
        "a model.safetensors fedsub wrote, or leave it out for the seeded initial draw",
    ),
}


def _refuse_empty_texts(args: argparse.Namespace) -> None:
    """A path (or other text option) given as empty or blank text is refused, naming the
    option, before anything runs."""
    for dest, (flag, expected) in TEXT_OPTIONS.items():
        text = getattr(args, dest, None)
        if isinstance(text, str) and not text.strip():
            shown = "empty" if not text else f"blank ({text!r})"
            raise ConfigError(f"{flag} is {shown}; give {expected}")


def _compare(args: argparse.Namespace, algorithms: list[str] | None) -> int:
    from fedsub.library import run_config as run  # its errors name the command line's flags

    if args.resume and _is_sweep(_resumed_folder(args)):
        return _sweep(args, algorithms)
    if args.resume:
        config, out = _resumed_config(args, algorithms), _resumed_folder(args)
    else:
        config, out = _config(args, algorithms), _out_folder(args)
    try:
        with _reporting(args.quiet), _stop_on_signals() as stop_requested:
            result = run(
                config,
                out=out,
                resume=bool(args.resume),
                overwrite=args.overwrite,
                profile=args.profile,
                stop_requested=stop_requested,
                initial_model=args.initial_model,
            )
    except _interrupted() as stopped:
        return _say_how_to_resume(args.command, stopped, out, stop_requested, args.initial_model)
    print(result.markdown, end="")
    if result.profiles:
        print("\nwhere the rounds' time went (profile.json in each algorithm's folder):")
        print(profiling.table(result.profiles), end="")
    if not args.quiet:
        print(f"results in {result.out}/ (summary.json, summary.md, curves.png)")
    return _diverged_exit(result)


def _interrupted() -> type[Interrupted]:
    """The exception of a run stopped by a signal (imported when a command trains)."""
    from fedsub.engine.loop import Interrupted

    return Interrupted


def _silence_other_processes(args: argparse.Namespace) -> None:
    """Under torchrun only process 0 talks: the others get --quiet, no standard output and
    only error logs (their errors are still printed, naming the process)."""
    if distributed.from_environment().writes:
        return
    if hasattr(args, "quiet"):
        args.quiet = True
    logging.getLogger("fedsub").setLevel(logging.ERROR)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)


def _refuse_what_torchrun_cannot_split(args: argparse.Namespace) -> None:
    """Under torchrun only training splits across processes; `fedsub data` (downloads, plots)
    would run once per process, writing the same files at the same time."""
    if args.command in ("data", "reproduce") and distributed.from_environment().split:
        what = f"data {args.data_command}" if args.command == "data" else "reproduce"
        raise ConfigError(
            f"`fedsub {what}` under torchrun: only `fedsub run` and "
            "`fedsub compare` are split across processes; run it without torchrun"
        )


class _Diverging(Protocol):
    """What the exit status reads of a run's result (a comparison's or a sweep's)."""

    @property
    def diverged(self) -> Mapping[str, object]: ...

    def divergence_message(self) -> str: ...


def _diverged_exit(outcome: _Diverging) -> int:
    """Exit 1 with a ``fedsub: error:`` line when any algorithm diverged (its outputs are
    written all the same), else 0."""
    if not outcome.diverged:
        return 0
    if not distributed.from_environment().writes:
        return 1
    print(f"fedsub: error: {outcome.divergence_message()}", file=sys.stderr)
    return 1


def _which_process() -> str:
    """How an error names the torchrun process it comes from ("" for process 0 and alone)."""
    try:
        processes = distributed.from_environment()
    except FedsubError:
        return ""
    return "" if processes.writes else f"{processes}: "


def _say_how_to_resume(
    command: str,
    stopped: Interrupted,
    out: Path,
    stop: Callable[[], bool] | None = None,
    initial_model: str | None = None,
) -> int:
    """Exit 128 + the signal that stopped the run (130 Ctrl-C, 143 SIGTERM), saying how to
    resume it (with the model file it started from, when it did)."""
    signum = stop.signum if isinstance(stop, _StopRequest) and stop.signum else signal.SIGINT
    if not distributed.from_environment().writes:
        return 128 + signum
    again = "" if initial_model is None else f" --initial-model {shlex.quote(initial_model)}"
    print(
        f"fedsub: stopped after round {stopped.round}; checkpoint {stopped.checkpoint}. "
        f"Resume with: fedsub {command} --resume {out}{again}",
        file=sys.stderr,
    )
    return 128 + signum


def _is_sweep(folder: Path) -> bool:
    from fedsub.files.run_folder import read_run_file

    try:
        return read_run_file(folder).get("kind") == "sweep"
    except FedsubError:  # no run file, or not a readable one: the run's resume says why
        return False


def _resumed_folder(args: argparse.Namespace) -> Path:
    """--resume DIR; refused when empty, or with an --out that names another folder."""
    from fedsub.files.run_folder import check_folder_text

    check_folder_text(args.resume, "--resume")
    folder = Path(args.resume)
    if args.out is not None and Path(args.out).resolve() != folder.resolve():
        raise ConfigError(
            f"--resume {args.resume} continues that run in its own folder; --out {args.out} "
            "names another. Drop --out (to continue a copy elsewhere, copy the folder and "
            "--resume the copy)"
        )
    return folder


def _refuse_changes_on_resume(args: argparse.Namespace, algorithms: list[str] | None) -> None:
    flags = (getattr(args, "algorithm", None), getattr(args, "sweep", None))
    given = [args.config, algorithms, *flags]
    if any(g is not None for g in given) or args.set or args.overwrite:  # even given empty
        raise ConfigError(
            "--resume continues a run as it was configured (its run.json and config.toml); "
            "drop CONFIG, --set, --algorithm(s), --sweep and --overwrite"
        )


def _resumed_config(args: argparse.Namespace, algorithms: list[str] | None) -> config_lib.Config:
    """``--resume DIR`` continues the run exactly as it was configured in DIR/config.toml."""
    from fedsub import config as config_lib

    _refuse_changes_on_resume(args, algorithms)
    path = _resumed_folder(args) / "config.toml"
    if not path.exists():
        raise ConfigError(f"{args.resume} is not a fedsub run folder: {path} does not exist")
    return config_lib.load(path)


class _Aborted(KeyboardInterrupt):
    """A second stop signal: the run stops at once (exit 128 + the signal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@dataclasses.dataclass
class _StopRequest:
    """Whether (and by which signal) the run was asked to stop after its current round."""

    signum: int = 0

    def __call__(self) -> bool:
        return self.signum != 0


STOP_SIGNALS: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


@contextmanager
def _stop_on_signals() -> Iterator[Callable[[], bool]]:
    """The first Ctrl-C or SIGTERM (what a batch scheduler sends before it kills a job) asks
    the run to stop after the current round, with a checkpoint; a second one stops at once."""
    request = _StopRequest()

    def handler(signum: int, frame: object) -> None:
        if request.signum:
            raise _Aborted(signum)
        request.signum = signum
        if distributed.from_environment().writes:  # under torchrun every process hears it
            print(
                f"\nfedsub: {STOP_SIGNALS[signum]}: finishing this round, then checkpointing "
                f"({STOP_SIGNALS[signum]} again to stop at once)",
                file=sys.stderr,
            )

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield request
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


def _reporting(quiet: bool):
    """Progress of long phases and the training bar on stderr; nothing when quiet."""
    return reporting(Reporter() if quiet else RichReporter())


def cmd_run(args: argparse.Namespace) -> int:
    if args.resume:
        return _compare(args, None)
    if args.algorithm is not None:
        if not args.algorithm.strip():
            raise ConfigError(
                f"--algorithm {args.algorithm!r}: expected an algorithm name, e.g. "
                "--algorithm fedsubavg (`fedsub list algorithms`)"
            )
        return _compare(args, [args.algorithm.strip()])
    listed = _config(args).train.algorithms
    if len(listed) != 1:
        raise ConfigError(
            f"`fedsub run` trains one algorithm but train.algorithms lists {listed}; "
            "pass --algorithm NAME or use `fedsub compare`"
        )
    return _compare(args, None)


def cmd_compare(args: argparse.Namespace) -> int:
    algorithms = None
    if args.algorithms is not None:
        algorithms = [a.strip() for a in args.algorithms.split(",")]
        if not all(algorithms):
            raise ConfigError(
                f"--algorithms {args.algorithms!r}: expected algorithm names separated by "
                "commas, e.g. --algorithms fedavg,fedsubavg (`fedsub list algorithms`); "
                "without --algorithms the config's train.algorithms run"
            )
    if args.sweep is not None:  # --sweep "" is refused there, not read as no sweep
        return _sweep(args, algorithms)
    return _compare(args, algorithms)


@dataclasses.dataclass(frozen=True)
class _SweepPlan:
    out: Path
    key: str
    values: list[str]
    base: dict  # the raw config every value starts from
    where: str  # where the base config comes from, for error messages


def _sweep_plan(args: argparse.Namespace, algorithms: list[str] | None) -> _SweepPlan:
    """The sweep the arguments ask for: read back from its folder on ``--resume``, else from
    ``--sweep``, the config file and ``--set``."""
    from fedsub import config as config_lib
    from fedsub.runs.experiment import read_sweep, repeated_value

    if args.resume:
        _refuse_changes_on_resume(args, algorithms)
        out = _resumed_folder(args)
        key, values, base = read_sweep(out)
        return _SweepPlan(out, key, values, base, str(out / "run.json"))
    key, eq, values_text = args.sweep.partition("=")
    values = [v.strip() for v in values_text.split(",")]
    if not eq or not key.strip() or not all(values):
        raise ConfigError(
            f"--sweep {args.sweep!r}: expected section.key=v1,v2,... (values separated by "
            "commas, none empty)"
        )
    twice = repeated_value(values)
    if twice is not None:
        raise ConfigError(f"--sweep {args.sweep!r}: value {twice!r} is given twice")
    extra, named = _algorithms_override(args, algorithms)
    path = Path(args.config) if args.config else config_lib.default_config_path()
    where = str(path) if args.config else "default config"
    # a bad --set, flag or file is named as such, before the values; checked with the swept
    # key at its first value (a base may need it: [dp] without dp.target_epsilon)
    first = f"{key.strip()}={values[0]}"
    named = {**named, first: f"--sweep {args.sweep}"}
    config_lib.load(Path(args.config) if args.config else None, [*args.set, *extra, first], named)
    base = config_lib.apply_overrides(config_lib.read_toml(path), [*args.set, *extra])
    return _SweepPlan(_out_folder(args), key.strip(), values, base, where)


def _sweep(args: argparse.Namespace, algorithms: list[str] | None) -> int:
    """A sweep, or (``--resume DIR`` of a sweep's folder) the rest of one."""
    from fedsub.runs.experiment import sweep, sweep_config

    if args.initial_model is not None:
        raise ConfigError(
            "--initial-model starts one comparison from a model file; a sweep (--sweep, or "
            "--resume of a sweep's folder) starts every value from the seeded initial draw: "
            "drop --initial-model, or run each value as its own `fedsub compare`"
        )
    plan = _sweep_plan(args, algorithms)
    out, key, values, base, where = plan.out, plan.key, plan.values, plan.base, plan.where
    for value in values:  # every value valid before training
        try:
            sweep_config(base, key, value, where)
        except ConfigError as error:
            if args.resume:
                raise
            inner = str(error).removeprefix(f"{where}: ")
            raise ConfigError(f"--sweep {args.sweep}: value {value}: {inner}") from None
    try:
        with _reporting(args.quiet), _stop_on_signals() as stop_requested:
            outcome = sweep(
                key,
                values,
                base,
                out,
                None,
                resume=bool(args.resume),
                stop_requested=stop_requested,
                overwrite=args.overwrite,
                where=where,
                profile=args.profile,
            )
    except _interrupted() as stopped:
        return _say_how_to_resume("compare", stopped, out, stop_requested)
    print(outcome.markdown, end="")
    return _diverged_exit(outcome)


def cmd_data_stats(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from fedsub import config as config_lib
    from fedsub.data.registry import DATASETS
    from fedsub.files.atomic_files import check_image_path
    from fedsub.runs.run_setup import load_data
    from fedsub.submodel.index import SubmodelIndex
    from fedsub.submodel.stats import feature_heat, plot_heat_distribution, table1_row

    plot = check_image_path(args.plot, "--plot") if args.plot is not None else None
    if args.name.endswith(".toml"):  # a run's config: its [data] section, as the run sees it
        config = config_lib.load(Path(args.name), args.set)
    elif args.name in DATASETS:
        config = config_lib.load(None, [f'data.name="{args.name}"', *args.set])
    else:
        raise ConfigError(
            f"unknown dataset {args.name!r}; give a config file (.toml) or one of "
            f"{', '.join(DATASETS)}"
        )
    with _reporting(False):
        dataset = load_data(config)
        index = SubmodelIndex.build(dataset)
        row = table1_row(dataset, index)
    table = Table(title=dataset.name, caption=", ".join(f"{k}={v}" for k, v in _options(config)))
    table.add_column("statistic")
    table.add_column("value", justify="right")
    for key, value in row.items():
        table.add_row(
            key.replace("_", " "), f"{value:.4g}" if isinstance(value, float) else str(value)
        )
    Console().print(table)
    if plot is not None:
        heat = feature_heat(dataset, index)
        untouched = int(row["features"]) - len(heat)
        plot_heat_distribution(heat, plot, dataset.name, untouched)
        print(f"heat distribution plot: {plot}")
    return 0


def cmd_dp(args: argparse.Namespace) -> int:
    from fedsub.runs.run_setup import dp_plan

    config = _config(args)
    with _reporting(False):
        print("\n".join(dp_plan(config)))
    return 0


def cmd_reshard(args: argparse.Namespace) -> int:
    from fedsub.engine.reshard import reshard_run

    done = reshard_run(Path(args.run_folder), args.processes)
    if not args.quiet:
        print("\n".join(f"re-sharded {p} for {args.processes} processes" for p in done))
        print(
            f"resume with: torchrun --nproc-per-node {args.processes} -m fedsub compare "
            f"--resume {args.run_folder}"
        )
    return 0


def cmd_data_fetch(args: argparse.Namespace) -> int:
    from fedsub.data.fetch import DOWNLOADS, Download, fetch, listing

    if args.name is None:  # what can be fetched, from where, and whether it is cached
        print("\n".join(listing()))
        return 0
    if args.name not in DOWNLOADS:
        raise ConfigError(
            f"{args.name!r} has no official download; fetchable: {', '.join(DOWNLOADS)} "
            "(others are read from data.path)"
        )
    pinned = DOWNLOADS[args.name]
    if args.checksum and len(pinned) > 1:
        raise ConfigError(f"{args.name} has {len(pinned)} files; --checksum fits one-file sets")
    for download in pinned:
        url = download.url
        if args.url:  # a mirror: the file itself, or the folder holding several
            url = args.url if len(pinned) == 1 else args.url.rstrip("/") + "/" + download.filename
        if args.checksum:  # the user's own pin replaces both of ours (e.g. a newer release)
            download = Download(url, download.filename, args.checksum)
        else:
            download = dataclasses.replace(download, url=url)
        print(fetch(args.name, download, unpinned=args.unpinned))
    return 0


def _options(config: config_lib.Config) -> list[tuple[str, object]]:
    return [("seed", config.data.seed), *dataclasses.asdict(config.data.options).items()]


def cmd_reproduce(args: argparse.Namespace) -> int:
    """The seeds' tables and figures: the list, or one run beside the paper's numbers. Exit 0
    when every part asked for ran, 1 when one did not (its reason in the report and on
    stderr), 2 for options refused before anything ran."""
    from fedsub.reproduce import status

    configs = Path(args.configs) if args.configs is not None else None
    if args.id is None:
        _refuse_options_of_a_run(args)
        print("\n".join(status.listing(status.configs_given(configs))))
        return 0
    from fedsub.reproduce import running

    if args.resume and args.overwrite:
        raise ConfigError(
            "--resume continues the runs in --out; --overwrite replaces them: pick one"
        )
    out = _out_folder(args, REPRODUCE_OUT)
    try:
        with _reporting(args.quiet), _stop_on_signals() as stop_requested:
            folders = running.Folders(args.overwrite, args.resume, stop_requested)
            results = running.reproduce(
                args.id,
                out,
                smoke=args.smoke,
                part=args.part,
                data_path=args.data_path,
                overrides=args.set,
                configs=configs,
                folders=folders,
                seeds=args.seeds,
            )
    except _interrupted() as stopped:
        print(
            f"fedsub: stopped after round {stopped.round}; continue with: "
            f"{_reproduce_again(args, out)}",
            file=sys.stderr,
        )
        signum = stop_requested.signum if isinstance(stop_requested, _StopRequest) else 0
        return 128 + (signum or signal.SIGINT)
    print("\n".join(running.summary_lines(results)))
    if not args.quiet:
        print(f"results in {out}/ (reproduce.md, reproduce.json, plots)")
    missed = running.not_run(results)
    if missed is None:
        return 0
    print(f"fedsub: error: {missed}", file=sys.stderr)
    return 1


def _reproduce_again(args: argparse.Namespace, out: Path) -> str:
    """The command that continues a stopped reproduction: the same options, --resume."""
    words = ["fedsub", "reproduce", args.id, "--out", str(out)]
    for flag, value in (("--part", args.part), ("--data-path", args.data_path)):
        if value is not None:
            words += [flag, value]
    if args.configs is not None:
        words += ["--configs", args.configs]
    words += [w for text in args.set for w in ("--set", text)]
    words += ["--smoke"] if args.smoke else []
    words += ["--seeds", str(args.seeds)] if args.seeds != 1 else []
    return shlex.join([*words, "--resume"])


def _refuse_options_of_a_run(args: argparse.Namespace) -> None:
    """`fedsub reproduce` without an id lists the experiments: options of a run are refused
    rather than ignored."""
    given = {
        "--part": args.part is not None,
        "--out": args.out is not None,
        "--smoke": args.smoke,
        "--data-path": args.data_path is not None,
        "--set": bool(args.set),
        "--overwrite": args.overwrite,
        "--resume": args.resume,
        "--seeds": args.seeds != 1,
    }
    named = [flag for flag, present in given.items() if present]
    if named:
        raise ConfigError(
            f"{', '.join(named)} without an ID: `fedsub reproduce` alone lists the tables and "
            "figures; give one, e.g. fedsub reproduce 004-fig4 " + " ".join(named)
        )


def cmd_list(args: argparse.Namespace) -> int:
    from fedsub.cli.listing_cache import cached_listing

    lines, problems = cached_listing(args.kind, lambda: _listing(args.kind))
    print("\n".join(lines))
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    return 0


def _listing(kind: str) -> tuple[list[str], list[str]]:
    """``fedsub list KIND``'s lines and the plugins that could not be used (imports the
    registries, and with them torch: listing_cache.py keeps the answer)."""
    import warnings

    from fedsub.cli.catalog import listing, plugin_problems
    from fedsub.plugins import PluginWarning

    with warnings.catch_warnings():  # a broken plugin is reported once, below the listing
        warnings.simplefilter("ignore", PluginWarning)
        return listing(kind), plugin_problems()


EXAMPLES = {
    "run": """\
  fedsub run --algorithm fedsubavg --set train.rounds=20 --out runs/quick
  fedsub run configs/li-synthetic.toml --algorithm fedavg@scheme1 --quiet""",
    "compare": """\
  fedsub compare configs/li-synthetic.toml --set train.lr=0.5 --set eval.every=5
  fedsub compare --algorithms fedavg,fedsubavg --sweep train.local_steps=1,5,10""",
    "stats": """\
  fedsub data stats synthetic-sparse --set data.num_users=500
  fedsub data stats configs/movielens-lr.toml --plot heat.png""",
    "fetch": """\
  fedsub data fetch
  fedsub data fetch movielens-1m --url https://example.org/mirror/ml-1m.zip""",
    "reproduce": """\
  fedsub reproduce
  fedsub reproduce 004-fig4 --out runs/004-fig4
  fedsub reproduce 001-tab2 --part movielens --data-path ml-1m.zip --out runs/t2
  fedsub reproduce 001-fig2 --smoke --out runs/smoke""",
    "list": """\
  fedsub list algorithms
  fedsub list keys""",
    "dp": """\
  fedsub dp --set dp.mechanism=gaussian --set dp.target_epsilon=4
  fedsub dp my.toml --set dp.noise_multiplier=1.2 --set train.sampling=poisson""",
    "reshard": """\
  fedsub reshard runs/sharded --processes 4
  torchrun --standalone --nproc-per-node 4 -m fedsub compare --resume runs/sharded""",
    "data": """\
  fedsub data stats synthetic-sparse
  fedsub data fetch movielens-1m""",
    "fedsub": """\
  fedsub compare --set train.rounds=50 --out runs/first
  fedsub run configs/li-synthetic.toml --algorithm fedavg@scheme1""",
}


def _epilog(command: str, set_note: bool = True) -> str:
    """A subcommand's help ending: the --set note (where it takes --set) and two examples."""
    note = (
        SET_NOTE if set_note else "`fedsub list algorithms|datasets|models|keys` shows the choices."
    )
    return f"{note}\n\nexamples:\n{EXAMPLES[command]}\n"


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors also reach torchrun's failure report (its
    subcommands' parsers are of the same class)."""

    def error(self, message: str) -> NoReturn:
        distributed.report_to_launcher(f"{self.prog}: error: {message}")
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog="fedsub", description=__doc__, epilog=_epilog("fedsub"), formatter_class=raw
    )
    parser.add_argument("--version", action="version", version=f"fedsub {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def add_common(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", nargs="?", help="TOML config (default: the embedded default)")
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="SECTION.KEY=VALUE",
            help="override a config key; repeatable; VALUE is TOML (see below)",
        )
        p.add_argument(
            "--out",
            help=f"a folder of this run's own (default {DEFAULT_OUT}); a folder holding other "
            "runs, the current or home folder are refused",
        )
        p.add_argument("--quiet", action="store_true", help="no progress bar or notes")
        p.add_argument(
            "--resume",
            metavar="DIR",
            help="continue the stopped run (or sweep) in DIR; every piece read back is checked "
            "to belong to that run",
        )
        p.add_argument(
            "--overwrite",
            action="store_true",
            help="replace the run already in --out: only what that run wrote is removed (after "
            "this run's first round; a run that fails before it leaves the old one in place)",
        )
        p.add_argument(
            "--initial-model",
            metavar="FILE",
            help="start from this model.safetensors (a run folder's, written by fedsub) "
            "instead of the seeded initial draw: a warm start (server state, heat and the "
            "round count start afresh); every algorithm starts from it; checked against the "
            "model before anything is written; give it again with --resume",
        )
        p.add_argument(
            "--profile",
            action="store_true",
            help="time each round's phases (pull, forward, backward, client rule, push, "
            "aggregation, server step, evaluation, checkpoint); printed at the end and "
            "written to <algorithm>/profile.json",
        )

    def add_command(where, name: str, help_text: str, set_note: bool = True):
        return where.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=_epilog(name, set_note),
            formatter_class=raw,
        )

    run = add_command(commands, "run", "train one algorithm")
    add_common(run)
    run.add_argument(
        "--algorithm",
        help="which algorithm (default: the config's only one; fedsub list algorithms)",
    )
    run.set_defaults(func=cmd_run)

    comp = add_command(commands, "compare", "train several algorithms on the same schedule")
    add_common(comp)
    comp.add_argument(
        "--algorithms", help="comma-separated, e.g. fedavg,fedsubavg (fedsub list algorithms)"
    )
    comp.add_argument(
        "--sweep",
        metavar="SECTION.KEY=V1,V2,...",
        help="one comparison per value, then a rounds-to-target table (the papers' Table 3)",
    )
    comp.set_defaults(func=cmd_compare)

    data = add_command(commands, "data", "inspect and download datasets", set_note=False)
    data_commands = data.add_subparsers(dest="data_command", required=True)
    stats = add_command(data_commands, "stats", "clients, samples, feature heat dispersion")
    stats.add_argument(
        "name", help="dataset name (fedsub list datasets) or a config file whose [data] to use"
    )
    stats.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="data.KEY=VALUE",
        help="override a [data] key; repeatable; VALUE is TOML",
    )
    stats.add_argument("--plot", help="write the feature heat distribution (PNG)")
    stats.set_defaults(func=cmd_data_stats)
    fetch = add_command(data_commands, "fetch", "download a dataset into the cache", set_note=False)
    fetch.add_argument("name", nargs="?", help="e.g. movielens-1m (none: list what can be)")
    fetch.add_argument(
        "--url", help="a mirror of the official file, or of the folder of a multi-file set"
    )
    fetch.add_argument("--checksum", help="sha256:<hex> or md5:<hex> (overrides the pin)")
    fetch.add_argument(
        "--unpinned",
        action="store_true",
        help="accept a file that has no published checksum on its size alone",
    )
    fetch.set_defaults(func=cmd_data_fetch)

    reproduce = add_command(
        commands,
        "reproduce",
        "the seeds' tables and figures: list them, or run one beside the paper's numbers",
    )
    reproduce.add_argument("id", nargs="?", help="e.g. 004-fig4 (none: list every one)")
    reproduce.add_argument("--part", help="one part (a table's row, a figure's panel)")
    reproduce.add_argument("--out", help=f"output folder (default {REPRODUCE_OUT})")
    reproduce.add_argument(
        "--smoke", action="store_true", help="smoke size: 2 rounds, 2 clients (checks it runs)"
    )
    reproduce.add_argument("--data-path", help="the part's dataset file or folder (data.path)")
    reproduce.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config key of the part's runs; repeatable",
    )
    reproduce.add_argument(
        "--seeds",
        type=int,
        default=1,
        metavar="N",
        help="run each training part N times (train.seed, +1, ...): mean, spread, and each claim "
        "judged on every seed; costs N times the part's time (default 1)",
    )
    reproduce.add_argument("--configs", help="the configs folder (default: the checkout's)")
    reproduce.add_argument(
        "--overwrite", action="store_true", help="replace the runs already in --out"
    )
    reproduce.add_argument(
        "--resume",
        action="store_true",
        help="continue the stopped runs in --out (finished ones are read back)",
    )
    reproduce.add_argument("--quiet", action="store_true", help="no progress bar or notes")
    reproduce.set_defaults(func=cmd_reproduce)
    reproduce.epilog = (reproduce.epilog or "") + REPRODUCE_EXIT

    dp = add_command(commands, "dp", "the epsilon a config's [dp] will spend, without training")
    dp.add_argument("config", nargs="?", help="TOML config (default: the embedded default)")
    dp.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config key; repeatable; VALUE is TOML",
    )
    dp.set_defaults(func=cmd_dp)

    reshard = add_command(
        commands,
        "reshard",
        "re-shard a row-sharded run's newest checkpoints for another number of processes",
        set_note=False,
    )
    reshard.add_argument("run_folder", metavar="RUN_FOLDER", help="the stopped run's folder")
    reshard.add_argument(
        "--processes",
        type=int,
        required=True,
        metavar="P",
        help="how many processes the run resumes with (torchrun --nproc-per-node P; P >= 2)",
    )
    reshard.add_argument("--quiet", action="store_true", help="print nothing")
    reshard.set_defaults(func=cmd_reshard)

    listing = add_command(
        commands,
        "list",
        "list algorithms, datasets, models (with their options) or every config key",
        set_note=False,
    )
    listing.add_argument("kind", choices=["algorithms", "datasets", "models", "keys"])
    listing.set_defaults(func=cmd_list)
    return parser


def _is_out_of_memory(error: RuntimeError) -> bool:
    """torch's failed allocations: ``OutOfMemoryError`` (a GPU), or the CPU allocator's
    RuntimeError."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, torch.OutOfMemoryError):
        return True
    return "can't allocate memory" in str(error) or "out of memory" in str(error).lower()


def _out_of_memory(detail: str) -> int:
    return _failed(
        f"out of memory ({detail or 'allocation failed'}); reduce the sizes in "
        "the config (data sizes, train.batch_size, train.clients_per_round, ...)"
    )


def _failed(message: str) -> int:
    """Print the error a command ends with (status 2); under torchrun also hand it to the
    launcher, whose failure report then ends with it (distributed.report_to_launcher)."""
    line = f"fedsub: error: {message}"
    print(line, file=sys.stderr)
    distributed.report_to_launcher(line)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="fedsub: %(message)s")
    quiet = getattr(args, "quiet", False)
    logging.getLogger("fedsub").setLevel(logging.WARNING if quiet else logging.INFO)
    try:
        _refuse_empty_texts(args)
        _refuse_what_torchrun_cannot_split(args)
        _silence_other_processes(args)
        with notes_once():  # an old key's note once, however often the config is read
            return args.func(args)
    except FedsubError as error:
        return _failed(f"{_which_process()}{error}")
    except MemoryError as error:  # e.g. a dataset size far beyond this machine
        return _out_of_memory(str(error))
    except RuntimeError as error:
        if not _is_out_of_memory(error):
            raise
        return _out_of_memory(str(error).splitlines()[0])
    except BrokenPipeError:  # e.g. `fedsub list keys | head`: the reader left, not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush stays quiet
        return 141
    except OSError as error:  # a file or folder the system refused (full disk, permissions)
        what = f"{error.filename}: " if error.filename else ""
        return _failed(f"{what}{error.strerror or error}")
    except KeyboardInterrupt as error:
        print("fedsub: interrupted", file=sys.stderr)
        return 128 + (error.signum if isinstance(error, _Aborted) else signal.SIGINT)
    finally:
        distributed.leave()


if __name__ == "__main__":
    sys.exit(main())
