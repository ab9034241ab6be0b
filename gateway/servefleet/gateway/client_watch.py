"""Stop waiting on an upstream when the client that asked has gone.

The engine aborts a generation when its connection closes, so a gateway that notices a client
leaving and drops the upstream connection frees the replica within a step, instead of letting
it compute an answer nobody will read (streaming or not, queued, prefilling or decoding).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from servefleet.gateway.asgi import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def unless_client_leaves(work: Coroutine[Any, Any, T], receive: Receive) -> T:
    """`work`'s result; cancels it and raises ClientGone when the client disconnects first.

    Only for after the request body was read: the next ASGI message is then the disconnect.
    """
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_client_gone(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone


async def _client_gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
