"""pulumi/k8s's serving layer under mocks: every object validates (built-in kinds with kubernetes-validate
--strict, KEDA's and the Prometheus Operator's with the schemas of sd3_crd_schemas.py); the Deployment fits the
contract of `sd3cluster serve` (one GPU, probes, drain, read-only weights); settings are checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pulumi
import pytest
import yaml
from sd3_crd_schemas import SCHEMAS
from sd3_k8s import serving as manifests
from sd3_k8s.config import ConfigError, K8sStackConfig, load_config, parse_config
from sd3_k8s.serving_config import SERVE_SETTINGS, STACK_OWNED_SETTINGS
from sd3_k8s.stack import build
from sd3_pulumi_testing import K8S_VALUES, REPO, declare, integral

KUBERNETES_VERSION = kubernetes_validate.latest_version()
RELEASE = "kubernetes:helm.sh/v3:Release"
SERVING = {"pretrained": "/weights/models/sd3-medium"}
FULL_SERVING = {
    "pretrained": "/models/sd3-medium", "weightsClaim": "sd3-weights", "weightsMountPath": "/models",
    "minReplicas": 2, "maxReplicas": 12, "targetQueueDepth": 6, "cpu": "8", "memoryGi": 64, "preStopS": 15,
    "serviceType": "LoadBalancer", "servicePort": 8080,
    "gpuNodeSelector": {"node.kubernetes.io/instance-type": "g6e.xlarge"},
    "gpuTolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                       {"key": "pool", "operator": "Equal", "value": "inference", "effect": "NoSchedule"}],
    "cpuNodeSelector": {"pool": "cpu"},
    "cpuTolerations": [{"key": "pool", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}],
    "settings": {"max_batch": 8, "queue_size": 64, "drain_timeout_s": 120, "drain_grace_s": 10, "dtype": "bf16",
                 "compile": True},
    "cpuWorkers": {"replicas": 3, "args": ["serve", "--device", "cpu"], "cpu": "4", "memoryGi": 8, "port": 8000},
}


def _declare(pulumi_mocks, serving=None, **overrides):
    config = parse_config({**K8S_VALUES, "serving": SERVING if serving is None else serving, **overrides})
    outputs = declare(lambda: pulumi.Output.all(**build(config)))
    return config, outputs


def _serving_objects(pulumi_mocks) -> list[dict]:
    """Kubernetes objects the Serving component declared (its children), as the provider would get them."""
    return [integral(r.inputs) for r in pulumi_mocks.resources
            if r.custom and r.typ.startswith("kubernetes:") and r.typ != RELEASE and r.name.startswith("serving-")]


def _one(pulumi_mocks, kind: str, component: str = "serve") -> dict:
    (found,) = [obj for obj in _serving_objects(pulumi_mocks) if obj["kind"] == kind
                and obj["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return found


def _validate(obj: dict) -> None:
    schema = SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if schema is not None:
        jsonschema.validate(obj, schema)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


CASES = {
    "defaults": ({}, {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "PodMonitor", "ScaledObject"}),
    "everything": ({"serving": FULL_SERVING}, {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget",
                                               "PodMonitor", "ScaledObject"}),
    "fixed-size": ({"serving": {**SERVING, "autoscaling": False}},
                   {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "PodMonitor"}),
    "own-prometheus": ({"monitoring": False, "serving": {**SERVING, "prometheusUrl": "http://prom.obs.svc:9090"}},
                       {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "ScaledObject"}),
}


@pytest.mark.parametrize(("overrides", "kinds"), CASES.values(), ids=CASES.keys())
def test_every_serving_object_validates(pulumi_mocks, overrides, kinds):
    _declare(pulumi_mocks, **overrides)
    objects = _serving_objects(pulumi_mocks)
    assert {obj["kind"] for obj in objects} == kinds
    for obj in objects:
        _validate(obj)
        if obj["kind"] == "ScaledObject":
            # What KEDA makes of it is a plain HPA: check that one with the Kubernetes schema too.
            kubernetes_validate.validate(manifests.keda_hpa(obj), KUBERNETES_VERSION, strict=True)


def test_crd_schemas_catch_a_misspelled_field():
    config = parse_config({**K8S_VALUES, "serving": SERVING})
    scaled = manifests.scaled_object(config)
    scaled["spec"]["maxReplicas"] = scaled["spec"].pop("maxReplicaCount")
    with pytest.raises(jsonschema.ValidationError):
        _validate(scaled)
    scaled = manifests.scaled_object(config)
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 8  # KEDA wants a string
    with pytest.raises(jsonschema.ValidationError):
        _validate(scaled)
    monitor = manifests.pod_monitor(config)
    monitor["spec"]["podMetricsEndpoints"][0]["targetPort"] = "http"
    with pytest.raises(jsonschema.ValidationError):
        _validate(monitor)


def test_deployment_runs_serve_with_one_gpu_and_the_routes_as_probes(pulumi_mocks):
    _declare(pulumi_mocks)
    deployment = _one(pulumi_mocks, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == K8S_VALUES["image"]
    assert container["args"][:3] == ["serve", "--config", "/etc/sd3cluster/serve/serve.yaml"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert container["ports"] == [{"name": "http", "containerPort": 5000, "protocol": "TCP"}]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert "replicas" not in deployment["spec"]  # the HPA that KEDA makes owns the count
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_weights_claim_is_mounted_read_only_and_the_config_map_is_the_serve_config(pulumi_mocks):
    _declare(pulumi_mocks)
    pod = _one(pulumi_mocks, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert volumes["weights"]["persistentVolumeClaim"] == {"claimName": "sd3-train-shared", "readOnly": True}
    assert mounts["weights"] == {"name": "weights", "mountPath": "/weights", "readOnly": True}
    config_map = _one(pulumi_mocks, "ConfigMap", "serve-config")
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert mounts["config"]["mountPath"] == "/etc/sd3cluster/serve"
    serve = yaml.safe_load(config_map["data"]["serve.yaml"])["serve"]
    assert serve == {"host": "0.0.0.0", "port": 5000, "device": "cuda", "pretrained": "/weights/models/sd3-medium"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"/home/sd3", "/tmp"} <= {m["mountPath"] for m in container["volumeMounts"]}


@pytest.mark.parametrize(("settings", "pre_stop", "at_least"), [({}, 10, 10 + 5 + 600), (
    {"drain_timeout_s": 120, "drain_grace_s": 10}, 15, 15 + 10 + 120)])
def test_termination_grace_covers_prestop_and_the_whole_drain(pulumi_mocks, settings, pre_stop, at_least):
    _declare(pulumi_mocks, serving={**SERVING, "preStopS": pre_stop, "settings": settings})
    pod = _one(pulumi_mocks, "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", str(pre_stop)]}}
    assert at_least < pod["terminationGracePeriodSeconds"] <= at_least + 30


def test_a_changed_serve_config_rolls_the_pods():
    first = parse_config({**K8S_VALUES, "serving": SERVING})
    second = parse_config({**K8S_VALUES, "serving": {**SERVING, "settings": {"max_batch": 8}}})
    annotation = "sd3-cluster/serve-config"
    assert (manifests.serve_pod_template(first)["metadata"]["annotations"][annotation]
            != manifests.serve_pod_template(second)["metadata"]["annotations"][annotation])


def test_service_and_budget_select_the_serving_pods(pulumi_mocks):
    _declare(pulumi_mocks, serving=FULL_SERVING)
    template = _one(pulumi_mocks, "Deployment")["spec"]["template"]
    service = _one(pulumi_mocks, "Service")
    assert service["spec"]["selector"] == template["metadata"]["labels"]
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    budget = _one(pulumi_mocks, "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"] == template["metadata"]["labels"]
    monitor = _one(pulumi_mocks, "PodMonitor", "serve-metrics")
    assert monitor["spec"]["selector"]["matchLabels"] == template["metadata"]["labels"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"


def test_autoscaling_on_queue_depth(pulumi_mocks):
    _, outputs = _declare(pulumi_mocks, serving=FULL_SERVING)
    scaled = _one(pulumi_mocks, "ScaledObject", "autoscaling")
    spec = scaled["spec"]
    deployment = _one(pulumi_mocks, "Deployment")
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                      "name": deployment["metadata"]["name"]}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 12)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["query"] == 'sum(sd3_serve_queue_depth{namespace="sd3",container="sd3-serve"})'
    assert trigger["metadata"]["threshold"] == "6"
    assert trigger["metadata"]["serverAddress"] == "http://kube-prometheus-stack-prometheus.monitoring.svc:9090"
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] \
        == 300
    releases = {r.inputs["chart"] for r in pulumi_mocks.of_type(RELEASE)}
    assert "keda" in releases
    assert outputs["serving_url"] == "http://sd3-serve.sd3.svc:8080"


def test_fixed_size_serving_installs_no_keda(pulumi_mocks):
    _declare(pulumi_mocks, serving={**SERVING, "autoscaling": False, "minReplicas": 3, "maxReplicas": 3})
    assert _one(pulumi_mocks, "Deployment")["spec"]["replicas"] == 3
    assert "keda" not in {r.inputs["chart"] for r in pulumi_mocks.of_type(RELEASE)}


def test_cpu_workers_run_on_the_cpu_pool_and_gpu_pods_on_the_gpu_pool(pulumi_mocks):
    _declare(pulumi_mocks, serving=FULL_SERVING)
    gpu_pod = _one(pulumi_mocks, "Deployment")["spec"]["template"]["spec"]
    assert gpu_pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "g6e.xlarge"}
    assert {"key": "pool", "operator": "Equal", "value": "inference", "effect": "NoSchedule"} in gpu_pod["tolerations"]
    workers = _one(pulumi_mocks, "Deployment", "serve-cpu")
    assert workers["spec"]["replicas"] == 3
    pod = workers["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"] == ["serve", "--device", "cpu"]
    assert not any("nvidia.com/gpu" in part for part in container["resources"].values())
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == [{"key": "pool", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}]
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "nvidia.com/gpu.present", "operator": "DoesNotExist"}]
    service = _one(pulumi_mocks, "Service", "serve-cpu")
    assert service["spec"]["selector"] == workers["spec"]["template"]["metadata"]["labels"]


def test_serving_components_parent_their_resources(pulumi_mocks):
    _declare(pulumi_mocks)
    components = {r.typ for r in pulumi_mocks.resources if not r.custom}
    assert {"sd3cluster:k8s:Serving", "sd3cluster:k8s:Autoscaler"} <= components


BAD_SERVING = [
    ({"pretrained": None}, "serving.pretrained is missing"),
    ({"pretrained": "models/x"}, "give an absolute path"),
    ({"pretrained": "/shared/models/x"}, "outside the weights volume mounted at /weights"),
    ({"minReplicas": 0}, "serving.minReplicas is 0"),
    ({"minReplicas": 5, "maxReplicas": 2}, "need 1 <= minReplicas <= maxReplicas"),
    ({"maxReplicas": "many"}, "serving.maxReplicas is 'many', not a whole number"),
    ({"targetQueueDepth": 0}, "serving.targetQueueDepth is 0"),
    ({"preStopS": 600}, "serving.preStopS is 600"),
    ({"serviceType": "Ingress"}, "serving.serviceType is 'Ingress'"),
    ({"autoscaling": "maybe"}, "use true or false"),
    ({"name": "SD3_Serve"}, "serving.name is 'SD3_Serve'"),
    ({"minReplica": 2}, "'minReplica' (did you mean 'minReplicas'?)"),
    ({"gpuNodeSelector": ["a"]}, "serving.gpuNodeSelector must be a map"),
    ({"gpuTolerations": [{"key": "a", "operater": "Exists"}]}, "'operater' (did you mean 'operator'?)"),
    ({"cpuTolerations": [{"key": "a", "effect": "NoExec"}]}, "effect is 'NoExec'"),
    ({"settings": {"max_bacth": 8}}, "'max_bacth' (did you mean 'max_batch'?)"),
    ({"settings": {"max_batch": "8"}}, "serving.settings.max_batch is '8': give a int"),
    ({"settings": {"compile": 1}}, "serving.settings.compile is 1: give a bool"),
    ({"settings": {"port": 8000}}, "serving.settings.port is set by the stack"),
    ({"settings": {"drain_timeout_s": 0}}, "drain_timeout_s is 0: give more than 0"),
    ({"settings": {"drain_grace_s": -1}}, "drain_grace_s is -1: give 0 or more"),
    ({"settings": {"max_batch": 100}}, "serving.settings.max_batch is 100: give 1 to 64"),
    ({"settings": {"png_compress_level": 12}}, "serving.settings.png_compress_level is 12: give 0 to 9"),
    ({"settings": {"dtype": "int8"}}, "serving.settings.dtype is 'int8': use auto, bf16, fp16, fp32"),
    ({"settings": {"step": "newest"}}, "serving.settings.step is 'newest': give a step number or latest"),
    ({"settings": {"job_prefix": "pod 1/gpu"}}, "serving.settings.job_prefix is 'pod 1/gpu'"),
    ({"cpuWorkers": {"replicas": 2}}, "serving.cpuWorkers.args is missing"),
    ({"cpuWorkers": {"args": ["x"], "port": 80}}, "serving.cpuWorkers.port is 80"),
    ({"cpuWorkers": {"args": ["x"], "replica": 2}}, "'replica' (did you mean 'replicas'?)"),
    ({"cpu": "lots"}, "serving.cpu is 'lots': give cores"),
    ({"prometheusUrl": "prometheus:9090"}, "serving.prometheusUrl is 'prometheus:9090': give the URL"),
    ({"cpuWorkers": {"args": ["x"], "cpu": "2 cores"}}, "serving.cpuWorkers.cpu is '2 cores'"),
    ({"cpuWorkers": {"args": ["x"], "image": "my image"}}, "serving.cpuWorkers.image is 'my image'"),
    ({"settings": {"lora_scale": "strong"}}, "serving.settings.lora_scale is 'strong'"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_SERVING, ids=[m for _, m in BAD_SERVING])
def test_bad_serving_settings_are_refused_before_any_resource(pulumi_mocks, overrides, message):
    serving = {key: value for key, value in {**SERVING, **overrides}.items() if value is not None}
    with pytest.raises(ConfigError) as caught:
        build(parse_config({**K8S_VALUES, "serving": serving}))
    assert message in str(caught.value)
    assert str(caught.value).startswith("sd3-cluster-k8s:")
    assert pulumi_mocks.resources == []


def test_autoscaling_without_monitoring_needs_a_prometheus():
    with pytest.raises(ConfigError, match=r"serving\.prometheusUrl is ''"):
        parse_config({**K8S_VALUES, "monitoring": False, "serving": SERVING})


def test_misspelled_stack_key_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown keys: 'servng' \(did you mean 'serving'\?\)"):
        parse_config({**K8S_VALUES, "servng": SERVING})


def test_load_config_refuses_a_key_set_in_the_stack_but_unknown(pulumi_mocks):
    """What `pulumi up` reads: every key of the project's namespace (Pulumi.yaml's name), not only the known ones."""
    project = "sd3-cluster-k8s"
    saved = dict(pulumi.runtime.config.CONFIG.get())
    try:
        pulumi.runtime.set_all_config({f"{project}:image": "registry.example.com/sd3cluster:0.1.0",
                                       f"{project}:storageClassName": "efs-sc",
                                       f"{project}:gpusPerNodes": "4",
                                       "kubernetes:context": "other-project-keys-are-not-ours"})
        with pytest.raises(ConfigError, match=r"'gpusPerNodes' \(did you mean 'gpusPerNode'\?\)"):
            load_config()
        pulumi.runtime.set_all_config({f"{project}:image": "registry.example.com/sd3cluster:0.1.0",
                                       f"{project}:storageClassName": "efs-sc",
                                       f"{project}:serving": '{"pretrained": "/weights/m", "maxReplicas": 3}'})
        config = load_config()
        assert config.serving is not None and config.serving.max_replicas == 3
    finally:
        pulumi.runtime.set_all_config(saved)


def test_serve_settings_are_those_of_the_serve_command():
    """The stack's list of `serve:` keys against the package's own config (this repository's workloads/src)."""
    code = "import json; from sd3cluster.config import ServeConfig; print(json.dumps(list(ServeConfig.model_fields)))"
    env = {**os.environ, "PYTHONPATH": str(REPO / "workloads" / "src")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                            check=True)
    assert set(json.loads(result.stdout)) == set(SERVE_SETTINGS) | set(STACK_OWNED_SETTINGS)


def test_serve_setting_ranges_are_those_of_the_serve_command():
    """The stack's copy of serve's ranges against ServeConfig's own bounds (this repository's workloads/src)."""
    from sd3_k8s.serving_config import SERVE_RANGES

    # Numeric bounds only (annotated_types' Ge/Gt/Le/Lt); other metadata (a text pattern, a length) is not a range.
    code = ("import json; from sd3cluster.config import ServeConfig; b = {n: {type(m).__name__: "
            "getattr(m, type(m).__name__.lower()) for m in f.metadata if type(m).__name__ in ('Ge', 'Gt', 'Le', 'Lt')}"
            " for n, f in ServeConfig.model_fields.items()}; print(json.dumps({n: v for n, v in b.items() if v}))")
    env = {**os.environ, "PYTHONPATH": str(REPO / "workloads" / "src")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                            check=True)
    bounds = {name: b for name, b in json.loads(result.stdout).items() if name not in STACK_OWNED_SETTINGS}
    assert set(bounds) == set(SERVE_RANGES)
    for name, b in bounds.items():
        low = b.get("Ge", b.get("Gt"))
        assert SERVE_RANGES[name] == (low, b.get("Le"), "Gt" in b), name


def test_the_example_stack_sets_every_key_and_is_valid():
    """Pulumi.example.yaml is the settings' manual: it shows every key, and what it shows is accepted."""
    from sd3_k8s.config import CONFIG_KEYS
    from sd3_k8s.serving_config import CPU_WORKER_KEYS, SERVING_KEYS

    example = yaml.safe_load((REPO / "pulumi" / "k8s" / "Pulumi.example.yaml").read_text())["config"]
    values = {name.split(":", 1)[1]: value for name, value in example.items() if name.startswith("sd3-cluster-k8s:")}
    assert set(values) == set(CONFIG_KEYS)
    assert set(values["serving"]) == set(SERVING_KEYS)
    assert set(values["serving"]["cpuWorkers"]) == set(CPU_WORKER_KEYS)
    config = parse_config(values)
    assert config.serving is not None and config.serving.cpu_workers is not None


def _load(settings: dict[str, str]) -> K8sStackConfig:
    """load_config() as `pulumi up` runs it, on these stack settings (namespace sd3-cluster-k8s)."""
    saved = dict(pulumi.runtime.config.CONFIG.get())
    try:
        pulumi.runtime.set_all_config({"sd3-cluster-k8s:image": "registry.example.com/sd3cluster:0.1.0",
                                       "sd3-cluster-k8s:storageClassName": "efs-sc", **settings})
        return load_config()
    finally:
        pulumi.runtime.set_all_config(saved)


def test_unknown_key_lists_the_known_keys_closest_first():
    from sd3_k8s.config import CONFIG_KEYS

    with pytest.raises(ConfigError) as caught:
        _load({"sd3-cluster-k8s:monitorin": "false"})
    listed = str(caught.value).split("closest first: ", 1)[1].split(", ")
    assert listed[0] == "monitoring" and set(listed) == set(CONFIG_KEYS)


@pytest.mark.parametrize(("settings", "message"), [
    ({"sd3-cluster-k8s:serving": "/weights/models/sd3-medium"},
     "sd3-cluster-k8s:serving is '/weights/models/sd3-medium', plain text, but it is a map: "
     "`pulumi config set --path serving.pretrained /weights/models/sd3-medium`"),
    ({"sd3-cluster-k8s:nodeSelector": "pool=gpu"},
     "sd3-cluster-k8s:nodeSelector is 'pool=gpu', plain text, but it is a map of node labels"),
    ({"sd3-cluster-k8s:serving": '{"pretrained": "/weights/m"'}, "sd3-cluster-k8s:serving is '{\"pretrained\""),
])
def test_plain_text_for_a_map_is_explained(pulumi_mocks, settings, message):
    with pytest.raises(ConfigError) as caught:
        _load(settings)
    assert not isinstance(caught.value, pulumi.ConfigTypeError)
    assert message in str(caught.value)
    # __main__ turns ConfigError into a RunError `from None`: no cause here may bring a traceback back.
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert pulumi_mocks.resources == []
