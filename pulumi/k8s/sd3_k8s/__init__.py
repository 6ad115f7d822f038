"""The Kubernetes layer of sd3-cluster: GPU operator, gang scheduling, shared volume, training job, monitoring."""
