"""EC2 instances running Squid, one per proxy (provider type `aws`).

Each proxy is a small instance (t3.micro by default) with a public IPv4
address, launched from a configured AMI or the newest Debian 12 image of the
region. Squid is installed and configured by the user data, rendered by
squid/conf.py like every other provider's config. One security group per
installation opens the proxy port to `allowed_cidrs` only.

EC2 calls an instance `running` as soon as it boots, minutes before its user
data has installed Squid. The script reports its progress on the serial
console, and `get` says RUNNING only once GetConsoleOutput shows "ready"
there, or TERMINATED with the script's reason if it reports a failure. The
console is EC2's documented way to see what an instance says at boot without
giving it credentials; an instance tagging itself would need an IAM role on
every proxy, which a compromised proxy could then use.

One module per concern, the provider class last:

- `settings`: the `aws:` config block, and checks across entries.
- `instances`: the state table, tags, and an EC2 instance as the contract's `Instance`.
- `user_data`: the boot script, a template file (`user_data.sh.tmpl`) filled in,
  and reading its report from the console.
- `security_group`: the installation's security group.
- `errors`: the error edge, EC2's error codes as the taxonomy.
- `provider`: `AwsProvider` and this type's `PROVIDER_TYPE`.

Design choices, and why:

- Credentials come from the default AWS chain (`from_config`: environment,
  shared config, an instance role or IRSA), never from the YAML; tests inject
  a client pointed at a fake server instead.
- The SDK's built-in retries are switched off: Temporal's activity retry
  policy is the one retry layer, derived from the error taxonomy.
- RunInstances carries the instance name as its client token, so a retried
  create never launches a second instance (EC2 "Ensuring idempotency").
- The provider acts only on its own: `delete` reads the instance's tags
  first, and a create that meets an instance of its name adopts it only
  when owner, installation, generation (and namespace, when tagged) match
  (providers.naming.ownership_mismatch).
- A spot instance EC2 reclaims ends TERMINATED with the reason said, so its
  workflow replaces it like any lost instance.
"""

from providers.aws.instances import NAME_TAG, PORT_TAG
from providers.aws.provider import PROVIDER_TYPE, AwsProvider
from providers.aws.security_group import group_name
from providers.aws.settings import AwsConfig
from providers.aws.user_data import SQUID_CONF, STARTUP_READY, STATE_MARKER, user_data

__all__ = [
    "NAME_TAG",
    "PORT_TAG",
    "PROVIDER_TYPE",
    "SQUID_CONF",
    "STARTUP_READY",
    "STATE_MARKER",
    "AwsConfig",
    "AwsProvider",
    "group_name",
    "user_data",
]
