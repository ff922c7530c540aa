"""The attempt machine places a conversation by its key: the first attempt on the account the
key's rendezvous order puts first, each failover on the next in that order (within the routed
cluster's accounts behind Envoy), with local and with shared state."""

from __future__ import annotations

import msgspec
import pytest
from machine_moves import machine_moves  # noqa: F401 (autouse: each move is a row)

from switchyard_mw.accounts import build_accounts, pool_from_accounts
from switchyard_mw.config import parse_config
from switchyard_mw.context import RequestContext
from switchyard_mw.core import affinity
from switchyard_mw.core.shared import Shared
from switchyard_mw.engine.claims import claimed
from switchyard_mw.engine.machine import (
    DONE,
    FORWARD,
    HOLD_FOR_FAILOVER,
    NEXT,
    AttemptMachine,
    How,
    Send,
)
from switchyard_mw.engine.policies import Engine
from switchyard_mw.wire import Wire, read_request

NAMES = ("a", "b", "c")
CONFIG = "".join(
    f'[llm_clients.{n}]\nbase_url = "https://api.anthropic.com"\napi_key_env = "K"\n'
    f'models = ["m"]\nweight = {w}\n\n'
    for n, w in zip(NAMES, (1.0, 2.0, 0.5), strict=True)
)
WEIGHTS = (1.0, 2.0, 0.5)
USERS = [f"user-{i}" for i in range(60)]


def expected_order(key: str) -> list[str]:
    """The rendezvous order of the conversation keyed `key`, from core.affinity alone."""
    seeds = [affinity.seed(n) for n in NAMES]
    return [NAMES[i] for i in affinity.order(affinity.key_hash(key), seeds, WEIGHTS)]


class AlwaysOurs:
    """A shared store that grants every probe claim and records who asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def changed(
        self, account: str, change: object, local: Shared, *, model: str | None = None
    ) -> None:
        pass

    def held(self, account: str, model: str, until_unix: float) -> None:
        pass

    async def claim_probe(self, account: str, model: str | None = None) -> Shared | None:
        self.asked.append(account)
        return None


def engine_with(store: AlwaysOurs | None = None) -> Engine:
    config = parse_config(CONFIG)
    accounts = build_accounts(config, {"K": "k"})
    pool = pool_from_accounts(accounts)
    if store is not None:
        pool.attach(store)  # type: ignore[arg-type]
    return Engine(server=config.server, accounts=accounts, pool=pool)


def machine_for(
    user: str | None, store: AlwaysOurs | None = None, engine: Engine | None = None
) -> AttemptMachine:
    engine = engine or engine_with(store)
    body: dict[str, object] = {
        "model": "m",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
    if user is not None:
        body["metadata"] = {"user_id": user}
    raw = msgspec.json.encode(body)
    return engine.machine(RequestContext(read_request(Wire.ANTHROPIC, raw), raw, 0.0))


def sent_to(action: object) -> str:
    assert isinstance(action, Send)
    return action.lease.account


def fail_over(m: AttemptMachine) -> object:
    assert m.started(500) is HOLD_FOR_FAILOVER
    assert m.ended(How.RETURNED, held=["held"]) is NEXT
    return m.next()


def test_the_first_attempt_and_every_failover_follow_the_key_s_rendezvous_order() -> None:
    firsts = set()
    for user in USERS:
        order = expected_order(user)
        m = machine_for(user)
        assert sent_to(m.begin()) == order[0]
        assert sent_to(fail_over(m)) == order[1]
        assert sent_to(fail_over(m)) == order[2]
        assert m.tried == order
        firsts.add(order[0])
    assert firsts == set(NAMES)  # the keys do spread: the test is not one account's


def test_behind_envoy_a_failover_takes_the_next_in_order_on_the_routed_cluster() -> None:
    for user in USERS:
        order = expected_order(user)
        m = machine_for(user)
        assert sent_to(m.begin()) == order[0]
        m.within = {order[0], order[2]}  # the cluster the first attempt was routed to
        assert sent_to(fail_over(m)) == order[2]


@pytest.mark.parametrize("user", USERS[:12])
async def test_with_shared_state_the_first_attempt_is_the_key_s_account(user: str) -> None:
    order = expected_order(user)
    store = AlwaysOurs()
    m = machine_for(user, store)
    assert sent_to(await claimed(m, m.begin())) == order[0]
    assert sent_to(await claimed(m, fail_over(m))) == order[1]
    assert store.asked == []  # nothing cooled: no probe to claim


def test_without_a_user_id_the_first_user_turn_keys_the_conversation() -> None:
    engine = engine_with()
    by_user, by_turn = [], []
    for _ in range(6):
        m = machine_for(None, engine=engine)
        by_turn.append(sent_to(m.begin()))
        assert m.started(200) is FORWARD
        assert m.ended(How.FINISHED) is DONE
        m = machine_for(USERS[0], engine=engine)
        by_user.append(sent_to(m.begin()))
        assert m.started(200) is FORWARD
        assert m.ended(How.FINISHED) is DONE
    turn = m.ctx.view.first_turn_hash if m.ctx.view else None
    assert turn is not None
    assert by_turn == [expected_order(turn)[0]] * 6  # not the rotation: one account
    assert by_user == [expected_order(USERS[0])[0]] * 6
