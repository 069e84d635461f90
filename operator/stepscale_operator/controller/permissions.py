"""Every Kubernetes permission the operator needs, and why (pure).

The chart (``charts/stepscale/templates/rbac.yaml``) grants exactly
:func:`required_rules`: cluster-wide (no ``watchNamespaces``) as a ClusterRole
bound cluster-wide; limited to namespaces as a Role in each watched namespace and
nothing cluster-scoped (kopf's cluster scanning is off then, see
``entry.run_operator``). ``tests/operator/test_chart.py`` compares the rendered
roles with it, and the operator tests check that every request the running
operator makes, in either mode, is covered by it and (namespaced) stays in the
watched namespaces.
"""

from __future__ import annotations

from stepscale_operator.controller.kube_api import CLIENT_CALLS
from stepscale_operator.controller.spec import GROUP, PLURAL

Call = tuple[str, str, str]  # (API group, resource or resource/subresource, verb)

# What kopf does on its own behalf.
KOPF_CALLS: frozenset[Call] = frozenset(
    {
        # Watch the custom resources (list + watch), add its finalizer and
        # progress annotations (patch), write status (patch on the subresource).
        (GROUP, PLURAL, "list"),
        (GROUP, PLURAL, "watch"),
        (GROUP, PLURAL, "patch"),
        (GROUP, f"{PLURAL}/status", "patch"),
        # The pod watch that follows every engine's endpoints.
        ("", "pods", "list"),
        ("", "pods", "watch"),
        # Events (kopf.info/warn and kopf's own handler failures).
        ("", "events", "create"),
    }
)

# Cluster scanning, cluster-wide only: kopf notices CRDs appearing and disappearing.
# (Namespaced, scanning is off: the namespaces are the ones named, and the CRD is
# installed before the operator starts, as the chart does.)
SCANNING_CALLS: frozenset[Call] = frozenset(
    {
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    }
)

# No request, but the OwnerReferencesPermissionEnforcement admission plugin asks
# for it: the child objects' owner references set blockOwnerDeletion.
ADMISSION_CALLS: frozenset[Call] = frozenset({(GROUP, f"{PLURAL}/finalizers", "update")})

PEERING_VERBS = ("get", "list", "watch", "patch")


def peering_calls(namespaced: bool) -> frozenset[Call]:
    """Kopf peering: read, watch and keep alive the peering object."""
    resource = "kopfpeerings" if namespaced else "clusterkopfpeerings"
    return frozenset(("kopf.dev", resource, verb) for verb in PEERING_VERBS)


def required_calls(namespaced: bool) -> frozenset[Call]:
    """Every (group, resource, verb) the operator needs."""
    calls = CLIENT_CALLS | KOPF_CALLS | ADMISSION_CALLS | peering_calls(namespaced)
    return calls if namespaced else calls | SCANNING_CALLS


def required_rules(namespaced: bool) -> dict[tuple[str, str], frozenset[str]]:
    """The same as (group, resource) -> verbs, the shape of a role's rules."""
    rules: dict[tuple[str, str], set[str]] = {}
    for group, resource, verb in required_calls(namespaced):
        rules.setdefault((group, resource), set()).add(verb)
    return {key: frozenset(verbs) for key, verbs in rules.items()}
