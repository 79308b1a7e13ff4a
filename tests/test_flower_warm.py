"""fedsub.flower.warm_clientapp: the launcher forks one child per ``flwr-clientapp`` call its
stand-in forwards, with the call's arguments and torch already imported; without the
launcher the stand-in runs Flower's own ``flwr-clientapp``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from .processes import wait_for

ROOT = Path(__file__).resolve().parents[1]


def record() -> None:
    """A child's stand-in for Flower's flwr-clientapp: what it was given, and what it had."""
    folder = Path(os.environ["WARM_RECORDS"])
    seen = {"argv": sys.argv, "torch": "torch" in sys.modules, "parent": os.getppid()}
    (folder / f"{os.getpid()}.json").write_text(json.dumps(seen))


def test_the_launcher_forks_a_warm_child_per_call_and_the_stand_in_falls_back(tmp_path):
    folder, records = tmp_path / "warm", tmp_path / "records"
    records.mkdir()
    paths = [str(ROOT), str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "WARM_RECORDS": str(records), "PYTHONPATH": os.pathsep.join(paths)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    serve = [sys.executable, "-m", "fedsub.flower.warm_clientapp", "serve", str(folder)]
    launcher = subprocess.Popen(
        [*serve, "--entry", "tests.test_flower_warm:record"],
        env=env,
        cwd=ROOT,
    )
    stand_in = folder / "flwr-clientapp"
    try:
        wait_for(stand_in.exists, 120, "the launcher")
        assert folder.stat().st_mode & 0o777 == 0o700
        for i in range(3):
            call = [str(stand_in), "--token", f"token-{i}", "--insecure"]
            subprocess.run(call, env=env, check=True, timeout=60)
        wait_for(lambda: len(list(records.iterdir())) == 3, 60, "three children")
    finally:
        launcher.kill()
        launcher.wait(timeout=30)
    children = [json.loads(p.read_text()) for p in records.iterdir()]
    assert sorted(c["argv"][2] for c in children) == ["token-0", "token-1", "token-2"]
    assert all(c["argv"][0] == "flwr-clientapp" and c["torch"] for c in children)
    assert {c["parent"] for c in children} == {launcher.pid}  # forked by the launcher
    # the launcher gone: the stand-in is Flower's flwr-clientapp
    fallback = subprocess.run(
        [str(stand_in), "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert fallback.returncode == 0 and "Run a Flower ClientApp" in fallback.stdout


def test_node_polls_pull_fast_after_a_message_wake_the_superexec_and_idle_as_flower(monkeypatch):
    """fedsub's SuperNode loop (fedsub.flower.polls.NodePolls in Flower's
    start_client_internal): Flower's 3-s idle pull until a message came, then ``fast`` for
    ``window`` seconds; the reply wait 0.05 s (Flower: 0.5 s); other sleeps as asked; the
    SuperExec it started woken (WAKE) when the node's state creates a message's task."""
    from flwr.supernode import start_client_internal as loop

    from fedsub.flower import polls

    slept: list[float] = []
    monkeypatch.setattr(
        polls, "time", types.SimpleNamespace(sleep=slept.append, monotonic=time.monotonic)
    )
    answers = iter([None, 7])
    for name in ("time", "subprocess"):
        monkeypatch.setattr(loop, name, getattr(loop, name))  # restored after the test
    tasks: list[int] = []
    state = types.SimpleNamespace(create_task=lambda: tasks.append(1) or 1)

    def pull_and_store(state: types.SimpleNamespace) -> int | None:
        answer = next(answers)
        if answer is not None:
            state.create_task()
        return answer

    monkeypatch.setattr(loop, "_pull_and_store_message", pull_and_store)
    node = polls.NodePolls(fast=0.01, window=60.0)
    assert node.install(loop)
    waiting = (
        "import signal, sys, time; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGWINCH});"
        "print('ready', flush=True); woken = signal.sigtimedwait({signal.SIGWINCH}, 60);"
        "print('woken' if woken else 'not woken', flush=True)"
    )
    superexec = loop.subprocess.Popen(
        [sys.executable, "-c", waiting], stdout=subprocess.PIPE, text=True
    )
    try:
        assert node.superexec is superexec and superexec.stdout.readline() == "ready\n"
        loop.time.sleep(3)  # no message yet: Flower's idle pull
        assert loop._pull_and_store_message(state=state) is None
        loop.time.sleep(3)
        assert loop._pull_and_store_message(state=state) == 7  # a task: a wake; fast pulls
        loop.time.sleep(3)
        loop.time.sleep(0.5)
        loop.time.sleep(1.7)
        assert superexec.stdout.readline() == "woken\n"
    finally:
        superexec.kill()
        superexec.wait(timeout=30)
    node.last -= 61.0  # the window over: Flower's idle pull again
    loop.time.sleep(3)
    assert slept == [3, 3, 0.01, polls.REPLY_POLL, 1.7, 3] and tasks == [1]
    assert not polls.NodePolls(0.01, 60.0).install(polls)  # no Flower loop: left as it is


def test_a_woken_superexec_looks_for_a_task_at_once_and_object_pulls_retry_quickly(monkeypatch):
    """wakeable_task_polls: Flower's SuperExec task poll (run_superexec) ends at WAKE, not
    after its interval; quick_object_pulls: Flower's object pulls first retry after 0.05 s."""
    from flwr.supercore.inflatable import inflatable_utils as objects

    from fedsub.flower.polls import FIRST_BACKOFF, quick_object_pulls

    for function in (objects.pull_objects, objects.pull_and_inflate_object_from_tree):
        defaults = function.__kwdefaults__
        # Flower's default (an earlier ServerApp in this process may have sped it up already)
        monkeypatch.setitem(defaults, "initial_backoff", 1)
    assert quick_object_pulls()
    assert objects.pull_objects.__kwdefaults__["initial_backoff"] == FIRST_BACKOFF
    assert (
        objects.pull_and_inflate_object_from_tree.__kwdefaults__["initial_backoff"] == FIRST_BACKOFF
    )
    woken = (  # in its own process: it blocks WAKE there, first (as the stand-in does)
        "import os, signal, time\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGWINCH})\n"
        "from flwr.supercore.superexec import run_superexec\n"
        "from fedsub.flower.polls import WAKE, wakeable_task_polls\n"
        "assert wakeable_task_polls(run_superexec)\n"
        "os.kill(os.getpid(), WAKE)\n"
        "started = time.monotonic()\n"
        "run_superexec.time.sleep(30)\n"
        "print(round(time.monotonic() - started))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", woken], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < 15  # woken, not the 30 s asked


def _flowers_transfers(monkeypatch) -> None:
    """Flower's own object transfers for this test (min(2, cores) at a time), restored after."""
    from flwr.supercore.inflatable import inflatable_utils as objects

    monkeypatch.setattr(objects, "get_num_workers", objects.get_num_workers)
    for function in (objects.push_objects, objects.push_object_contents_from_iterable):
        monkeypatch.setitem(function.__kwdefaults__, "max_concurrent_pushes", 2)
    for function in (objects.pull_objects, objects.pull_and_inflate_object_from_tree):
        monkeypatch.setitem(function.__kwdefaults__, "max_concurrent_pulls", 2)


def test_wide_object_transfers_keep_8_requests_in_flight_whatever_the_cores(monkeypatch):
    """Flower pushes and pulls a message's objects min(2, cores) at a time; after
    wide_object_transfers, WORKERS (8) at a time on a 2-core host too."""
    from flwr.supercore.inflatable import inflatable_utils as objects

    from fedsub.flower.polls import WORKERS, wide_object_transfers

    _flowers_transfers(monkeypatch)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert objects.get_num_workers(objects.pull_objects.__kwdefaults__["max_concurrent_pulls"]) == 2
    assert wide_object_transfers() and WORKERS == 8
    for function in (objects.push_objects, objects.push_object_contents_from_iterable):
        assert function.__kwdefaults__["max_concurrent_pushes"] == WORKERS
    for function in (objects.pull_objects, objects.pull_and_inflate_object_from_tree):
        assert function.__kwdefaults__["max_concurrent_pulls"] == WORKERS
    assert objects.get_num_workers(WORKERS) == WORKERS
    seen = []  # the pulls run 8 at a time: 8 of them wait for each other, none deadlocks
    barrier = threading.Barrier(WORKERS, timeout=60)

    def pull(object_id: str) -> bytes:
        seen.append(object_id)
        barrier.wait()
        return object_id.encode()

    pulled = objects.pull_objects([str(i) for i in range(WORKERS)], pull)
    assert sorted(pulled) == sorted(str(i) for i in range(WORKERS)) and len(seen) == WORKERS


def test_fedsubs_supernode_runs_flowers_with_its_stand_ins_first_on_the_path(monkeypatch, tmp_path):
    """``python -m fedsub.flower.supernode [--cold] -- <flower-supernode arguments>``: Flower's
    SuperNode with its arguments, fedsub's flower-superexec stand-in first on the PATH (Flower's
    own SuperExec behind it, here asked for --help), Flower's SuperExec poll left as
    Flower's; a bad --idle-poll refused naming it."""
    from flwr.supercore.inflatable import inflatable_utils as objects
    from flwr.supernode import start_client_internal as loop

    from fedsub.flower import supernode

    for name in ("time", "subprocess", "_pull_and_store_message"):
        monkeypatch.setattr(loop, name, getattr(loop, name))
    for function in (objects.pull_objects, objects.pull_and_inflate_object_from_tree):
        monkeypatch.setitem(function.__kwdefaults__, "initial_backoff", 1)
    _flowers_transfers(monkeypatch)
    monkeypatch.setattr(sys, "argv", sys.argv)
    monkeypatch.setenv("PATH", os.environ["PATH"])
    seen = {}

    def flower_supernode() -> None:
        seen["argv"], seen["path"] = sys.argv, os.environ["PATH"]

    supernode.main(["--cold", "--", "--insecure", "--superlink=127.0.0.1:1"], run=flower_supernode)
    assert seen["argv"] == ["flower-supernode", "--insecure", "--superlink=127.0.0.1:1"]
    folder = Path(seen["path"].split(os.pathsep)[0])
    assert sorted(p.name for p in folder.iterdir()) == ["flower-superexec"]  # cold: no launcher
    assert folder.stat().st_mode & 0o777 == 0o700
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    shown = subprocess.run(
        [str(folder / "flower-superexec"), "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert shown.returncode == 0 and "flower-superexec" in shown.stdout, shown.stderr
    with pytest.raises(SystemExit):
        supernode.main(["--idle-poll", "0"], run=flower_supernode)
