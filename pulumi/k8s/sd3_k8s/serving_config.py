"""Settings of the serving layer (`sd3-cluster-k8s:serving`, a map): the `sd3cluster serve` Deployment on GPU
nodes, its autoscaling, and optional CPU-only pods beside it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .settings import (
    CPU_FORM,
    CPU_QUANTITY,
    ConfigError,
    boolean,
    integer,
    key,
    label,
    mapping,
    refuse_unknown_keys,
    string,
)

SECTION = "serving."
CPU_SECTION = "serving.cpuWorkers."
# Prometheus of the monitoring layer (kube-prometheus-stack's Service in the `monitoring` namespace).
STACK_PROMETHEUS = "http://kube-prometheus-stack-prometheus.monitoring.svc:9090"
GPU_TAINT_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
# Keys of the `serve:` section of `sd3cluster serve` (workloads/README.md) a stack may set, and their types.
# host, port, device, pretrained and name belong to the stack: the pods must listen where the probes and the
# Service look, on the GPU the pod was given, on the weights volume.
SERVE_SETTINGS: dict[str, type | tuple[type, ...]] = {
    "checkpoint": str, "step": (int, str), "ema": bool, "dtype": str, "compile": bool, "warmup": bool,
    "max_batch": int, "max_wait_ms": (int, float), "queue_size": int, "request_timeout_s": (int, float),
    "drain_timeout_s": (int, float), "drain_grace_s": (int, float), "output_dir": str,
    "default_steps": int, "max_steps": int, "default_guidance": (int, float), "max_guidance": (int, float),
    "default_size": int, "min_side": int, "max_side": int, "max_pixels": int, "max_n": int,
    "max_prompt_chars": int, "max_body_bytes": int, "max_sequence_length": int, "job_ttl_s": (int, float),
    "png_compress_level": int, "lora": str, "lora_scale": (int, float), "job_prefix": str,
}
STACK_OWNED_SETTINGS = ("host", "port", "device", "pretrained", "name")
# The ranges `sd3cluster serve` accepts for those settings (its ServeConfig; a test compares the two), checked
# here so a wrong value stops `pulumi up` instead of every pod at start: name -> (low, high, low excluded).
SERVE_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "lora_scale": (0, 10, False), "max_sequence_length": (1, 512, False), "max_batch": (1, 64, False),
    "max_wait_ms": (0, 10000, False), "queue_size": (1, None, False), "request_timeout_s": (0, None, True),
    "drain_timeout_s": (0, None, True), "drain_grace_s": (0, None, False), "job_ttl_s": (0, None, True),
    "png_compress_level": (0, 9, False), "default_steps": (1, 1000, False), "max_steps": (1, 1000, False),
    "default_guidance": (0, 100, False), "max_guidance": (0, 100, False), "default_size": (16, 8192, False),
    "min_side": (16, 8192, False), "max_side": (16, 8192, False), "max_pixels": (256, None, False),
    "max_n": (1, 64, False), "max_prompt_chars": (1, None, False), "max_body_bytes": (1024, None, False),
}
SERVE_CHOICES: dict[str, tuple[str, ...]] = {"dtype": ("auto", "bf16", "fp16", "fp32")}
# `sd3cluster serve`'s own defaults of the two settings the pods' termination time is made from.
DEFAULT_DRAIN_TIMEOUT_S = 600
DEFAULT_DRAIN_GRACE_S = 5
CONTAINER_PORT = 5000

SERVING_KEYS = (
    "name", "image", "pretrained", "weightsClaim", "weightsMountPath", "minReplicas", "maxReplicas", "autoscaling",
    "targetQueueDepth", "activationQueueDepth", "pollingIntervalS", "scaleDownWindowS", "prometheusUrl", "cpu",
    "memoryGi", "preStopS", "serviceType", "servicePort", "gpuNodeSelector", "gpuTolerations", "cpuNodeSelector",
    "cpuTolerations", "settings", "cpuWorkers",
)
CPU_WORKER_KEYS = ("name", "image", "replicas", "args", "cpu", "memoryGi", "port")


@dataclass(frozen=True)
class CpuWorkersConfig:
    """Pods of the CPU pool: no GPU, the image and command are the user's (request checks, post-processing)."""

    name: str
    image: str
    args: tuple[str, ...]
    replicas: int = 2
    cpu: str = "2"
    memory_gi: int = 4
    port: int | None = None


@dataclass(frozen=True)
class ServingConfig:
    image: str
    pretrained: str
    weights_claim: str
    name: str = "sd3-serve"
    weights_mount_path: str = "/weights"
    min_replicas: int = 1
    max_replicas: int = 4
    autoscaling: bool = True
    target_queue_depth: int = 8
    activation_queue_depth: int = 0
    polling_interval_s: int = 15
    scale_down_window_s: int = 300
    prometheus_url: str = STACK_PROMETHEUS
    cpu: str | None = None
    memory_gi: int | None = None
    pre_stop_s: int = 10
    service_type: str = "ClusterIP"
    service_port: int = 80
    gpu_node_selector: Mapping[str, str] = field(default_factory=dict)
    gpu_tolerations: tuple[Mapping[str, Any], ...] = (GPU_TAINT_TOLERATION,)
    cpu_node_selector: Mapping[str, str] = field(default_factory=dict)
    cpu_tolerations: tuple[Mapping[str, Any], ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    cpu_workers: CpuWorkersConfig | None = None

    @property
    def drain_timeout_s(self) -> float:
        return float(self.settings.get("drain_timeout_s", DEFAULT_DRAIN_TIMEOUT_S))

    @property
    def drain_grace_s(self) -> float:
        return float(self.settings.get("drain_grace_s", DEFAULT_DRAIN_GRACE_S))

    @property
    def termination_grace_s(self) -> int:
        """preStop, then serve's own drain (readiness off for drain_grace_s, accepted work for up to
        drain_timeout_s), then a margin for the process to exit: the kubelet counts all of it from the start."""
        return int(self.pre_stop_s + self.drain_grace_s + self.drain_timeout_s + 15 + 0.999)


def _absolute(values: Mapping[str, Any], name: str, default: str | None, section: str) -> str:
    value = values.get(name, default)
    if not value or not str(value).startswith("/"):
        raise ConfigError(f"{key(name, section)} is '{value or ''}': give an absolute path inside the pod")
    return str(value).rstrip("/") or "/"


def _tolerations(values: Mapping[str, Any], name: str, default: tuple, section: str) -> tuple[dict, ...]:
    raw = values.get(name)
    if raw is None:
        return tuple(dict(item) for item in default)
    allowed = ("key", "operator", "value", "effect", "tolerationSeconds")
    if not isinstance(raw, list) or not all(isinstance(item, Mapping) for item in raw):
        raise ConfigError(f"{key(name, section)} must be a list of tolerations, e.g. "
                          "[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]")
    for index, item in enumerate(raw):
        refuse_unknown_keys(item, allowed, f"{key(name, section)}[{index}]")
        if item.get("operator", "Equal") not in ("Equal", "Exists"):
            raise ConfigError(f"{key(name, section)}[{index}].operator is '{item['operator']}': use Equal or Exists")
        if item.get("effect", "NoSchedule") not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise ConfigError(f"{key(name, section)}[{index}].effect is '{item['effect']}': use NoSchedule, "
                              "PreferNoSchedule or NoExecute")
    return tuple(dict(item) for item in raw)


def _serve_settings(raw: Any) -> dict[str, Any]:
    where = key("settings", SECTION)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a map of `serve:` settings, e.g. {{max_batch: 4, queue_size: 32}}")
    for name in raw:
        if name in STACK_OWNED_SETTINGS:
            raise ConfigError(f"{where}.{name} is set by the stack (pods listen on 0.0.0.0:{CONTAINER_PORT}, use "
                              f"their GPU and {key('pretrained', SECTION)}): remove it from settings")
    refuse_unknown_keys(raw, tuple(SERVE_SETTINGS), where)
    for name, value in raw.items():
        wanted = SERVE_SETTINGS[name]
        types = wanted if isinstance(wanted, tuple) else (wanted,)
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            names = " or ".join(t.__name__ for t in types)
            raise ConfigError(f"{where}.{name} is {value!r}: give a {names}")
        if name in SERVE_RANGES:
            low, high, low_excluded = SERVE_RANGES[name]
            below = low is not None and (value <= low if low_excluded else value < low)
            if below or (high is not None and value > high):
                shown = f"more than {low}" if low_excluded else f"{low} or more" if high is None else f"{low} to {high}"
                raise ConfigError(f"{where}.{name} is {value}: give {shown}")
        if name in SERVE_CHOICES and value not in SERVE_CHOICES[name]:
            raise ConfigError(f"{where}.{name} is {value!r}: use {', '.join(SERVE_CHOICES[name])}")
        if name == "job_prefix" and not re.fullmatch(r"[A-Za-z0-9._-]{0,200}", value):
            raise ConfigError(f"{where}.job_prefix is {value!r}: use up to 200 letters, digits, '.', '_' and '-'")
        if name == "step" and isinstance(value, str) and value != "latest":
            raise ConfigError(f"{where}.step is {value!r}: give a step number or latest")
    return dict(raw)


def _cpu_workers(raw: Any, default_image: str, serving_name: str) -> CpuWorkersConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key('cpuWorkers', SECTION)} must be a map ({', '.join(CPU_WORKER_KEYS)})")
    refuse_unknown_keys(raw, CPU_WORKER_KEYS, key("cpuWorkers", SECTION))
    args = raw.get("args")
    if not isinstance(args, list) or not args or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{key('args', CPU_SECTION)} is missing: give the command line of the CPU pods as a list "
                          "of strings after the image's entrypoint (sd3cluster), e.g. [serve, --device, cpu, ...]")
    replicas = integer(raw, "replicas", 2, CPU_SECTION)
    if not 0 <= replicas <= 256:
        raise ConfigError(f"{key('replicas', CPU_SECTION)} is {replicas}: use 0 to 256 pods")
    memory = integer(raw, "memoryGi", 4, CPU_SECTION)
    if memory < 1:
        raise ConfigError(f"{key('memoryGi', CPU_SECTION)} is {memory}: give 1 GiB or more")
    port = integer(raw, "port", None, CPU_SECTION)
    if port is not None and not 1024 <= port <= 65535:
        raise ConfigError(f"{key('port', CPU_SECTION)} is {port}: use a port from 1024 to 65535 (the image's user "
                          "is not root)")
    image = str(raw.get("image") or default_image)
    if " " in image:
        raise ConfigError(f"{key('image', CPU_SECTION)} is '{image}': give an image reference without spaces")
    return CpuWorkersConfig(
        name=label(raw, "name", f"{serving_name}-cpu", CPU_SECTION),
        image=image,
        args=tuple(args),
        replicas=replicas,
        cpu=string(raw, "cpu", "2", CPU_SECTION, pattern=CPU_QUANTITY, form=CPU_FORM),
        memory_gi=memory,
        port=port,
    )


def parse_serving(raw: Any, default_image: str, default_claim: str, monitoring: bool) -> ServingConfig:
    """Validate `sd3-cluster-k8s:serving`; the image defaults to the stack's, the weights to its shared claim."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{key('serving')} must be a map (pulumi config set --path serving.pretrained /weights/...)")
    refuse_unknown_keys(raw, SERVING_KEYS, key("serving"))
    name = label(raw, "name", "sd3-serve", SECTION)
    mount = _absolute(raw, "weightsMountPath", "/weights", SECTION)
    if "pretrained" not in raw:
        raise ConfigError(f"{key('pretrained', SECTION)} is missing: give the diffusers folder (`sd3cluster export "
                          f"--base ...` writes one) on the weights volume, e.g. {mount}/models/sd3-medium")
    pretrained = _absolute(raw, "pretrained", None, SECTION)
    if not pretrained.startswith(mount + "/"):
        raise ConfigError(f"{key('pretrained', SECTION)} is '{pretrained}', outside the weights volume mounted at "
                          f"{mount} ({key('weightsMountPath', SECTION)}): give a folder under it")
    weights_claim = label(raw, "weightsClaim", default_claim, SECTION)

    min_replicas = integer(raw, "minReplicas", 1, SECTION)
    max_replicas = integer(raw, "maxReplicas", 4, SECTION)
    autoscaling = boolean(raw, "autoscaling", True, SECTION)
    if min_replicas == 0:
        # The queue that autoscaling reads lives in the pods: with none, no request is ever queued to count.
        raise ConfigError(f"{key('minReplicas', SECTION)} is 0: the queue depth that scales the pods is measured in "
                          "the pods, so with none running nothing would start one; use 1 or more")
    if not 1 <= min_replicas <= max_replicas <= 256:
        raise ConfigError(f"{key('minReplicas', SECTION)} ({min_replicas}) and {key('maxReplicas', SECTION)} "
                          f"({max_replicas}): need 1 <= minReplicas <= maxReplicas <= 256")
    target = integer(raw, "targetQueueDepth", 8, SECTION)
    if target < 1:
        raise ConfigError(f"{key('targetQueueDepth', SECTION)} is {target}: give the images waiting per pod above "
                          "which another pod starts, 1 or more")
    activation = integer(raw, "activationQueueDepth", 0, SECTION)
    if activation < 0:
        raise ConfigError(f"{key('activationQueueDepth', SECTION)} is {activation}: give 0 or more")
    polling = integer(raw, "pollingIntervalS", 15, SECTION)
    window = integer(raw, "scaleDownWindowS", 300, SECTION)
    for setting, value in (("pollingIntervalS", polling), ("scaleDownWindowS", window)):
        if not 1 <= value <= 3600:
            raise ConfigError(f"{key(setting, SECTION)} is {value}: use 1 to 3600 seconds")
    prometheus_url = str(string(raw, "prometheusUrl", None, SECTION) or (STACK_PROMETHEUS if monitoring else ""))
    if prometheus_url and not re.match(r"^https?://[^\s/]+", prometheus_url):
        raise ConfigError(f"{key('prometheusUrl', SECTION)} is '{prometheus_url}': give the URL of a Prometheus, "
                          "e.g. http://prometheus.monitoring.svc:9090")
    if autoscaling and not prometheus_url.startswith(("http://", "https://")):
        raise ConfigError(f"{key('prometheusUrl', SECTION)} is '{prometheus_url}': autoscaling reads the queue depth "
                          "from Prometheus; with monitoring off, give your Prometheus URL (http://...:9090) or set "
                          f"{key('autoscaling', SECTION)} to false")
    cpu = string(raw, "cpu", None, SECTION, pattern=CPU_QUANTITY, form=CPU_FORM)
    memory = integer(raw, "memoryGi", None, SECTION)
    if memory is not None and memory < 1:
        raise ConfigError(f"{key('memoryGi', SECTION)} is {memory}: give 1 GiB or more")
    pre_stop = integer(raw, "preStopS", 10, SECTION)
    if not 0 <= pre_stop <= 120:
        raise ConfigError(f"{key('preStopS', SECTION)} is {pre_stop}: use 0 to 120 seconds (time for the Service's "
                          "endpoints and load balancers to drop a stopping pod)")
    service_type = str(raw.get("serviceType", "ClusterIP"))
    if service_type not in SERVICE_TYPES:
        raise ConfigError(f"{key('serviceType', SECTION)} is '{service_type}': use {', '.join(SERVICE_TYPES)}")
    service_port = integer(raw, "servicePort", 80, SECTION)
    if not 1 <= service_port <= 65535:
        raise ConfigError(f"{key('servicePort', SECTION)} is {service_port}: use a port from 1 to 65535")
    image = str(raw.get("image") or default_image)
    if " " in image:
        raise ConfigError(f"{key('image', SECTION)} is '{image}': give an image reference without spaces")
    return ServingConfig(
        image=image,
        pretrained=pretrained,
        weights_claim=weights_claim,
        name=name,
        weights_mount_path=mount,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        autoscaling=autoscaling,
        target_queue_depth=target,
        activation_queue_depth=activation,
        polling_interval_s=polling,
        scale_down_window_s=window,
        prometheus_url=prometheus_url,
        cpu=cpu,
        memory_gi=memory,
        pre_stop_s=pre_stop,
        service_type=service_type,
        service_port=service_port,
        gpu_node_selector=mapping(raw, "gpuNodeSelector", SECTION),
        gpu_tolerations=_tolerations(raw, "gpuTolerations", (GPU_TAINT_TOLERATION,), SECTION),
        cpu_node_selector=mapping(raw, "cpuNodeSelector", SECTION),
        cpu_tolerations=_tolerations(raw, "cpuTolerations", (), SECTION),
        settings=_serve_settings(raw.get("settings") or {}),
        cpu_workers=_cpu_workers(raw.get("cpuWorkers"), image, name),
    )
