"""The gate at the front of every request: who is asking (authentication), may they (scope and
namespace), and not too often (rate limits) — before validation, the cache or the engine.

Front ends (gRPC, HTTP) turn what their protocol carries into Credentials (a bearer token, the client
certificate's names). What needs nothing of the request but its credentials (the key, its rate
limits, whether it may generate at all) is checked by `AccessControl.admit` before a front end
reads or translates the request; the scope and namespace the request names, by `permit` once they
are read (`authorize`: both at once, where the front end reads them without translating anything).
The pipeline and CacheAdmin only ever see the Grant they return. Refusals are RequestErrors: UNAUTHENTICATED for a missing or unknown key, PERMISSION_DENIED
for a key that may not do this (scope or namespace), RESOURCE_EXHAUSTED over a rate limit. A
refusal's message names only the caller's own key and what it sent, never another tenant's.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from appliance.gateway.errors import RequestError
from appliance.security.api_keys import ANONYMOUS, KeyRing, Principal, is_hex, parse_token
from appliance.security.ratelimit import RateLimiter

GENERATE = "generate"
# May send cache_policy ONLY: answers from the cache, never the engine. Such a request tells
# whether a prompt was asked before in the namespace, so it needs a scope of its own.
CACHE_ONLY = "cache:read-only-policy"
ADMIN = "admin"


# Not frozen: a frozen dataclass's __init__ costs twice as much, and one is made per request.
@dataclass(slots=True)
class Credentials:
    """What a request presents: an `authorization: Bearer KEY` value and, under mutual TLS, the
    names of its verified client certificate (subject CN, DNS and URI SANs)."""

    bearer: str | None = None
    identities: tuple[str, ...] = ()

    def claimed_key_id(self) -> str:
        """The key id the bearer token names, for the access log of a refused request ("" when
        there is no well-formed token)."""
        parsed = parse_token(self.bearer) if self.bearer else None
        return parsed[0] if parsed and is_hex(parsed[0]) else ""


NO_CREDENTIALS = Credentials()


def bearer_token(authorization: str) -> str | None:
    """The token of an `authorization` value of the Bearer scheme (case-insensitive), else None."""
    scheme, _, token = authorization.strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class Grant:
    """An admitted request: its key and, once permitted, its namespace; `release` once it ends
    (frees its stream; releasing again does nothing)."""

    __slots__ = ("_limiter", "key_id", "namespace", "principal")

    def __init__(self, principal: Principal, namespace: str, limiter: RateLimiter | None) -> None:
        self.principal = principal
        self.key_id = principal.key_id
        self.namespace = namespace
        self._limiter = limiter

    def release(self) -> None:
        if self._limiter is not None:
            self._limiter.close_stream(self.key_id)
            self._limiter = None


def _unauthenticated(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.UNAUTHENTICATED, message)


def _denied(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.PERMISSION_DENIED, message)


class AccessControl:
    """Authentication, per-key rate limits and authorization. Without a key ring (no keys file;
    allowed on loopback) every request is the anonymous principal, which may do everything."""

    def __init__(self, keys: KeyRing | None = None) -> None:
        self.keys = keys
        self.limiter = RateLimiter()

    @property
    def required(self) -> bool:
        return self.keys is not None

    def authenticate(self, credentials: Credentials) -> Principal:
        keys = self.keys
        if keys is None:
            return ANONYMOUS
        if credentials.bearer is not None:
            principal = keys.by_token(credentials.bearer)
            if principal is None:
                raise _unauthenticated("the API key is not valid (malformed, unknown or revoked)")
            return principal
        if credentials.identities:
            principal = keys.by_identity(credentials.identities)
            if principal is None:
                raise _unauthenticated(
                    "the client certificate stands for no API key; send "
                    "'authorization: Bearer KEY' (a gRPC metadata entry or an HTTP header)"
                )
            return principal
        raise _unauthenticated(
            "this gateway requires an API key: send 'authorization: Bearer KEY' (a gRPC "
            "metadata entry or an HTTP header)"
        )

    def authorize(self, credentials: Credentials, namespace: str, scope: str) -> Grant:
        """A request for `namespace` ("": the key's only one, else "default") needing `scope`."""
        principal = self.authenticate(credentials)
        if principal is ANONYMOUS:
            return Grant(principal, namespace, None)
        limits = principal.limits
        self.limiter.take(principal.key_id, limits)
        self._scope(principal, scope)
        namespace = self._namespace(principal, namespace)
        counted = self.limiter.open_stream(principal.key_id, limits)
        return Grant(principal, namespace, self.limiter if counted else None)

    def admit(self, credentials: Credentials, scopes: tuple[str, ...]) -> Grant:
        """What is checked before a request is read: the key, its rate (one request taken), one of
        `scopes` (those the request may need: which one, it says itself), its requests open at
        once (this one counted). `permit` then checks the scope and namespace the request names."""
        principal = self.authenticate(credentials)
        if principal is ANONYMOUS:
            return Grant(principal, "", None)
        limits = principal.limits
        self.limiter.take(principal.key_id, limits)
        if principal.scopes.isdisjoint(scopes):
            self._scope(principal, scopes[0])
        counted = self.limiter.open_stream(principal.key_id, limits)
        return Grant(principal, "", self.limiter if counted else None)

    def would_admit(self, credentials: Credentials, scopes: tuple[str, ...]) -> bool:
        """Whether `admit` would pass now; nothing is taken or counted (a client that waits for
        100 Continue is not asked for a body that would be refused unread)."""
        try:
            principal = self.authenticate(credentials)
        except RequestError:
            return False
        if principal is ANONYMOUS:
            return True
        if principal.scopes.isdisjoint(scopes):
            return False
        return self.limiter.has_room(principal.key_id, principal.limits)

    def permit(self, grant: Grant, namespace: str, scope: str) -> None:
        """The admitted request may use `namespace` ("": the key's only one, else "default") and
        needs `scope`; the grant's namespace is set. Checking again (a grant from `authorize`)
        gives the same answer. The caller releases the grant on a refusal."""
        principal = grant.principal
        if principal is ANONYMOUS:
            grant.namespace = namespace
            return
        self._scope(principal, scope)
        grant.namespace = self._namespace(principal, namespace)

    def authorize_admin(self, credentials: Credentials, namespace: str) -> Grant:
        """A CacheAdmin call: the `admin` scope; a namespace the key holds, or any namespace
        (every namespace's entries or counters) only for a key that holds "*"."""
        grant = self.admit_admin(credentials)
        self.permit_admin(grant, namespace)
        return grant

    def admit_admin(self, credentials: Credentials) -> Grant:
        """What `authorize_admin` checks before the call's message is read: the key, its rate,
        the `admin` scope."""
        principal = self.authenticate(credentials)
        if principal is ANONYMOUS:
            return Grant(principal, "", None)
        self.limiter.take(principal.key_id, principal.limits)
        self._scope(principal, ADMIN)
        return Grant(principal, "", None)

    def permit_admin(self, grant: Grant, namespace: str) -> None:
        """The rest of `authorize_admin`, once the message names the namespace."""
        principal = grant.principal
        grant.namespace = namespace
        if principal is ANONYMOUS or principal.any_namespace:
            return
        if not namespace or namespace not in principal.namespaces:
            raise _denied(
                f"key '{principal.key_id}' may administer only its own namespaces "
                f"({', '.join(sorted(principal.namespaces))}): name one of them"
                + ("" if namespace else '; all namespaces need a key holding "*"')
            )

    def admit_key(self, credentials: Credentials) -> Grant:
        """A call that needs a known key and no scope (server reflection): the key and its rate
        (one request taken)."""
        principal = self.authenticate(credentials)
        if principal is not ANONYMOUS:
            self.limiter.take(principal.key_id, principal.limits)
        return Grant(principal, "", None)

    @staticmethod
    def _scope(principal: Principal, scope: str) -> None:
        if scope not in principal.scopes:
            raise _denied(
                f"key '{principal.key_id}' lacks the scope '{scope}' "
                f"(it holds: {', '.join(sorted(principal.scopes))})"
            )

    @staticmethod
    def _namespace(principal: Principal, namespace: str) -> str:
        if principal.any_namespace:
            return namespace
        if not namespace:
            if len(principal.namespaces) == 1:
                return next(iter(principal.namespaces))
            namespace = "default"
        if namespace in principal.namespaces:
            return namespace
        holds = ", ".join(sorted(principal.namespaces))
        raise _denied(
            f"key '{principal.key_id}' may not use namespace {namespace[:64]!r}; it holds: {holds}"
        )
