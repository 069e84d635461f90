"""``stepscale operator`` as a process, logging in the two ways a user runs it.

* with a kubeconfig (``KUBECONFIG``): what ``stepscale operator`` on a laptop does;
* in-cluster, as the chart's pod: ``KUBERNETES_SERVICE_HOST``/``PORT`` set and the
  service account's ``token``, ``ca.crt`` and ``namespace`` files at
  ``/var/run/secrets/kubernetes.io/serviceaccount``, the API server on HTTPS.

Real: the CLI process, kopf's login and the ``kubernetes`` client's credential
loading, TLS verification against the CA file. Emulated: the API server (kmock,
see ``conftest.py``) behind a TLS proxy (``tls_proxy.py``), whose certificate a
CA made here signs; the service-account files are mounted at their real path in
a private mount namespace of the process (``unshare``), or, where the system does
not allow that, the ``kubernetes`` client is told their path instead (the one
place the in-cluster test departs from a pod, stated in the test's output).
The ``api`` fixture checks that every request carried the token.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.operator.conftest import (
    DEPLOY_RESOURCE,
    OPERATOR_TOKEN,
    ApiServerEmulator,
    create,
    get_object,
    status_of,
    vd_body,
    vd_path,
    write_kubeconfig,
)
from tests.operator.tls_proxy import make_tls_files, tls_proxy

pytestmark = pytest.mark.asyncio

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
CLI = (sys.executable, "-m", "stepscale_operator.cli", "operator")
CLI_ARGS = ("--standalone", "--tick-seconds", "0.25", "--metrics-port", "0", "--health-port", "0")


def clean_environment(home: Path) -> dict[str, str]:
    """This process's environment without any cluster credentials (and a fresh HOME)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")
    }
    env["HOME"] = str(home)
    return env


def mount_namespace_works() -> bool:
    """Whether ``unshare`` can give a process its own mount namespace here."""
    probe = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
    try:
        done = subprocess.run(
            [*probe, "sh", "-c", "mount -t tmpfs tmpfs /run"], capture_output=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def in_cluster_command(files: Path) -> list[str]:
    """The operator with ``files`` (token, ca.crt, namespace) as its service account."""
    if mount_namespace_works():
        # /var/run is /run: a private tmpfs there holds the files at their real path.
        script = (
            f"mount -t tmpfs tmpfs /run && mkdir -p {SERVICE_ACCOUNT_DIR} && "
            f'cp "$0"/token "$0"/ca.crt "$0"/namespace {SERVICE_ACCOUNT_DIR}/ && exec "$@"'
        )
        unshare = ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
        return [*unshare, "sh", "-c", script, str(files), *CLI, *CLI_ARGS]
    print("no private mount namespace here: the service-account path is redirected")
    redirect = (
        "import sys, kubernetes.config.incluster_config as c; "
        "c.SERVICE_TOKEN_FILENAME = sys.argv[1] + '/token'; "
        "c.SERVICE_CERT_FILENAME = sys.argv[1] + '/ca.crt'; "
        "from stepscale_operator.cli import main; sys.exit(main(sys.argv[2:]))"
    )
    return [sys.executable, "-c", redirect, str(files), "operator", *CLI_ARGS]


async def run_until_handled(
    api: ApiServerEmulator, command: Sequence[str], env: dict[str, str], log: Path
) -> None:
    """Start ``command``, create a VllmDeployment, wait until the operator has made its
    Deployment and written its status, then stop it with SIGTERM (exit status 0)."""
    with log.open("wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        await create(api, vd_path(), vd_body("chat"))
        for _ in range(300):  # bounds a broken test only (60 s)
            if process.poll() is not None:
                break
            if get_object(api, DEPLOY_RESOURCE, "chat") and status_of(api, "chat").get("mode"):
                break
            await asyncio.sleep(0.2)
        output = log.read_text(errors="replace")[-4000:]
        assert process.poll() is None, f"the operator exited ({process.returncode}):\n{output}"
        assert get_object(api, DEPLOY_RESOURCE, "chat"), f"no Deployment made:\n{output}"
        assert status_of(api, "chat").get("mode") == "auto", f"no status written:\n{output}"
        process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(process.wait, 30)
        assert code == 0, log.read_text(errors="replace")[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_operator_logs_in_with_a_kubeconfig(api: ApiServerEmulator, tmp_path: Path) -> None:
    """``stepscale operator`` with ``KUBECONFIG`` naming a file: it logs in and reconciles."""
    env = clean_environment(tmp_path)
    env["KUBECONFIG"] = write_kubeconfig(
        str(tmp_path / "kubeconfig"), str(api.url).rstrip("/"), OPERATOR_TOKEN
    )
    await run_until_handled(api, [*CLI, *CLI_ARGS], env, tmp_path / "operator.log")
    assert api.authorizations == {f"bearer {OPERATOR_TOKEN}"}


async def test_operator_logs_in_with_its_service_account(
    api: ApiServerEmulator, tmp_path: Path
) -> None:
    """In-cluster: the service account's token and CA, the API server on HTTPS."""
    account = tmp_path / "serviceaccount"
    account.mkdir()
    tls = make_tls_files(tmp_path)
    (account / "token").write_text(OPERATOR_TOKEN)
    (account / "ca.crt").write_bytes(tls.ca_cert.read_bytes())
    (account / "namespace").write_text("stepscale-system")
    async with tls_proxy(tls, int(api.url.port or 80)) as port:
        env = clean_environment(tmp_path)
        env["KUBERNETES_SERVICE_HOST"] = "127.0.0.1"
        env["KUBERNETES_SERVICE_PORT"] = str(port)
        await run_until_handled(api, in_cluster_command(account), env, tmp_path / "operator.log")
    assert api.authorizations == {f"bearer {OPERATOR_TOKEN}"}


async def test_operator_without_credentials_says_so(tmp_path: Path) -> None:
    """No kubeconfig and no service account: a one-line error and exit status 2."""
    done = await asyncio.to_thread(
        subprocess.run,
        [*CLI, *CLI_ARGS],
        env=clean_environment(tmp_path),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert b"no Kubernetes configuration" in done.stderr
