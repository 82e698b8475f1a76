"""``Delivery``: a tracker's store calls on a thread of their own, so a slow or unreachable store never stalls
training or a checkpoint."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal


def first_line(error: BaseException) -> str:
    """An exception in one short line for a warning: its type and the start of its message's first line."""
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(error).__name__}: {first[:300]}"


class Delivery:
    """Runs ``send`` on a daemon thread each time ``start()`` is called; one attempt at a time, in order.

    ``send`` delivers what its owner has pending and removes what it delivered; it raises on failure, leaving the
    rest pending for the next ``start()`` (the owner's next flush): that is the retry. A ``start()`` while an
    attempt runs makes that attempt go once more when it succeeds, so nothing handed over is left behind. The
    thread is a daemon: a store that hangs cannot keep the process from exiting.
    """

    def __init__(self, send: Callable[[], None], name: str) -> None:
        self._send = send
        self._name = name
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._again = False
        self.error: Exception | None = None
        """The last attempt's failure; ``None`` before any, and once one succeeded."""
        self.outage: str | None = None
        """The failure last reported by ``outage_news`` (its first line), until the store is reported back."""

    def outage_news(self, waiting: int) -> Literal["failed", "recovered"] | None:
        """On the owner's thread, at each flush: ``"failed"`` the first time attempts fail (``outage`` then names
        the failure), ``"recovered"`` once one succeeded with nothing left ``waiting``; ``None`` when neither is
        news. The owner warns or prints it: one warning an outage, however many flushes it lasts."""
        error = self.error
        if error is not None and self.outage is None:
            self.outage = first_line(error)
            return "failed"
        if error is None and self.outage is not None and not waiting:
            self.outage = None
            return "recovered"
        return None

    def start(self) -> None:
        with self._lock:
            if not self._idle.is_set():
                self._again = True
                return
            self._idle.clear()
        threading.Thread(target=self._run, name=self._name, daemon=True).start()

    def wait(self, timeout: float) -> bool:
        """Wait until no attempt runs, at most ``timeout`` seconds; whether none runs now."""
        return self._idle.wait(timeout)

    def _run(self) -> None:
        while True:
            try:
                self._send()
                self.error = None
            except Exception as error:  # any failure of the store: kept for the owner to report, and retried
                self.error = error
            with self._lock:
                again, self._again = self._again, False
                if not (again and self.error is None):
                    self._idle.set()
                    return
