"""A pool's checks of the endpoints its members report, before any client is given one.

Anyone who may signal in the namespace can send a member's report, so the
endpoint a report names is only advertised (`Member.verified`) once the
member's provider confirms that the member's own instance serves there
(`verify_endpoint`, which also asks where its traffic leaves from). Checks
run a batch at a time; one that meets a quota or rate limit is asked again
once it passes, and one the provider can never answer is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime

from temporalio import workflow
from temporalio.exceptions import ApplicationError, FailureError

with workflow.unsafe.imports_passed_through():
    from activities.models import EndpointCheck, VerifyEndpointInput
    from activities.provider import ProviderActivities
    from contract import QUOTA_RETRY_DELAY, ErrorType, ProxyState
    from workflows import policies, pool_plan
    from workflows.patches import VERIFY_WAITS_OUT_QUOTA, taken
    from workflows.pool_commands import Commands
    from workflows.pool_plan import Member, Wake


class EndpointChecks:
    """The reported endpoints not yet confirmed, and the checks under way."""

    def __init__(
        self,
        *,
        members: Callable[[], Mapping[str, Member]],
        commands: Commands,
        failed: Callable[[str], None],
        refuse: Callable[[str], None],
    ) -> None:
        # `members`: the pool's members now. `failed`: a check could not be
        # made (the pool's last error). `refuse`: a report refused, and why.
        self._members = members
        self._commands = commands
        self._failed = failed
        self._refuse = refuse
        # Set once the run has its input: where checks run (None: the pool's
        # own queue) and where the exit check asks, "" for none
        # (activities/exit_echo.py).
        self.task_queue: str | None = None
        self.echo_url = ""
        # Members whose reported endpoint awaits its provider's confirmation, and
        # those whose check is under way.
        self._unverified: set[str] = set()
        self._verifying: set[str] = set()
        # Members whose check met a quota or rate limit: asked again from then.
        self._verify_after: dict[str, datetime] = {}
        # Not carried: the next run's checks say it again if it still holds.
        self.last_exit_problem: str | None = None

    def reported(self, member: str) -> None:
        """A member reported a Ready endpoint not confirmed yet."""
        self._unverified.add(member)

    def ask_again(self, members: Iterable[Member]) -> None:
        """Carried from an earlier run unconfirmed (a check cut short by continue-as-new)."""
        self._unverified = {
            m.member
            for m in members
            if m.state == ProxyState.READY and m.endpoint and m.endpoint != m.verified
        }

    def start(self) -> None:
        """Ask the provider about every reported endpoint not yet confirmed, once at a time."""
        now = workflow.now()
        members = self._members()
        for member_id in sorted(self._unverified - self._verifying):
            if len(self._verifying) >= pool_plan.COMMAND_BATCH:
                break  # the rest when these answer
            member = members.get(member_id)
            if member is None or member.state != ProxyState.READY or not member.endpoint:
                self._unverified.discard(member_id)
                self._verify_after.pop(member_id, None)
                continue
            if self._verify_after.get(member_id, now) > now:
                continue  # waiting out a quota: `next_wake` steps then
            self._verify_after.pop(member_id, None)
            self._verifying.add(member_id)
            self._commands.spawn(self._verify(member, member.endpoint))

    def next_wake(self) -> Wake | None:
        """When the first check waiting out a quota is due again, if any is."""
        due = [at for member, at in self._verify_after.items() if member in self._unverified]
        return Wake(min(due), "check an endpoint again after a quota") if due else None

    async def _verify(self, member: Member, claimed: str) -> None:
        try:
            check: EndpointCheck = await workflow.execute_activity_method(
                ProviderActivities.verify_endpoint,
                VerifyEndpointInput(
                    member.provider,
                    member.member,
                    claimed,
                    self.echo_url,
                    generation=member.generation,
                    placement=dict(member.placement),
                ),
                summary=f"verify {member.member} at {claimed}",
                task_queue=self.task_queue,
                start_to_close_timeout=policies.VERIFY.start_to_close,
                schedule_to_close_timeout=policies.VERIFY.schedule_to_close,
                retry_policy=policies.TRANSIENT_RETRY,
            )
        except FailureError as err:
            self._failed(f"could not verify {member.member}'s endpoint: {err}")
            cause = err.cause
            if (
                isinstance(cause, ApplicationError)
                and cause.type == ErrorType.QUOTA_EXCEEDED
                and taken(VERIFY_WAITS_OUT_QUOTA)
            ):
                # A quota or rate limit passes: still unverified, asked again
                # once its delay is over (the provider's hint, else minutes).
                delay = cause.next_retry_delay or QUOTA_RETRY_DELAY
                self._verify_after[member.member] = workflow.now() + delay
            elif isinstance(cause, ApplicationError) and (
                cause.non_retryable or cause.type in policies.NON_RETRYABLE
            ):
                # Asking again cannot help (a provider this worker does not
                # have): refused, or the next step would ask at once, forever.
                self._unverified.discard(member.member)
                self._refuse(f"{member.member}: {cause.message}")
            # Otherwise still unverified (the provider's outage outlasted the
            # retries): asked again on the next step.
            return
        finally:
            self._verifying.discard(member.member)
        current = self._members().get(member.member)
        if current is None or current.state != ProxyState.READY or current.endpoint != claimed:
            return  # overtaken by a later report, which has a check of its own
        self._unverified.discard(member.member)
        if check.verified:
            current.verified, current.exit_address = claimed, check.exit_address
            if check.exit_problem:
                self.last_exit_problem = f"{member.member}: {check.exit_problem}"
        else:
            self._refuse(check.problem)
