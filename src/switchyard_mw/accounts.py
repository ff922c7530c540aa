"""Upstream accounts as the running process sees them: config plus the key read at start-up."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from .answer_names import Namer, namer_for
from .clouds import CloudAccess, Outbound, StreamTranslator, cloud_access
from .clouds.kinds import base_url_of
from .config import Config, LLMClient, read_api_keys
from .core.clock import Clock, monotonic
from .core.pool import AccountPool, AccountSpec
from .model_names import PLACEHOLDER, fill_path

_BOUND_KEPT = 256
"""Bound copies kept per account: a `"*"` account with a path template is bound to whatever
name a client sends, so past this the copies are made per request and not kept."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Account:
    """One `llm_clients` entry, ready to call. `repr` never shows the key.

    `ctx.account` is bound to the attempt's model (`for_model`): its `url()` fills the
    account's `path` template and `provider_model` is the name the provider knows it by.
    """

    name: str
    spec: LLMClient
    api_key: str | None = field(default=None, repr=False)
    model: str | None = None
    """The public model this account is bound to (None: unbound, as `build_accounts` makes)."""
    _bound: dict[str, Account] = field(default_factory=dict, repr=False, compare=False)
    cloud: CloudAccess | None = field(default=None, repr=False, compare=False)
    """A `vertex` or `bedrock` account's envelope and credentials (None: `kind = "api"`)."""

    @property
    def renames(self) -> bool:
        """Whether a request to this account may need another body or path than the client's."""
        return isinstance(self.spec.models, dict) or self.spec.path is not None

    def for_model(self, model: str | None) -> Account:
        """This account bound to the public `model` (itself when nothing would change)."""
        if model is None or model == self.model or not self.renames:
            return self
        bound = self._bound.get(model)
        if bound is None:
            bound = replace(self, model=model, _bound={})
            if len(self._bound) < _BOUND_KEPT:
                self._bound[model] = bound
        return bound

    @property
    def provider_model(self) -> str | None:
        """The name the provider knows the bound model by (None when unbound)."""
        return None if self.model is None else self.spec.provider_model(self.model)

    @property
    def answer_name(self) -> str | None:
        """The model name this account's answers must carry, where its provider's differs
        (the bound public name); None: its answers name the model as clients do."""
        if self.model is None or self.spec.provider_model(self.model) == self.model:
            return None
        return self.model

    def answer_namer(self, content_type: bytes | str, encoding: bytes | str = b"") -> Namer | None:
        """What writes the public name into a successful answer's `model` as it passes
        (`feed(chunk)` each chunk, `end()` once it ended), given the answer's `content-type` and
        `content-encoding`; None: nothing to rename (or a compressed body: ask for
        `identity`)."""
        public = self.answer_name
        if public is None:
            return None
        if isinstance(content_type, str):
            content_type = content_type.encode("latin-1")
        if isinstance(encoding, str):
            encoding = encoding.encode("latin-1")
        return namer_for(public, content_type, encoding)

    @property
    def kind(self) -> str:
        """`api`, `vertex` or `bedrock` (the config's `kind`)."""
        return self.spec.kind

    @property
    def counts_tokens(self) -> bool:
        """Whether the account takes a token count (`/v1/messages/count_tokens`): the API's
        and Vertex AI's do, Bedrock's does not."""
        return self.cloud is None or self.cloud.cloud.counts_tokens

    @property
    def base_url(self) -> str:
        """The configured `base_url` without a trailing slash (the request path follows); a
        cloud account's default from its region when unset."""
        if self.cloud is not None:  # a Bedrock region may come from the AWS environment
            return self.cloud.cloud.base_url
        return base_url_of(self.spec)

    async def outbound(
        self, path: str, body: bytes, headers: Iterable[tuple[str, str]] = ()
    ) -> Outbound:
        """What to send to this account for a request on `path` (e.g. `/v1/messages`) with
        `body` (`ctx.body_for_app()`): the URL, `headers` plus the credential, and the body,
        for any kind: a cloud account's re-enveloped and signed (a token fetched or a
        signature made, which is why this is awaited). Raises `WireError` for a request the
        account cannot take, `CloudCredentialError` when it gets no credential in time."""
        if self.cloud is None:
            return Outbound(self.url(path), [*headers, *self.auth_headers()], body)
        return await self.cloud.outbound(path, body, list(headers), model=self.provider_model)

    def error_answer(
        self, status: int, body: bytes, headers: Iterable[tuple[bytes, bytes]] = ()
    ) -> tuple[int, bytes]:
        """An error answer of this account as the client's wire sends it: a cloud's own
        errors (Vertex's Google-shaped ones) in the Anthropic shape, with the status the
        cooling policy should see; an `api` account's unchanged. `headers`: the answer's,
        names lowercased (a cloud may name its error there)."""
        if self.cloud is None:
            return status, body
        return self.cloud.cloud.error_answer(status, body, headers)

    def stream_translator(self, content_type: str) -> StreamTranslator | None:
        """What turns this account's 2xx stream of `content_type` into Anthropic SSE, chunk
        by chunk (`feed`, then `end`); None when it is passed on as it is."""
        return None if self.cloud is None else self.cloud.cloud.stream_translator(content_type)

    def auth_headers(self) -> list[tuple[str, str]]:
        """The credential header this account sends upstream, in its `auth` scheme."""
        if self.api_key is None:
            return []
        if self.spec.auth == "bearer":
            return [("authorization", f"Bearer {self.api_key}")]
        return [(self.spec.auth, self.api_key)]  # the header is the scheme's name

    def url(self, path: str) -> str:
        """`base_url` joined with a request path such as `/v1/messages`, or with the
        account's `path` template in its place, `{model}` filled with the provider's name."""
        return self.base_url + self.upstream_path(path)

    def upstream_path(self, path: str) -> str:
        """The path (and the template's query) this account is called on for `path`."""
        if self.cloud is not None:
            raise ValueError(
                f"account {self.name!r} is a {self.kind} account: its URL depends on the body, "
                "use `await ctx.account.outbound(path, body)`"
            )
        template = self.spec.path
        if template is None:
            return path
        if PLACEHOLDER not in template:
            return template
        provider = self.provider_model
        if provider is None:
            raise ValueError(
                f"account {self.name!r} puts the model in its path: use ctx.account (bound to "
                "the request's model) or account.for_model(name)"
            )
        return fill_path(template, provider)


def build_accounts(config: Config, environ: Mapping[str, str] | None = None) -> dict[str, Account]:
    """Every configured client with its key; `StartupError` names each unset key variable.

    A cloud account's library is imported here (`MissingExtraError` names its extra); its
    credential is fetched on first use."""
    keys = read_api_keys(config, environ)
    return {
        name: Account(name=name, spec=spec, api_key=keys[name], cloud=cloud_access(name, spec))
        for name, spec in config.llm_clients.items()
    }


def pool_from_accounts(accounts: Mapping[str, Account], *, clock: Clock = monotonic) -> AccountPool:
    """The account pool for `accounts`, keyed by their `llm_clients` names."""
    return AccountPool(
        [
            AccountSpec(
                name=name,
                models=frozenset(c.spec.models),
                priority=c.spec.priority,
                failure_threshold=c.spec.failure_threshold,
                cooldown_secs=c.spec.cooldown_secs,
                max_cooldown_secs=c.spec.max_cooldown_secs,
                max_throttle_secs=c.spec.max_throttle_secs,
                weight=c.spec.weight,
            )
            for name, c in accounts.items()
        ],
        clock=clock,
    )
