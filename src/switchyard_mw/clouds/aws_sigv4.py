"""AWS Signature V4 for a `kind = "bedrock"` account, by botocore (the `bedrock` extra).

Credentials come from the standard AWS chain as the AWS CLI finds them (`bedrock.profile`,
else the environment's `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/`AWS_SESSION_TOKEN`, the
shared files' profile, a container or instance role), resolved once, on the first request;
credentials that expire (a role's, SSO's) are refreshed by botocore when they near their end,
in a worker thread, so a refresh never blocks the event loop. A chain that finds nothing, or
that does not answer within `RESOLVE_TIMEOUT_SECS`, is a `CloudCredentialError` naming the
account, never a hang.

Only what must be is signed: the host, `x-amz-date` (and `x-amz-security-token`), the content
type and accept; the payload's hash is in the signature. The client's other headers travel
unsigned, so nothing on the way that adds or rewrites one can break the signature.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from ..config import BedrockSettings
from ..errors import CloudCredentialError, MissingExtraError, StartupError

try:
    import botocore.session
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.exceptions import BotoCoreError, ReadTimeoutError
    from botocore.exceptions import ConnectionError as AwsConnectionError
except ImportError as exc:
    raise MissingExtraError("switchyard_mw.clouds.aws_sigv4", "bedrock", exc) from None

from .base import Envelope, Headers

SERVICE = "bedrock"
"""The service name Bedrock's runtime signs under."""
RESOLVE_TIMEOUT_SECS = 10.0
"""The longest wait for the credential chain (an instance role's metadata endpoint, STS)."""

_SET_HERE = frozenset({"host", "content-type", "accept", "authorization", "x-amz-date"})
_SET_HERE |= {"x-amz-security-token", "x-amz-content-sha256"}
_JSON = "application/json"
_EVENTSTREAM = "application/vnd.amazon.eventstream"


class AwsSigV4:
    """Signs each request of one Bedrock account; its credentials resolved once."""

    def __init__(
        self,
        account: str,
        settings: BedrockSettings,
        *,
        resolve_timeout_secs: float = RESOLVE_TIMEOUT_SECS,
    ) -> None:
        self.account = account
        self.profile = settings.profile
        self._session = botocore.session.Session(profile=settings.profile)
        region = settings.region or _region(self._session)
        if not region:
            raise StartupError(
                f"llm_clients.{account}.bedrock.region: not set, and neither AWS_REGION, "
                "AWS_DEFAULT_REGION nor the profile names one"
            )
        self.region: str = region
        self._timeout = resolve_timeout_secs
        self._credentials: Any = None  # botocore's Credentials, or RefreshableCredentials
        self._lock: asyncio.Lock | None = None

    def __repr__(self) -> str:
        return f"AwsSigV4(account={self.account!r}, region={self.region!r})"

    async def headers(self, envelope: Envelope, headers: Headers) -> Headers:
        """`headers` with the SigV4 signature of a POST of `envelope`."""
        frozen = await self._frozen()
        accept = _EVENTSTREAM if envelope.stream else _JSON
        request = AWSRequest(
            method="POST",
            url=envelope.url,
            data=envelope.body,
            headers={"Content-Type": _JSON, "Accept": accept},
        )
        SigV4Auth(frozen, SERVICE, self.region).add_auth(request)
        kept = [(k, v) for k, v in headers if k.lower() not in _SET_HERE]
        return kept + [(k.lower(), str(v)) for k, v in request.headers.items()]

    def check(self) -> list[str]:
        """A named profile that the shared files do not hold (checked offline)."""
        return _profile_problems(self._session, self.profile)

    async def _frozen(self) -> Any:
        """Frozen credentials for one signature; resolving or refreshing off the loop."""
        credentials = self._credentials
        if credentials is not None and not _nearing_end(credentials):
            return credentials.get_frozen_credentials()  # no IO: nothing to refresh
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one resolution at a time; the others wait for it
            try:
                return await asyncio.wait_for(asyncio.to_thread(self._resolve), self._timeout)
            except TimeoutError:
                raise CloudCredentialError(
                    self.account,
                    f"no AWS credentials within {self._timeout:g} s (the credential chain "
                    "did not answer)",
                    refused=False,
                ) from None

    def _resolve(self) -> Any:
        """In a worker thread: the chain resolved (once), its credentials refreshed if due."""
        try:
            if self._credentials is None:
                self._credentials = self._session.get_credentials()
                if self._credentials is None:
                    raise CloudCredentialError(
                        self.account,
                        "no AWS credentials found (environment, shared files"
                        + (f", profile {self.profile!r}" if self.profile else "")
                        + ", container or instance role)",
                        refused=True,
                    )
            return self._credentials.get_frozen_credentials()
        except BotoCoreError as exc:
            # botocore's messages name files and profiles, never a secret.
            raise CloudCredentialError(
                self.account, f"AWS credentials: {exc}", refused=_refused(exc)
            ) from None


def offline_problems(settings: BedrockSettings) -> list[str]:
    """What check-config can tell of a Bedrock account without a network: a profile the shared
    files lack, a region found nowhere (`bedrock.region`, the environment, the profile)."""
    session = botocore.session.Session()
    problems = _profile_problems(session, settings.profile)
    if settings.region is None and not problems:
        try:
            region = _region(botocore.session.Session(profile=settings.profile))
        except BotoCoreError:
            region = None
        if region is None:
            problems.append(
                "bedrock.region: not set, and neither AWS_REGION, AWS_DEFAULT_REGION nor the "
                "profile names one"
            )
    return problems


def _profile_problems(session: Any, profile: str | None) -> list[str]:
    if profile is None:
        return []
    try:
        profiles = session.available_profiles
    except BotoCoreError as exc:
        return [f"bedrock.profile: the shared AWS files cannot be read: {type(exc).__name__}"]
    if profile not in profiles:
        return [f"bedrock.profile: no profile {profile!r} in the shared AWS files"]
    return []


def _region(session: Any) -> str | None:
    """The region as the AWS tools look it up: `AWS_REGION`, then botocore's own chain
    (`AWS_DEFAULT_REGION`, the profile's `region`)."""
    region = os.environ.get("AWS_REGION") or session.get_config_variable("region")
    return region if isinstance(region, str) and region else None


def _nearing_end(credentials: Any) -> bool:
    """Whether signing with `credentials` may refresh them (IO) first."""
    refresh_needed = getattr(credentials, "refresh_needed", None)
    return bool(refresh_needed()) if refresh_needed is not None else False


def _refused(exc: BotoCoreError) -> bool:
    """A chain that is misconfigured (a profile missing, a file malformed) will not heal by
    waiting; one that could not reach its endpoint might."""
    return not isinstance(exc, AwsConnectionError | ReadTimeoutError)
