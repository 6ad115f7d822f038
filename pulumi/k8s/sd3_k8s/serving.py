"""The Kubernetes objects of the serving layer as plain manifests (pure functions; no Pulumi here).

`sd3cluster serve` runs one process per GPU, so a pod takes one GPU (`nvidia.com/gpu: 1`) and the Deployment
scales pods. A stopping pod first sleeps in preStop while the Service's endpoints and load balancers drop it, then
serve gets SIGTERM: /readyz answers 503 for drain_grace_s, accepted work finishes within drain_timeout_s, and
terminationGracePeriodSeconds covers all of it.

Autoscaling is a KEDA ScaledObject with a Prometheus trigger on `sd3_serve_queue_depth` (images waiting, summed
over the pods, averaged per pod by the HPA that KEDA makes). KEDA rather than an HPA on a custom metric: the HPA
route needs prometheus-adapter registered as the cluster's one custom-metrics API with a rule per metric, while
KEDA queries Prometheus with the PromQL written here, per ScaledObject, and still scales through a plain HPA.
"""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from .config import K8sStackConfig
from .manifests import labels
from .serving_config import CONTAINER_PORT, ServingConfig

KEDA_API = "keda.sh/v1alpha1"
POD_MONITOR_API = "monitoring.coreos.com/v1"
CONFIG_DIR = "/etc/sd3cluster/serve"
CONFIG_FILE = "serve.yaml"
SERVE_USER = 10001  # the image's user (workloads/Containerfile)
QUEUE_METRIC = "sd3_serve_queue_depth"


def _serving(config: K8sStackConfig) -> ServingConfig:
    if config.serving is None:
        raise ValueError("the stack has no serving settings (sd3-cluster-k8s:serving)")
    return config.serving


def _metadata(config: K8sStackConfig, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": config.namespace, "labels": labels(config, component)}


def serve_settings(config: K8sStackConfig) -> dict[str, Any]:
    """The `serve:` section the pods read: the stack's own keys, then the user's settings."""
    serving = _serving(config)
    return {"serve": {"host": "0.0.0.0", "port": CONTAINER_PORT, "device": "cuda",
                      "pretrained": serving.pretrained, **dict(serving.settings)}}


def serve_config_text(config: K8sStackConfig) -> str:
    return yaml.safe_dump(serve_settings(config), sort_keys=False)


def serve_config_map(config: K8sStackConfig) -> dict[str, Any]:
    serving = _serving(config)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(config, serving.name, "serve-config"),
            "data": {CONFIG_FILE: serve_config_text(config)}}


def _http_probe(path: str, period: int, failures: int, timeout: int = 3) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": timeout}


def _pod_security() -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": SERVE_USER, "runAsGroup": SERVE_USER, "fsGroup": SERVE_USER,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def _scratch_volumes() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The root filesystem is read-only: home (Hugging Face, Triton and compile caches) and /tmp are scratch."""
    volumes = [{"name": "home", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "home", "mountPath": "/home/sd3"}, {"name": "tmp", "mountPath": "/tmp"}]
    return volumes, mounts


def serve_pod_template(config: K8sStackConfig) -> dict[str, Any]:
    serving = _serving(config)
    resources: dict[str, Any] = {"limits": {"nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 1}}
    if serving.cpu:
        resources["requests"]["cpu"] = serving.cpu
    if serving.memory_gi:
        resources["requests"]["memory"] = resources["limits"]["memory"] = f"{serving.memory_gi}Gi"
    scratch, scratch_mounts = _scratch_volumes()
    container = {
        "name": serving.name,
        "image": serving.image,
        # $(POD_NAME) is expanded by the kubelet: each worker's log lines carry its pod's name.
        "args": ["serve", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}", "--set", "serve.name=$(POD_NAME)"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "ports": [{"name": "http", "containerPort": CONTAINER_PORT, "protocol": "TCP"}],
        "resources": resources,
        # Weights load and warm-up before /readyz turns 200; /healthz answers from the start, the startup probe
        # gives the process 10 minutes to begin answering it (torch imports, a cold volume).
        "startupProbe": _http_probe("/healthz", 5, 120),
        "livenessProbe": _http_probe("/healthz", 10, 3, timeout=5),
        "readinessProbe": _http_probe("/readyz", 5, 1),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(serving.pre_stop_s)]}}},
        "volumeMounts": [
            {"name": "weights", "mountPath": serving.weights_mount_path, "readOnly": True},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            *scratch_mounts,
        ],
        "securityContext": _container_security(),
    }
    spec: dict[str, Any] = {
        "containers": [container],
        "terminationGracePeriodSeconds": serving.termination_grace_s,
        "securityContext": _pod_security(),
        "volumes": [
            {"name": "weights", "persistentVolumeClaim": {"claimName": serving.weights_claim, "readOnly": True}},
            {"name": "config", "configMap": {"name": serving.name}},
            *scratch,
        ],
        "tolerations": [dict(t) for t in serving.gpu_tolerations],
    }
    if serving.gpu_node_selector:
        spec["nodeSelector"] = dict(serving.gpu_node_selector)
    # A changed serve config must roll the pods: they read the file once, at start.
    checksum = hashlib.sha256(serve_config_text(config).encode()).hexdigest()[:16]
    return {"metadata": {"labels": labels(config, "serve"), "annotations": {"sd3-cluster/serve-config": checksum}},
            "spec": spec}


def serve_deployment(config: K8sStackConfig) -> dict[str, Any]:
    serving = _serving(config)
    spec: dict[str, Any] = {
        "selector": {"matchLabels": labels(config, "serve")},
        # A new pod must be ready before an old one stops: capacity never drops during a rollout.
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        "template": serve_pod_template(config),
    }
    if not serving.autoscaling:
        # With autoscaling the HPA owns the count; a count here would reset it on every `pulumi up`.
        spec["replicas"] = serving.min_replicas
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(config, serving.name, "serve"),
            "spec": spec}


def serve_service(config: K8sStackConfig) -> dict[str, Any]:
    serving = _serving(config)
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(config, serving.name, "serve"),
            "spec": {"type": serving.service_type, "selector": labels(config, "serve"),
                     "ports": [{"name": "http", "port": serving.service_port, "targetPort": "http",
                                "protocol": "TCP"}]}}


def serve_disruption_budget(config: K8sStackConfig) -> dict[str, Any]:
    """Node drains take one serving pod at a time, each given its full drain."""
    serving = _serving(config)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _metadata(config, serving.name, "serve"),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels(config, "serve")}}}


def queue_depth_query(config: K8sStackConfig) -> str:
    """Images waiting in all the serving pods (kube-prometheus-stack labels scraped series with namespace and
    container)."""
    serving = _serving(config)
    return f'sum({QUEUE_METRIC}{{namespace="{config.namespace}",container="{serving.name}"}})'


def scaled_object(config: K8sStackConfig) -> dict[str, Any]:
    serving = _serving(config)
    return {
        "apiVersion": KEDA_API, "kind": "ScaledObject", "metadata": _metadata(config, serving.name, "autoscaling"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": serving.name},
            "pollingInterval": serving.polling_interval_s,
            "minReplicaCount": serving.min_replicas,
            "maxReplicaCount": serving.max_replicas,
            "advanced": {"horizontalPodAutoscalerConfig": {
                "name": f"{serving.name}-keda",
                "behavior": {
                    # Up at once (a GPU pod takes minutes to warm); down one pod a minute after a calm window,
                    # so a lull between bursts does not throw away warm pods.
                    "scaleUp": {"stabilizationWindowSeconds": 0,
                                "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
                    "scaleDown": {"stabilizationWindowSeconds": serving.scale_down_window_s,
                                  "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
                },
            }},
            "triggers": [{
                "type": "prometheus",
                "metricType": "AverageValue",
                "metadata": {
                    "serverAddress": serving.prometheus_url,
                    "query": queue_depth_query(config),
                    "threshold": str(serving.target_queue_depth),
                    "activationThreshold": str(serving.activation_queue_depth),
                },
            }],
        },
    }


def keda_hpa(scaled: dict[str, Any]) -> dict[str, Any]:
    """The HorizontalPodAutoscaler KEDA makes of a ScaledObject, as a manifest the Kubernetes schema can check
    (external metric `s0-prometheus`, the trigger's threshold as an average per pod)."""
    spec = scaled["spec"]
    advanced = spec["advanced"]["horizontalPodAutoscalerConfig"]
    metrics = [{"type": "External", "external": {
        "metric": {"name": f"s{index}-{trigger['type']}",
                   "selector": {"matchLabels": {"scaledobject.keda.sh/name": scaled["metadata"]["name"]}}},
        "target": {"type": trigger["metricType"], "averageValue": trigger["metadata"]["threshold"]}}}
        for index, trigger in enumerate(spec["triggers"])]
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": advanced["name"], "namespace": scaled["metadata"]["namespace"]},
            "spec": {"scaleTargetRef": spec["scaleTargetRef"], "minReplicas": spec["minReplicaCount"],
                     "maxReplicas": spec["maxReplicaCount"], "metrics": metrics, "behavior": advanced["behavior"]}}


def pod_monitor(config: K8sStackConfig) -> dict[str, Any]:
    """Prometheus (kube-prometheus-stack picks up every PodMonitor) scrapes each serving pod's /metrics."""
    serving = _serving(config)
    return {"apiVersion": POD_MONITOR_API, "kind": "PodMonitor",
            "metadata": _metadata(config, serving.name, "serve-metrics"),
            "spec": {"selector": {"matchLabels": labels(config, "serve")},
                     "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}]}}


def cpu_workers_deployment(config: K8sStackConfig) -> dict[str, Any]:
    """CPU-only pods on the CPU pool: its selector and tolerations, never a GPU node (no GPU toleration, and
    nodes that GPU feature discovery labelled are excluded)."""
    serving = _serving(config)
    workers = serving.cpu_workers
    if workers is None:
        raise ValueError("the serving settings have no cpuWorkers")
    scratch, scratch_mounts = _scratch_volumes()
    container: dict[str, Any] = {
        "name": workers.name, "image": workers.image, "args": list(workers.args),
        "resources": {"requests": {"cpu": workers.cpu, "memory": f"{workers.memory_gi}Gi"},
                      "limits": {"memory": f"{workers.memory_gi}Gi"}},
        "volumeMounts": scratch_mounts,
        "securityContext": _container_security(),
    }
    if workers.port:
        container["ports"] = [{"name": "http", "containerPort": workers.port, "protocol": "TCP"}]
    spec: dict[str, Any] = {
        "containers": [container],
        "securityContext": _pod_security(),
        "volumes": scratch,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "DoesNotExist"}]}]}}},
    }
    if serving.cpu_node_selector:
        spec["nodeSelector"] = dict(serving.cpu_node_selector)
    if serving.cpu_tolerations:
        spec["tolerations"] = [dict(t) for t in serving.cpu_tolerations]
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(config, workers.name, "serve-cpu"),
            "spec": {"replicas": workers.replicas, "selector": {"matchLabels": labels(config, "serve-cpu")},
                     "template": {"metadata": {"labels": labels(config, "serve-cpu")}, "spec": spec}}}


def cpu_workers_service(config: K8sStackConfig) -> dict[str, Any]:
    workers = _serving(config).cpu_workers
    if workers is None or workers.port is None:
        raise ValueError("the CPU workers have no port to serve")
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(config, workers.name, "serve-cpu"),
            "spec": {"selector": labels(config, "serve-cpu"),
                     "ports": [{"name": "http", "port": workers.port, "targetPort": "http", "protocol": "TCP"}]}}
