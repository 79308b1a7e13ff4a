"""The example's TLS + SuperNode-authentication recipe (its README, its certificate script)
on real processes: registered nodes train over TLS, an unregistered key is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .processes import FEDSUB_SUPERNODE, Processes, flower_env, free_ports, port_open, wait_for

EXAMPLE = Path(__file__).parents[1] / "examples" / "flower-fedsubavg"
SCRIPT = EXAMPLE / "scripts" / "make_certificates.sh"
BIN = Path(sys.executable).parent


def make_certificates(out: Path, nodes: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), str(out), str(nodes)], capture_output=True, text=True, timeout=60
    )


def test_certificate_script_makes_a_server_certificate_the_ca_verifies_and_ec_node_keys(
    tmp_path,
):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    certs = tmp_path / "certs"
    made = make_certificates(certs, 2)
    assert made.returncode == 0, made.stderr
    verified = subprocess.run(
        ["openssl", "verify", "-CAfile", str(certs / "ca.crt"), str(certs / "server.crt")],
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    text = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(certs / "server.crt")],
        capture_output=True,
        text=True,
    ).stdout
    assert "DNS:localhost" in text and "IP Address:127.0.0.1" in text
    for i in (1, 2):  # read as flwr reads them (`flwr supernode register`, the SuperNode)
        public = serialization.load_ssh_public_key((certs / f"supernode-{i}.pub").read_bytes())
        private = serialization.load_ssh_private_key((certs / f"supernode-{i}").read_bytes(), None)
        assert isinstance(public, ec.EllipticCurvePublicKey) and public.curve.name == "secp384r1"
        assert private.public_key() == public
    assert not (certs / "supernode-3").exists()
    assert sorted(p.name for p in certs.iterdir() if p.name.startswith(".")) == []


def test_certificate_script_refuses_a_folder_inside_the_app_and_writes_nothing_there():
    before = sorted(EXAMPLE.rglob("*"))
    for inside in (EXAMPLE / "certificates", EXAMPLE / "scripts" / "a" / "b", EXAMPLE):
        made = make_certificates(inside, 1)
        assert made.returncode == 2
        assert "inside the app folder" in made.stderr
        assert sorted(EXAMPLE.rglob("*")) == before  # not even an empty folder


def test_certificate_script_failing_after_making_its_folder_removes_it(tmp_path):
    """openssl missing from the PATH: the script fails after its checks; the folders it made
    are removed again, a folder that was there stays."""
    import shutil

    tools = tmp_path.parent / f"{tmp_path.name}-tools"  # every tool but openssl
    tools.mkdir()
    for tool in ("dirname", "basename", "mkdir", "mktemp", "rm", "rmdir", "ls"):
        (tools / tool).symlink_to(shutil.which(tool) or tool)
    bash = shutil.which("bash") or "bash"
    for out in (tmp_path / "new" / "certs", tmp_path):
        made = subprocess.run(
            [bash, str(SCRIPT), str(out), "1"],
            capture_output=True,
            text=True,
            env={"PATH": str(tools)},
        )
        assert made.returncode == 127, made.stderr  # openssl: command not found
    assert sorted(tmp_path.iterdir()) == []
    shutil.rmtree(tools)


@pytest.mark.deployment  # 25 s of real TLS processes: make test-deployment
def test_tls_and_supernode_auth_train_registered_nodes_and_refuse_an_unregistered_one(tmp_path):
    certs = tmp_path / "certs"
    assert make_certificates(certs, 3).returncode == 0
    link, *node_ports = free_ports(4)
    env = flower_env(
        tmp_path,
        link,
        f'root-certificates = "{certs / "ca.crt"}"',
        BIN,
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
    )
    processes = Processes(tmp_path, env, BIN)
    start = processes.start

    def flwr(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "flwr"), *args], env=env, capture_output=True, text=True, timeout=120
        )

    def supernode(i: int, port: int, *extra: str, fedsubs: bool = True) -> subprocess.Popen:
        """fedsub's SuperNode (Flower's own with ``fedsubs=False``) with TLS and its key."""
        return start(
            f"supernode{i}",
            *(FEDSUB_SUPERNODE if fedsubs else ("flower-supernode",)),
            f"--root-certificates={certs / 'ca.crt'}",
            f"--superlink=127.0.0.1:{link}",
            f"--port={port}",
            f"--auth-supernode-private-key={certs / f'supernode-{i}'}",
            "--node-config",
            f"partition-id={i - 1} num-partitions=2",
            *extra,
        )

    out = tmp_path / "out"
    try:
        start(
            "superlink",
            "flower-superlink",
            f"--ssl-ca-certfile={certs / 'ca.crt'}",
            f"--ssl-certfile={certs / 'server.crt'}",
            f"--ssl-keyfile={certs / 'server.key'}",
            "--enable-supernode-auth",
            "--disable-runtime-dependency-installation",
            f"--port={link}",
            f"--database={tmp_path / 'state.db'}",
        )
        wait_for(lambda: port_open(link), 60, "the SuperLink")
        registering = [  # both at once
            subprocess.Popen(
                [
                    str(BIN / "flwr"),
                    *("supernode", "register", str(certs / f"supernode-{i}.pub"), "test"),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in (1, 2)
        ]
        for registering_one in registering:
            output, _ = registering_one.communicate(timeout=120)
            assert registering_one.returncode == 0, output
        supernode(1, node_ports[0])
        supernode(2, node_ports[1])
        # its key was never registered (Flower's SuperNode: it never gets to start a ClientApp)
        stranger = supernode(3, node_ports[2], "--max-retries=1", fedsubs=False)
        overrides = "data.num_users=2; train.rounds=1; train.clients_per_round=2"
        submitted = flwr(
            "run",
            str(EXAMPLE),
            "test",
            "--run-config",
            f'set="{overrides}" out-dir="{out}" round-timeout=30.0 eval-every=0',
        )
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        wait_for(lambda: (out / "flower-result.json").exists(), 300, "the run to finish")
        result = json.loads((out / "flower-result.json").read_text())
        assert [r["replies"] for r in result["rounds"]] == [2]
        stranger.wait(timeout=60)  # refused, it gave up after one retry (during the run)
        assert (
            "No SuperNode found with the given public key"
            in (tmp_path / "superlink.log").read_text()
        )
    finally:
        processes.stop_all()
