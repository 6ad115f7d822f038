"""The Kubernetes objects of the training stack as plain manifests (pure functions; no Pulumi here).

The training job is a Volcano Job: Volcano's gang scheduling starts all pods or none (minAvailable = all),
so a job never holds GPUs while it waits for the rest. Every pod runs torchrun; they meet at pod 0's
address, published by a headless Service that lists pods before they are ready.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from .config import EFA_RESOURCE, RDMA_SHARED_PREFIX, K8sStackConfig

TASK_NAME = "worker"
VOLCANO_JOB_API = "batch.volcano.sh/v1alpha1"
TRAIN_CONFIG_DIR = "/etc/sd3cluster/train"
TRAIN_CONFIG_FILE = "train.yaml"
RDMA_PLUGIN_NAMESPACE = "kube-system"
RDMA_PLUGIN_NAME = "rdma-shared-device-plugin"
RDMA_PLUGIN_CONFIG_DIR = "/k8s-rdma-shared-dev-plugin"
# Pods that may share one RDMA device (the plugin's rdmaHcaMax): enough for every pod a node can hold.
RDMA_HCA_MAX = 64


def labels(config: K8sStackConfig, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "sd3-cluster",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": config.job_name,
        "app.kubernetes.io/managed-by": "pulumi",
    }


def namespace(config: K8sStackConfig) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": config.namespace, "labels": labels(config, "namespace")}}


def shared_claim_name(config: K8sStackConfig) -> str:
    return f"{config.job_name}-shared"


def rendezvous_service_name(config: K8sStackConfig) -> str:
    return f"{config.job_name}-rdzv"


def shared_claim(config: K8sStackConfig) -> dict[str, Any]:
    """Datasets, latents, checkpoints and TensorBoard logs: one volume every pod mounts read-write."""
    return {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": shared_claim_name(config), "namespace": config.namespace,
                     "labels": labels(config, "shared-volume")},
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": config.storage_class,
            "resources": {"requests": {"storage": f"{config.shared_storage_gi}Gi"}},
        },
    }


def train_config_map_name(config: K8sStackConfig) -> str:
    return f"{config.job_name}-config"


def run_paths(config: K8sStackConfig) -> dict[str, str]:
    """The run's folders on the shared claim: checkpoints (a restarted job resumes from them) and the run's
    outputs (metrics.jsonl and TensorBoard's event files under output.dir)."""
    root = config.shared_mount_path
    return {"checkpoint": f"{root}/checkpoints/{config.job_name}", "output": f"{root}/runs/{config.job_name}"}


def train_settings(config: K8sStackConfig) -> dict[str, Any]:
    """The `sd3cluster train` config of the job: the stack's `train` sections, with the run's folders on the claim."""
    settings = {section: dict(values) for section, values in config.train.items()}
    paths = run_paths(config)
    settings.setdefault("checkpoint", {})["dir"] = paths["checkpoint"]
    settings.setdefault("output", {})["dir"] = paths["output"]
    return settings


def train_config_text(config: K8sStackConfig) -> str:
    return yaml.safe_dump(train_settings(config), sort_keys=False)


def train_config_map(config: K8sStackConfig) -> dict[str, Any]:
    """The config file every pod reads, mounted read-only at TRAIN_CONFIG_DIR."""
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": train_config_map_name(config), "namespace": config.namespace,
                     "labels": labels(config, "train-config")},
        "data": {TRAIN_CONFIG_FILE: train_config_text(config)},
    }


def rendezvous_service(config: K8sStackConfig) -> dict[str, Any]:
    """Headless: DNS gives each pod a name (<pod>.<service>), including pods not yet ready, as torchrun needs."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": rendezvous_service_name(config), "namespace": config.namespace,
                     "labels": labels(config, "rendezvous")},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(config, "trainer"),
            "ports": [{"name": "rendezvous", "port": config.rendezvous_port, "targetPort": config.rendezvous_port,
                       "protocol": "TCP"}],
        },
    }


def rendezvous_endpoint(config: K8sStackConfig) -> str:
    # Volcano names pods <job>-<task>-<index>; its svc plugin sets each pod's hostname to that name.
    host = f"{config.job_name}-{TASK_NAME}-0.{rendezvous_service_name(config)}.{config.namespace}.svc"
    return f"{host}:{config.rendezvous_port}"


def torchrun_args(config: K8sStackConfig) -> list[str]:
    return [
        f"--nnodes={config.nodes}",
        f"--nproc-per-node={config.gpus_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous_endpoint(config)}",
        f"--rdzv-id={config.job_name}",
        # Local restarts of a worker; a lost pod restarts the whole job (policies below), which resumes
        # from the last complete checkpoint on the shared volume.
        "--max-restarts=3",
        "--no-python",
        "sd3cluster", "train", "--config", f"{TRAIN_CONFIG_DIR}/{TRAIN_CONFIG_FILE}",
    ]


def _resources(config: K8sStackConfig) -> dict[str, Any]:
    limits: dict[str, Any] = {"nvidia.com/gpu": config.gpus_per_node}
    if config.rdma_resource:
        limits[config.rdma_resource] = config.rdma_per_node
    requests: dict[str, Any] = dict(limits)
    if config.cpu_per_node:
        requests["cpu"] = config.cpu_per_node
    if config.memory_gi_per_node:
        requests["memory"] = f"{config.memory_gi_per_node}Gi"
        limits["memory"] = f"{config.memory_gi_per_node}Gi"
    return {"limits": limits, "requests": requests}


def _environment(config: K8sStackConfig) -> list[dict[str, Any]]:
    env = [
        {"name": "NCCL_DEBUG", "value": "WARN"},  # NCCL
        {"name": "OMP_NUM_THREADS", "value": "8"},  # PyTorch's CPU threads per process (torchrun sets 1 otherwise)
        # Restarted workers must not read the dead workers' addresses from a store torchrun kept (see
        # workloads/README.md, "Restarts").
        {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"},
    ]
    if config.rdma_resource == EFA_RESOURCE:
        # libfabric (through aws-ofi-nccl in the image): EFA only, and GPUDirect RDMA where the devices do it.
        env += [{"name": "FI_PROVIDER", "value": "efa"}, {"name": "FI_EFA_USE_DEVICE_RDMA", "value": "1"}]
    return env


def trainer_pod_template(config: K8sStackConfig) -> dict[str, Any]:
    """The pod every node runs: all its GPUs, the shared claim, /dev/shm in memory for NCCL and data loaders."""
    container: dict[str, Any] = {
        "name": "trainer",
        "image": config.image,
        "command": ["torchrun"],
        "args": torchrun_args(config),
        "env": _environment(config),
        "ports": [{"name": "rendezvous", "containerPort": config.rendezvous_port, "protocol": "TCP"}],
        "resources": _resources(config),
        "volumeMounts": [
            {"name": "shared", "mountPath": config.shared_mount_path},
            {"name": "train-config", "mountPath": TRAIN_CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    if config.rdma_resource:
        # RDMA registers (pins) memory: without IPC_LOCK the verbs provider cannot lock its buffers.
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # a failed pod fails the job, which Volcano restarts (policies)
        "subdomain": rendezvous_service_name(config),
        "containers": [container],
        "volumes": [
            {"name": "shared", "persistentVolumeClaim": {"claimName": shared_claim_name(config)}},
            {"name": "train-config", "configMap": {"name": train_config_map_name(config)}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{config.shm_gi}Gi"}},
        ],
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }
    if config.node_selector:
        spec["nodeSelector"] = dict(config.node_selector)
    return {"metadata": {"labels": labels(config, "trainer")}, "spec": spec}


def training_job(config: K8sStackConfig) -> dict[str, Any]:
    return {
        "apiVersion": VOLCANO_JOB_API, "kind": "Job",
        "metadata": {"name": config.job_name, "namespace": config.namespace, "labels": labels(config, "job")},
        "spec": {
            "schedulerName": "volcano",
            "queue": config.queue,
            "minAvailable": config.nodes,
            "maxRetry": config.max_retry,
            "plugins": {"svc": ["--disable-network-policy=true"], "env": []},
            "policies": [
                {"event": "PodEvicted", "action": "RestartJob"},
                {"event": "PodFailed", "action": "RestartJob"},
            ],
            "tasks": [{
                "name": TASK_NAME,
                "replicas": config.nodes,
                "minAvailable": config.nodes,
                "template": trainer_pod_template(config),
            }],
        },
    }


def task_pods(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The Pods a Volcano Job makes, as Pod manifests (what the Kubernetes schema can check)."""
    pods = []
    for task in job["spec"]["tasks"]:
        for index in range(task["replicas"]):
            pods.append({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{job['metadata']['name']}-{task['name']}-{index}",
                             "namespace": job["metadata"]["namespace"], **task["template"]["metadata"]},
                "spec": task["template"]["spec"],
            })
    return pods


# ------------------------------------------------------------------------ what advertises the RDMA resource


def rdma_shared_plugin_name(config: K8sStackConfig) -> str:
    """The plugin's resourceName: the part of rdmaResource after rdma/."""
    return str(config.rdma_resource)[len(RDMA_SHARED_PREFIX):]


def rdma_plugin_config_map(config: K8sStackConfig) -> dict[str, Any]:
    """The RDMA shared device plugin's config.json: one resource over the RDMA devices of rdmaInterfaces."""
    plugin_config = {"periodicUpdateInterval": 300, "configList": [{
        "resourceName": rdma_shared_plugin_name(config),
        "rdmaHcaMax": RDMA_HCA_MAX,
        "selectors": {"ifNames": list(config.rdma_interfaces)},
    }]}
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": f"{RDMA_PLUGIN_NAME}-config", "namespace": RDMA_PLUGIN_NAMESPACE,
                     "labels": labels(config, "rdma-device-plugin")},
        "data": {"config.json": json.dumps(plugin_config, indent=2)},
    }


def rdma_plugin_daemon_set(config: K8sStackConfig) -> dict[str, Any]:
    """The RDMA shared device plugin (github.com/Mellanox/k8s-rdma-shared-dev-plugin, its documented DaemonSet):
    registers rdma/<name> with the kubelet on every node the training pods may use."""
    pod_labels = {**labels(config, "rdma-device-plugin"), "app.kubernetes.io/instance": RDMA_PLUGIN_NAME}
    spec: dict[str, Any] = {
        "hostNetwork": True,
        "priorityClassName": "system-node-critical",
        "tolerations": [{"operator": "Exists"}],
        "containers": [{
            "name": RDMA_PLUGIN_NAME,
            "image": config.rdma_device_plugin_image,
            "imagePullPolicy": "IfNotPresent",
            # It opens /dev/infiniband and registers with the kubelet's socket.
            "securityContext": {"privileged": True},
            "volumeMounts": [
                {"name": "device-plugin", "mountPath": "/var/lib/kubelet/device-plugins"},
                {"name": "plugins-registry", "mountPath": "/var/lib/kubelet/plugins_registry"},
                {"name": "config", "mountPath": RDMA_PLUGIN_CONFIG_DIR, "readOnly": True},
                {"name": "devs", "mountPath": "/dev/"},
            ],
        }],
        "volumes": [
            {"name": "device-plugin", "hostPath": {"path": "/var/lib/kubelet/device-plugins"}},
            {"name": "plugins-registry", "hostPath": {"path": "/var/lib/kubelet/plugins_registry"}},
            {"name": "config", "configMap": {"name": f"{RDMA_PLUGIN_NAME}-config",
                                             "items": [{"key": "config.json", "path": "config.json"}]}},
            {"name": "devs", "hostPath": {"path": "/dev/"}},
        ],
    }
    if config.node_selector:
        spec["nodeSelector"] = dict(config.node_selector)
    return {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": RDMA_PLUGIN_NAME, "namespace": RDMA_PLUGIN_NAMESPACE,
                     "labels": labels(config, "rdma-device-plugin")},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/instance": RDMA_PLUGIN_NAME}},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": pod_labels}, "spec": spec},
        },
    }


def uses_efa_plugin(config: K8sStackConfig) -> bool:
    return config.rdma_resource == EFA_RESOURCE


def uses_rdma_shared_plugin(config: K8sStackConfig) -> bool:
    return bool(config.rdma_resource) and str(config.rdma_resource).startswith(RDMA_SHARED_PREFIX)
