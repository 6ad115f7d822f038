"""One ComponentResource per layer of the training stack."""

from __future__ import annotations

import pulumi
import pulumi_kubernetes as k8s

from . import charts, manifests, serving
from .config import K8sStackConfig


def _release(name: str, chart: charts.Chart, version: str, values: dict, parent: pulumi.Resource,
             depends_on: list[pulumi.Resource] | None = None) -> k8s.helm.v3.Release:
    return k8s.helm.v3.Release(
        name,
        name=chart.release,
        chart=chart.chart,
        version=version,
        repository_opts=k8s.helm.v3.RepositoryOptsArgs(repo=chart.repo),
        namespace=chart.namespace,
        create_namespace=True,
        values=values,
        # Operators' webhooks and CRDs must be in place before anything that uses them is created.
        atomic=True,
        timeout=900,
        opts=pulumi.ResourceOptions(parent=parent, depends_on=depends_on or []),
    )


class GpuOperator(pulumi.ComponentResource):
    """NVIDIA GPU Operator: device plugin (nvidia.com/gpu), and optionally the driver and container toolkit."""

    def __init__(self, name: str, config: K8sStackConfig, opts: pulumi.ResourceOptions | None = None):
        super().__init__("sd3cluster:k8s:GpuOperator", name, None, opts)
        self.release = _release(f"{name}-release", charts.GPU_OPERATOR, config.charts.gpu_operator,
                                charts.gpu_operator_values(config), self)
        self.register_outputs({"status": self.release.status})


class BatchScheduler(pulumi.ComponentResource):
    """Volcano: the scheduler and controllers that run gang-scheduled Jobs (batch.volcano.sh)."""

    def __init__(self, name: str, config: K8sStackConfig, opts: pulumi.ResourceOptions | None = None):
        super().__init__("sd3cluster:k8s:BatchScheduler", name, None, opts)
        self.release = _release(f"{name}-release", charts.VOLCANO, config.charts.volcano,
                                charts.volcano_values(config), self)
        self.register_outputs({"status": self.release.status})


class SharedVolume(pulumi.ComponentResource):
    """The ReadWriteMany claim every training pod mounts."""

    def __init__(self, name: str, config: K8sStackConfig, namespace: k8s.core.v1.Namespace,
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("sd3cluster:k8s:SharedVolume", name, None, opts)
        manifest = manifests.shared_claim(config)
        self.claim = k8s.core.v1.PersistentVolumeClaim(
            f"{name}-claim", metadata=manifest["metadata"], spec=manifest["spec"],
            # RWX volumes are often bound only when a pod uses them: do not wait for Bound here.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[namespace]))
        self.claim_name = manifest["metadata"]["name"]
        self.register_outputs({"claim_name": self.claim_name})


class RdmaDevicePlugin(pulumi.ComponentResource):
    """What advertises rdmaResource to the scheduler: AWS's EFA device plugin (vpc.amazonaws.com/efa) or the
    RDMA shared device plugin (rdma/<name>); without it the gang would wait Pending for a resource no node has."""

    def __init__(self, name: str, config: K8sStackConfig, opts: pulumi.ResourceOptions | None = None):
        super().__init__("sd3cluster:k8s:RdmaDevicePlugin", name, None, opts)
        self.ready: list[pulumi.Resource] = []
        if manifests.uses_efa_plugin(config):
            self.ready.append(_release(f"{name}-efa", charts.EFA_DEVICE_PLUGIN, config.charts.efa_device_plugin,
                                       charts.efa_device_plugin_values(config), self))
        else:
            plugin_config = manifests.rdma_plugin_config_map(config)
            config_map = k8s.core.v1.ConfigMap(f"{name}-config", metadata=plugin_config["metadata"],
                                               data=plugin_config["data"], opts=pulumi.ResourceOptions(parent=self))
            daemon_set = manifests.rdma_plugin_daemon_set(config)
            self.ready.append(k8s.apps.v1.DaemonSet(
                f"{name}-daemonset", metadata=daemon_set["metadata"], spec=daemon_set["spec"],
                opts=pulumi.ResourceOptions(parent=self, depends_on=[config_map])))
        self.register_outputs({"resource": config.rdma_resource})


class TrainingJob(pulumi.ComponentResource):
    """The multi-node SD3 training run: its config, the headless rendezvous Service and the Volcano Job."""

    def __init__(self, name: str, config: K8sStackConfig, namespace: k8s.core.v1.Namespace,
                 depends_on: list[pulumi.Resource], opts: pulumi.ResourceOptions | None = None):
        super().__init__("sd3cluster:k8s:TrainingJob", name, None, opts)
        train_config = manifests.train_config_map(config)
        self.config_map = k8s.core.v1.ConfigMap(
            f"{name}-config", metadata=train_config["metadata"], data=train_config["data"],
            opts=pulumi.ResourceOptions(parent=self, depends_on=[namespace]))
        service = manifests.rendezvous_service(config)
        self.service = k8s.core.v1.Service(
            f"{name}-rdzv", metadata=service["metadata"], spec=service["spec"],
            opts=pulumi.ResourceOptions(parent=self, depends_on=[namespace]))
        job = manifests.training_job(config)
        self.job = k8s.apiextensions.CustomResource(
            f"{name}-job", api_version=job["apiVersion"], kind=job["kind"], metadata=job["metadata"],
            spec=job["spec"],
            opts=pulumi.ResourceOptions(parent=self,
                                        depends_on=[namespace, self.service, self.config_map, *depends_on]))
        self.register_outputs({"job_name": config.job_name,
                               "rendezvous_endpoint": manifests.rendezvous_endpoint(config)})


class Monitoring(pulumi.ComponentResource):
    """Prometheus, Alertmanager and Grafana (kube-prometheus-stack), and NVIDIA's DCGM exporter for GPU metrics."""

    def __init__(self, name: str, config: K8sStackConfig, depends_on: list[pulumi.Resource],
                 opts: pulumi.ResourceOptions | None = None):
        super().__init__("sd3cluster:k8s:Monitoring", name, None, opts)
        self.prometheus = _release(f"{name}-prometheus", charts.KUBE_PROMETHEUS_STACK,
                                   config.charts.kube_prometheus_stack, charts.kube_prometheus_stack_values(config),
                                   self)
        # The exporter's ServiceMonitor needs the CRD that kube-prometheus-stack installs.
        self.dcgm_exporter = _release(f"{name}-dcgm-exporter", charts.DCGM_EXPORTER, config.charts.dcgm_exporter,
                                      charts.dcgm_exporter_values(config), self,
                                      depends_on=[self.prometheus, *depends_on])
        self.register_outputs({"prometheus": self.prometheus.status, "dcgm_exporter": self.dcgm_exporter.status})


class Autoscaler(pulumi.ComponentResource):
    """KEDA: scales the serving Deployment on the queue depth Prometheus reads from its pods."""

    def __init__(self, name: str, config: K8sStackConfig, opts: pulumi.ResourceOptions | None = None):
        super().__init__("sd3cluster:k8s:Autoscaler", name, None, opts)
        self.release = _release(f"{name}-release", charts.KEDA, config.charts.keda, charts.keda_values(config), self)
        self.register_outputs({"status": self.release.status})


class Serving(pulumi.ComponentResource):
    """`sd3cluster serve` on GPU nodes (one GPU a pod) behind a Service, its config, disruption budget, metrics
    scrape and autoscaling; and CPU-only pods on the CPU pool when the settings ask for them."""

    def __init__(self, name: str, config: K8sStackConfig, namespace: k8s.core.v1.Namespace,
                 depends_on: list[pulumi.Resource], autoscaler: pulumi.Resource | None = None,
                 monitoring: pulumi.Resource | None = None, opts: pulumi.ResourceOptions | None = None):
        super().__init__("sd3cluster:k8s:Serving", name, None, opts)
        settings = config.serving
        in_namespace = pulumi.ResourceOptions(parent=self, depends_on=[namespace])
        config_map = serving.serve_config_map(config)
        self.config_map = k8s.core.v1.ConfigMap(f"{name}-config", metadata=config_map["metadata"],
                                                data=config_map["data"], opts=in_namespace)
        deployment = serving.serve_deployment(config)
        self.deployment = k8s.apps.v1.Deployment(
            f"{name}-deployment", metadata=deployment["metadata"], spec=deployment["spec"],
            # Pods wait minutes for weights and warm-up: Pulumi does not wait for them to be ready. With
            # autoscaling, the replica count belongs to the HPA.
            opts=pulumi.ResourceOptions(parent=self, depends_on=[namespace, self.config_map, *depends_on],
                                        ignore_changes=["spec.replicas"] if settings.autoscaling else None))
        service = serving.serve_service(config)
        self.service = k8s.core.v1.Service(f"{name}-service", metadata=service["metadata"], spec=service["spec"],
                                           opts=in_namespace)
        budget = serving.serve_disruption_budget(config)
        self.budget = k8s.policy.v1.PodDisruptionBudget(f"{name}-pdb", metadata=budget["metadata"],
                                                        spec=budget["spec"], opts=in_namespace)
        outputs: dict[str, object] = {"service": settings.name, "url": self.url(config)}
        if monitoring is not None:
            monitor = serving.pod_monitor(config)
            self.pod_monitor = k8s.apiextensions.CustomResource(
                f"{name}-metrics", api_version=monitor["apiVersion"], kind=monitor["kind"],
                metadata=monitor["metadata"], spec=monitor["spec"],
                opts=pulumi.ResourceOptions(parent=self, depends_on=[namespace, monitoring]))
        if settings.autoscaling:
            scaled = serving.scaled_object(config)
            self.scaled_object = k8s.apiextensions.CustomResource(
                f"{name}-autoscaling", api_version=scaled["apiVersion"], kind=scaled["kind"],
                metadata=scaled["metadata"], spec=scaled["spec"],
                opts=pulumi.ResourceOptions(
                    parent=self, depends_on=[namespace, self.deployment, *([autoscaler] if autoscaler else [])]))
            outputs["autoscaling"] = serving.queue_depth_query(config)
        if settings.cpu_workers is not None:
            workers = serving.cpu_workers_deployment(config)
            self.cpu_workers = k8s.apps.v1.Deployment(f"{name}-cpu-workers", metadata=workers["metadata"],
                                                      spec=workers["spec"], opts=in_namespace)
            if settings.cpu_workers.port:
                workers_service = serving.cpu_workers_service(config)
                self.cpu_workers_service = k8s.core.v1.Service(
                    f"{name}-cpu-workers-service", metadata=workers_service["metadata"],
                    spec=workers_service["spec"], opts=in_namespace)
        self.register_outputs(outputs)

    @staticmethod
    def url(config: K8sStackConfig) -> str:
        settings = config.serving
        return f"http://{settings.name}.{config.namespace}.svc:{settings.service_port}"
