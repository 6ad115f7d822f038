"""The whole Kubernetes stack: components wired together, and the outputs."""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from . import manifests
from .components import BatchScheduler, GpuOperator, Monitoring, SharedVolume, TrainingJob
from .config import K8sStackConfig


def build(config: K8sStackConfig) -> dict[str, Any]:
    """Declare every resource; return the stack outputs."""
    manifest = manifests.namespace(config)
    namespace = k8s.core.v1.Namespace(config.namespace, metadata=manifest["metadata"])
    gpu_stack: list[pulumi.Resource] = []
    if config.gpu_operator:
        gpu_stack.append(GpuOperator("gpu-operator", config).release)
    scheduler = BatchScheduler("volcano", config)
    volume = SharedVolume("shared", config, namespace)
    job = TrainingJob("training", config, namespace, depends_on=[scheduler.release, volume.claim, *gpu_stack])
    outputs: dict[str, Any] = {
        "namespace": config.namespace,
        "shared_claim": volume.claim_name,
        "training_job": job.job.id,
        "rendezvous_endpoint": manifests.rendezvous_endpoint(config),
        "gpus": config.total_gpus,
    }
    if config.monitoring:
        Monitoring("monitoring", config, depends_on=gpu_stack)
        outputs["grafana"] = "kubectl -n monitoring port-forward svc/kube-prometheus-stack-grafana 3000:80"
    return outputs
