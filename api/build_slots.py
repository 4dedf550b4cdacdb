"""How many model builds (a plan of a factory or transformers model, run as a Ray task
for up to ``ZEROSERVICE_PLAN_TIMEOUT_S``) one tenant may have in flight at once. Each
holds one of the API's request threads while it waits, so without a bound one tenant's
plans could hold them all and stall every other tenant and the health probes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from .errors import RETRY_AFTER_S, Rejected

T = TypeVar("T")


class BuildSlots:
    def __init__(self, per_tenant: int):
        self.per_tenant = per_tenant
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}

    @contextmanager
    def slot(self, tenant: str) -> Iterator[None]:
        """One of ``tenant``'s slots while the block runs; 429 (with Retry-After) when
        all of them are taken."""
        with self._lock:
            held = self._held.get(tenant, 0)
            if held >= self.per_tenant:
                raise Rejected(
                    429,
                    f"plan: {held} model builds of this tenant are running, the most at once "
                    f"(ZEROSERVICE_PLAN_BUILDS_PER_TENANT); retry when one has ended",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            self._held[tenant] = held + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._held[tenant] - 1
                if left:
                    self._held[tenant] = left
                else:
                    del self._held[tenant]

    def run(self, tenant: str, build: Callable[[], T]) -> T:
        with self.slot(tenant):
            return build()
