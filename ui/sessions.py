"""Per browser session state of the page, and the one way the page runs a request."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from unimax.service import EngineService


class Sessions:
    """Per browser session: the request in flight (so Stop and a closed tab can cancel it) and
    the latest stats (what this page's panels show)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.handles: dict[str, object] = {}
        self.stats: dict[str, dict] = {}
        self.epochs: dict[str, int] = {}  # bumped by Clear: older replies stop writing
        # a message refused while the session's reply streams: the reply's status says so
        # until it ends (its next update would otherwise replace the notice at once)
        self.notices: dict[str, str] = {}

    def notice(self, session: str, text: str | None = None) -> str | None:
        """Set (``text``) or read the session's notice; "" clears it."""
        with self.lock:
            if text is not None:
                self.notices[session] = text
            return self.notices.get(session) or None

    def epoch(self, session: str) -> int:
        with self.lock:
            return self.epochs.get(session, 0)

    def bump(self, session: str) -> None:
        with self.lock:
            self.epochs[session] = self.epochs.get(session, 0) + 1

    def start(self, session: str, handle) -> None:
        with self.lock:
            self.handles[session] = handle

    def running(self, session: str) -> bool:
        """Whether a reply started after the last Stop / Clear is in flight in this session."""
        with self.lock:
            handle = self.handles.get(session)
        return handle is not None and not handle.finished.is_set()

    def cancel(self, session: str) -> bool:
        """Cancel this session's reply; False when none was running (it had finished)."""
        with self.lock:
            handle = self.handles.pop(session, None)
        if handle is None or handle.finished.is_set():
            return False
        handle.cancel()
        return True

    def set_stats(self, session: str, stats: dict, epoch: int | None = None) -> None:
        """``epoch``: the session's epoch when the reply started; a reply's stats that come
        after a Clear (a cancelled reply's last ones) are dropped, not shown on the cleared
        page."""
        with self.lock:
            if epoch is None or self.epochs.get(session, 0) == epoch:
                self.stats[session] = stats

    def get_stats(self, session: str) -> dict:
        with self.lock:
            return dict(self.stats.get(session, {}))

    def collect_final(self, session: str, handle, epoch: int) -> None:
        if handle.finished.wait(30):
            for event in list(handle.queue.queue):
                if event.kind == "stats":
                    self.set_stats(session, event.data["stats"], epoch)

    def close(self, session: str) -> None:
        self.cancel(session)
        with self.lock:
            self.stats.pop(session, None)


def stream(service: EngineService, sessions: Sessions, session: str, conversation_id,
           messages: list[dict], mode: str, settings) -> Iterator[tuple]:
    """Yields (kind, text, data) from one request; cancels it if the consumer goes away."""
    # (before the page's load event has set the id, the tab's session stands in for it)
    epoch = sessions.epoch(session)
    handle = service.submit(conversation_id or f"session-{session}", messages, mode, settings)
    sessions.start(session, handle)
    try:
        for event in handle.events():
            if event.kind == "stats":
                sessions.set_stats(session, event.data["stats"], epoch)
            yield event.kind, event.text, event.data
    finally:
        if not handle.finished.is_set():
            handle.cancel()  # Stop, a closed tab, or an error in the page: free the GPU
            # The engine ends it within one block; its final stats still reach the panels
            # (collected off this generator, which Gradio is closing).
            threading.Thread(target=sessions.collect_final, args=(session, handle, epoch),
                             daemon=True).start()


class Together:
    """Racing requests as one for Sessions: Stop or a closed tab cancels them all; finished
    when all are."""

    def __init__(self, handles: list):
        self.handles = handles
        self.finished = self  # (Sessions reads handle.finished.is_set())

    def is_set(self) -> bool:
        return all(handle.finished.is_set() for handle in self.handles)

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()


def race(service: EngineService, sessions: Sessions, session: str,
         requests: list[tuple]) -> Iterator[tuple]:
    """Yields (index, kind, text, data) from requests served side by side
    (EngineService.race), in the order their events come; cancels them all if the consumer
    goes away."""
    handles = service.race(requests)
    together = Together(handles)
    sessions.start(session, together)
    events: queue.Queue = queue.Queue()
    for n, handle in enumerate(handles):  # (each engine-thread event handed on at once)
        handle.subscribe(lambda event, n=n: events.put((n, event)))
    running = len(handles)
    try:
        while running:
            n, event = events.get()
            running -= event.kind in ("done", "error")
            yield n, event.kind, event.text, event.data
    finally:
        if not together.is_set():
            together.cancel()
