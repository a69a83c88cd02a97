"""Stopping the frontend's own tasks without swallowing the caller's cancellation.

`with suppress(BaseException): await task` after `task.cancel()` also swallows a
CancelledError meant for the caller (the handler itself being cancelled while it waits), and
the handler then goes on as if nothing happened. `stop` tells the two apart by the caller's
own `cancelling()` count, and logs a task that failed instead of hiding it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


async def stop(*tasks: asyncio.Task[Any]) -> None:
    """Cancel tasks of ours and wait for each; the caller's own cancellation goes on up."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
        except Exception:
            log.exception("a task failed as it was stopped")
