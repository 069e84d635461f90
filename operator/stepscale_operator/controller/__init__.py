"""The Kubernetes side of Stepscale: the ``VllmDeployment`` controller (kopf).

Pure modules (no Kubernetes API calls, importable without kopf):

* :mod:`.spec`: parse and validate a ``VllmDeployment`` spec, mirroring the CRD;
* :mod:`.children`: the child Deployment and Service built from a spec;
* :mod:`.discovery`: pods of a deployment to FPM endpoints and stream keys;
* :mod:`.status`: the status subresource built from the core's state;
* :mod:`.cost_model_prior`: a cost-model snapshot seeded from initial coefficients;
* :mod:`.metrics`: the operator's Prometheus metrics, declared in one table;
* :mod:`.rounds`: a decision round's event and metrics;
* :mod:`.permissions`: every Kubernetes permission the operator needs, and why;
* :mod:`.autoscaler`: one deployment's ingest, model, load and planner (ZMQ, no Kubernetes).

Kubernetes-facing modules: :mod:`.kube_api` (the few API calls), :mod:`.handlers`
(the kopf handlers) and :mod:`.entry` (``stepscale operator``).
"""

from stepscale_operator.controller.spec import GROUP, KIND, PLURAL, VERSION

__all__ = ["GROUP", "KIND", "PLURAL", "VERSION"]
