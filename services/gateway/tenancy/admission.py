"""Who may send a request now, and what it cost: API keys (``keys``), the in-flight limit,
the JetStream backlog, the predicted wait against the deadline and the longest queue time,
with per-key shares under saturation (``waits``), the per-key limits shared by all gateways
(``limits``) and the usage meter (``usage``). Every refusal is a clean 401, 403, 429 (with
``Retry-After``) or 503 (with ``Retry-After`` when overloaded) before any work is queued,
instead of a queue that grows without end.

The app calls this façade only: :meth:`Admission.authenticate` → :meth:`~Admission.admit`
(reserve) → :meth:`~Admission.settle` (refund the unused part, meter the usage).
"""

from __future__ import annotations

import asyncio
import hmac
import signal
from collections.abc import Coroutine
from dataclasses import dataclass

from services.gateway.tenancy.keys import KeyRing, Tenant
from services.gateway.tenancy.limits import Limits
from services.gateway.tenancy.quota import Quota
from services.gateway.tenancy.usage import UsageMeter
from services.gateway.tenancy.waits import WaitAdmission
from shared.config import Settings
from shared.errors import AuthenticationError, Overloaded, PdError
from shared.logging import get_logger

log = get_logger("gateway.admission")

#: Tokens reserved from a key's token bucket for a choice without an explicit max_tokens.
DEFAULT_RESERVATION = 256


class PermissionDenied(PdError):
    """A valid key that may not use this endpoint (403)."""

    status = 403
    type = "permission_error"
    code = "permission_denied"


@dataclass(slots=True)
class Ticket:
    """An admitted request: who, the tokens reserved, and the limits store that admitted it
    (``redis``, ``local``, or ``""`` when the key has no limit)."""

    tenant: Tenant
    request_id: str
    reserved: int = 0
    store: str = ""
    prompt_tokens: int = 0  # estimated (whole); the admitted backlog counts its computed share until the first token


class RedisOnLoop:
    """One ``redis.asyncio`` client per event loop (a client's connections belong to the
    loop that opened them; tests run several loops in one process)."""

    def __init__(self, url: str):
        self.url = url
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client = None

    def client(self):
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            import redis.asyncio as aioredis

            self._client = aioredis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=2.0,
                                                   retry=None)
            self._loop = loop
        return self._client


class Admission:
    """The gateway's admission decisions.

    Args:
        settings: keys (``api_keys``, ``keys_file``, ``admin_api_key``), gateway limits
            (``max_inflight_requests``, ``max_queued_tasks``) and per-key limits
            (``rate_limit_*``, ``max_concurrent_requests_per_key``).

    Raises:
        SettingsError: the keys file is invalid.
    """

    def __init__(self, settings: Settings):
        self.settings = settings
        self.keys = KeyRing(settings)
        redis = None
        if settings.rate_limit_store == "redis":
            redis = RedisOnLoop(settings.rate_limit_redis_url or settings.redis_url).client
        self.limits = Limits(settings, redis)
        self.usage = UsageMeter(settings.namespace, redis)
        self.anonymous = Tenant("anonymous", settings.rate_limit_tokens_per_minute,
                                settings.rate_limit_requests_per_minute, settings.max_concurrent_requests_per_key)
        self.max_inflight = settings.max_inflight_requests
        self.max_queued = settings.max_queued_tasks
        self.inflight = 0
        self.waits = WaitAdmission(settings)
        self._tasks: set[asyncio.Task] = set()

    # --- who -------------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> Tenant:
        """The caller (the anonymous tenant when keys are off).

        Raises:
            AuthenticationError: keys are on and the header is missing or wrong (401).
        """
        if not self.keys.is_on:
            return self.anonymous
        tenant = self.keys.lookup(_bearer(authorization))
        if tenant is None:
            raise AuthenticationError("Incorrect API key provided")
        return tenant

    @staticmethod
    def cache_salt(tenant: Tenant | None, requested: str | None) -> str:
        """The prefix-cache salt of a request: the tenant's group (its key's, or its
        organisation's ``cache_salt``) before the request's own ``cache_salt``."""
        group = getattr(tenant, "cache_salt", "")
        return f"{group}:{requested or ''}" if group else (requested or "")

    def quota(self, tenant: Tenant) -> Quota:
        return Quota(tenant.tokens_per_minute, tenant.requests_per_minute, tenant.max_concurrent_requests,
                     self.settings.rate_limit_window_s)

    # --- admit and settle ------------------------------------------------------------------
    async def admit(self, tenant: Tenant, backlog: int, choices: list, prompts=None,
                    heartbeats: dict | None = None, instance_id: str = "") -> Ticket:
        """Admit a request (its ``choices``, each with a TokenizeTask), or refuse it.

        With ``heartbeats`` (the live workers' and gateways' by stage) its wait is predicted
        (:class:`~services.gateway.tenancy.waits.WaitAdmission`) and it is refused when the
        queue would be too long, its deadline out of reach, or its key over its share.

        With a token limit the request reserves its prompt tokens (counted with ``prompts``,
        the gateway's PromptProcessor, off the event loop) plus its ``max_tokens`` for every
        choice, so concurrent requests on every gateway cannot overspend the key's budget
        before any has finished; :meth:`settle` gives back what was not used.

        Raises:
            Overloaded: the gateway, the queues or the key's limits are full (429).
            QueueFull: the predicted wait is too long (503, an Overloaded).
            ServiceUnavailable: the limits' Redis is unreachable under the closed policy (503).
            InvalidRequest: a prompt the tokenizer rejects (counting it for the reservation).
        """
        self.check_inflight()
        if self.max_queued and backlog >= self.max_queued:
            raise Overloaded(f"{backlog} requests are queued for prefill; retry shortly", retry_after_s=2.0)
        ticket = Ticket(tenant, choices[0].task.meta.request_id)
        output_tokens = reservation(choices)
        if heartbeats is not None:
            try:
                ticket.prompt_tokens, _ = self.waits.check(tenant.name, [c.task for c in choices], output_tokens,
                                                           heartbeats, instance_id)
            except Overloaded as exc:
                self.record_refusal(tenant, exc.code or exc.type)
                raise
        quota = self.quota(tenant)
        if not quota.is_limited:
            self._count_admitted(ticket, output_tokens, heartbeats is not None)
            return ticket
        if quota.tokens:
            ticket.reserved = reservation(choices) + (await asyncio.to_thread(num_prompt_tokens, choices, prompts)
                                                      if prompts is not None else 0)
        try:
            ticket.store = await self.limits.acquire(tenant.name, quota, ticket.reserved, ticket.request_id)
        except PdError as exc:
            self.record_refusal(tenant, exc.code or exc.type)
            raise
        self._count_admitted(ticket, output_tokens, heartbeats is not None)
        return ticket

    def _count_admitted(self, ticket: Ticket, output_tokens: int, predicted: bool) -> None:
        if predicted:
            self.waits.admitted(ticket.request_id, ticket.tenant.name, ticket.prompt_tokens, output_tokens)

    def first_token(self, ticket: Ticket | None, choices: list) -> None:
        """The request's first token came: its prompt leaves the admitted backlog."""
        if ticket is not None:
            self.waits.first_token(ticket.request_id, choices[0].task, choices[0].num_prompt_tokens)

    def settle(self, ticket: Ticket | None, choices: list, outcome: str) -> None:
        """Settle a finished (or failed) request in the background: refund the unused part of
        its reservation, free its concurrent slot and meter its usage under ``outcome``."""
        if ticket is None:
            return
        self.waits.finished(ticket.request_id)
        self._learn_cached(choices)
        used = sum(c.num_prompt_tokens + c.num_tokens for c in choices)
        name, quota = ticket.tenant.name, self.quota(ticket.tenant)
        if ticket.store:
            self._spawn(self.limits.settle(ticket.store, name, quota, used - ticket.reserved, ticket.request_id))
        if self.keys.is_on:
            prompt: dict[int, int] = {}
            cached: dict[int, int] = {}
            for c in choices:  # a prompt is counted once however many choices it has
                prompt[c.prompt_index] = max(prompt.get(c.prompt_index, 0), c.num_prompt_tokens)
                cached[c.prompt_index] = max(cached.get(c.prompt_index, 0), c.usage.cached_tokens if c.usage else 0)
            self._spawn(self.usage.record(name, outcome, sum(prompt.values()), sum(cached.values()),
                                          sum(c.num_tokens for c in choices)))

    def _learn_cached(self, choices: list) -> None:
        """Teach the predicted-wait rule how much of a prompt the prefix cache served, from the
        usage each finished choice carried: every choice is a prefill of its own (admission
        counted the prompt once per choice), with its own hits."""
        for c in choices:
            if c.usage is not None and c.usage.prompt_tokens:
                self.waits.learn_cached(c.usage.prompt_tokens, c.usage.cached_tokens)

    def record_refusal(self, tenant: Tenant, outcome: str) -> None:
        if self.keys.is_on:
            self._spawn(self.usage.record(tenant.name, outcome))

    def check_inflight(self) -> None:
        """Raises Overloaded (429) when the gateway already serves its limit of requests."""
        if self.max_inflight and self.inflight >= self.max_inflight:
            raise Overloaded(f"the server is at its limit of {self.max_inflight} requests in flight; retry shortly",
                             retry_after_s=1.0)

    # --- admin -----------------------------------------------------------------------------
    async def usage_report(self, authorization: str | None) -> dict:
        """``GET /v1/usage``: usage per key name, summed over every gateway.

        Raises:
            AuthenticationError: no key, or an unknown one (401).
            PermissionDenied: a tenant's key, or no admin key configured (403).
        """
        given = _bearer(authorization)
        admin = self.settings.admin_api_key
        if not (admin and hmac.compare_digest(given.encode(), admin.encode())):
            if self.keys.is_on and self.keys.lookup(given) is not None:
                raise PermissionDenied("this endpoint needs the admin key")
            if not admin:
                raise PermissionDenied("the admin endpoints are off: set PD_ADMIN_API_KEY")
            raise AuthenticationError("Incorrect API key provided")
        await self.drain()
        return await self.usage.summary()

    # --- life --------------------------------------------------------------------------------
    def start(self) -> None:
        """Reload the keys file on SIGHUP (call from the serving loop's thread)."""
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._reload_now)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            log.info("keys_sighup_unavailable")

    def _reload_now(self) -> None:
        self.keys.ask_reload()
        self.keys.maybe_reload()

    async def drain(self) -> None:
        """Wait for the settlements and usage records under way."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def stop(self) -> None:
        await self.drain()
        await self.limits.stop()

    def _spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("settle_failed", error=repr(task.exception()))


def _bearer(authorization: str | None) -> str:
    """The key in an ``Authorization: Bearer <key>`` header.

    Raises:
        AuthenticationError: the header is missing or not a bearer token (401).
    """
    if not authorization or not authorization.lower().startswith("bearer "):
        raise AuthenticationError("Missing API key: send 'Authorization: Bearer <key>'")
    return authorization[7:].strip()


def reservation(choices: list) -> int:
    """Completion tokens reserved for a request: each choice's ``max_tokens``, or, when the
    client left it to the default (the rest of the context), :data:`DEFAULT_RESERVATION`."""
    return sum(min(c.task.sampling.max_tokens, DEFAULT_RESERVATION) if c.task.max_tokens_is_default
               else c.task.sampling.max_tokens for c in choices)


def num_prompt_tokens(choices: list, prompts) -> int:
    """Prompt tokens of every choice (a prompt shared by n choices counts n times, as the
    pipeline computes it n times), counted as the tokenizer stage will."""
    counted: dict[int, int] = {}
    for c in choices:
        if c.prompt_index not in counted:
            counted[c.prompt_index] = len(prompts.tokenize(c.task))
    return sum(counted[c.prompt_index] for c in choices)
