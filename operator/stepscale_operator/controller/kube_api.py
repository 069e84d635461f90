"""The few Kubernetes API calls the controller makes (the ``kubernetes`` client).

Kopf itself watches ``VllmDeployment`` objects and pods, patches their status
and posts events; this module only reads and applies the child objects and
lists pods:

* apply (server-side apply, field manager ``stepscale-operator``, forced) a
  Deployment or Service; when the object does not exist and the server does
  not create it on apply (an emulator), create it;
* read a Deployment or a Service (to restore one deleted behind the operator's back);
* list the pods of one ``VllmDeployment`` (to notice deletions a watch missed).

:data:`CLIENT_CALLS` lists exactly these; :mod:`.permissions` adds what kopf
needs, and the chart's RBAC (a ClusterRole, or Roles in the watched namespaces)
grants that and nothing else.
"""

from __future__ import annotations

import json
import os
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from stepscale_operator.controller.children import FIELD_MANAGER

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"

# (API group, resource, verb) of every call below.
CLIENT_CALLS: frozenset[tuple[str, str, str]] = frozenset(
    {
        ("apps", "deployments", "get"),
        ("apps", "deployments", "create"),
        ("apps", "deployments", "patch"),
        ("", "services", "get"),
        ("", "services", "create"),
        ("", "services", "patch"),
        ("", "pods", "list"),
    }
)


def client_configuration() -> client.Configuration:
    """Where the API server is and who the operator is, from the environment.

    In a pod (``KUBERNETES_SERVICE_HOST`` set and a service-account token mounted)
    the service account, else the kubeconfig (``KUBECONFIG``, read now, or
    ``~/.kube/config``). Raises :class:`kubernetes.config.ConfigException` when
    there is neither. Both the child-object client and kopf (``entry.login``) log
    in with it, so that they act as one user.
    """
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG") or "~/.kube/config",
            client_configuration=configuration,
        )
    return configuration


def api_client_from_environment() -> client.ApiClient:
    """An API client logged in as :func:`client_configuration` says."""
    return client.ApiClient(client_configuration())


class KubernetesApi:
    """Reads and applies the child objects of ``VllmDeployment`` objects."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.apps = client.AppsV1Api(api_client)
        self.core = client.CoreV1Api(api_client)

    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply of a Deployment or Service; returns the object as stored."""
        kind = body["kind"]
        name = body["metadata"]["name"]
        namespace = body["metadata"]["namespace"]
        patch: Any
        create: Any
        if kind == "Deployment":
            patch = self.apps.patch_namespaced_deployment
            create = self.apps.create_namespaced_deployment
        elif kind == "Service":
            patch = self.core.patch_namespaced_service
            create = self.core.create_namespaced_service
        else:
            raise ValueError(f"cannot apply a {kind}")
        try:
            response = patch(
                name,
                namespace,
                body,
                field_manager=FIELD_MANAGER,
                force=True,
                _content_type=APPLY_CONTENT_TYPE,
                _preload_content=False,
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
            response = create(namespace, body, field_manager=FIELD_MANAGER, _preload_content=False)
        return _json(response)

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Deployment ``namespace/name``, or None when it does not exist."""
        return _read_or_none(self.apps.read_namespaced_deployment, namespace, name)

    def get_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Service ``namespace/name``, or None when it does not exist."""
        return _read_or_none(self.core.read_namespaced_service, namespace, name)

    def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """The pods of ``namespace`` that match ``label_selector``."""
        response = self.core.list_namespaced_pod(
            namespace, label_selector=label_selector, _preload_content=False
        )
        items = _json(response).get("items")
        return [item for item in items or [] if isinstance(item, dict)]

    def close(self) -> None:
        """Release the client's connection pool."""
        self.api_client.close()


def _read_or_none(read: Any, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        response = read(name, namespace, _preload_content=False)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return _json(response)


def _json(response: Any) -> dict[str, Any]:
    data = json.loads(response.data or b"{}")
    return data if isinstance(data, dict) else {}
