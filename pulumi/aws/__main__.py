"""sd3-cluster on AWS: `pulumi up` here, then `ansible-playbook site.yml -i inventories/cloud`."""

import pulumi
from sd3_aws.config import ConfigError, load_config
from sd3_aws.stack import build

try:
    config = load_config()
except ConfigError as error:
    # RunError shows the message alone, without a Python traceback; nothing has been declared yet.
    raise pulumi.RunError(f"stack configuration error: {error}") from None

for key, value in build(config).items():
    pulumi.export(key, value)
