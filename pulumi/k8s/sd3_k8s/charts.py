"""Helm charts the stack installs, and their values (pure functions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import K8sStackConfig


@dataclass(frozen=True)
class Chart:
    release: str
    chart: str
    repo: str
    namespace: str


GPU_OPERATOR = Chart("gpu-operator", "gpu-operator", "https://helm.ngc.nvidia.com/nvidia", "gpu-operator")
VOLCANO = Chart("volcano", "volcano", "https://volcano-sh.github.io/helm-charts", "volcano-system")
KUBE_PROMETHEUS_STACK = Chart("kube-prometheus-stack", "kube-prometheus-stack",
                              "https://prometheus-community.github.io/helm-charts", "monitoring")
# AWS's EFA device plugin: advertises vpc.amazonaws.com/efa on nodes with EFA interfaces (eks-charts).
EFA_DEVICE_PLUGIN = Chart("aws-efa-k8s-device-plugin", "aws-efa-k8s-device-plugin", "https://aws.github.io/eks-charts",
                          "kube-system")
DCGM_EXPORTER = Chart("dcgm-exporter", "dcgm-exporter", "https://nvidia.github.io/dcgm-exporter/helm-charts",
                      "monitoring")


def gpu_operator_values(config: K8sStackConfig) -> dict[str, Any]:
    """Driver and container toolkit are switches: EKS/GKE GPU node images often carry both already."""
    return {
        "driver": {"enabled": config.gpu_operator_driver},
        "toolkit": {"enabled": config.gpu_operator_toolkit},
        # The monitoring layer installs its own DCGM exporter with a ServiceMonitor; one per node is enough.
        "dcgmExporter": {"enabled": not config.monitoring},
        "nfd": {"enabled": True},
    }


def volcano_values(config: K8sStackConfig) -> dict[str, Any]:
    # The chart's scheduler config already enables the gang plugin; nothing else is needed for minAvailable.
    return {"custom": {"metrics_enable": config.monitoring}}


def kube_prometheus_stack_values(config: K8sStackConfig) -> dict[str, Any]:
    """Prometheus picks up every ServiceMonitor and PodMonitor, not only this release's (DCGM, training)."""
    return {
        "prometheus": {"prometheusSpec": {
            "serviceMonitorSelectorNilUsesHelmValues": False,
            "podMonitorSelectorNilUsesHelmValues": False,
            "retention": "15d",
        }},
        "grafana": {"enabled": True},
    }


def dcgm_exporter_values(config: K8sStackConfig) -> dict[str, Any]:
    values: dict[str, Any] = {
        "serviceMonitor": {"enabled": True, "interval": "15s"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
    if config.node_selector:
        values["nodeSelector"] = dict(config.node_selector)
    return values


KEDA = Chart("keda", "keda", "https://kedacore.github.io/charts", "keda")


def keda_values(config: K8sStackConfig) -> dict[str, Any]:
    """KEDA's own metrics (scaler errors, the values it read) go to the monitoring layer's Prometheus, if any."""
    scraped = {"enabled": config.monitoring, "serviceMonitor": {"enabled": config.monitoring}}
    return {"prometheus": {"operator": dict(scraped), "metricServer": dict(scraped)}}


def efa_device_plugin_values(config: K8sStackConfig) -> dict[str, Any]:
    # On the training nodes only (nodeSelector), and past the GPU taint they carry.
    values: dict[str, Any] = {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
    if config.node_selector:
        values["nodeSelector"] = dict(config.node_selector)
    return values
