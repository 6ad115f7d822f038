"""pulumi/k8s under mocks: every object validates against the Kubernetes schema; the job is what training needs."""

from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pulumi
import pytest
import yaml
from sd3_crd_schemas import VOLCANO_JOB as VOLCANO_JOB_SCHEMA
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


RDMA_SHARED = {"rdmaResource": "rdma/rdma_shared_device_a", "rdmaInterfaces": ["ens8f0np0", "ens9f0np0"]}


@pytest.mark.parametrize(("overrides", "kinds"), [
    ({}, ["ConfigMap", "Job", "Namespace", "PersistentVolumeClaim", "Service"]),
    ({"rdmaResource": "vpc.amazonaws.com/efa", "rdmaPerNode": 32, "cpuPerNode": "90", "memoryGiPerNode": 1000,
      "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"}},
     ["ConfigMap", "Job", "Namespace", "PersistentVolumeClaim", "Service"]),
    (RDMA_SHARED, ["ConfigMap", "ConfigMap", "DaemonSet", "Job", "Namespace", "PersistentVolumeClaim", "Service"]),
])
def test_every_object_validates_against_the_kubernetes_schema(pulumi_mocks, overrides, kinds):
    _declare(pulumi_mocks, **overrides)
    objects = _objects(pulumi_mocks)
    assert sorted(obj["kind"] for obj in objects) == kinds
    for obj in objects:
        if obj["apiVersion"] == manifests.VOLCANO_JOB_API:
            # Volcano's own fields against the schema vendored from its CRD, the Pods it makes against Kubernetes'.
            jsonschema.validate(obj, VOLCANO_JOB_SCHEMA)
            pods = manifests.task_pods(obj)
            assert len(pods) == 3
            for pod in pods:
                kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("breakage", [
    lambda job: job["spec"].update(minAvaliable=2),  # misspelled
    lambda job: job["spec"]["tasks"][0].update(replica=2),
    lambda job: job["spec"]["policies"].append({"event": "PodFailed", "action": "RestartJobs"}),
    lambda job: job["spec"]["plugins"].update(sshd=[]),
])
def test_volcano_schema_catches_a_broken_job(breakage):
    job = manifests.training_job(parse_config(K8S_VALUES))
    jsonschema.validate(job, VOLCANO_JOB_SCHEMA)
    breakage(job)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(job, VOLCANO_JOB_SCHEMA)


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
    _declare(pulumi_mocks)
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
    assert args[-5:] == ["--no-python", "sd3cluster", "train", "--config", "/etc/sd3cluster/train/train.yaml"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # restarted workers must not read stale addresses


# Who reads each variable the trainer gets: nothing is set that nothing reads.
ENV_READERS = {"NCCL_DEBUG": "NCCL", "OMP_NUM_THREADS": "PyTorch", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "torchrun",
               "FI_PROVIDER": "libfabric", "FI_EFA_USE_DEVICE_RDMA": "libfabric"}


@pytest.mark.parametrize("overrides", [{}, {"rdmaResource": "vpc.amazonaws.com/efa", "rdmaPerNode": 32}])
def test_every_environment_variable_has_a_reader(pulumi_mocks, overrides):
    _declare(pulumi_mocks, **overrides)
    (container,) = _job(pulumi_mocks)["spec"]["tasks"][0]["template"]["spec"]["containers"]
    names = [e["name"] for e in container["env"]]
    assert set(names) <= set(ENV_READERS) and "SD3_SHARED_DIR" not in names and "POD_NAME" not in names


def test_the_train_config_is_a_config_map_the_pods_mount(pulumi_mocks):
    _, outputs = _declare(pulumi_mocks, train={"model": {"preset": "sd3-medium"}, "train": {"steps": 500},
                                               "checkpoint": {"every": 100}})
    (config_map,) = [r for r in pulumi_mocks.of_type("kubernetes:core/v1:ConfigMap")]
    assert config_map.inputs["metadata"]["name"] == outputs["train_config"] == "sd3-train-config"
    settings = yaml.safe_load(config_map.inputs["data"]["train.yaml"])
    # Checkpoints and the run (metrics, TensorBoard under output.dir) land on the shared claim, per job.
    assert settings == {"model": {"preset": "sd3-medium"}, "train": {"steps": 500},
                        "checkpoint": {"every": 100, "dir": "/shared/checkpoints/sd3-train"},
                        "output": {"dir": "/shared/runs/sd3-train"}}
    assert (outputs["checkpoints"], outputs["runs"]) == ("/shared/checkpoints/sd3-train", "/shared/runs/sd3-train")
    template = _job(pulumi_mocks)["spec"]["tasks"][0]["template"]["spec"]
    volumes = {v["name"]: v for v in template["volumes"]}
    (container,) = template["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert volumes["train-config"]["configMap"]["name"] == "sd3-train-config"
    assert mounts["train-config"] == {"name": "train-config", "mountPath": "/etc/sd3cluster/train", "readOnly": True}
    assert mounts["shared"]["mountPath"] == "/shared"


def test_the_train_config_is_one_sd3cluster_reads(tmp_path):
    """The rendered file goes through sd3cluster's own config reader (the one `sd3cluster train` uses)."""
    config_module = pytest.importorskip("sd3cluster.config", reason="sd3cluster: PYTHONPATH=workloads/src")
    config = parse_config({**K8S_VALUES, "train": {"model": {"preset": "tiny"}, "train": {"steps": 7}}})
    path = tmp_path / "train.yaml"
    path.write_text(manifests.train_config_text(config))
    loaded = config_module.load_config(path)
    assert loaded.train.steps == 7
    assert str(loaded.checkpoint.dir) == "/shared/checkpoints/sd3-train"
    assert str(loaded.output.dir) == "/shared/runs/sd3-train"


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
    # AWS's EFA device plugin advertises the resource, on the training nodes, before the job is declared.
    plugin = _releases(pulumi_mocks)["aws-efa-k8s-device-plugin"]
    assert plugin["repositoryOpts"]["repo"] == "https://aws.github.io/eks-charts"
    assert plugin["values"]["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_rdma_shared_device_plugin_advertises_the_resource(pulumi_mocks):
    _declare(pulumi_mocks, **RDMA_SHARED)
    (container,) = _job(pulumi_mocks)["spec"]["tasks"][0]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
    (daemon_set,) = pulumi_mocks.of_type("kubernetes:apps/v1:DaemonSet")
    plugin_maps = [r for r in pulumi_mocks.of_type("kubernetes:core/v1:ConfigMap")
                   if r.inputs["metadata"]["namespace"] == "kube-system"]
    (plugin_map,) = plugin_maps
    plugin_config = json.loads(plugin_map.inputs["data"]["config.json"])
    (resource,) = plugin_config["configList"]
    # The plugin registers rdma/<resourceName>: the name the pods ask for.
    assert "rdma/" + resource["resourceName"] == "rdma/rdma_shared_device_a"
    assert resource["selectors"] == {"ifNames": ["ens8f0np0", "ens9f0np0"]}
    volumes = {v["name"]: v for v in daemon_set.inputs["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == plugin_map.inputs["metadata"]["name"]
    assert volumes["device-plugin"]["hostPath"]["path"] == "/var/lib/kubelet/device-plugins"


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
    ({"train": {"optimiser": {"lr": 1}}}, "train has optimiser, not a section of the train config"),
    ({"train": {"model": "sd3-medium"}}, "train.model is 'sd3-medium', not a map"),
    ({"train": {"checkpoint": {"dir": "/tmp/ckpt"}}}, "train.checkpoint.dir is set, but the stack puts it"),
    ({"rdmaResource": "nvidia.com/hostdev"}, "rdmaResource is 'nvidia.com/hostdev': the stack declares"),
    ({"rdmaResource": "rdma/hca"}, "rdmaInterfaces is '[]'"),
    ({"rdmaResource": "vpc.amazonaws.com/efa", "rdmaInterfaces": ["eth0"]}, "finds the EFA devices itself"),
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
