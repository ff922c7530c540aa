"""The `x-switchyard-*` headers a response carries: the deadline in force, and their cache."""

from __future__ import annotations

import pytest

from switchyard_mw.context import RequestContext
from switchyard_mw.engine import answers
from switchyard_mw.engine.attempts import in_force


@pytest.mark.parametrize(
    ("deadline", "budget_left", "expected"),
    [
        (60.0, None, 60.0),  # no budget
        (60.0, 90.0, 60.0),
        (60.0, 60.0, 60.0),  # exactly as long: either is the same bound
        (60.0, 59.999, 59.999),  # the budget ends first: it is the bound in force
        (60.0, 3.0, 3.0),
        (60.0, 0.0, 0.0),
        (60.0, -1.0, 0.0),  # already over: never a negative deadline
    ],
)
def test_the_deadline_in_force(deadline: float, budget_left: float | None, expected: float) -> None:
    now = 500.0
    budget_at = None if budget_left is None else now + budget_left
    assert in_force(deadline, budget_at, now) == pytest.approx(expected)


def ctx_with(deadline: float | None) -> RequestContext:
    ctx = RequestContext()
    ctx.resolved_model = "m"
    ctx.attempt_deadline_secs = deadline
    return ctx


def test_the_header_is_the_deadline_in_whole_ms() -> None:
    headers = dict(answers.exposed_headers(ctx_with(2.9994)))
    assert headers[b"x-switchyard-deadline-ms"] == b"2999"
    assert dict(answers.exposed_headers(ctx_with(2.9996)))[b"x-switchyard-deadline-ms"] == b"3000"
    assert b"x-switchyard-deadline-ms" not in dict(answers.exposed_headers(ctx_with(None)))


def test_budgets_of_every_length_keep_the_cache_bounded_and_answers_right() -> None:
    for ms in range(1, 5000):
        headers = dict(answers.exposed_headers(ctx_with(ms / 1000)))
        assert headers[b"x-switchyard-deadline-ms"] == str(ms).encode()
    assert len(answers._EXPOSED) <= answers._EXPOSED_MAX


def test_the_providers_request_id_follows_the_shared_headers_and_is_never_cached() -> None:
    first, second = ctx_with(1.0), ctx_with(1.0)
    first.upstream_request_id = b"req_1"
    second.upstream_request_id = b"req_2"
    one, two = answers.exposed_headers(first), answers.exposed_headers(second)
    assert one[-1] == (b"x-switchyard-upstream-request-id", b"req_1")
    assert two[-1] == (b"x-switchyard-upstream-request-id", b"req_2")
    assert one[:-1] == two[:-1] == answers.exposed_headers(ctx_with(1.0))
    assert not any("req_" in repr(key) for key in answers._EXPOSED)  # the cache keeps none
