"""Who may connect, against real processes: TLS and mTLS on the public port, mTLS and the internal token
between the control plane and its workers (a caller that is not the control plane cannot use a worker), a
worker that refuses to listen beyond loopback without a credential, and workers that die with their serve."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from serve_process import BUILTIN, ROOT, ServeProcess

from clients.client import CoalesceClient
from clients.retry import NO_RETRY
from clients.types import CoalesceError, Tls
from protos.coalesce.v1 import worker_pb2, worker_pb2_grpc
from tests.tls_certs import CertAuthority

pytestmark = pytest.mark.slow


def _worker_address(server: ServeProcess) -> str:
    line = server.wait_for_line(r"worker \S+ connected")
    return re.search(r"worker (\S+) connected", line).group(1)  # type: ignore[union-attr]


def _info(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode:
    try:
        worker_pb2_grpc.WorkerServiceStub(channel).Info(worker_pb2.InfoRequest(), metadata=metadata, timeout=5)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_tls_mtls_and_the_workers_only_caller(tmp_path: Path) -> None:
    public, internal = CertAuthority(tmp_path, "public CA"), CertAuthority(tmp_path, "internal CA")
    server_cert, server_key = public.issue("api")
    client_cert, client_key = public.issue("caller")
    node_cert, node_key = internal.issue("node")
    env = {
        "COALESCE_TLS__CERT_FILE": str(server_cert),
        "COALESCE_TLS__KEY_FILE": str(server_key),
        "COALESCE_TLS__CLIENT_CA_FILE": str(public.path),
        "COALESCE_INTERNAL_TLS__CA_FILE": str(internal.path),
        "COALESCE_INTERNAL_TLS__CERT_FILE": str(node_cert),
        "COALESCE_INTERNAL_TLS__KEY_FILE": str(node_key),
    }
    server = ServeProcess(*BUILTIN, "--kv-cache-mb", "16", env=env)
    try:
        address = server.address
        with CoalesceClient(address, tls=Tls(str(public.path), str(client_cert), str(client_key))) as client:
            assert len(client.generate("over TLS", max_tokens=4, ignore_eos=True).result().token_ids) == 4
        for tls in (Tls(str(public.path)), None):  # no client certificate; plaintext
            with CoalesceClient(address, tls=tls, retry=NO_RETRY) as client, pytest.raises(CoalesceError) as err:
                client.model_info()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
        # The worker: only a caller with the internal CA's certificate, and then only with the internal token.
        worker = _worker_address(server)
        with grpc.insecure_channel(worker) as plain:
            assert _info(plain) == grpc.StatusCode.UNAVAILABLE
        no_cert = grpc.ssl_channel_credentials(root_certificates=internal.path.read_bytes())
        with grpc.secure_channel(worker, no_cert) as channel:
            assert _info(channel) == grpc.StatusCode.UNAVAILABLE
        node = grpc.ssl_channel_credentials(internal.path.read_bytes(), node_key.read_bytes(), node_cert.read_bytes())
        with grpc.secure_channel(worker, node) as channel:
            assert _info(channel, (("authorization", "Bearer guess"),)) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop()


def test_a_worker_serves_only_its_control_plane() -> None:
    server = ServeProcess(*BUILTIN, "--kv-cache-mb", "16")
    try:
        with grpc.insecure_channel(_worker_address(server)) as channel:
            assert _info(channel) == grpc.StatusCode.UNAUTHENTICATED  # the internal token is the serve's own
            assert _info(channel, (("authorization", f"Bearer {os.environ['COALESCE_TOKEN']}"),)) == (
                grpc.StatusCode.UNAUTHENTICATED  # a caller's API token is not the workers' internal token
            )
        with CoalesceClient(server.address) as client:  # its control plane is fine
            assert client.generate("hi", max_tokens=2, ignore_eos=True).result().token_ids
    finally:
        server.stop()


def test_a_worker_beyond_loopback_needs_a_credential() -> None:
    env = {k: v for k, v in os.environ.items() if k != "COALESCE_INTERNAL_TOKEN"}
    cmd = [sys.executable, "-m", "clients.cli", "worker", *BUILTIN, "--host", "0.0.0.0", "--port", "0"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "must serve only its control plane: set internal_token" in done.stderr
    assert "Traceback" not in done.stderr


def test_workers_die_with_their_serve() -> None:
    server = ServeProcess(*BUILTIN, "--kv-cache-mb", "16")
    (worker,) = server.worker_pids()
    server.proc.send_signal(signal.SIGKILL)  # no chance to stop its children
    server.proc.wait(10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    raise AssertionError(f"worker {worker} outlived its serve")
