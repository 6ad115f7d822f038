"""Stack configuration, read once into a frozen object and validated before any resource is declared."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .serving_config import ServingConfig, parse_serving
from .settings import CPU_FORM, CPU_QUANTITY, NAMESPACE, ConfigError, refuse_unknown_keys
from .settings import boolean as _bool
from .settings import integer as _int
from .settings import key as _key
from .settings import label as _label
from .settings import mapping as _mapping
from .settings import string as _string

__all__ = ["ConfigError", "K8sStackConfig", "load_config", "parse_config"]

_RESOURCE_NAME = re.compile(r"^([a-z0-9.-]+/)?[A-Za-z0-9_.-]+$")
MAX_NODES = 64
MAX_GPUS_PER_NODE = 16
_CHART_VERSION = re.compile(r"^v?[0-9]+\.[0-9]+\.[0-9]+([-+][0-9A-Za-z.-]+)?$")
_QUEUE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")
EFA_RESOURCE = "vpc.amazonaws.com/efa"
# The RDMA shared device plugin advertises rdma/<resourceName> (github.com/Mellanox/k8s-rdma-shared-dev-plugin).
RDMA_SHARED_PREFIX = "rdma/"
RDMA_SHARED_DEVICE_PLUGIN_IMAGE = "ghcr.io/mellanox/k8s-rdma-shared-dev-plugin:v1.5.2"
_INTERFACE = re.compile(r"^[A-Za-z0-9_.:-]{1,15}$")
_IMAGE = re.compile(r"^[^\s]+$")
# The sections of `sd3cluster train --config` (workloads/src/sd3cluster/config.py, class Config).
TRAIN_SECTIONS = ("model", "data", "flow", "optim", "train", "lora", "checkpoint", "output", "verify")
# Where the stack puts a run on the shared claim; the job writes its checkpoints and TensorBoard logs there.
STACK_OWNED_TRAIN_KEYS = (("checkpoint", "dir"), ("output", "dir"))


@dataclass(frozen=True)
class ChartVersions:
    gpu_operator: str = "v25.3.4"
    volcano: str = "1.12.2"
    dcgm_exporter: str = "4.4.1"
    kube_prometheus_stack: str = "77.0.0"
    keda: str = "2.17.2"
    efa_device_plugin: str = "0.5.6"


@dataclass(frozen=True)
class K8sStackConfig:
    image: str
    storage_class: str
    namespace: str = "sd3"
    job_name: str = "sd3-train"
    nodes: int = 2
    gpus_per_node: int = 8
    train: Mapping[str, Any] = field(default_factory=dict)
    shared_storage_gi: int = 1000
    shared_mount_path: str = "/shared"
    shm_gi: int = 64
    cpu_per_node: str | None = None
    memory_gi_per_node: int | None = None
    rdma_resource: str | None = None
    rdma_per_node: int = 0
    rdma_interfaces: tuple[str, ...] = ()
    rdma_device_plugin_image: str = RDMA_SHARED_DEVICE_PLUGIN_IMAGE
    rendezvous_port: int = 29400
    max_retry: int = 3
    queue: str = "default"
    node_selector: Mapping[str, str] = field(default_factory=dict)
    gpu_operator: bool = True
    gpu_operator_driver: bool = True
    gpu_operator_toolkit: bool = True
    monitoring: bool = True
    charts: ChartVersions = field(default_factory=ChartVersions)
    serving: ServingConfig | None = None

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def _train_settings(raw: Any) -> dict[str, Any]:
    """The `sd3cluster train` config the job runs (a map of its sections), checked for form here; the values
    themselves are checked by sd3cluster when the job starts."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{_key('train')} is '{raw}', not a map of the train config's sections: "
                          "`pulumi config set --path train.train.steps 1000` (see Pulumi.example.yaml)")
    unknown = sorted(set(raw) - set(TRAIN_SECTIONS))
    if unknown:
        raise ConfigError(f"{_key('train')} has {', '.join(map(str, unknown))}, not a section of the train config: "
                          f"use {', '.join(TRAIN_SECTIONS)} (workloads/README.md lists their keys)")
    for section, settings in raw.items():
        if not isinstance(settings, Mapping):
            raise ConfigError(f"{_key('train')}.{section} is '{settings}', not a map: "
                              f"`pulumi config set --path train.{section}.KEY VALUE`")
    for section, name in STACK_OWNED_TRAIN_KEYS:
        if name in raw.get(section, {}):
            raise ConfigError(f"{_key('train')}.{section}.{name} is set, but the stack puts it on the shared claim "
                              "(/shared/checkpoints/<jobName>, /shared/runs/<jobName>) so a restarted job resumes "
                              "from its checkpoints: remove it")
    return {str(section): dict(settings) for section, settings in raw.items()}


def _rdma_plugin(values: Mapping[str, Any], rdma_resource: Any) -> tuple[tuple[str, ...], str]:
    """What advertises the RDMA resource: AWS's EFA device plugin, or the RDMA shared device plugin over the
    interfaces named in rdmaInterfaces."""
    interfaces = values.get("rdmaInterfaces", [])
    image = _string(values, "rdmaDevicePluginImage", RDMA_SHARED_DEVICE_PLUGIN_IMAGE, pattern=_IMAGE,
                    form="give an image reference, e.g. " + RDMA_SHARED_DEVICE_PLUGIN_IMAGE)
    if not rdma_resource:
        if interfaces:
            raise ConfigError(f"{_key('rdmaInterfaces')} is set but {_key('rdmaResource')} is not: name the resource")
        return (), image
    resource = str(rdma_resource)
    if resource == EFA_RESOURCE:
        if interfaces:
            raise ConfigError(f"{_key('rdmaInterfaces')} is set but AWS's EFA device plugin finds the EFA devices "
                              "itself: remove it")
        return (), image
    if not resource.startswith(RDMA_SHARED_PREFIX):
        raise ConfigError(f"{_key('rdmaResource')} is '{resource}': the stack declares the device plugin that "
                          f"advertises {EFA_RESOURCE} (AWS's EFA plugin) or {RDMA_SHARED_PREFIX}<name> (the RDMA "
                          "shared device plugin); use one of those, e.g. rdma/rdma_shared_device_a")
    if not isinstance(interfaces, list) or not interfaces or not all(
            isinstance(name, str) and _INTERFACE.match(name) for name in interfaces):
        raise ConfigError(f"{_key('rdmaInterfaces')} is '{interfaces}': the RDMA shared device plugin shares the "
                          "RDMA devices of these network interfaces; give them as a list, e.g. "
                          "`pulumi config set --path 'rdmaInterfaces[0]' ens8f0np0`")
    return tuple(interfaces), image


def parse_config(values: Mapping[str, Any]) -> K8sStackConfig:
    """Validate the stack's settings (keys as in Pulumi.<stack>.yaml, without the project prefix)."""
    refuse_unknown_keys(values, CONFIG_KEYS, "the stack configuration (sd3-cluster-k8s:*)")
    image = str(values.get("image") or "")
    if not image or " " in image:
        raise ConfigError(f"{_key('image')} is missing: set the training image, one with the sd3cluster package "
                          "and torchrun in it, e.g. `pulumi config set image registry.example.com/sd3cluster:1.0`")
    storage_class = str(values.get("storageClassName") or "")
    if storage_class and not _QUEUE.match(storage_class):
        raise ConfigError(f"{_key('storageClassName')} is '{storage_class}': give the name of a storage class "
                          "(lower-case letters, digits, dashes and dots), see `kubectl get storageclass`")
    if not storage_class:
        raise ConfigError(f"{_key('storageClassName')} is missing: the shared volume is ReadWriteMany; set a class "
                          "that provides it (EFS CSI, FSx CSI, NFS CSI, CephFS), see `kubectl get storageclass`")

    nodes = _int(values, "nodes", 2)
    if not 1 <= nodes <= MAX_NODES:
        raise ConfigError(f"{_key('nodes')} is {nodes}: the training job runs on 1 to {MAX_NODES} pods (one per node)")
    gpus = _int(values, "gpusPerNode", 8)
    if not 1 <= gpus <= MAX_GPUS_PER_NODE:
        raise ConfigError(f"{_key('gpusPerNode')} is {gpus}: each pod takes 1 to {MAX_GPUS_PER_NODE} GPUs")

    rdma_resource = values.get("rdmaResource") or None
    rdma_per_node = _int(values, "rdmaPerNode", 1 if rdma_resource else 0)
    if rdma_resource is not None and not _RESOURCE_NAME.match(str(rdma_resource)):
        raise ConfigError(f"{_key('rdmaResource')} is '{rdma_resource}': give the extended resource the device "
                          "plugin advertises, e.g. vpc.amazonaws.com/efa or rdma/rdma_shared_device_a")
    if rdma_resource and rdma_per_node < 1:
        raise ConfigError(f"{_key('rdmaPerNode')} is {rdma_per_node}: request at least 1 {rdma_resource} per pod")
    if not rdma_resource and rdma_per_node:
        raise ConfigError(f"{_key('rdmaPerNode')} is set but {_key('rdmaResource')} is not: name the resource too")

    train = _train_settings(values.get("train", {}))
    rdma_interfaces, plugin_image = _rdma_plugin(values, rdma_resource)

    shared_gi = _int(values, "sharedStorageGi", 1000)
    shm_gi = _int(values, "shmGi", 64)
    memory_gi = _int(values, "memoryGiPerNode", None)
    for name, size in (("sharedStorageGi", shared_gi), ("shmGi", shm_gi)):
        if size < 1:
            raise ConfigError(f"{_key(name)} is {size}: give a size of 1 GiB or more")
    if memory_gi is not None and memory_gi <= shm_gi:
        raise ConfigError(f"{_key('memoryGiPerNode')} is {memory_gi} but /dev/shm takes {shm_gi} GiB of it "
                          f"({_key('shmGi')}): raise the memory or lower shmGi")

    port = _int(values, "rendezvousPort", 29400)
    if not 1024 <= port <= 65535:
        raise ConfigError(f"{_key('rendezvousPort')} is {port}: use a port from 1024 to 65535")

    node_selector = _mapping(values, "nodeSelector", example="{node.kubernetes.io/instance-type: p5.48xlarge}")
    max_retry = _int(values, "maxRetry", 3, minimum=0, maximum=100, unit=" whole-job restarts")
    queue = _string(values, "queue", "default", pattern=_QUEUE, form="give the name of a Volcano queue "
                    "(lower-case letters, digits, dashes and dots), e.g. default")

    defaults = ChartVersions()
    chart_form = "give a chart version such as 1.12.2 or v25.3.4"
    charts = ChartVersions(
        gpu_operator=_string(values, "gpuOperatorVersion", defaults.gpu_operator, pattern=_CHART_VERSION,
                             form=chart_form),
        volcano=_string(values, "volcanoVersion", defaults.volcano, pattern=_CHART_VERSION, form=chart_form),
        dcgm_exporter=_string(values, "dcgmExporterVersion", defaults.dcgm_exporter, pattern=_CHART_VERSION,
                              form=chart_form),
        kube_prometheus_stack=_string(values, "kubePrometheusStackVersion", defaults.kube_prometheus_stack,
                                      pattern=_CHART_VERSION, form=chart_form),
        keda=_string(values, "kedaVersion", defaults.keda, pattern=_CHART_VERSION, form=chart_form),
        efa_device_plugin=_string(values, "efaDevicePluginVersion", defaults.efa_device_plugin,
                                  pattern=_CHART_VERSION, form=chart_form),
    )
    cpu = _string(values, "cpuPerNode", None, pattern=CPU_QUANTITY, form=CPU_FORM)
    job_name = _label(values, "jobName", "sd3-train")
    monitoring = _bool(values, "monitoring", True)
    serving = None
    if values.get("serving") is not None:
        serving = parse_serving(values["serving"], default_image=image, default_claim=f"{job_name}-shared",
                                monitoring=monitoring)
    return K8sStackConfig(
        image=image,
        storage_class=storage_class,
        namespace=_label(values, "namespace", "sd3"),
        job_name=job_name,
        nodes=nodes,
        gpus_per_node=gpus,
        train=train,
        shared_storage_gi=shared_gi,
        shm_gi=shm_gi,
        cpu_per_node=cpu,
        memory_gi_per_node=memory_gi,
        rdma_resource=str(rdma_resource) if rdma_resource else None,
        rdma_per_node=rdma_per_node,
        rdma_interfaces=rdma_interfaces,
        rdma_device_plugin_image=plugin_image,
        rendezvous_port=port,
        max_retry=max_retry,
        queue=queue,
        node_selector=node_selector,
        gpu_operator=_bool(values, "gpuOperator", True),
        gpu_operator_driver=_bool(values, "gpuOperatorDriver", True),
        gpu_operator_toolkit=_bool(values, "gpuOperatorToolkit", True),
        monitoring=monitoring,
        charts=charts,
        serving=serving,
    )


CONFIG_KEYS = (
    "image", "storageClassName", "namespace", "jobName", "nodes", "gpusPerNode", "train", "sharedStorageGi",
    "shmGi", "cpuPerNode", "memoryGiPerNode", "rdmaResource", "rdmaPerNode", "rendezvousPort", "maxRetry", "queue",
    "nodeSelector", "gpuOperator", "gpuOperatorDriver", "gpuOperatorToolkit", "monitoring", "gpuOperatorVersion",
    "volcanoVersion", "dcgmExporterVersion", "kubePrometheusStackVersion", "kedaVersion", "serving",
    "rdmaInterfaces", "rdmaDevicePluginImage", "efaDevicePluginVersion",
)
# Settings that are maps (`pulumi config set --path`, or YAML in Pulumi.<stack>.yaml), with the right form of each.
STRUCTURED_KEYS = {
    "nodeSelector": "map of node labels: `pulumi config set --path "
                    "'nodeSelector[\"node.kubernetes.io/instance-type\"]' p5.48xlarge`, or a YAML map under the key "
                    "in Pulumi.<stack>.yaml",
    "train": "map of the train config's sections: `pulumi config set --path train.train.steps 1000`, or a YAML map "
             "under the key in Pulumi.<stack>.yaml",
    "rdmaInterfaces": "list of interface names: `pulumi config set --path 'rdmaInterfaces[0]' ens8f0np0`",
    "serving": "map: `pulumi config set --path serving.pretrained /weights/models/sd3-medium`, or a YAML map under "
               "the key in Pulumi.<stack>.yaml (see Pulumi.example.yaml)",
}


def load_config() -> K8sStackConfig:
    """Read every setting of this stack's namespace (maps come back as objects) and validate them."""
    return parse_config(NAMESPACE.read(STRUCTURED_KEYS))
