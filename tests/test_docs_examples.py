"""The docs' code examples run: every ```python block of docs/**/*.md, and every line starting
with ``fedsub `` of its ```console / ```bash blocks.

Each page's blocks run in order, in a fresh folder holding links to the checkout's
``configs/`` and ``examples/`` (so the commands' relative paths work), with
``$FEDSUB_DATA`` pointing inside it. The python blocks share one namespace per page (a later
block uses an earlier one's names, as a reader would); the commands run in process through
``fedsub.cli.main``, which must return 0. Commands run at smoke size: ``fedsub run`` /
``compare`` get ``--set train.rounds=2 --set eval.every=1`` appended (a later ``--set``
wins), ``fedsub reproduce ID`` gets ``--smoke``, and those three get ``--quiet``.

A block with a title (```toml title="clicks.toml"```) is a file the reader writes: the test
writes it into the folder, where the commands after it read it.

A ``torchrun ... -m fedsub ARGS`` line runs for real (``python -m torch.distributed.run``
with the line's options, gloo on the CPU, one thread per process; ``ARGS`` at smoke size), and
a ``NAME=value`` before a command sets its environment (``PYTHONPATH=.``: the page's folder).

A block that cannot run here (a download, a GPU, a long run, a Flower deployment) is preceded
by a line ``<!-- docs-test: skip REASON -->`` (an HTML comment, so readers do not see it); the
reason is printed with the skip. Every command of an unmarked block runs: a line that is
neither a ``fedsub`` nor a ``torchrun`` command (``make``, ``flwr``, ``python``, ``pip``) fails
the test until its block is marked, so no command in the docs goes untried unsaid.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP = re.compile(r"^<!--\s*docs-test:\s*skip\s+(?P<reason>.+?)\s*-->$")
FENCE = re.compile(r'^```(?P<lang>[\w-]*)(?:\s+title="(?P<title>[^"]+)")?\s*$')
RUNNABLE = {"python", "console", "bash", "shell", "sh"}
SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "<", "&"}
SMOKE_TRAINING = ["--set", "train.rounds=2", "--set", "eval.every=1"]
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
TORCHRUN_SECONDS = 240
QUIET_COMMANDS = {"run", "compare", "reproduce"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    skip: str | None  # the reason, when marked
    title: str | None = None  # a file the reader writes (```toml title="my.toml"```)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The page's fenced blocks in a runnable language, in order, with their skip markers."""
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    previous = ""  # the last non-blank line outside a block
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index].strip())
        if opening is None or not lines[index].strip().startswith("```"):
            if lines[index].strip():
                previous = lines[index].strip()
            index += 1
            continue
        start, body = index, []
        index += 1
        while index < len(lines) and lines[index].strip() != "```":
            body.append(lines[index])
            index += 1
        index += 1  # the closing fence
        language = opening["lang"].lower()
        if language in RUNNABLE or opening["title"]:
            marker = SKIP.match(previous)
            reason = marker["reason"] if marker else None
            code = "\n".join(body) + "\n"
            found.append(Block(page, start + 1, language, code, reason, opening["title"]))
        previous = ""
    return found


@dataclass(frozen=True)
class Command:
    """A command line of a console block: its ``NAME=value`` prefixes and its words."""

    env: dict[str, str]
    words: list[str]

    @property
    def program(self) -> str:
        return self.words[0]


def shell_commands(block: Block) -> list[Command]:
    """Every command of a console block (continuation lines joined; with ``$ `` prompts only
    the prompted lines, the others being output; comments and blank lines dropped)."""
    if block.language not in RUNNABLE - {"python"}:
        return []
    joined = re.sub(r"\\\n\s*", " ", block.code)
    lines = [line.strip() for line in joined.splitlines()]
    if any(line.startswith("$ ") for line in lines):
        lines = [line for line in lines if line.startswith("$ ")]
    commands = []
    for line in lines:
        line = line.removeprefix("$ ").strip()
        if not line or line.startswith("#"):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words = list(lexer)
        operators = SHELL_OPERATORS.intersection(words)
        assert not operators, (
            f"{block.where}: `{line}` uses {sorted(operators)}: write plain fedsub commands "
            "(or mark the block `<!-- docs-test: skip REASON -->`)"
        )
        env = {}
        while words and ENV_ASSIGNMENT.match(words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words:
            commands.append(Command(env, words))
    return commands


def commands_of(block: Block) -> list[list[str]]:
    """The ``fedsub`` commands of a console block, each as its argument list without the
    leading ``fedsub``."""
    return [c.words[1:] for c in shell_commands(block) if c.program == "fedsub"]


def torchrun_split(words: list[str]) -> tuple[list[str], list[str]]:
    """``torchrun OPTIONS -m fedsub ARGS`` -> (OPTIONS, ARGS)."""
    if "-m" not in words or words[words.index("-m") + 1 : words.index("-m") + 2] != ["fedsub"]:
        raise AssertionError(f"`{shlex.join(words)}`: expected torchrun ... -m fedsub ARGS")
    at = words.index("-m")
    return words[1:at], words[at + 2 :]


def at_smoke_size(argv: list[str]) -> list[str]:
    """The command as the test runs it: few rounds, no progress output."""
    command = argv[0] if argv else ""
    if command in QUIET_COMMANDS and "--quiet" not in argv:
        argv = [*argv, "--quiet"]
    if command in ("run", "compare") and "--resume" not in argv:
        argv = [*argv, *SMOKE_TRAINING]
    if command == "reproduce" and len(argv) > 1 and not argv[1].startswith("-"):
        argv = [*argv, "--smoke"]
    return argv


def run_command(argv: list[str], where: str) -> None:
    from fedsub.cli import commands as cli

    try:
        status = cli.main(argv)
    except SystemExit as stop:  # argparse's --version / --help
        status = stop.code if isinstance(stop.code, int) else 1
    assert status == 0, f"{where}: `fedsub {shlex.join(argv)}` exited {status}"


def run_torchrun(command: Command, folder: Path, where: str) -> None:
    """A ``torchrun ... -m fedsub ARGS`` line, as written (its process count included), with
    ARGS at smoke size; it must exit 0."""
    options, argv = torchrun_split(command.words)
    source = str(Path(__file__).resolve().parents[1] / "src")
    paths = [str(folder / p) for p in command.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, **command.env, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([*paths, source])
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *options, "-m", "fedsub",
         *at_smoke_size(argv)],
        cwd=folder, env=env, capture_output=True, text=True, timeout=TORCHRUN_SECONDS,
    )  # fmt: skip
    assert done.returncode == 0, (
        f"{where}: `{shlex.join(command.words)}` exited {done.returncode}:\n{done.stderr[-3000:]}"
    )


def run_shell(command: Command, folder: Path, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A command of a console block: fedsub in this process (``PYTHONPATH`` entries on
    ``sys.path``), torchrun for real; any other program is refused (mark its block)."""
    if command.program == "torchrun":
        run_torchrun(command, folder, where)
        return
    assert command.program == "fedsub", (
        f"{where}: `{shlex.join(command.words)}` is not a fedsub or torchrun command; the test "
        "cannot run it as written: mark its block `<!-- docs-test: skip REASON -->`"
    )
    for entry in reversed(command.env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry:
            monkeypatch.syspath_prepend(str(folder / entry))
    run_command(at_smoke_size(command.words[1:]), where)


def has_examples(page: Path) -> bool:
    return any(b.language == "python" or b.title or shell_commands(b) for b in blocks_of(page))


PAGES = sorted(page for page in DOCS.rglob("*.md") if has_examples(page))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for shared in ("configs", "examples"):
        (tmp_path / shared).symlink_to(ROOT / shared)
    monkeypatch.setattr(sys, "path", list(sys.path))  # a page may import from examples/
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDSUB_DATA", str(tmp_path / "cache"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace: dict[str, object] = {"__name__": "__docs__"}
    skipped = []
    ran = 0
    for block in blocks_of(page):
        if block.skip is not None:
            skipped.append(f"{block.where}: {block.skip}")
            continue
        if block.title is not None:  # a file the page has the reader write
            (tmp_path / block.title).write_text(block.code, encoding="utf-8")
        elif block.language == "python":
            code = compile(block.code, block.where, "exec")
            exec(code, namespace)
            ran += 1
        else:
            for command in shell_commands(block):
                started = time.perf_counter()
                run_shell(command, tmp_path, block.where, monkeypatch)
                print(f"{time.perf_counter() - started:5.1f} s  {shlex.join(command.words)}")
                ran += 1
    for reason in skipped:
        print(f"skipped {reason}")
    if ran == 0:
        pytest.skip("every example of the page is marked: " + "; ".join(skipped))


def test_blocks_are_found_and_marked_blocks_say_why() -> None:
    """The collector sees the fences a page writes, and a skip marker needs a reason."""
    page = DOCS / "getting-started" / "first-run.md"
    blocks = blocks_of(page)
    assert any(b.language in ("console", "bash") and commands_of(b) for b in blocks)
    for page in DOCS.rglob("*.md"):
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip().startswith("<!--") and "docs-test" in line:
                assert SKIP.match(line.strip()), f"{page}:{number}: `{line}` is not a skip marker"


def test_smoke_size_keeps_the_commands_meaning() -> None:
    assert at_smoke_size(["compare", "--out", "runs/a"]) == [
        "compare",
        "--out",
        "runs/a",
        "--quiet",
        *SMOKE_TRAINING,
    ]
    assert at_smoke_size(["compare", "--resume", "runs/a"]) == [
        "compare",
        "--resume",
        "runs/a",
        "--quiet",
    ]
    assert at_smoke_size(["reproduce", "004-fig4", "--out", "r"])[-1] == "--smoke"
    assert at_smoke_size(["reproduce"]) == ["reproduce", "--quiet"]
    assert at_smoke_size(["list", "keys"]) == ["list", "keys"]


def test_every_command_line_is_run_or_its_block_says_why() -> None:
    """No page shows a command the test neither runs nor marks: each line of an unmarked
    console block is a fedsub or torchrun command (torchrun naming ``-m fedsub``)."""
    for page in DOCS.rglob("*.md"):
        for block in blocks_of(page):
            if block.skip is not None:
                continue
            for command in shell_commands(block):
                assert command.program in ("fedsub", "torchrun"), (
                    f"{block.where}: `{shlex.join(command.words)}` cannot run as written here: "
                    "mark its block `<!-- docs-test: skip REASON -->`"
                )
                if command.program == "torchrun":
                    torchrun_split(command.words)


def test_a_command_keeps_its_environment_and_torchrun_its_options() -> None:
    block = Block(DOCS / "x.md", 1, "console", "$ PYTHONPATH=. torchrun --standalone "
                  "--nproc-per-node 2 -m fedsub compare a.toml --out r\n", None)  # fmt: skip
    (command,) = shell_commands(block)
    assert command.env == {"PYTHONPATH": "."} and command.program == "torchrun"
    assert torchrun_split(command.words) == (
        ["--standalone", "--nproc-per-node", "2"],
        ["compare", "a.toml", "--out", "r"],
    )
