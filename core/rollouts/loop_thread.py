"""An event loop of its own on a daemon thread, for a user's code that runs during rollouts.

An environment's calls and an agent harness run there, not on the sampler's loop (which
batches every episode's model calls): code that blocks cannot freeze the other episodes, and
a call that hangs can be given up on -- cancelled if it awaits, left behind with its thread if
it blocks (a daemon thread never keeps the process alive).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any


class LoopThread:
    """A started event loop on daemon thread ``name``; :meth:`submit` runs a coroutine there and
    :meth:`close` stops it, cancelling what is still pending."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            if tasks:
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        finally:
            self.loop.close()  # also drops its default executor without waiting for its threads

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        """Run ``coro`` on this thread's loop; its future, to await with ``asyncio.wrap_future``."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        """Stop the loop (once the thread is free: a blocked one stops when its call returns)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
