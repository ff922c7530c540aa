"""The recommended failover block (docs/policies/recommended.md) is a config users copy: it
must load as written, and say what its table says it sets."""

from __future__ import annotations

import re
from pathlib import Path

from switchyard_mw.config import parse_config

PAGE = Path(__file__).parents[2] / "docs" / "policies" / "recommended.md"


def block() -> str:
    blocks = re.findall(r"```toml\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert len(blocks) == 1, "the page has one block to copy"
    return blocks[0]


def test_the_block_loads_as_written() -> None:
    config = parse_config(block(), source=str(PAGE))
    assert config.server.resume_streams is True
    assert set(config.llm_clients) == {"anthropic-main", "cloud-backup"}
    for client in config.llm_clients.values():
        assert client.first_token_secs == 20
        assert client.stream_idle_secs == 30
        assert client.retry_wait_max_secs == 3
        assert client.hedge_after_secs is None
    chain = config.fallbacks["claude-opus-5"]
    assert tuple(chain.models) == ("claude-haiku-5",)
    assert set(chain.on) == {"unavailable"}


def test_the_table_names_every_value_the_block_sets() -> None:
    text = PAGE.read_text()
    table = text.split("## Why each setting", 1)[1].split("\n## ", 1)[0]
    for key, value in [
        ("first_token_secs", "20"),
        ("stream_idle_secs", "30"),
        ("retry_wait_max_secs", "3"),
        ("timeout_secs", "60"),
        ("resume_streams", "`true`"),
    ]:
        assert re.search(rf"\| `{key}` \| {re.escape(value)} \|", table), key
