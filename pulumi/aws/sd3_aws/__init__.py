"""The AWS layer of sd3-cluster: network, placement, GPU instances, shared file system, Ansible inventory."""
