"""The provider error taxonomy (docs/architecture.md, "Errors").

Providers raise only these four. Each wraps the SDK error that caused it
(`__cause__` and `.cause`), so logs keep the original while callers branch on
the class. Anything unclassified is Transient: retrying is safer than failing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from providers.base import Disruption


class ProviderError(Exception):
    """Base of the taxonomy; never raised itself."""

    def __init__(
        self,
        message: str,
        *,
        cause: BaseException | None = None,
        retry_after_seconds: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.cause = cause
        # A server's own hint (Retry-After) beats our backoff when present.
        self.retry_after_seconds = retry_after_seconds
        if cause is not None:
            self.__cause__ = cause


class NotFound(ProviderError):
    """The instance does not exist; `disruption` says so when its platform took it away."""

    def __init__(
        self,
        message: str,
        *,
        cause: BaseException | None = None,
        retry_after_seconds: float | None = None,
        disruption: Disruption | None = None,
    ) -> None:
        super().__init__(message, cause=cause, retry_after_seconds=retry_after_seconds)
        self.disruption = disruption


class QuotaExceeded(ProviderError):
    """Quota, capacity or rate limit: retry, but only after minutes."""


class Transient(ProviderError):
    """Network trouble, 5xx, throttling or anything unclassified: retry with backoff."""


class Permanent(ProviderError):
    """Bad request, permission denied, invalid config: retrying cannot help."""


TAXONOMY: tuple[type[ProviderError], ...] = (NotFound, QuotaExceeded, Transient, Permanent)


def classify(exc: BaseException) -> ProviderError:
    """Return `exc` if it is already classified, otherwise wrap it as Transient."""
    if isinstance(exc, ProviderError):
        return exc
    return Transient(f"{type(exc).__name__}: {exc}", cause=exc)


@contextlib.contextmanager
def translated(normalise: Callable[[BaseException], ProviderError]) -> Iterator[None]:
    """A provider's error edge: what escapes the block is the taxonomy, as `normalise` says."""
    try:
        yield
    except Exception as exc:
        error = normalise(exc)
        if error is exc:
            raise
        raise error from exc
