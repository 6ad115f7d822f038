"""JSON schemas of the custom resources the serving layer declares, for the fields the stack uses.

kubernetes-validate knows the built-in kinds only, and no CRD can be downloaded here, so these schemas are
written from the projects' documented specs: KEDA's ScaledObject (keda.sh/docs/2.17/reference/scaledobject-spec/
and the Prometheus scaler, keda.sh/docs/2.17/scalers/prometheus/) and the Prometheus Operator's PodMonitor
(prometheus-operator.dev/docs/api-reference/api/#monitoring.coreos.com/v1.PodMonitor), and Volcano's Job
(batch.volcano.sh/v1alpha1, the CRD's openAPIV3Schema in volcano-sh/volcano's installer/helm/chart/volcano/crd/bases/
batch.volcano.sh_jobs.yaml, v1.12; the pod template inside a task is a Kubernetes PodTemplateSpec, checked with
kubernetes-validate as the Pods it makes). Every object is closed
(`additionalProperties: false`), so a misspelled field fails as it would with `kubernetes-validate --strict`.
"""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def _closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required or [], "additionalProperties": False}


_METADATA = _closed({"name": _NAME, "namespace": _NAME, "labels": _STRING_MAP, "annotations": _STRING_MAP},
                    ["name", "namespace"])

_HPA_POLICY = _closed({"type": {"enum": ["Pods", "Percent"]}, "value": {"type": "integer", "minimum": 1},
                       "periodSeconds": {"type": "integer", "minimum": 1, "maximum": 1800}},
                      ["type", "value", "periodSeconds"])
_HPA_RULES = _closed({"stabilizationWindowSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
                      "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
                      "policies": {"type": "array", "items": _HPA_POLICY}})

_PROMETHEUS_TRIGGER_METADATA = _closed({
    "serverAddress": {"type": "string", "pattern": "^https?://"},
    "query": {"type": "string", "minLength": 1},
    # KEDA reads trigger metadata as strings: numbers must be quoted.
    "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
    "activationThreshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
    "namespace": {"type": "string"},
    "ignoreNullValues": {"type": "string", "enum": ["true", "false"]},
    "unsafeSsl": {"type": "string", "enum": ["true", "false"]},
}, ["serverAddress", "query", "threshold"])

SCALED_OBJECT = _closed({
    "apiVersion": {"const": "keda.sh/v1alpha1"},
    "kind": {"const": "ScaledObject"},
    "metadata": _METADATA,
    "spec": _closed({
        "scaleTargetRef": _closed({"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME,
                                   "envSourceContainerName": {"type": "string"}}, ["name"]),
        "pollingInterval": {"type": "integer", "minimum": 1},
        "cooldownPeriod": {"type": "integer", "minimum": 0},
        "initialCooldownPeriod": {"type": "integer", "minimum": 0},
        "idleReplicaCount": {"type": "integer", "minimum": 0},
        "minReplicaCount": {"type": "integer", "minimum": 0},
        "maxReplicaCount": {"type": "integer", "minimum": 1},
        "advanced": _closed({
            "restoreToOriginalReplicaCount": {"type": "boolean"},
            "horizontalPodAutoscalerConfig": _closed({
                "name": _NAME,
                "behavior": _closed({"scaleUp": _HPA_RULES, "scaleDown": _HPA_RULES}),
            }),
        }),
        "triggers": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "properties": {"type": {"const": "prometheus"}, "name": {"type": "string"},
                           "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                           "useCachedMetrics": {"type": "boolean"},
                           "metadata": _PROMETHEUS_TRIGGER_METADATA},
            "required": ["type", "metadata"],
            "additionalProperties": False,
        }},
    }, ["scaleTargetRef", "triggers"]),
}, ["apiVersion", "kind", "metadata", "spec"])

POD_MONITOR = _closed({
    "apiVersion": {"const": "monitoring.coreos.com/v1"},
    "kind": {"const": "PodMonitor"},
    "metadata": _METADATA,
    "spec": _closed({
        "selector": _closed({"matchLabels": _STRING_MAP}, ["matchLabels"]),
        "namespaceSelector": _closed({"any": {"type": "boolean"}, "matchNames": {"type": "array"}}),
        "jobLabel": {"type": "string"},
        "podTargetLabels": {"type": "array", "items": {"type": "string"}},
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": _closed({
            "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
            "interval": {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"},
            "scrapeTimeout": {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"},
            "scheme": {"enum": ["http", "https"]},
        })},
    }, ["selector", "podMetricsEndpoints"]),
}, ["apiVersion", "kind", "metadata", "spec"])

# Volcano's job lifecycle (pkg/apis/batch/v1alpha1: Event and Action).
_VOLCANO_EVENTS = ["*", "PodPending", "PodRunning", "PodFailed", "PodEvicted", "Unknown", "TaskCompleted",
                   "TaskFailed", "OutOfSync", "CommandIssued", "JobUpdated"]
_VOLCANO_ACTIONS = ["AbortJob", "RestartJob", "RestartTask", "RestartPod", "TerminateJob", "CompleteJob",
                    "ResumeJob", "SyncJob", "EnqueueJob", "SyncQueue", "OpenQueue", "CloseQueue"]
_VOLCANO_POLICY = _closed({
    "event": {"enum": _VOLCANO_EVENTS},
    "events": {"type": "array", "items": {"enum": _VOLCANO_EVENTS}},
    "action": {"enum": _VOLCANO_ACTIONS},
    "exitCode": {"type": "integer"},
    "timeout": {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$"},
})
_VOLCANO_TASK = _closed({
    "name": _NAME,
    "replicas": {"type": "integer", "minimum": 0},
    "minAvailable": {"type": "integer", "minimum": 0},
    "maxRetry": {"type": "integer", "minimum": 0},
    "policies": {"type": "array", "items": _VOLCANO_POLICY},
    "topologyPolicy": {"enum": ["none", "best-effort", "restricted", "single-numa-node"]},
    "dependsOn": _closed({"name": {"type": "array", "items": {"type": "string"}},
                          "iteration": {"enum": ["any", "all"]}}),
    # A PodTemplateSpec: its contents are checked against Kubernetes' own schema (task_pods).
    "template": _closed({"metadata": {"type": "object"}, "spec": {"type": "object"}}, ["spec"]),
}, ["name", "replicas", "template"])

VOLCANO_JOB = _closed({
    "apiVersion": {"const": "batch.volcano.sh/v1alpha1"},
    "kind": {"const": "Job"},
    "metadata": _METADATA,
    "spec": _closed({
        "schedulerName": {"type": "string"},
        "queue": {"type": "string"},
        "priorityClassName": {"type": "string"},
        "minAvailable": {"type": "integer", "minimum": 0},
        "minSuccess": {"type": "integer", "minimum": 1},
        "maxRetry": {"type": "integer", "minimum": 0},
        "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
        "runningEstimate": {"type": "string"},
        # Job plugins and their arguments: ssh, svc, env, pytorch, mpi, tensorflow.
        "plugins": {"type": "object", "propertyNames": {"enum": ["ssh", "svc", "env", "pytorch", "mpi", "tensorflow"]},
                    "additionalProperties": {"type": "array", "items": {"type": "string"}}},
        "policies": {"type": "array", "items": _VOLCANO_POLICY},
        "tasks": {"type": "array", "minItems": 1, "items": _VOLCANO_TASK},
        "volumes": {"type": "array", "items": {"type": "object"}},
        "networkTopology": _closed({"mode": {"enum": ["hard", "soft"]},
                                    "highestTierAllowed": {"type": "integer", "minimum": 1}}),
    }, ["tasks"]),
}, ["apiVersion", "kind", "metadata", "spec"])

SCHEMAS = {("keda.sh/v1alpha1", "ScaledObject"): SCALED_OBJECT, ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR,
           ("batch.volcano.sh/v1alpha1", "Job"): VOLCANO_JOB}
