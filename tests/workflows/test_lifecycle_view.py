"""What the Web UI shows of a proxy (workflows/lifecycle_view.py), without a server.

Each cause of an instance reads as why and when; a rotation under way says
why the instance shown is being replaced; text someone else wrote shows as
written. The same text on a real member's page after a ban is checked in
test_pool_web_ui.py.
"""

from __future__ import annotations

from activities.models import InstanceRef
from contract import ProxyState
from workflows import lifecycle_view, markdown
from workflows.lifecycle_carried import CarriedState, instance_cause, status_of

DECIDED = "2026-01-01T00:00:00+00:00"
READY = "2026-01-01T00:01:30.123456+00:00"
REF = InstanceRef(
    provider="local", provider_id="p-1", name="proxy-1", generation=3, ip="127.0.0.1", port=20007
)


def details(carried: CarriedState) -> str:
    return lifecycle_view.current_details(
        status_of(carried, waiting_for=None, terminate_reason=None)
    )


def serving(why: str) -> CarriedState:
    """Ready on REF, made for `why`."""
    return CarriedState(
        state=ProxyState.READY,
        provider="local",
        current=REF,
        shown=REF,
        generation=3,
        ready_since=READY,
        cause=instance_cause(why, DECIDED),
    )


def test_a_first_instance_says_first_start_and_when() -> None:
    carried = CarriedState(
        state=ProxyState.PROVISIONING,
        provider="local",
        shown=REF,
        next_cause=instance_cause(lifecycle_view.FIRST_START, DECIDED),
    )
    assert f"why this instance: first start ({DECIDED})" in details(carried)


def test_a_ban_s_instance_names_the_ban_its_reason_and_when() -> None:
    why = lifecycle_view.rotation("pool: ban: 403 | captcha on <b>/search</b>", None)

    text = details(serving(why))

    assert text.startswith("**Ready** on `local`\n\nendpoint `127.0.0.1:20007` (proxy-1")
    assert (
        "why this instance: the pool asked for a rotation: ban: 403 \\| captcha on "
        f"\\<b\\>/search\\</b\\> ({DECIDED}); Ready since 2026-01-01T00:01:30+00:00"
    ) in text


def test_each_cause_reads_as_what_happened() -> None:
    assert lifecycle_view.rotation(None, 3600) == (
        "rotation by age: Ready for its max lifetime (3600s)"
    )
    assert lifecycle_view.rotation("pool: rotate all", None) == (
        "the pool asked for a rotation: rotate all"
    )
    assert lifecycle_view.rotation(lifecycle_view.ROTATE_SIGNAL_DEFAULT, None) == "a rotate signal"
    assert lifecycle_view.rotation("new exit wanted", 3600) == "a rotate signal: new exit wanted"
    assert lifecycle_view.failed_probes("unhealthy: 2 probes failed: timeout", None) == (
        "the instance before failed its probes: unhealthy: 2 probes failed: timeout"
    )
    assert lifecycle_view.failed_probes("unhealthy: 1 probe failed", "pool monitor: refused") == (
        "the pool's monitor found the instance before failing (pool monitor: refused) "
        "and its own probe agreed: unhealthy: 1 probe failed"
    )
    assert lifecycle_view.failed_to_come_up("proxy-2 never passed a probe: timeout") == (
        "the instance before never came up: proxy-2 never passed a probe: timeout"
    )


def test_a_replacement_under_way_says_why_before_it_has_an_instance() -> None:
    why = lifecycle_view.failed_probes("gone: instance deleted", None)
    carried = CarriedState(
        state=ProxyState.UNHEALTHY, provider="local", next_cause=instance_cause(why, DECIDED)
    )
    assert f"why a new instance: {markdown.text(why)} ({DECIDED})" in details(carried)


def test_a_rotation_under_way_says_why_the_serving_instance_is_replaced() -> None:
    carried = serving(lifecycle_view.FIRST_START)
    carried.next_cause = instance_cause(lifecycle_view.rotation(None, 600), "2026-01-01T00:11:30Z")

    text = details(carried)

    assert "why this instance: first start" in text
    assert (
        "being replaced: rotation by age: Ready for its max lifetime (600s) (2026-01-01T00:11:30Z)"
    ) in text


def test_an_error_someone_else_wrote_shows_as_written() -> None:
    carried = serving(lifecycle_view.FIRST_START)
    carried.last_error = "create failed: [click](http://evil.example) *now*\nsecond line"
    carried.last_error_at = DECIDED

    assert (
        f"last error ({DECIDED}): create failed: \\[click\\](http://evil.example) \\*now\\* "
        "second line"
    ) in details(carried)
