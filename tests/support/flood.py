"""A connection flood for tests/integration/test_edge.py, in a process of its own: ``n``
connections kept open with half-sent request heads, each reading its answer (a 503 past the
cap at once, a 408 after header_timeout) and then opening again after a pause.

One asyncio loop, not a thread per connection: 450 threads in the test's own process starved
the thread that reads the daemon's output, the daemon's log writes blocked on the full pipe,
vLLM's with them, and a restart under the flood ran into watch.load_timeout.

    python -m tests.support.flood PORT N   (runs until stdin closes; prints a JSON count)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import sys
from collections import Counter

HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"  # and never the rest
PAUSE = 2.0  # seconds between a connection's answer and the next one


async def one(port: int, answers: Counter[str], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(HEAD)
            got = await asyncio.wait_for(reader.read(), 60)
            writer.close()
            what = got[:12].decode("latin-1") or "closed"
        except (OSError, asyncio.TimeoutError) as e:
            what = type(e).__name__
        answers[what] += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), PAUSE)


async def main(port: int, n: int) -> Counter[str]:
    answers: Counter[str] = Counter()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    loop.add_reader(fd, lambda: None if os.read(fd, 1) else stop.set())
    await asyncio.gather(*(one(port, answers, stop) for _ in range(n)))
    return answers


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    counts = asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
    print(json.dumps(counts), flush=True)
