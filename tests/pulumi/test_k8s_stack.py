"""pulumi/k8s under mocks: every object validates against the Kubernetes schema; the job is what training needs."""

from __future__ import annotations

import kubernetes_validate
import pulumi
import pytest
from sd3_k8s import manifests
from sd3_k8s.config import ConfigError, parse_config
from sd3_k8s.stack import build
from sd3_pulumi_testing import K8S_VALUES, declare, integral

KUBERNETES_VERSION = kubernetes_validate.latest_version()
RELEASE = "kubernetes:helm.sh/v3:Release"
VOLCANO_JOB = "kubernetes:batch.volcano.sh/v1alpha1:Job"


def _declare(pulumi_mocks, **overrides):
    config = parse_config({**K8S_VALUES, **overrides})
    outputs = declare(lambda: pulumi.Output.all(**build(config)))
    return config, outputs


def _objects(pulumi_mocks) -> list[dict]:
    """What the program declared as Kubernetes objects (Helm releases are Pulumi resources, not objects)."""
    return [integral(r.inputs) for r in pulumi_mocks.resources
            if r.custom and r.typ.startswith("kubernetes:") and r.typ != RELEASE]


def _job(pulumi_mocks) -> dict:
    (job,) = pulumi_mocks.of_type(VOLCANO_JOB)
    return integral(job.inputs)


@pytest.mark.parametrize("overrides", [{}, {"rdmaResource": "vpc.amazonaws.com/efa", "rdmaPerNode": 32,
                                            "cpuPerNode": "90", "memoryGiPerNode": 1000,
                                            "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"}}])
def test_every_object_validates_against_the_kubernetes_schema(pulumi_mocks, overrides):
    _declare(pulumi_mocks, **overrides)
    objects = _objects(pulumi_mocks)
    kinds = sorted(obj["kind"] for obj in objects)
    assert kinds == ["Job", "Namespace", "PersistentVolumeClaim", "Service"]
    for obj in objects:
        if obj["apiVersion"] == manifests.VOLCANO_JOB_API:
            # A custom resource: the schema has no Volcano types, so check the Pods it makes.
            pods = manifests.task_pods(obj)
            assert len(pods) == 3
            for pod in pods:
                kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_schema_check_catches_a_broken_object():
    broken = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"ports": [{"port": "web"}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_job_is_gang_scheduled_on_all_pods(pulumi_mocks):
    _declare(pulumi_mocks, nodes=4)
    spec = _job(pulumi_mocks)["spec"]
    assert spec["schedulerName"] == "volcano"
    assert spec["minAvailable"] == 4
    (task,) = spec["tasks"]
    assert task["replicas"] == 4 and task["minAvailable"] == 4
    assert {"event": "PodFailed", "action": "RestartJob"} in spec["policies"]


def test_pods_request_gpus_and_mount_the_shared_claim(pulumi_mocks):
    _declare(pulumi_mocks, gpusPerNode=4)
    (claim,) = pulumi_mocks.of_type("kubernetes:core/v1:PersistentVolumeClaim")
    assert claim.inputs["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim.inputs["spec"]["storageClassName"] == "efs-sc"
    pod = _job(pulumi_mocks)["spec"]["tasks"][0]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 4
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes["shared"]["persistentVolumeClaim"]["claimName"] == claim.inputs["metadata"]["name"]
    assert mounts["shared"] == "/shared"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert mounts["dshm"] == "/dev/shm"


def test_every_pod_runs_torchrun_with_rendezvous_on_the_headless_service(pulumi_mocks):
    _declare(pulumi_mocks, trainConfig="/shared/configs/sd3-medium.yaml")
    (service,) = pulumi_mocks.of_type("kubernetes:core/v1:Service")
    assert service.inputs["spec"]["clusterIP"] == "None"
    assert service.inputs["spec"]["publishNotReadyAddresses"] is True
    template = _job(pulumi_mocks)["spec"]["tasks"][0]["template"]
    assert service.inputs["spec"]["selector"] == template["metadata"]["labels"]
    assert template["spec"]["subdomain"] == service.inputs["metadata"]["name"]
    (container,) = template["spec"]["containers"]
    assert container["command"] == ["torchrun"]
    args = container["args"]
    assert "--nnodes=3" in args and "--nproc-per-node=8" in args and "--rdzv-backend=c10d" in args
    assert "--rdzv-endpoint=sd3-train-worker-0.sd3-train-rdzv.sd3.svc:29400" in args
    assert args[-5:] == ["--no-python", "sd3cluster", "train", "--config", "/shared/configs/sd3-medium.yaml"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # restarted workers must not read stale addresses


def test_rdma_is_optional(pulumi_mocks):
    _declare(pulumi_mocks)
    (container,) = _job(pulumi_mocks)["spec"]["tasks"][0]["template"]["spec"]["containers"]
    assert set(container["resources"]["limits"]) == {"nvidia.com/gpu"}
    assert "securityContext" not in container


def test_rdma_resources(pulumi_mocks):
    _declare(pulumi_mocks, rdmaResource="vpc.amazonaws.com/efa", rdmaPerNode=32)
    (container,) = _job(pulumi_mocks)["spec"]["tasks"][0]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["vpc.amazonaws.com/efa"] == 32
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert {"name": "FI_PROVIDER", "value": "efa"} in container["env"]


def _releases(pulumi_mocks) -> dict[str, dict]:
    return {r.inputs["chart"]: integral(r.inputs) for r in pulumi_mocks.of_type(RELEASE)}


def test_helm_releases(pulumi_mocks):
    _declare(pulumi_mocks)
    releases = _releases(pulumi_mocks)
    assert set(releases) == {"gpu-operator", "volcano", "dcgm-exporter", "kube-prometheus-stack"}
    assert all(r["version"] and r["repositoryOpts"]["repo"].startswith("https://") for r in releases.values())
    operator = releases["gpu-operator"]["values"]
    assert operator["driver"]["enabled"] is True and operator["toolkit"]["enabled"] is True
    assert operator["dcgmExporter"]["enabled"] is False  # the monitoring layer brings its own
    assert releases["dcgm-exporter"]["values"]["serviceMonitor"]["enabled"] is True


def test_gpu_operator_driver_and_toolkit_switch_off(pulumi_mocks):
    _declare(pulumi_mocks, gpuOperatorDriver="false", gpuOperatorToolkit=False)
    operator = _releases(pulumi_mocks)["gpu-operator"]["values"]
    assert operator["driver"]["enabled"] is False and operator["toolkit"]["enabled"] is False


def test_optional_layers(pulumi_mocks):
    _, outputs = _declare(pulumi_mocks, gpuOperator=False, monitoring=False)
    assert set(_releases(pulumi_mocks)) == {"volcano"}
    assert "grafana" not in outputs and outputs["gpus"] == 24


def test_components_parent_their_resources(pulumi_mocks):
    _declare(pulumi_mocks)
    components = {r.typ for r in pulumi_mocks.resources if not r.custom}
    assert components == {"sd3cluster:k8s:GpuOperator", "sd3cluster:k8s:BatchScheduler", "sd3cluster:k8s:SharedVolume",
                          "sd3cluster:k8s:TrainingJob", "sd3cluster:k8s:Monitoring"}


BAD_CONFIGS = [
    ({"nodes": 0}, "nodes is 0"),
    ({"gpusPerNode": 0}, "gpusPerNode is 0"),
    ({"image": ""}, "image is missing"),
    ({"storageClassName": None}, "storageClassName is missing"),
    ({"namespace": "SD3"}, "namespace is 'SD3'"),
    ({"trainConfig": "train.yaml"}, "give an absolute path"),
    ({"rdmaResource": "efa devices"}, "rdmaResource is 'efa devices'"),
    ({"rdmaPerNode": 2}, "rdmaPerNode is set but"),
    ({"memoryGiPerNode": 32, "shmGi": 64}, "raise the memory or lower shmGi"),
    ({"rendezvousPort": 80}, "rendezvousPort is 80"),
    ({"gpuOperatorDriver": "yes"}, "use true or false"),
    # Values that were taken as they came, and failed (if at all) in the cluster, long after `pulumi up`.
    ({"cpuPerNode": "eight"}, "cpuPerNode is 'eight': give cores (8, 0.5) or millicores"),
    ({"maxRetry": -1}, "maxRetry is -1: use 0 to 100 whole-job restarts"),
    ({"maxRetry": "often"}, "maxRetry is 'often', not a whole number"),
    ({"volcanoVersion": "latest"}, "volcanoVersion is 'latest': give a chart version"),
    ({"queue": "My Queue"}, "queue is 'My Queue': give the name of a Volcano queue"),
    ({"storageClassName": "EFS SC"}, "storageClassName is 'EFS SC'"),
    ({"nodeSelector": {"pool": ["a", "b"]}}, "nodeSelector.pool is [\"a\", \"b\"]: each value of the map"),
    ({"nodes": 2.5}, "nodes is '2.5', not a whole number"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_config_is_refused_before_any_resource(pulumi_mocks, overrides, message):
    values = {key: value for key, value in {**K8S_VALUES, **overrides}.items() if value is not None}
    with pytest.raises(ConfigError) as caught:
        build(parse_config(values))
    assert message in str(caught.value)
    assert str(caught.value).startswith("sd3-cluster-k8s:")
    assert pulumi_mocks.resources == []
