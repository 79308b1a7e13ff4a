"""The command line's options fed what a user may type by mistake: empty or blank paths for
every path option, config files written with a byte-order mark, and `fedsub reproduce` options
an experiment cannot use. Each mistake ends in exactly one `fedsub: error:` line naming the
option (exit 2) and leaves the user's files as they were; a byte-order mark changes nothing.
"""

from __future__ import annotations

import codecs
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsub import config as config_lib
from fedsub.cli import main
from fedsub.errors import ConfigError
from fedsub.moved_keys import MOVED
from fedsub.reproduce.registry import EXPERIMENTS, GENERATED, ClosedForm, Settings

from .test_fuzz_config import LINES
from .test_fuzz_run_folders import snapshot

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
BLANKS = st.sampled_from(["", " ", "\t", "  \n"])
USER_CONFIG = '[train]\nrounds = 1\nalgorithms = ["fedavg"]\n'
DEFAULT = config_lib.Config.from_dict({})


@contextmanager
def users_folder() -> Iterator[Path]:
    """A current folder holding the user's config and an earlier file in ./runs."""
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "mine.toml").write_text(USER_CONFIG)
        (root / "runs").mkdir()
        (root / "runs" / "notes.txt").write_text("the user's\n")
        before = os.getcwd()
        os.chdir(root)
        try:
            yield root
        finally:
            os.chdir(before)


def one_error(capsys, argv: list[str], names: list[str], root: Path, before: dict) -> None:
    """Exit 2, one `fedsub: error:` line naming one of ``names``, the folder as it was."""
    code = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (argv, code, err)
    assert len(lines) == 1 and lines[0].startswith("fedsub: error: "), (argv, err)
    assert any(name in lines[0] for name in names), (argv, names, lines[0])
    assert snapshot(root) == before, argv


# --- empty or blank text for every path option ----------------------------------------------

PATH_OPTIONS = {
    "run": ["CONFIG", "--out", "--resume"],
    "compare": ["CONFIG", "--out", "--resume"],
    "sweep": ["CONFIG", "--out"],
    "stats": ["--plot"],
    "fetch": ["--url", "--checksum"],
    "reproduce": ["--out", "--configs", "--data-path"],
}
BASE = {
    "run": ["run", "mine.toml", "--algorithm", "fedavg", "--quiet"],
    "compare": ["compare", "mine.toml", "--quiet"],
    "sweep": ["compare", "mine.toml", "--sweep", "train.lr=0.1,0.2", "--quiet"],
    "stats": ["data", "stats", "synthetic-sparse"],
    "fetch": ["data", "fetch", "mnist"],
    "reproduce": ["reproduce", "001-fig2", "--smoke", "--quiet"],
}


def _with_blank(command: str, option: str, blank: str) -> list[str]:
    argv = list(BASE[command])
    if option == "CONFIG":
        return [argv[0], blank, *argv[2:]]
    if option == "--resume":  # a resumed run takes no config: the blank folder is the question
        return [argv[0], "--resume", blank]
    return [*argv, option, blank]


@SETTINGS
@given(
    pick=st.sampled_from([(c, o) for c, options in PATH_OPTIONS.items() for o in options]),
    blank=BLANKS,
)
def test_an_empty_or_blank_path_option_is_one_error_naming_it(capsys, pick, blank):
    """The reported bug: `fedsub compare --resume ""` trained a fresh default run, exit 0."""
    command, option = pick
    with users_folder() as root:
        before = snapshot(root)
        one_error(capsys, _with_blank(command, option, blank), [f"{option} is "], root, before)


# --- a byte-order mark ----------------------------------------------------------------------


def _loaded(path: Path) -> object:
    """The config, or its error with the file's name taken out."""
    try:
        return config_lib.load(path)
    except ConfigError as error:
        return str(error).replace(str(path), "FILE")


@settings(max_examples=200, deadline=None)
@given(st.lists(LINES, max_size=10))
def test_a_config_with_a_utf8_byte_order_mark_reads_as_without(lines):
    text = "\n".join(lines).encode("utf-8", "surrogatepass")
    with tempfile.TemporaryDirectory() as folder:
        plain, marked = Path(folder) / "plain.toml", Path(folder) / "marked.toml"
        plain.write_bytes(text)
        marked.write_bytes(codecs.BOM_UTF8 + text)
        assert _loaded(marked) == _loaded(plain)


@SETTINGS
@given(
    mark=st.sampled_from([codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE]),
    command=st.sampled_from(["run", "compare"]),
)
def test_a_utf16_config_is_one_error_saying_so(capsys, mark, command):
    with users_folder() as root:
        codec = "utf-16-le" if mark == codecs.BOM_UTF16_LE else "utf-16-be"
        (root / "wide.toml").write_bytes(mark + USER_CONFIG.encode(codec))
        before = snapshot(root)
        argv = [command, "wide.toml", "--quiet", "--out", "runs/new"]
        one_error(capsys, argv, ["UTF-16"], root, before)


# --- reproduce: options an experiment cannot use -----------------------------------------


def _runnable(e) -> list:
    return [p for p in e.parts if p.action is not None]


def _ids(kind) -> list[str]:
    """Experiments all of whose runnable parts are of ``kind`` (closed forms, settings)."""
    return [
        e.id
        for e in EXPERIMENTS.values()
        if _runnable(e) and all(isinstance(p.action, kind) for p in _runnable(e))
    ]


def _generated_ids() -> list[str]:
    """Experiments whose every runnable part trains or counts on data fedsub generates."""
    return [
        e.id
        for e in EXPERIMENTS.values()
        if _runnable(e)
        and all(
            p.data is GENERATED and not isinstance(p.action, ClosedForm | Settings)
            for p in _runnable(e)
        )
    ]


CONFIGLESS = _ids(ClosedForm) + _ids(Settings)
# (option, its text, the experiments it is wrong for: None = every one)
WRONG = [
    ("--set", ["--set", "train.rounds=3"], CONFIGLESS),
    ("--configs", ["--configs", "."], _ids(ClosedForm)),
    ("--data-path", ["--data-path", "."], CONFIGLESS + _generated_ids()),
    ("--set", ["--set", "train.rounds=-1"], None),
    ("--set", ["--set", "trian.rounds=2"], None),
    ("--set", ["--set", "train.roundz=2"], None),
    ("--part", ["--part", ""], None),
    ("--part", ["--part", "no-such-part"], None),
    ("--configs", ["--configs", "/nonexistent/configs"], None),
    ("--data-path", ["--data-path", "/nonexistent/data"], None),
    ("--resume", ["--resume"], None),  # nothing in --out to resume
]
HARMLESS = [[], ["--quiet"], ["--out", "runs/new"]]


@st.composite
def wrong_options(draw) -> tuple[str, list[str], list[str]]:
    """An experiment, one to three options of which at least one is wrong for it, in any
    order; and the names the error may give (a wrong option, or the id)."""
    experiment_id = draw(st.sampled_from(sorted(EXPERIMENTS)))
    fitting = [w for w in WRONG if w[2] is None or experiment_id in w[2]]
    wrong = draw(st.lists(st.sampled_from(fitting), min_size=1, max_size=2))
    extra = draw(st.sampled_from(HARMLESS))
    groups = [w[1] for w in wrong] + [extra]
    order = draw(st.permutations(range(len(groups))))
    argv = [a for i in order for a in groups[i]]
    names = [w[0] for w in wrong] + [experiment_id]
    return experiment_id, argv, names


@SETTINGS
@given(wrong_options())
def test_reproduce_refuses_every_option_an_experiment_cannot_use(capsys, drawn):
    """Not ignored, not a fresh start, not "every part": one error naming the option (or the
    experiment, when it has nothing to run), before anything runs or is written."""
    experiment_id, options, names = drawn
    with users_folder() as root:
        before = snapshot(root)
        argv = ["reproduce", experiment_id, *options, "--smoke"]  # a slip trains for seconds
        if "--out" not in options:
            argv += ["--out", "runs/reproduce"]
        one_error(capsys, argv, names, root, before)


DP_SETS = st.lists(
    st.sampled_from(
        [
            "dp.noise_multiplier=1e9",
            "dp.noise_multiplier=1e-6",
            "dp.noise_multiplier=1",
            "dp.target_epsilon=1e6",
            "dp.target_epsilon=1e-9",
            "dp.target_epsilon=2",
            "dp.delta=0.5",
            "dp.clip=1e-30",
            "dp.selection_threshold=1e9",
            "dp.epsilon_budget=1e-3",
            "train.sampling='poisson'",
            "dp.accountant='pld'",
        ]
    ),
    min_size=1,
    max_size=3,
    unique=True,
)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(DP_SETS, st.booleans())
def test_fedsub_dp_plans_or_gives_one_error_naming_a_key(capsys, sets, gaussian):
    """`fedsub dp` on what a user may type: the plan (exit 0) or one `fedsub: error:` line that
    names a key (dp.mechanism when it is missing), never a traceback from the accountant."""
    small = ["train.rounds=20", "data.num_users=300", "data.num_items=200"]
    mechanism = ["dp.mechanism='gaussian'"] if gaussian else []
    argv = ["dp", *(a for s in [*small, *mechanism, *sets] for a in ("--set", s))]
    code = main(argv)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code in (0, 2), (argv, captured.err)
    if code == 0 and not gaussian:  # no dp key was set: no DP, said so
        assert not any(s.startswith("dp.") for s in sets), (argv, captured.out)
        assert "mechanism = 'none'" in captured.out, captured.out
        return
    if code == 0:
        assert "epsilon after round 20" in captured.out, captured.out
        return
    assert len(lines) == 1 and lines[0].startswith("fedsub: error: "), (argv, captured.err)
    keys = [s.split("=", 1)[0] for s in sets] + ["dp.mechanism"]
    assert any(k in lines[0] for k in keys), (argv, lines[0])


# --- a key under its old and new name; a folder given as the config -------------------------


@SETTINGS
@given(
    old=st.sampled_from(sorted(MOVED)),
    command=st.sampled_from(["run", "compare", "sweep"]),
    reverse=st.booleans(),
    twice=st.booleans(),
)
def test_a_key_set_under_its_old_and_new_name_is_one_error_naming_both(
    capsys, old, command, reverse, twice
):
    """`--set train.dtype=... --set execution.dtype=...` (either order, a repeated name
    between them or not): one error naming both --set, never the last one winning."""
    section, key = MOVED[old]
    value = config_lib.toml_value(getattr(getattr(DEFAULT, section), key))
    sets = [f"train.{old}={value}", f"{section}.{key}={value}"]
    sets = sets[::-1] if reverse else sets
    sets = [sets[0], sets[0], sets[1]] if twice else sets
    argv = [*BASE[command], *[word for text in sets for word in ("--set", text)]]
    with users_folder() as root:
        before = snapshot(root)
        one_error(capsys, argv, [f"--set {sets[0]} and --set {sets[-1]} set the same key"], root,
                  before)  # fmt: skip


@SETTINGS
@given(command=st.sampled_from(["run", "compare", "sweep"]), run_folder=st.booleans())
def test_a_folder_given_as_the_config_is_one_error_saying_so(capsys, command, run_folder):
    with users_folder() as root:
        if run_folder:
            (root / "runs" / "config.toml").write_text(USER_CONFIG)
        before = snapshot(root)
        argv = [BASE[command][0], "runs", *BASE[command][2:]]
        one_error(capsys, argv, ["runs is a directory, not a config file"], root, before)
