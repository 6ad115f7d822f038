"""sd3-cluster on an existing Kubernetes cluster: GPU operator, Volcano, shared volume, training job, monitoring."""

import pulumi
from sd3_k8s.config import ConfigError, load_config
from sd3_k8s.stack import build

try:
    config = load_config()
except ConfigError as error:
    # RunError shows the message alone, without a Python traceback; nothing has been declared yet.
    raise pulumi.RunError(f"stack configuration error: {error}") from None

for key, value in build(config).items():
    pulumi.export(key, value)
