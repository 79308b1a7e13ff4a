"""Where a real-process Flower round's time goes: one SuperLink and N SuperNodes on this host,
the example app (examples/flower-fedsubavg) submitted with ``flwr run``, as an operator runs
it (docs/tutorials/flower.md).

Per round, from ``flower-result.json``: the round's wall time at the ServerApp
(``round_seconds``), the seconds the nodes' handlers worked (``client_seconds``, summed over
the round's messages: training, and at ``full`` the secure sum's stages), and what is left
(``overhead``: Flower's polling, the ``flwr-clientapp`` process each message starts, its
imports and data load, the wire), and each wave of messages the round sent (its types, a secure
sum's stage riding with them after a colon, and the seconds from its push to its last reply;
``wave_seconds_median`` over rounds 2 on); plus the time from ``flwr run`` to round 1 (the
ServerApp's start and the registration wave). ``--node`` says how each SuperNode starts:
``fedsub`` (default: ``python -m fedsub.flower.supernode``, the docs' deployment path: fast
pulls during a run, a woken SuperExec, warm ClientApps), ``flower-warm`` (Flower's
``flower-supernode`` with fedsub's warm ClientApp launcher on its PATH) or ``flower``
(``flower-supernode`` alone: a fresh ``flwr-clientapp`` per message); Flower's SuperExecs poll
every 0.25 s in both ``flower`` modes (the earlier recommendation).

The SuperLink keeps its state in memory, Flower's default and the docs' deployment
(``--superlink-file``: in a SQLite file, as this benchmark did before 2026-11-28 13:30; each
of a message's object requests then writes to it, and a plain round took about 0.6 s more).

    python benchmarks/flower_rounds.py [--nodes 3] [--rounds 3] [--level none|full]
        [--node fedsub|flower|flower-warm] [--set "key=value"] [--superlink-file]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "flower-fedsubavg"
BIN = Path(sys.executable).parent


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:g} s for {what}")
        time.sleep(0.1)


def port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False


def environment(folder: Path, link: int) -> dict[str, str]:
    """FLWR_HOME with the "bench" connection; Flower's SuperExecs poll every 0.25 s (the
    example README's recommendation); the worktree's fedsub first on the path."""
    home = folder / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
        f'address = "127.0.0.1:{link}"\ninsecure = true\n'
    )
    path = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {
        **os.environ,
        "FLWR_HOME": str(home),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(path),
        "PYTHONUNBUFFERED": "1",
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.25",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    }


def flwr(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [str(BIN / "flwr"), *args], env=env, capture_output=True, text=True, timeout=120
    )
    return done.stdout


def run_ended(env: dict[str, str], run_id: int) -> bool:
    """Whether Flower records the run as finished (succeeded or failed)."""
    listed = flwr(env, "ls", "bench", "--run-id", str(run_id), "--format", "json")
    with contextlib.suppress(ValueError, KeyError):
        return str(json.loads(listed)["runs"][0]["status"]).startswith("finished")
    return False


def seldom(check: Callable[[], bool], seconds: float) -> Callable[[], bool]:
    """``check``, asked at most once per ``seconds`` (False in between): ``flwr ls`` starts
    a Python that imports Flower, a second of CPU taken from the deployment it measures."""
    last = -math.inf

    def seldom_check() -> bool:
        nonlocal last
        if time.monotonic() - last < seconds:
            return False
        last = time.monotonic()
        return check()

    return seldom_check


def run_log(env: dict[str, str], run_id: int) -> str:
    return flwr(env, "log", str(run_id), "bench", "--show")


NODES = ("fedsub", "flower", "flower-warm")  # how each SuperNode is started (the docstring)
IN_MEMORY = ":flwr-in-memory:"  # the SuperLink's state: Flower's default, the docs' deployment


def measure(
    nodes: int,
    rounds: int,
    level: str,
    node: str,
    folder: Path,
    more: tuple[str, ...] = (),
    database: str = IN_MEMORY,
) -> dict:
    link, *node_ports = free_ports(nodes + 1)
    env = environment(folder, link)
    started: list[subprocess.Popen] = []

    def start(name: str, *args: str, extra: dict | None = None) -> None:
        log = open(folder / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        started.append(
            subprocess.Popen(
                list(args),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={k: v for k, v in {**env, **(extra or {})}.items() if v is not None},
                cwd=folder,
                start_new_session=True,
            )
        )

    try:
        start(
            "superlink",
            str(BIN / "flower-superlink"),
            "--insecure",
            "--disable-runtime-dependency-installation",
            f"--port={link}",
            f"--database={database}",
        )
        for i, port in enumerate(node_ports):
            command, extra = [str(BIN / "flower-supernode")], None
            if node == "fedsub":  # fedsub's SuperNode: short polls, warm ClientApps
                command = [sys.executable, "-m", "fedsub.flower.supernode", "--"]
                extra = {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": None}  # woken, not polled
            if node == "flower-warm":  # the launcher before flwr-clientapp (its docstring)
                shim = folder / f"warm{i}"
                start(
                    f"warm{i}",
                    sys.executable,
                    "-m",
                    "fedsub.flower.warm_clientapp",
                    "serve",
                    str(shim),
                )
                wait_for(lambda s=shim: (s / "flwr-clientapp").exists(), 120, "the warm launcher")
                extra = {"PATH": f"{shim}{os.pathsep}{env['PATH']}"}
            start(
                f"supernode{i}",
                *command,
                "--insecure",
                f"--superlink=127.0.0.1:{link}",
                f"--port={port}",
                "--node-config",
                f"partition-id={i} num-partitions={nodes}",
                extra=extra,
            )
        wait_for(lambda: port_open(link), 60, "the SuperLink")
        out = folder / "out"
        overrides = (
            f"data.num_users={nodes}; train.rounds={rounds}; train.clients_per_round={nodes}; "
            f"train.algorithms=['fedsubavg']; privacy.level='{level}'"
        )
        if level != "none":  # one secure-sum group of every node
            overrides += f"; privacy.secagg_group={nodes}"
        overrides = "; ".join([overrides, *more])
        run_config = f'set="{overrides}" out-dir="{out}" round-timeout=600.0 eval-every=0'
        submitted = time.monotonic()
        submit = [str(BIN / "flwr"), "run", str(EXAMPLE), "bench", "--format", "json"]
        result = subprocess.run(
            [*submit, "--run-config", run_config],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if result.returncode != 0:
            raise RuntimeError(result.stdout + result.stderr)
        run_id = int(json.loads(result.stdout)["run-id"])
        ended = seldom(lambda: run_ended(env, run_id), 20.0)
        wait_for(lambda: (out / "progress.jsonl").exists() or ended(), 900, "round 1")
        first_sent = time.monotonic() - submitted
        wait_for(lambda: (out / "flower-result.json").exists() or ended(), 1800, "the end")
        if not (out / "flower-result.json").exists():  # the ServerApp failed: its log says why
            raise RuntimeError(run_log(env, run_id)[-3000:])
        total = time.monotonic() - submitted
    finally:
        for process in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    outcome = json.loads((out / "flower-result.json").read_text())
    if not outcome["succeeded"]:
        raise RuntimeError(json.dumps(outcome.get("failed")))
    per_round = []
    for record in outcome["rounds"]:
        costs = record["costs"]
        work = max(n["client_seconds"] for n in costs["nodes"].values())
        per_round.append(
            {
                "round": record["round"],
                "round_seconds": round(costs["round_seconds"], 3),
                "slowest_node_work_seconds": round(work, 3),
                "overhead_seconds": round(costs["round_seconds"] - work, 3),
                # each wave of messages: its types (a secure sum's stage riding after a
                # colon) and the seconds from its push to its last reply
                "waves": [f"{w['what']} {w['seconds']:.2f}" for w in costs.get("waves", [])],
            }
        )
    by_wave: dict[str, list[float]] = {}
    for record in outcome["rounds"][1:]:  # round 1 starts the warm ClientApps
        for w in record["costs"].get("waves", []):
            by_wave.setdefault(w["what"], []).append(w["seconds"])
    model = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    return {
        "model_sha256": model[:16],  # the same model, cold or warm
        "nodes": nodes,
        "rounds": rounds,
        "level": level,
        "node": node,
        "seconds_to_round_1": round(first_sent, 2),
        "run_seconds": round(total, 2),
        "round_seconds_median": statistics.median(r["round_seconds"] for r in per_round),
        "overhead_seconds_median": statistics.median(r["overhead_seconds"] for r in per_round),
        "waves_per_round": statistics.median(len(r["waves"]) for r in per_round),
        "wave_seconds_median": {k: round(statistics.median(v), 3) for k, v in by_wave.items()},
        "per_round": per_round,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--level", default="none", choices=["none", "heat", "download", "full"])
    parser.add_argument("--node", default="fedsub", choices=NODES, help="how nodes start")
    parser.add_argument("--set", action="append", default=[], help="a further config override")
    parser.add_argument(
        "--superlink-file",
        action="store_true",
        help="the SuperLink keeps its state in a SQLite file (Flower's default: in memory)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedsub-flower-rounds-") as folder:
        database = str(Path(folder) / "state.db") if args.superlink_file else IN_MEMORY
        measured = measure(
            args.nodes, args.rounds, args.level, args.node, Path(folder), tuple(args.set), database
        )
        print(json.dumps({**measured, "superlink_database": database}, indent=1))


if __name__ == "__main__":
    main()
