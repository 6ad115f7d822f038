"""The whole Kubernetes stack: components wired together, and the outputs."""

from __future__ import annotations

from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from . import manifests
from .components import (
    Autoscaler,
    BatchScheduler,
    GpuOperator,
    Monitoring,
    RdmaDevicePlugin,
    Serving,
    SharedVolume,
    TrainingJob,
)
from .config import K8sStackConfig


def build(config: K8sStackConfig) -> dict[str, Any]:
    """Declare every resource; return the stack outputs."""
    manifest = manifests.namespace(config)
    namespace = k8s.core.v1.Namespace(config.namespace, metadata=manifest["metadata"])
    gpu_stack: list[pulumi.Resource] = []
    if config.gpu_operator:
        gpu_stack.append(GpuOperator("gpu-operator", config).release)
    # The gang asks for the RDMA resource: what advertises it comes first.
    rdma = RdmaDevicePlugin("rdma-device-plugin", config).ready if config.rdma_resource else []
    scheduler = BatchScheduler("volcano", config)
    volume = SharedVolume("shared", config, namespace)
    job = TrainingJob("training", config, namespace, depends_on=[scheduler.release, volume.claim, *gpu_stack, *rdma])
    outputs: dict[str, Any] = {
        "namespace": config.namespace,
        "shared_claim": volume.claim_name,
        "training_job": job.job.id,
        "rendezvous_endpoint": manifests.rendezvous_endpoint(config),
        "train_config": manifests.train_config_map_name(config),
        "checkpoints": manifests.run_paths(config)["checkpoint"],
        "runs": manifests.run_paths(config)["output"],
        "gpus": config.total_gpus,
    }
    monitoring = None
    if config.monitoring:
        monitoring = Monitoring("monitoring", config, depends_on=gpu_stack)
        outputs["grafana"] = "kubectl -n monitoring port-forward svc/kube-prometheus-stack-grafana 3000:80"
    if config.serving is not None:
        autoscaler = Autoscaler("keda", config).release if config.serving.autoscaling else None
        # The weights live on the shared claim unless serving names a claim of its own (made elsewhere).
        weights = [volume.claim] if config.serving.weights_claim == volume.claim_name else []
        serving = Serving("serving", config, namespace, depends_on=[*weights, *gpu_stack], autoscaler=autoscaler,
                          monitoring=monitoring.prometheus if monitoring else None)
        outputs["serving_url"] = Serving.url(config)
        outputs["serving_deployment"] = serving.deployment.metadata.name
    return outputs
