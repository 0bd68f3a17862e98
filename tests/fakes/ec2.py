"""EC2 for the AWS provider's tests: moto in server mode, behind a layer for what moto lacks.

The real boto3 client talks HTTP to `FakeEc2.url` with fake credentials.
Behind that URL, `moto.server.ThreadedMotoServer` answers EC2's Query API
(instances, images, subnets of the default VPC, security groups, tags) as a
real endpoint would. In front of it a small HTTP layer, like
tests/fakes/compute.py for Compute Engine, adds what moto does not model,
each as the EC2 documentation describes it (docs/fakes.md lists them):

- RunInstances idempotency: a client token answered once returns the same
  instance again; with other parameters it is IdempotentParameterMismatch.
  DescribeInstances accepts the `client-token` filter, and
  `instance-lifecycle` (spot).
- Readiness: GetConsoleOutput answers what the instance wrote to its serial
  console (`console_write`, as its user data would), not moto's fixed text;
  with `ready_after_polls=N` an instance reports ready on its own after N
  polls (a slow boot).
- Faults (`inject_error(action, kind, times=1, subnet=None)`): ERROR_KINDS,
  as EC2 answers them (error code, message, HTTP status).
- Spot interruption (`interrupt_spot(instance_id)`): the instance goes to
  shutting-down or terminated with state reason Server.SpotInstanceTermination.
- Spot interruption notice (`notify_spot_interruption(instance_id)`): EC2
  tells a spot instance two minutes ahead, only inside it (IMDS
  `spot/instance-action`, https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html);
  the fake plays the user data's watcher and writes its console line.
- Spot rebalance recommendation (`recommend_rebalance(instance_id)`): EC2
  warns a spot instance at elevated risk of interruption, only inside it
  (IMDS `events/recommendations/rebalance`,
  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/rebalance-recommendations.html);
  the fake plays the user data's watcher and writes its console line.
- `auto_start_ip`: every instance's public IP is this address (127.0.0.1
  in front of a local Squid), as a real one has its own.
- Eventual consistency (`instance_lag=N`, `group_lag=N`): a new instance
  (or security group) is not there for the next N calls that name it or
  would list it,
  as "Eventual consistency in the Amazon EC2 API" describes
  (https://docs.aws.amazon.com/ec2/latest/devguide/eventual-consistency.html):
  DescribeInstances by id, TerminateInstances and GetConsoleOutput answer
  InvalidInstanceID.NotFound (TerminateInstances leaves it running),
  filtered describes leave it out, and calls naming the group answer
  InvalidGroup.NotFound.
- Offerings (`not_offered(instance_type, zone)`): the zone leaves the type
  out of DescribeInstanceTypeOfferings and refuses to launch it there with
  `Unsupported` ("Troubleshoot Amazon EC2 instance launch issues"). moto
  answers DescribeInstanceTypes (with `Hypervisor`) itself.
- The serial console of a type not built on Nitro: GetConsoleOutput
  `Latest=true` is supported "only on instances built on the Nitro System"
  (API reference, GetConsoleOutput), so on a Xen type (t2, m4, c4) nothing
  the instance writes after its launch is shown, and "ready" never appears.
- CPU credits: a T3, T3a or T4g instance launched without a
  CreditSpecification is unlimited, a T2 standard ("Unlimited mode
  concepts", https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/burstable-performance-instances-unlimited-mode-concepts.html),
  and DescribeInstanceCreditSpecifications says so; moto says standard for all.
- Rule races (`a_racing_worker(action)`): another worker makes the same
  security group change just before the next `action` call, which then
  gets what EC2 answers for it (moto's InvalidPermission.Duplicate or
  InvalidPermission.NotFound).

moto keeps its state in process-wide backends: one moto server per process,
one FakeEc2 at a time, which resets it when it starts.

    with FakeEc2() as fake:
        provider = AwsProvider(settings, "prod-eu", ec2=fake.client())
"""

from __future__ import annotations

import base64
import http.client
import itertools
import logging
import re
import threading
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlencode
from xml.sax.saxutils import escape

import boto3
import botocore.session
import pytest
from botocore.config import Config as BotoConfig
from moto.backends import get_backend
from moto.core import DEFAULT_ACCOUNT_ID
from moto.ec2.models.amis import Ami
from moto.ec2.models.instances import StateReason
from moto.server import ThreadedMotoServer

from providers.aws.settings import DEBIAN_OWNER
from providers.aws.user_data import REBALANCE, STARTUP_INTERRUPTED, STARTUP_READY, STATE_MARKER
from tests.fakes.served import ServedFake
from tests.helpers.network import free_port

REGION = "eu-west-1"
# The Debian images the fake's region offers: the provider must pick the newest.
DEBIAN_IMAGES = {
    "ami-0d1e2b3a4c5f60718": ("debian-12-amd64-20250210-2019", datetime(2025, 2, 10, tzinfo=UTC)),
    "ami-0a9b8c7d6e5f40312": ("debian-12-amd64-20250316-2053", datetime(2025, 3, 16, tzinfo=UTC)),
    "ami-0f0e0d0c0b0a09080": ("debian-11-amd64-20250316-2053", datetime(2025, 3, 17, tzinfo=UTC)),
}
NEWEST_DEBIAN_12 = "ami-0a9b8c7d6e5f40312"
# The spot termination state reason (API reference, StateReason).
SPOT_TERMINATION = StateReason(
    "Server.SpotInstanceTermination: Spot instance termination",
    "Server.SpotInstanceTermination",
)


@dataclass(frozen=True)
class ErrorKind:
    """An EC2 error as the API answers it: HTTP status, error code, message."""

    status: int
    code: str
    message: str


# docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html
ERROR_KINDS: dict[str, ErrorKind] = {
    "capacity": ErrorKind(
        500,
        "InsufficientInstanceCapacity",
        "We currently do not have sufficient t3.micro capacity in the Availability Zone you "
        "requested (eu-west-1a). Our system will be working on provisioning additional "
        "capacity. You can currently get t3.micro capacity by not specifying an Availability "
        "Zone in your request or choosing eu-west-1b, eu-west-1c.",
    ),
    "instance_limit": ErrorKind(
        400,
        "InstanceLimitExceeded",
        "Your quota allows for 0 more running instance(s). You requested at least 1",
    ),
    "vcpu_limit": ErrorKind(
        400,
        "VcpuLimitExceeded",
        "You have requested more vCPU capacity than your current vCPU limit of 32 allows for "
        "the instance bucket that the specified instance type belongs to.",
    ),
    "throttled": ErrorKind(503, "RequestLimitExceeded", "Request limit exceeded."),
    "unauthorized": ErrorKind(
        403,
        "UnauthorizedOperation",
        "You are not authorized to perform this operation. User: "
        "arn:aws:iam::123456789012:user/proxy-operator is not authorized to perform: "
        "ec2:RunInstances",
    ),
    "auth_failure": ErrorKind(
        401, "AuthFailure", "AWS was not able to validate the provided access credentials"
    ),
    "internal": ErrorKind(500, "InternalError", "An internal error has occurred"),
    # The type is not offered in that zone ("Troubleshoot Amazon EC2 instance
    # launch issues": https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/troubleshooting-launch.html#troubleshooting-launch-unsupported).
    "unsupported": ErrorKind(
        400,
        "Unsupported",
        "Your requested instance type (t3.micro) is not supported in your requested "
        "Availability Zone (eu-west-1a). Please retry your request by not specifying an "
        "Availability Zone or choosing eu-west-1b, eu-west-1c.",
    ),
    # The zone's spot price is above MaxPrice (API reference, "Error codes").
    "spot_price_too_low": ErrorKind(
        400,
        "SpotMaxPriceTooLow",
        "Your Spot request price of 0.001 is lower than the minimum required Spot request "
        "fulfillment price of 0.0035.",
    ),
    # A TerminateInstances whose instance "might still be running" ("Eventual
    # consistency in the Amazon EC2 API"): the instance stays as it was.
    "instance_not_found": ErrorKind(
        400, "InvalidInstanceID.NotFound", "The instance ID does not exist"
    ),
}
IDEMPOTENT_MISMATCH = ErrorKind(
    400,
    "IdempotentParameterMismatch",
    "Arguments on this idempotent request are inconsistent with arguments used in previous "
    "request(s).",
)
_INSTANCE_ID = re.compile(r"<instanceId>(i-[0-9a-f]+)</instanceId>")
_GROUP_ID = re.compile(r"<groupId>(sg-[0-9a-f]+)</groupId>")
# Request parameters that name an instance or a security group.
_NAMES_INSTANCE = re.compile(r"InstanceId(\.\d+)?")
_NAMES_GROUP = re.compile(r"GroupId|ResourceId\.\d+|NetworkInterface\.\d+\.SecurityGroupId\.\d+")
_PUBLIC_IP = re.compile(r"<ipAddress>([0-9.]+)</ipAddress>")
# Burstable families that launch unlimited unless RunInstances says otherwise;
# T2 launches standard ("Unlimited mode concepts").
UNLIMITED_BY_DEFAULT = ("t3.", "t3a.", "t4g.")


@dataclass
class _Injection:
    action: str
    kind: ErrorKind
    remaining: int | None
    subnet: str | None


@dataclass(frozen=True)
class Call:
    """One request the fake received: its action and form parameters."""

    action: str
    params: dict[str, str]


_moto_lock = threading.Lock()
_moto_server: list[tuple[ThreadedMotoServer, int]] = []


def _moto_port() -> int:
    """The port of the process's moto server, started on first use (a few seconds).

    moto keeps its state in process-wide backends anyway; each FakeEc2 resets
    them when it starts, so sharing the server costs no isolation.
    """
    with _moto_lock:
        if not _moto_server:
            port = free_port()
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            server.start()
            _moto_server.append((server, port))
        return _moto_server[0][1]


# One botocore session makes every client: it parses EC2's service model and
# the endpoint rules (megabytes of JSON) once per test process, where a session
# per client parsed them for each, about a fifth of the suite's test-process
# CPU. A session is not safe to make clients from in several threads at once.
_session = botocore.session.get_session()
_session_lock = threading.Lock()


def make_client(url: str) -> Any:
    """A real boto3 EC2 client for `url`, with the SDK's retries off as the provider's are."""
    with _session_lock:
        return boto3.session.Session(
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            aws_session_token="testing",
            region_name=REGION,
            botocore_session=_session,
        ).client(
            "ec2",
            endpoint_url=url,
            config=BotoConfig(retries={"total_max_attempts": 1, "mode": "standard"}),
        )


class FakeEc2(ServedFake):
    """moto's EC2 behind the fault and fidelity layer; every public method is thread-safe."""

    def __init__(
        self,
        *,
        auto_start_ip: str | None = None,
        ready_after_polls: int | None = None,
        instance_lag: int = 0,
        group_lag: int = 0,
    ) -> None:
        self.auto_start_ip = auto_start_ip
        self.ready_after_polls = ready_after_polls
        self.instance_lag = instance_lag
        self.group_lag = group_lag
        # Instance or group id -> calls it is still missing from.
        self._hidden: dict[str, int] = {}
        # Action -> how many of its next calls another worker makes first.
        self._races: dict[str, int] = {}
        self._lock = threading.Lock()
        self._moto_port = 0
        self._errors: list[_Injection] = []
        self._calls: list[Call] = []
        # client token -> (the request's other parameters, the answer, instance id)
        self._tokens: dict[str, tuple[tuple[tuple[str, str], ...], bytes, str]] = {}
        self._console: dict[str, list[str]] = {}
        self._polls: dict[str, int] = {}
        # (instance type, availability zone) pairs EC2 does not offer.
        self._not_offered: set[tuple[str, str]] = set()
        # instance id -> its CPU-credit mode, as EC2 launched it.
        self._credits: dict[str, str] = {}
        self._request_ids = itertools.count(1)

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> FakeEc2:
        # moto's server logs every request through werkzeug.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._moto_port = _moto_port()
        self._forward_raw("POST", "/moto-api/reset", b"", {})
        self._add_debian_images()
        self._serve_http(self._handler_class(), "fake-ec2")
        return self

    def client(self) -> Any:
        return make_client(self.url)

    def subnets(self) -> list[tuple[str, str]]:
        """The default VPC's subnets as (id, availability zone), sorted by zone."""
        answer = make_client(self.url).describe_subnets(
            Filters=[{"Name": "default-for-az", "Values": ["true"]}]
        )
        return sorted(
            ((s["SubnetId"], s["AvailabilityZone"]) for s in answer["Subnets"]),
            key=lambda pair: pair[1],
        )

    # -- control --------------------------------------------------------------

    def inject_error(
        self, action: str, kind: str, *, times: int | None = 1, subnet: str | None = None
    ) -> None:
        """Fail the next `times` calls of `action` (launching in `subnet`, if given) with `kind`."""
        with self._lock:
            self._errors.append(_Injection(action, ERROR_KINDS[kind], times, subnet))

    def a_racing_worker(self, action: str, *, times: int = 1) -> None:
        """Another worker makes the next `times` `action` calls' change just before them."""
        with self._lock:
            self._races[action] = self._races.get(action, 0) + times

    def not_offered(self, instance_type: str, zone: str) -> None:
        """The availability zone `zone` does not offer `instance_type`."""
        with self._lock:
            self._not_offered.add((instance_type, zone))

    def clear_errors(self) -> None:
        with self._lock:
            self._errors.clear()

    def console_write(self, instance_id: str, line: str) -> None:
        """What a process on the instance writes to its serial console."""
        with self._lock:
            self._console.setdefault(instance_id, []).append(line)

    def report(self, instance_id: str, state: str) -> None:
        """The user data's report line, as the script writes it."""
        self.console_write(instance_id, f"{STATE_MARKER} {state}")

    def interrupt_spot(self, instance_id: str, *, state: str = "terminated") -> None:
        """EC2 reclaiming a spot instance: `shutting-down`, then `terminated`, with the reason.

        Only spot instances are interrupted (ValueError otherwise).
        """
        instance = self._backend().get_instance(instance_id)
        if instance.lifecycle != "spot":
            raise ValueError(f"{instance_id} is not a spot instance")
        if state == "terminated" and instance.state != "terminated":
            instance.terminate()  # releases its address and network interface
        instance._state.name = state
        instance._state.code = 32 if state == "shutting-down" else 48
        instance.state_reason = SPOT_TERMINATION

    def notify_spot_interruption(
        self, instance_id: str, action: str = "terminate", *, when: str = "2026-12-02T18:30:00Z"
    ) -> None:
        """EC2's two-minute notice, as the user data's watcher reports it on the console.

        The instance keeps running until `interrupt_spot`, as a real one does
        for two minutes; only spot instances get a notice (ValueError otherwise).
        """
        if self._backend().get_instance(instance_id).lifecycle != "spot":
            raise ValueError(f"{instance_id} is not a spot instance")
        self.report(instance_id, f"{STARTUP_INTERRUPTED} {action} {when}")

    def recommend_rebalance(self, instance_id: str, *, when: str = "2026-12-02T18:20:00Z") -> None:
        """EC2's rebalance recommendation, as the user data's watcher reports it on the console.

        The instance runs on, Squid serving; only spot instances get one
        (ValueError otherwise).
        """
        if self._backend().get_instance(instance_id).lifecycle != "spot":
            raise ValueError(f"{instance_id} is not a spot instance")
        self.report(instance_id, f"{REBALANCE} {when}")

    def open_by_hand(self, group_name: str, port: int, cidr: str) -> None:
        """An ingress rule somebody adds to the group, unseen by `calls` (straight to moto)."""
        client = make_client(f"http://127.0.0.1:{self._moto_port}")
        [group] = client.describe_security_groups(
            Filters=[{"Name": "group-name", "Values": [group_name]}]
        )["SecurityGroups"]
        client.authorize_security_group_ingress(
            GroupId=group["GroupId"],
            IpPermissions=[
                {
                    "IpProtocol": "tcp",
                    "FromPort": port,
                    "ToPort": port,
                    "IpRanges": [{"CidrIp": cidr}],
                }
            ],
        )

    def instances(self) -> list[Any]:
        """moto's instance models, every state included."""
        return list(self._backend().all_instances())

    def instance(self, instance_id: str) -> Any:
        return self._backend().get_instance(instance_id)

    def user_data(self, instance_id: str) -> str:
        """The user data the instance was launched with, decoded."""
        raw = make_client(self.url).describe_instance_attribute(
            InstanceId=instance_id, Attribute="userData"
        )["UserData"]["Value"]

        return base64.b64decode(raw).decode()

    def calls(self, action: str | None = None) -> list[Call]:
        with self._lock:
            return [c for c in self._calls if action is None or c.action == action]

    # -- the layer --------------------------------------------------------------

    def _backend(self) -> Any:
        return get_backend("ec2")[DEFAULT_ACCOUNT_ID][REGION]

    def _add_debian_images(self) -> None:
        backend = self._backend()
        for image_id, (name, created) in DEBIAN_IMAGES.items():
            backend.amis[image_id] = Ami(
                backend,
                image_id,
                name=name,
                owner_id=DEBIAN_OWNER,
                public=True,
                architecture="x86_64",
                virtualization_type="hvm",
                root_device_type="ebs",
                root_device_name="/dev/xvda",
                creation_date=created,
                region_name=REGION,
            )

    def _handle(self, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        form = {k: v[0] for k, v in parse_qs(body.decode(), keep_blank_values=True).items()}
        action = form.get("Action", "")
        with self._lock:
            self._calls.append(Call(action, form))
            injected = self._injected(action, form)
        if injected is not None:
            return self._error(injected)
        missing = self._named_but_hidden(form)
        if missing is not None:
            return self._error(missing)
        with self._lock:
            raced = self._races.get(action, 0) > 0
            if raced:
                self._races[action] -= 1
        if raced:
            self._forward(body, headers)  # the other worker's identical call
        if action == "RunInstances":
            unsupported = self._unsupported_here(form)
            if unsupported is not None:
                return self._error(unsupported)
            return self._run_instances(form, headers)
        if action == "DescribeInstanceTypeOfferings":
            status, answer = self._forward(body, headers)
            return status, self._offered_only(answer)
        if action == "GetConsoleOutput":
            return self._console_output(form)
        if action == "DescribeInstanceCreditSpecifications":
            status, answer = self._forward(body, headers)
            return status, self._credit_modes(answer)
        if action == "DescribeInstances":
            body = urlencode(self._lifecycle_filter(self._client_token_filter(form))).encode()
            status, answer = self._forward(body, headers)
            return status, self._unlisted(answer, "reservationSet", "instancesSet/item/instanceId")
        if action == "DescribeSecurityGroups":
            status, answer = self._forward(body, headers)
            return status, self._unlisted(answer, "securityGroupInfo", "groupId")
        status, answer = self._forward(body, headers)
        if action == "CreateSecurityGroup" and status == 200:
            self._hide(_GROUP_ID.search(answer.decode()), self.group_lag)
        return status, answer

    # -- eventual consistency ("Eventual consistency in the Amazon EC2 API") -----

    def _hide(self, made: re.Match[str] | None, lag: int) -> None:
        """A resource just made: missing from the next `lag` calls about it."""
        if made is not None and lag > 0:
            with self._lock:
                self._hidden[made[1]] = lag

    def _missing(self, resource_id: str) -> bool:
        """Whether this call does not see `resource_id` yet (and one fewer call will not)."""
        with self._lock:
            left = self._hidden.get(resource_id, 0)
            if left <= 0:
                return False
            if left == 1:
                del self._hidden[resource_id]
            else:
                self._hidden[resource_id] = left - 1
            return True

    def _named_but_hidden(self, form: dict[str, str]) -> ErrorKind | None:
        """The NotFound a call naming a resource EC2 does not show yet gets, as EC2 words it."""
        for key, value in form.items():
            if _NAMES_INSTANCE.fullmatch(key) and self._missing(value):
                message = f"The instance ID '{value}' does not exist"
                return ErrorKind(400, "InvalidInstanceID.NotFound", message)
            if _NAMES_GROUP.fullmatch(key) and self._missing(value):
                message = f"The security group '{value}' does not exist"
                return ErrorKind(400, "InvalidGroup.NotFound", message)
        return None

    def _unlisted(self, answer: bytes, listing: str, id_path: str) -> bytes:
        """A describe's `answer` without the items EC2 does not list yet."""
        with self._lock:
            if not self._hidden:
                return answer
        root = ET.fromstring(answer)
        ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
        found = root.find(ns + listing)
        if found is None:
            return answer
        path = "/".join(ns + step for step in id_path.split("/"))
        for item in list(found):
            ids = [e.text or "" for e in item.findall(path)]
            if [i for i in ids if self._missing(i)]:
                found.remove(item)
        if ns:
            ET.register_namespace("", ns[1:-1])
        return bytes(ET.tostring(root, encoding="utf-8", xml_declaration=True))

    # -- offerings and the Nitro console --------------------------------------------

    def _unsupported_here(self, form: dict[str, str]) -> ErrorKind | None:
        """RunInstances of a type the subnet's zone does not offer: `Unsupported`."""
        with self._lock:
            if not self._not_offered:
                return None
        subnet = form.get("NetworkInterface.1.SubnetId") or form.get("SubnetId") or ""
        zone = self._backend().get_subnet(subnet).availability_zone if subnet else ""
        wanted = form.get("InstanceType", "m1.small")
        with self._lock:
            if (wanted, zone) not in self._not_offered:
                return None
        message = (
            f"Your requested instance type ({wanted}) is not supported in your requested "
            f"Availability Zone ({zone})."
        )
        return ErrorKind(400, "Unsupported", message)

    def _offered_only(self, answer: bytes) -> bytes:
        """DescribeInstanceTypeOfferings without the offerings `not_offered` took away."""
        with self._lock:
            withheld = set(self._not_offered)
        if not withheld:
            return answer
        root = ET.fromstring(answer)
        ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
        found = root.find(ns + "instanceTypeOfferingSet")
        if found is None:
            return answer
        for item in list(found):
            pair = (item.findtext(ns + "instanceType") or "", item.findtext(ns + "location") or "")
            if pair in withheld:
                found.remove(item)
        if ns:
            ET.register_namespace("", ns[1:-1])
        return bytes(ET.tostring(root, encoding="utf-8", xml_declaration=True))

    def _injected(self, action: str, form: dict[str, str]) -> ErrorKind | None:
        subnet = form.get("NetworkInterface.1.SubnetId") or form.get("SubnetId")
        for injection in self._errors:
            if injection.action != action or injection.subnet not in (None, subnet):
                continue
            if injection.remaining is not None:
                injection.remaining -= 1
                if injection.remaining <= 0:
                    self._errors.remove(injection)
            return injection.kind
        return None

    def _run_instances(self, form: dict[str, str], headers: dict[str, str]) -> tuple[int, bytes]:
        """Idempotent on ClientToken (EC2 "Ensuring idempotency"), the public IP set."""
        token = form.get("ClientToken", "")
        others = tuple(sorted((k, v) for k, v in form.items() if k != "ClientToken"))
        with self._lock:
            known = self._tokens.get(token) if token else None
        if known is not None:
            return (200, known[1]) if known[0] == others else self._error(IDEMPOTENT_MISMATCH)
        status, answer = self._forward(urlencode(form).encode(), headers)
        found = _INSTANCE_ID.search(answer.decode())
        if status != 200 or found is None:
            return status, answer
        instance_id = found[1]
        self._hide(found, self.instance_lag)
        wanted = form.get("InstanceType", "m1.small")
        default = "unlimited" if wanted.startswith(UNLIMITED_BY_DEFAULT) else "standard"
        with self._lock:
            self._credits[instance_id] = form.get("CreditSpecification.CpuCredits", default)
        if self.auto_start_ip is not None:
            self._backend().get_instance(instance_id).nics[0].public_ip = self.auto_start_ip
            answer = _PUBLIC_IP.sub(
                f"<ipAddress>{self.auto_start_ip}</ipAddress>", answer.decode()
            ).encode()
        if token:
            with self._lock:
                self._tokens[token] = (others, answer, instance_id)
        return status, answer

    def _credit_modes(self, answer: bytes) -> bytes:
        """DescribeInstanceCreditSpecifications with each instance's mode as it was launched."""
        root = ET.fromstring(answer)
        ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
        for item in root.iter(ns + "item"):
            mode = item.find(ns + "cpuCredits")
            with self._lock:
                launched = self._credits.get(item.findtext(ns + "instanceId") or "")
            if mode is not None and launched is not None:
                mode.text = launched
        if ns:
            ET.register_namespace("", ns[1:-1])
        return bytes(ET.tostring(root, encoding="utf-8", xml_declaration=True))

    def _client_token_filter(self, form: dict[str, str]) -> dict[str, str]:
        """The `client-token` filter, which moto lacks, as the instance id the token made."""
        with self._lock:
            made = {token: known[2] for token, known in self._tokens.items()}
        rewritten = dict(form)
        for key, value in form.items():
            if re.fullmatch(r"Filter\.\d+\.Name", key) and value == "client-token":
                rewritten[key] = "instance-id"
                prefix = key.removesuffix("Name")
                for value_key in [k for k in form if k.startswith(f"{prefix}Value.")]:
                    rewritten[value_key] = made.get(form[value_key], "i-00000000")
        return rewritten

    def _lifecycle_filter(self, form: dict[str, str]) -> dict[str, str]:
        """The `instance-lifecycle` filter, which moto lacks, as the ids of the instances
        of that lifecycle (`spot`; moto marks no other)."""
        rewritten = dict(form)
        for key, value in form.items():
            if re.fullmatch(r"Filter\.\d+\.Name", key) and value == "instance-lifecycle":
                prefix = key.removesuffix("Name")
                wanted = {form[k] for k in form if k.startswith(f"{prefix}Value.")}
                for value_key in [k for k in form if k.startswith(f"{prefix}Value.")]:
                    del rewritten[value_key]
                ids = [i.id for i in self._backend().all_instances() if i.lifecycle in wanted]
                rewritten[key] = "instance-id"
                for n, instance_id in enumerate(ids or ["i-00000000"], start=1):
                    rewritten[f"{prefix}Value.{n}"] = instance_id
        return rewritten

    def _console_output(self, form: dict[str, str]) -> tuple[int, bytes]:

        instance_id = form.get("InstanceId", "")
        # InvalidInstanceID.NotFound as moto says it.
        instance = self._backend().get_instance(instance_id)
        latest = form.get("Latest", "").lower() == "true"
        if latest and not self._nitro(instance.instance_type):
            return 200, self._console_answer(instance_id, "")
        with self._lock:
            polls = self._polls[instance_id] = self._polls.get(instance_id, 0) + 1
            if self.ready_after_polls is not None and polls > self.ready_after_polls:
                lines = self._console.setdefault(instance_id, [])
                if not lines or lines[-1] != f"{STATE_MARKER} {STARTUP_READY}":
                    lines.append(f"{STATE_MARKER} {STARTUP_READY}")
            text = "".join(f"{line}\n" for line in self._console.get(instance_id, []))
        return 200, self._console_answer(instance_id, text)

    def _nitro(self, instance_type: str) -> bool:
        answer = make_client(f"http://127.0.0.1:{self._moto_port}").describe_instance_types(
            InstanceTypes=[instance_type]
        )
        return bool(answer["InstanceTypes"][0].get("Hypervisor") == "nitro")

    def _console_answer(self, instance_id: str, text: str) -> bytes:
        output = base64.b64encode(text.encode()).decode()
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            '<GetConsoleOutputResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
            f"<requestId>{uuid.uuid4()}</requestId><instanceId>{escape(instance_id)}</instanceId>"
            f"<timestamp>{datetime.now(UTC).isoformat()}</timestamp>"
            f"<output>{output}</output></GetConsoleOutputResponse>"
        )
        return xml.encode()

    def _error(self, kind: ErrorKind) -> tuple[int, bytes]:
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Response><Errors><Error><Code>{kind.code}</Code>"
            f"<Message>{escape(kind.message)}</Message></Error></Errors>"
            f"<RequestID>{uuid.uuid4()}</RequestID></Response>"
        )
        return kind.status, xml.encode()

    def _forward(self, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        return self._forward_raw("POST", "/", body, headers)

    def _forward_raw(
        self, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self._moto_port, timeout=60)
        try:
            sent = {k: v for k, v in headers.items() if k.lower() not in ("content-length", "host")}
            connection.request(method, path, body=body, headers=sent)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                status, answer = fake._handle(body, dict(self.headers.items()))
                self.send_response(status)
                self.send_header("Content-Type", "text/xml")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_args: object) -> None:
                pass

        return Handler


@pytest.fixture(name="fake_ec2")
def fake_ec2_fixture() -> Iterator[FakeEc2]:
    """A started FakeEc2, stopped after the test.

    tests/conftest.py keeps boto3 from real credentials and config for every
    test; the fake's clients carry fake keys of their own.
    """
    with FakeEc2() as fake:
        yield fake
