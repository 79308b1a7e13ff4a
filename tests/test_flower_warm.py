"""fedsub.flower.warm_clientapp: the launcher forks one child per ``flwr-clientapp`` call its
stand-in forwards, with the call's arguments and torch already imported; without the
launcher the stand-in runs Flower's own ``flwr-clientapp``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
