"""Jinja filters of the inference role: which workers a node runs and where they listen, each worker's serve
settings, the balancer's numbers that follow from them, Prometheus's targets, and what is wrong with the settings.

Pure functions of their arguments, so tests/inference calls them directly; the role, its validate.yml (which
preflight runs too) and the balancer's health checker all take their numbers from here.
"""

try:
    from ansible.errors import AnsibleFilterError as _FilterError
except ImportError:  # the unit tests also run without Ansible
    _FilterError = ValueError

# Ports below this need root; workers run unprivileged.
MIN_UNPRIVILEGED_PORT = 1024
MAX_PORT = 65535
# Serve settings that have their own role variable (the balancer and the unit read them too), so
# inference_serve_settings may not set them a second time.
OWN_KNOBS = {
    "host": "the node's cluster address", "port": "inference_base_port", "name": "the worker's name",
    "device": "the node's GPU count", "pretrained": "inference_model_dir",
    "request_timeout_s": "inference_request_timeout_s",
    "drain_timeout_s": "inference_drain_timeout_s", "drain_grace_s": "inference_drain_grace_s",
    "max_body_bytes": "inference_max_body_bytes", "job_prefix": "the worker's name",
}


class InferenceError(_FilterError):
    """A bad argument to a filter; the message names it."""


def _int(value, name):
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InferenceError(f"{name} is {value!r}, not a whole number") from None


def inference_workers(host, address, gpus, base_port):
    """The workers of one node: one per GPU (GPU i listens on base_port + i, device cuda, CUDA_VISIBLE_DEVICES=i),
    or a single CPU worker on base_port where the node has no GPU."""
    gpus, base_port = _int(gpus, "the GPU count"), _int(base_port, "inference_base_port")
    if gpus < 0:
        raise InferenceError(f"{host}: the GPU count is {gpus}; it must be 0 (a CPU node) or more")
    device = "cuda" if gpus > 0 else "cpu"
    workers = []
    for index in range(max(gpus, 1)):
        port = base_port + index
        workers.append({"name": f"{host}-{device}{index}", "host": str(host), "address": str(address),
                        "index": index, "port": port, "device": device, "url": f"http://{address}:{port}"})
    return workers


def inference_serve_config(worker, settings, extra=None, preset=""):
    """The YAML document (as data) one worker reads: the `serve:` section with the worker's own listen address,
    port, name and device over the role's settings. extra: inference_serve_settings, which may not repeat a key
    that has its own role variable. preset: the model preset of random weights (section `model:`), if any."""
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(OWN_KNOBS))
    if clash:
        raise InferenceError("inference_serve_settings sets "
                             + ", ".join(f"{k} (set it with {OWN_KNOBS[k]})" for k in clash))
    serve = {key: value for key, value in dict(settings).items() if value not in (None, "")}
    serve.update(extra)
    # job_prefix: job ids start with the worker's name, which the balancer maps back to this worker.
    serve.update({"host": worker["address"], "port": worker["port"], "name": worker["name"],
                  "device": worker["device"], "job_prefix": worker["name"]})
    document = {"serve": dict(sorted(serve.items()))}
    if preset:
        document["model"] = {"preset": str(preset)}
    return document


def inference_stop_timeout_s(drain_timeout_s, drain_grace_s, margin_s=30):
    """systemd's TimeoutStopSec for a worker: SIGTERM first lets /readyz answer 503 for drain_grace_s, then
    finishes accepted work for at most drain_timeout_s; systemd kills only after both and a margin."""
    return _int(drain_grace_s, "inference_drain_grace_s") + _int(drain_timeout_s, "inference_drain_timeout_s") + \
        _int(margin_s, "the stop margin")


def inference_balancer_settings(request_timeout_s, max_body_bytes, tries, margin_s=30):
    """nginx's numbers that follow from the service's: how long to wait for an answer (the service answers 504
    itself at its deadline, so a little longer), how long retries on other workers may go on, and the body limit."""
    read_timeout = _int(request_timeout_s, "inference_request_timeout_s") + _int(margin_s, "the timeout margin")
    return {"read_timeout_s": read_timeout, "next_upstream_timeout_s": read_timeout,
            "next_upstream_tries": _int(tries, "inference_balancer_tries"),
            "client_max_body_bytes": _int(max_body_bytes, "inference_max_body_bytes")}


def inference_targets(workers, job="sd3-inference"):
    """Prometheus file_sd target groups, one per worker: the `job` label names the job, `instance` is
    host:port so the series of two workers on one node stay apart."""
    return [{"targets": [f"{w['address']}:{w['port']}"],
             "labels": {"job": job, "instance": f"{w['host']}:{w['port']}", "host": w["host"], "worker": w["name"],
                        "device": w["device"]}} for w in workers]


def inference_problems(settings):
    """What is wrong with one host's inference settings, one sentence each with the fix (empty: nothing).
    settings: {host, worker, balancer, gpus, base_port, balancer_port, reserved_ports: {port: what}, model_dir,
    preset, request_timeout_s, drain_timeout_s, drain_grace_s, max_body_bytes, tries, serve_settings}."""
    problems = []
    host = settings.get("host", "this host")

    def whole(name, key, low, high=None):
        value = settings.get(key)
        try:
            number = int(value)
        except (TypeError, ValueError):
            problems.append(f"{host}: {name} is {value!r}: give a whole number")
            return None
        if number < low or (high is not None and number > high):
            limits = f"from {low} to {high}" if high is not None else f"{low} or more"
            problems.append(f"{host}: {name} is {number}: use a value {limits}")
            return None
        return number

    gpus = whole("the GPU count (inference_gpus_per_node, by default cluster_gpus_per_node)", "gpus", 0)
    for name, key, low in (("inference_request_timeout_s", "request_timeout_s", 1),
                           ("inference_drain_timeout_s", "drain_timeout_s", 1),
                           ("inference_drain_grace_s", "drain_grace_s", 0),
                           ("inference_max_body_bytes", "max_body_bytes", 1024)):
        whole(name, key, low)
    # One try would never route a request around a dead worker.
    whole("inference_balancer_tries", "tries", 2, 10)
    reserved = {int(port): what for port, what in (settings.get("reserved_ports") or {}).items()
                if str(port).isdigit()}
    if settings.get("worker"):
        base = whole("inference_base_port", "base_port", MIN_UNPRIVILEGED_PORT, MAX_PORT)
        if base is not None and gpus is not None:
            last = base + max(gpus, 1) - 1
            if last > MAX_PORT:
                problems.append(f"{host}: inference_base_port {base} + {max(gpus, 1)} worker(s) runs past port "
                                f"{MAX_PORT}: lower inference_base_port")
            taken = sorted(p for p in reserved if base <= p <= last)
            if settings.get("balancer"):
                balancer_port = settings.get("balancer_port")
                if str(balancer_port).isdigit() and base <= int(balancer_port) <= last:
                    taken.append(int(balancer_port))
                    reserved[int(balancer_port)] = "the balancer (inference_balancer_port)"
            for port in taken:
                problems.append(f"{host}: the workers' ports {base}-{last} include {port}, used by {reserved[port]}: "
                                f"move inference_base_port")
        model_dir, preset = settings.get("model_dir") or "", settings.get("preset") or ""
        if model_dir and not str(model_dir).startswith("/"):
            problems.append(f"{host}: inference_model_dir is '{model_dir}': give the absolute path of a diffusers "
                            f"folder on the shared volume")
        if not model_dir and not preset:
            problems.append(f"{host}: neither inference_model_dir (a diffusers folder, e.g. made by `sd3cluster "
                            f"export`) nor inference_preset (random weights, for tests) is set: the workers would have "
                            f"no model")
        clash = sorted(set(settings.get("serve_settings") or {}) & set(OWN_KNOBS))
        for key in clash:
            problems.append(f"{host}: inference_serve_settings sets {key}: set it with {OWN_KNOBS[key]} instead")
    if settings.get("balancer"):
        port = whole("inference_balancer_port", "balancer_port", 1, MAX_PORT)
        if port is not None and port in reserved:
            problems.append(f"{host}: inference_balancer_port {port} is used by {reserved[port]}: choose another port")
    return problems


class FilterModule:
    def filters(self):
        return {"inference_workers": inference_workers, "inference_serve_config": inference_serve_config,
                "inference_stop_timeout_s": inference_stop_timeout_s,
                "inference_balancer_settings": inference_balancer_settings, "inference_targets": inference_targets,
                "inference_problems": inference_problems}
