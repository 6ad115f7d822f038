"""Tags every resource of a cluster carries, so a cluster's resources can be found and costed together."""

from __future__ import annotations

from collections.abc import Mapping

TAG_PREFIX = "sd3-cluster"


def cluster_tags(cluster_name: str, role: str, name: str | None = None,
                 extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Tags for one resource: the user's extra tags first, so ours (cluster, role, Name) always win."""
    tags = dict(extra or {})
    tags.update({
        f"{TAG_PREFIX}:cluster": cluster_name,
        f"{TAG_PREFIX}:role": role,
        "ManagedBy": "pulumi",
        "Name": name or f"{cluster_name}-{role}",
    })
    return tags
