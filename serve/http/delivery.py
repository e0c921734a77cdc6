"""From the engine thread to the HTTP handlers: each request's outputs on an asyncio queue of the
server's event loop, one wake-up of the loop per engine step, and a client's disconnect noticed by a
side task so that its requests can be aborted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import Request

from hy3c.serve.engine.core import Engine, GenerationRequest, StepOutput

DISCONNECT_POLL_S = 0.25


class LoopSink:
    """Delivers a step's outputs for many requests to their queues on one event loop: one thread-safe
    wake-up of the loop per engine step (not one per request: each is a syscall on the engine thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def __call__(self, items: list[tuple[QueueEmit, StepOutput]]) -> None:
        self.loop.call_soon_threadsafe(_put_each, items)


class QueueEmit:
    """The engine's `emit` for one request: puts its outputs on an asyncio queue of the server's loop."""

    def __init__(self, sink: LoopSink, outputs: asyncio.Queue) -> None:
        self.batch_sink = sink
        self.outputs = outputs

    def __call__(self, out: StepOutput) -> None:
        self.batch_sink.loop.call_soon_threadsafe(self.outputs.put_nowait, out)


_DISCONNECTED = object()  # put on a request's queue when its client went away


async def _watch_disconnect(http: Request, outputs: asyncio.Queue) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    outputs.put_nowait(_DISCONNECTED)


def _put_each(items: list[tuple[QueueEmit, StepOutput]]) -> None:
    for emit, out in items:
        emit.outputs.put_nowait(out)


async def stream_outputs(
    engine: Engine, sink: LoopSink, requests: list[GenerationRequest], http: Request
) -> AsyncIterator[tuple[int, StepOutput]]:
    """Submit the requests; yield (choice index, output) until all finish; abort on disconnect."""
    outputs: asyncio.Queue = asyncio.Queue()
    index_of = {r.request_id: i for i, r in enumerate(requests)}
    unfinished = set(index_of)
    for r in requests:
        engine.submit(r, QueueEmit(sink, outputs))
    # a side task polls for a client disconnect: waiting on the queue with a timeout instead would
    # cost a task and a timer per token (~14 µs of event-loop time each, with the GIL held)
    watcher = asyncio.create_task(_watch_disconnect(http, outputs))
    try:
        while unfinished:
            out = await outputs.get()
            if out is _DISCONNECTED:
                return
            if out.finished:
                unfinished.discard(out.request_id)
            yield index_of[out.request_id], out
    finally:
        watcher.cancel()
        for request_id in unfinished:
            engine.abort(request_id)
