"""A small AST mutation tester for fedsub's update rules (issue 26, section 5).

One mutation at a time (an arithmetic / comparison / boolean operator swapped, a number or
a bool changed, a unary minus or `not` dropped) in chosen functions of fedsub's sources;
then the related tests run (pytest -x in a forked child that has torch already imported).
A mutant is killed when its tests fail or time out. Raise statements, asserts, f-strings
and docstrings are not mutated: messages are not formulas.

The worktree itself is never touched: the mutants are written into a copy (--repo, made
from the worktree's tracked files when it does not exist yet). Results are JSON lines:
file, function, line, source (the line's text), mutation, survived, seconds.

usage:
  python tools/mutate.py run PLAN.json OUT.jsonl [--repo DIR] [--only SURVIVORS.jsonl]
  python tools/mutate.py annotate OLD_REPO RESULTS.jsonl [--plan PLAN.json] > KEYS.jsonl

PLAN: [{"file": "src/fedsub/...", "functions": ["name" or "Class.name", ...] or null (all),
        "tests": ["tests/test_x.py", "-k", "..."]}]

--only replays the mutants named in a JSONL of earlier results (only the survived ones are
used): a mutant is matched by file + function + mutation + the text of its source line, not
by line number, so it still matches after the file's lines have moved. `annotate` adds the
function and source-line fields to results written before they were recorded, reading the
source they were run against (OLD_REPO).
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

TIMEOUT = 240
WORKTREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SWAPS: dict[type, type] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.Pow: ast.Mult,
    ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv,
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.And: ast.Or,
    ast.Or: ast.And,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}

Point = tuple[ast.AST, str, str, str]  # node, kind, what, enclosing function


def skip_zone(tree: ast.AST) -> set[int]:
    """ids of nodes inside raise statements, asserts, f-strings and docstrings."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Raise, ast.Assert, ast.JoinedStr)):
            for inner in ast.walk(node):
                skipped.add(id(inner))
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skipped.add(id(first.value))
    return skipped


def targets(tree: ast.Module, functions: list[str] | None) -> list[tuple[str, ast.AST]]:
    """(name, node) of the functions, methods, classes and module constants to mutate."""
    found: list[tuple[str, ast.AST]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if functions is None or node.name in functions:
                found.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                name = f"{node.name}.{getattr(item, 'name', '')}"
                if isinstance(item, ast.FunctionDef) and (functions is None or name in functions):
                    found.append((name, item))
            if functions is not None and node.name in functions:  # class-level constants
                found.append((node.name, node))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and functions is not None:
            assigned = getattr(node, "targets", [getattr(node, "target", None)])
            names = [t.id for t in assigned if isinstance(t, ast.Name)]
            if any(n in functions for n in names):
                found.append((names[0], node))
    return found


def mutations(tree: ast.Module, functions: list[str] | None) -> list[Point]:
    """(node, kind, what, function) for every mutation point, in a fixed order."""
    skipped = skip_zone(tree)
    points: list[Point] = []
    for name, root in targets(tree, functions):
        for node in ast.walk(root):
            if id(node) in skipped:
                continue
            if isinstance(node, (ast.BinOp, ast.AugAssign, ast.BoolOp)):
                if type(node.op) in SWAPS:
                    points.append((node, "op", type(node.op).__name__, name))
            elif isinstance(node, ast.Compare):
                for i, op in enumerate(node.ops):
                    if type(op) in SWAPS:
                        points.append((node, f"cmp{i}", type(op).__name__, name))
            elif isinstance(node, ast.Constant) and not isinstance(node.value, str):
                if isinstance(node.value, bool):
                    points.append((node, "bool", repr(node.value), name))
                elif isinstance(node.value, (int, float)):
                    points.append((node, "num", repr(node.value), name))
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
                points.append((node, "unary", type(node.op).__name__, name))
    return points


def describe(node: ast.AST, kind: str, what: str) -> str:
    """The mutation's text, e.g. 'Add -> Sub', '0.5 -> 1.0', 'drop USub'."""
    if kind == "op" or kind.startswith("cmp"):
        return f"{what} -> {SWAPS[getattr(ast, what)].__name__}"
    if kind == "bool":
        return f"{what} -> {not node.value!r}"  # type: ignore[attr-defined]
    if kind == "num":
        old = node.value  # type: ignore[attr-defined]
        new = old + 1 if old in (0, 0.0) or isinstance(old, int) else old * 2
        return f"{old!r} -> {new!r}"
    return f"drop {what}"


def apply(tree: ast.Module, index: int, functions: list[str] | None) -> ast.Module:
    """A copy of the tree with mutation number `index` applied."""
    mutant = copy.deepcopy(tree)
    node, kind, _, _ = mutations(mutant, functions)[index]
    if kind == "op":
        node.op = SWAPS[type(node.op)]()  # type: ignore[attr-defined]
    elif kind.startswith("cmp"):
        ops = node.ops  # type: ignore[attr-defined]
        ops[int(kind[3:])] = SWAPS[type(ops[int(kind[3:])])]()
    elif kind == "bool":
        node.value = not node.value  # type: ignore[attr-defined]
    elif kind == "num":
        old = node.value  # type: ignore[attr-defined]
        node.value = old + 1 if old in (0, 0.0) or isinstance(old, int) else old * 2  # type: ignore[attr-defined]
    else:  # drop the unary operator
        operand = node.operand  # type: ignore[attr-defined]
        for parent in ast.walk(mutant):
            for field, value in ast.iter_fields(parent):
                if value is node:
                    setattr(parent, field, operand)
                elif isinstance(value, list) and node in value:
                    value[value.index(node)] = operand
    return mutant


def key(record: dict[str, Any]) -> tuple[str, str, str, str]:
    return record["file"], record["function"], record["mutation"], record["source"]


def points_of(source: str, functions: list[str] | None) -> Iterator[dict[str, Any]]:
    """One record (without the outcome) per mutation point of a source file."""
    lines = source.splitlines()
    for node, kind, what, function in mutations(ast.parse(source), functions):
        line = getattr(node, "lineno", 0)
        yield {
            "function": function,
            "line": line,
            "source": lines[line - 1].strip() if line else "",
            "mutation": describe(node, kind, what),
        }


def run_tests(repo: str, tests: list[str]) -> tuple[bool, float]:
    """Whether the tests pass in repo (a forked child; killed after TIMEOUT seconds)."""
    import pytest  # imported before forking: children skip the cost

    started = time.time()
    pid = os.fork()
    if pid == 0:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        signal.alarm(TIMEOUT)
        os.chdir(repo)
        sys.path.insert(0, os.path.join(repo, "src"))
        args = ["-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
        os._exit(int(pytest.main(args)))
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0, time.time() - started


def copy_worktree(repo: str) -> None:
    """The worktree's tracked and untracked-but-not-ignored files, copied into repo."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=WORKTREE,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        source = os.path.join(WORKTREE, name)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(repo, name)), exist_ok=True)
            shutil.copy2(source, os.path.join(repo, name))


def run(plan_path: str, out_path: str, repo: str, only_path: str | None) -> None:
    import numpy  # noqa: F401  (imported before forking: children skip the cost)
    import torch  # noqa: F401

    sys.dont_write_bytecode = True  # a stale .pyc of an earlier mutant must never be read
    if not os.path.isdir(repo):
        copy_worktree(repo)
    for cache in [d for d, _, _ in os.walk(os.path.join(repo, "src")) if d.endswith("__pycache__")]:
        shutil.rmtree(cache)
    wanted: set[tuple[str, str, str, str]] | None = None
    if only_path is not None:
        with open(only_path) as only:
            records = [json.loads(line) for line in only if line.strip()]
        wanted = {key(r) for r in records if r.get("survived", True)}
    with open(plan_path) as plan_file:
        plan = json.load(plan_file)
    with open(out_path, "a") as out:
        for entry in plan:
            run_entry(entry, repo, wanted, out)


def run_entry(entry: dict[str, Any], repo: str, wanted: set | None, out: Any) -> None:
    path = os.path.join(repo, entry["file"])
    with open(path) as original:
        source = original.read()
    functions = entry.get("functions")
    points = [dict(p, file=entry["file"]) for p in points_of(source, functions)]
    chosen = [i for i, p in enumerate(points) if wanted is None or key(p) in wanted]
    if not chosen:
        return
    passed, seconds = run_tests(repo, entry["tests"])
    print(
        f"{entry['file']}: {len(chosen)} of {len(points)} mutants; "
        f"baseline passes={passed} ({seconds:.0f}s)",
        flush=True,
    )
    if not passed:
        return
    tree = ast.parse(source)
    try:
        for index in chosen:
            with open(path, "w") as mutated:
                mutated.write(ast.unparse(apply(tree, index, functions)))
            survived, seconds = run_tests(repo, entry["tests"])
            record = dict(points[index], survived=survived, seconds=round(seconds, 1))
            out.write(json.dumps(record) + "\n")
            out.flush()
            point = points[index]
            print(
                ("SURVIVED " if survived else "killed   ")
                + f"{point['file']}:{point['line']} {point['function']}: {point['mutation']}"
                f"  [{point['source']}]",
                flush=True,
            )
    finally:
        with open(path, "w") as restored:
            restored.write(source)


def annotate(
    old_repo: str, results_path: str, plan_path: str | None, emit: Callable[[str], None]
) -> None:
    """Earlier results with function and source fields, read from the source they ran on."""
    functions_of: dict[str, list[list[str] | None]] = {}
    if plan_path is not None:
        with open(plan_path) as plan_file:
            for entry in json.load(plan_file):
                functions_of.setdefault(entry["file"], []).append(entry.get("functions"))
    with open(results_path) as results:
        for line in results:
            record = json.loads(line)
            with open(os.path.join(old_repo, record["file"])) as old:
                source = old.read()
            matches = {
                (p["function"], p["source"])
                for functions in functions_of.get(record["file"], [None])
                for p in points_of(source, functions)
                if p["line"] == record["line"] and p["mutation"] == record["mutation"]
            }
            if len(matches) != 1:
                print(f"no single match for {record}: {matches}", file=sys.stderr)
                continue
            function, text = matches.pop()
            emit(json.dumps(dict(record, function=function, source=text)))


def main() -> None:
    global TIMEOUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    running = commands.add_parser("run", help="mutate and test")
    running.add_argument("plan")
    running.add_argument("out")
    running.add_argument(
        "--repo",
        default="/tmp/fedsub-mutate/repo",
        help="the copy of the worktree that is mutated (made if absent)",
    )
    running.add_argument("--only", help="JSONL of earlier results: replay their survivors")
    running.add_argument(
        "--timeout", type=int, default=TIMEOUT, help="seconds per mutant (a hang is a kill)"
    )
    annotating = commands.add_parser("annotate", help="add function/source to old results")
    annotating.add_argument("old_repo")
    annotating.add_argument("results")
    annotating.add_argument("--plan")
    args = parser.parse_args()
    if args.command == "run":
        TIMEOUT = args.timeout
        run(args.plan, args.out, args.repo, args.only)
    else:
        annotate(args.old_repo, args.results, args.plan, print)


if __name__ == "__main__":
    main()
