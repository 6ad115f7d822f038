"""The k8s program's view of the shared stack settings (pulumi/common/sd3_stack_settings.py): its namespace
`sd3-cluster-k8s`, and the readers bound to it.

Keys of structured settings (a map such as `serving`) are named by their path: `sd3-cluster-k8s:serving.minReplicas`.
"""

from __future__ import annotations

import re

from sd3_stack_settings import DNS_LABEL, ConfigError, Namespace, refuse_unknown_keys

__all__ = ["CPU_FORM", "CPU_QUANTITY", "DNS_LABEL", "NAMESPACE", "ConfigError", "boolean", "integer", "key",
           "label", "mapping", "refuse_unknown_keys", "string"]

NAMESPACE = Namespace("sd3-cluster-k8s")
key = NAMESPACE.key
integer = NAMESPACE.integer
boolean = NAMESPACE.boolean
string = NAMESPACE.string
label = NAMESPACE.label
mapping = NAMESPACE.mapping

# A Kubernetes CPU quantity: cores ("8", "0.5") or millicores ("500m").
CPU_QUANTITY = re.compile(r"^([0-9]+(\.[0-9]+)?|[0-9]+m)$")
CPU_FORM = "give cores (8, 0.5) or millicores (500m), as a Kubernetes CPU quantity"
