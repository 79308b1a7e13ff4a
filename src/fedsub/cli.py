"""fedsub: run, compare and inspect federated submodel training (FedSubAvg,
FedAvg and baselines) from the command line. `fedsub list keys` shows every
config key."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fedsub import __version__, distributed, profiling
from fedsub import config as config_lib
from fedsub.engine.loop import Interrupted
from fedsub.errors import ConfigError, FedsubError
from fedsub.progress import Reporter, RichReporter, reporting

SET_NOTE = """\
--set SECTION.KEY=VALUE overrides one config key and may be repeated; VALUE is
read as TOML (numbers, true/false, "strings", [lists]; a bare word is taken as a
string). `fedsub list keys` shows every key with its default and allowed values;
`fedsub list algorithms|datasets|models` shows those and their options."""


def _config(args: argparse.Namespace, extra: Sequence[str] = ()) -> config_lib.Config:
    path = Path(args.config) if args.config else None
    return config_lib.load(path, [*args.set, *extra])


def _compare(args: argparse.Namespace, algorithms: list[str] | None) -> int:
    from fedsub.experiment import compare

    if args.resume and _is_sweep(Path(args.resume)):
        return _sweep(args, algorithms)
    if args.resume:
        config, out = _resumed_config(args, algorithms), Path(args.resume)
    else:
        extra = [f"train.algorithms={algorithms!r}".replace("'", '"')] if algorithms else []
        config, out = _config(args, extra), Path(args.out)
    try:
        with _reporting(args.quiet), _stop_on_ctrl_c() as stop_requested:
            outcome = compare(
                config,
                out,
                None,
                bool(args.resume),
                stop_requested,
                args.overwrite,
                profile=args.profile,
            )
    except Interrupted as stopped:
        return _say_how_to_resume(args.command, stopped, out)
    print(outcome.markdown, end="")
    if outcome.profiles:
        print("\nwhere the rounds' time went (profile.json in each algorithm's folder):")
        print(profiling.table(outcome.profiles), end="")
    if not args.quiet:
        print(f"results in {outcome.out_dir}/ (summary.json, summary.md, curves.png)")
    return _diverged_exit(outcome)


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
    if args.command == "data" and distributed.from_environment().split:
        raise ConfigError(
            f"`fedsub data {args.data_command}` under torchrun: only `fedsub run` and "
            "`fedsub compare` are split across processes; run it without torchrun"
        )


def _diverged_exit(outcome) -> int:
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


def _say_how_to_resume(command: str, stopped: Interrupted, out: Path) -> int:
    if not distributed.from_environment().writes:
        return 130
    print(
        f"fedsub: stopped after round {stopped.round}; checkpoint {stopped.checkpoint}. "
        f"Resume with: fedsub {command} --resume {out}",
        file=sys.stderr,
    )
    return 130


def _is_sweep(folder: Path) -> bool:
    from fedsub.run_folder import read_run_file

    try:
        return read_run_file(folder).get("kind") == "sweep"
    except FedsubError:  # no run file, or not a readable one: the run's resume says why
        return False


def _refuse_changes_on_resume(args: argparse.Namespace, algorithms: list[str] | None) -> None:
    changes = [args.config, args.set, algorithms, getattr(args, "algorithm", None)]
    if any(changes) or getattr(args, "sweep", None) or args.overwrite:
        raise ConfigError(
            "--resume continues a run as it was configured (its run.json and config.toml); "
            "drop CONFIG, --set, --algorithm(s), --sweep and --overwrite"
        )


def _resumed_config(args: argparse.Namespace, algorithms: list[str] | None) -> config_lib.Config:
    """``--resume DIR`` continues the run exactly as it was configured in DIR/config.toml."""
    _refuse_changes_on_resume(args, algorithms)
    path = Path(args.resume) / "config.toml"
    if not path.exists():
        raise ConfigError(f"{args.resume} is not a fedsub run folder: {path} does not exist")
    return config_lib.load(path)


@contextmanager
def _stop_on_ctrl_c() -> Iterator[Callable[[], bool]]:
    """The first Ctrl-C asks the run to stop after the current round (with a checkpoint);
    a second one interrupts at once."""
    requested = False

    def handler(signum: int, frame: object) -> None:
        nonlocal requested
        if requested:
            raise KeyboardInterrupt
        requested = True
        if distributed.from_environment().writes:  # under torchrun every process hears it
            print(
                "\nfedsub: finishing this round, then checkpointing (Ctrl-C again to abort)",
                file=sys.stderr,
            )

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: requested
    finally:
        signal.signal(signal.SIGINT, previous)


def _reporting(quiet: bool):
    """Progress of long phases and the training bar on stderr; nothing when quiet."""
    return reporting(Reporter() if quiet else RichReporter())


def cmd_run(args: argparse.Namespace) -> int:
    if args.resume:
        return _compare(args, None)
    if args.algorithm:
        return _compare(args, [args.algorithm])
    listed = _config(args).train.algorithms
    if len(listed) != 1:
        raise ConfigError(
            f"`fedsub run` trains one algorithm but train.algorithms lists {listed}; "
            "pass --algorithm NAME or use `fedsub compare`"
        )
    return _compare(args, None)


def cmd_compare(args: argparse.Namespace) -> int:
    algorithms = [a.strip() for a in args.algorithms.split(",")] if args.algorithms else None
    if args.sweep:
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
    from fedsub.experiment import read_sweep

    if args.resume:
        _refuse_changes_on_resume(args, algorithms)
        out = Path(args.resume)
        key, values, base = read_sweep(out)
        return _SweepPlan(out, key, values, base, str(out / "run.json"))
    key, eq, values_text = args.sweep.partition("=")
    values = [v.strip() for v in values_text.split(",") if v.strip()]
    if not eq or not values:
        raise ConfigError(f"--sweep {args.sweep!r}: expected section.key=v1,v2,...")
    extra = [f"train.algorithms={algorithms!r}".replace("'", '"')] if algorithms else []
    path = Path(args.config) if args.config else config_lib.default_config_path()
    where = str(path) if args.config else "default config"
    base = config_lib.apply_overrides(config_lib.read_toml(path), [*args.set, *extra])
    _config(args, extra)  # a bad --set or file is named as such, before the values
    return _SweepPlan(Path(args.out), key, values, base, where)


def _sweep(args: argparse.Namespace, algorithms: list[str] | None) -> int:
    """A sweep, or (``--resume DIR`` of a sweep's folder) the rest of one."""
    from fedsub.experiment import sweep, sweep_config

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
        with _reporting(args.quiet), _stop_on_ctrl_c() as stop_requested:
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
    except Interrupted as stopped:
        return _say_how_to_resume("compare", stopped, out)
    print(outcome.markdown, end="")
    return _diverged_exit(outcome)


def cmd_data_stats(args: argparse.Namespace) -> int:
    from fedsub.data.registry import DATASETS
    from fedsub.experiment import load_data
    from fedsub.submodel.index import SubmodelIndex
    from fedsub.submodel.stats import feature_heat, plot_heat_distribution, table1_row

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
    if args.plot:
        plot_heat_distribution(feature_heat(dataset, index), Path(args.plot), dataset.name)
        print(f"heat distribution plot: {args.plot}")
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


def cmd_list(args: argparse.Namespace) -> int:
    from fedsub.catalog import listing

    print("\n".join(listing(args.kind)))
    return 0


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
    "list": """\
  fedsub list algorithms
  fedsub list keys""",
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


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
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
        p.add_argument("--out", default="runs/latest", help="output folder (default runs/latest)")
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
            help="replace the run already in --out (only the files fedsub wrote are removed)",
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

    listing = add_command(
        commands,
        "list",
        "list algorithms, datasets, models (with their options) or every config key",
        set_note=False,
    )
    listing.add_argument("kind", choices=["algorithms", "datasets", "models", "keys"])
    listing.set_defaults(func=cmd_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="fedsub: %(message)s")
    quiet = getattr(args, "quiet", False)
    logging.getLogger("fedsub").setLevel(logging.WARNING if quiet else logging.INFO)
    try:
        _refuse_what_torchrun_cannot_split(args)
        _silence_other_processes(args)
        return args.func(args)
    except FedsubError as error:
        print(f"fedsub: error: {_which_process()}{error}", file=sys.stderr)
        return 2
    except MemoryError as error:  # e.g. a dataset size far beyond this machine
        print(
            f"fedsub: error: out of memory ({error or 'allocation failed'}); "
            "reduce the sizes in the config (data sizes, train.clients_per_round, ...)",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print("fedsub: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `fedsub list keys | head`: the reader left, not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's final flush stays quiet
        return 141
    finally:
        distributed.leave()


if __name__ == "__main__":
    sys.exit(main())
