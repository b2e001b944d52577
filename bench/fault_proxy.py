"""A fault-injecting TCP proxy for an S3 endpoint (or any HTTP/1.1 server): the tests and benchmarks put it in
front of the session's SeaweedFS to make object storage misbehave on cue, and to count the requests a run makes.

    proxy = FaultProxy("127.0.0.1", s3_port).start()        # a thread running an asyncio loop
    env = {"AWS_ENDPOINT_URL": proxy.endpoint}               # clients given this endpoint go through it
    proxy.down(30)                                           # an outage: connections refused for 30 s
    proxy.refuse(r"^POST \\S*model\\.safetensors\\?uploadId=", lasting=15)   # one kind of request fails
    proxy.stall(seconds=8)                                   # requests get no answer (connections held open)
    proxy.latency(0.05)                                      # 50 ms before each request goes on
    proxy.deny()                                             # 403 AccessDenied to every request
    proxy.clear()                                            # healthy again
    proxy.count(r"^GET \\S*/val-")                           # requests seen whose request line matches
    proxy.stop()

Requests are matched by their request line ("GET /bucket/key?query HTTP/1.1"). The client-to-server stream is
parsed just enough to find where each request starts on a keep-alive connection (the head up to the blank line,
then a Content-Length body or a chunked one); the server's answers are piped back untouched, so a request the
proxy lets through reaches SeaweedFS byte for byte. A refused or denied request gets its answer from the proxy and
the connection is closed (the client opens a new one, as after any error). `down` closes the listening socket, so
new connections are refused as when the server is stopped, and cuts every open connection.

    python bench/fault_proxy.py --upstream 127.0.0.1:8333 --port 9333     # by hand, healthy until killed
"""
from __future__ import annotations

import argparse
import asyncio
import re
import threading
import time
from dataclasses import dataclass, field

DENIED_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied'
               b'</Message><Resource></Resource><RequestId>fault-proxy</RequestId></Error>')
SLOW_DOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code><Message>refused by the '
                  b'fault proxy</Message><RequestId>fault-proxy</RequestId></Error>')


@dataclass
class Rule:
    kind: str  # refuse | stall | deny | latency
    pattern: re.Pattern
    until: float | None = None  # time.monotonic() after which the rule is off; None = until cleared
    remaining: int | None = None  # matches left; None = unlimited
    delay_s: float = 0.0  # latency
    status: int = 0  # refuse: 0 = reset the connection, else this HTTP status
    lasting: float | None = None  # seconds the rule stays on from its first match (then `until` is set)
    hits: int = 0  # requests it applied to

    def active(self, now: float) -> bool:
        return (self.until is None or now < self.until) and (self.remaining is None or self.remaining > 0)


@dataclass
class Seen:
    time: float
    line: str  # the request line, e.g. "GET /bucket/key HTTP/1.1"
    fault: str = ""  # what the proxy did to it ("" = passed)


@dataclass
class _State:
    rules: list[Rule] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)
    down_until: float | None = None


class FaultProxy:
    """See the module docstring. Every method is safe to call from any thread."""

    def __init__(self, upstream_host: str, upstream_port: int, host: str = "127.0.0.1", port: int = 0):
        self.upstream = (upstream_host, upstream_port)
        self.host, self.port = host, port
        self._state = _State()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "FaultProxy":
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._listen())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fault proxy did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    async def _shutdown(self) -> None:
        await self._close_all()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._client, self.host, self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close_all(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    def _call(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # ------------------------------------------------------------------ faults
    def down(self, seconds: float | None = None) -> None:
        """Refuse connections (the listening socket is closed) and cut the open ones, for `seconds` (None: until
        up() or clear())."""
        with self._lock:
            self._state.down_until = time.monotonic() + seconds if seconds is not None else float("inf")
        self._call(self._close_all())
        if seconds is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, seconds, self._reopen_soon)

    def _reopen_soon(self) -> None:
        asyncio.ensure_future(self._reopen())

    async def _reopen(self) -> None:
        with self._lock:
            if self._state.down_until is None or time.monotonic() < self._state.down_until - 1e-3:
                return
            self._state.down_until = None
        if self._server is None:
            await self._listen()

    def up(self) -> None:
        with self._lock:
            self._state.down_until = None
        self._call(self._reopen_now())

    async def _reopen_now(self) -> None:
        if self._server is None:
            await self._listen()

    def is_down(self) -> bool:
        with self._lock:
            return self._state.down_until is not None

    def _add(self, rule: Rule) -> Rule:
        with self._lock:
            self._state.rules.append(rule)
        return rule

    @staticmethod
    def _until(seconds: float | None) -> float | None:
        return time.monotonic() + seconds if seconds is not None else None

    def refuse(self, pattern: str = ".*", *, count: int | None = None, seconds: float | None = None,
               lasting: float | None = None, status: int = 0) -> Rule:
        """Matching requests fail: the connection is reset (status 0) or answered with `status` (e.g. 500); for
        `count` requests, for `seconds` from now, or for `lasting` seconds from the first request it matches."""
        return self._add(Rule("refuse", re.compile(pattern), self._until(seconds), count, status=status,
                              lasting=lasting))

    def stall(self, pattern: str = ".*", *, seconds: float | None = None, lasting: float | None = None) -> Rule:
        """Matching requests get no answer: their connection is held open, silent, until the rule ends (then
        closed): `seconds` from now, `lasting` seconds from the first request it matches, or when cleared."""
        return self._add(Rule("stall", re.compile(pattern), self._until(seconds), lasting=lasting))

    def deny(self, pattern: str = ".*", *, seconds: float | None = None) -> Rule:
        """Matching requests are answered 403 AccessDenied (as with revoked or wrong credentials)."""
        return self._add(Rule("deny", re.compile(pattern), self._until(seconds)))

    def latency(self, delay_s: float, pattern: str = ".*", *, seconds: float | None = None) -> Rule:
        """Matching requests wait `delay_s` before they go on to the server."""
        return self._add(Rule("latency", re.compile(pattern), self._until(seconds), delay_s=delay_s))

    def clear(self) -> None:
        """No faults: rules removed and, when down, up again."""
        with self._lock:
            for rule in self._state.rules:
                rule.until = 0.0  # a request a stall holds is let go (its connection closed)
            self._state.rules.clear()
        self.up()

    # ------------------------------------------------------------------ what passed
    def requests(self, pattern: str = ".*") -> list[Seen]:
        regex = re.compile(pattern)
        with self._lock:
            return [s for s in self._state.seen if regex.search(s.line)]

    def count(self, pattern: str = ".*") -> int:
        return len(self.requests(pattern))

    def reset_log(self) -> None:
        with self._lock:
            self._state.seen.clear()

    # ------------------------------------------------------------------ the proxy itself
    def _decide(self, line: str) -> tuple[Rule | None, float, Seen]:
        """The first active fault rule matching a request line (latency rules add up instead), and the log entry."""
        now = time.monotonic()
        delay, chosen = 0.0, None
        with self._lock:
            for rule in self._state.rules:
                if not rule.active(now) or not rule.pattern.search(line):
                    continue
                if rule.kind == "latency":
                    delay += rule.delay_s
                    rule.hits += 1
                elif chosen is None:
                    chosen = rule
                    rule.hits += 1
                    if rule.lasting is not None and rule.until is None:
                        rule.until = now + rule.lasting
                    if rule.remaining is not None:
                        rule.remaining -= 1
            seen = Seen(time.time(), line, chosen.kind if chosen else "")
            self._state.seen.append(seen)
        return chosen, delay, seen

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        up_writer = None
        pipe = None
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            self._writers.add(up_writer)
            pipe = asyncio.ensure_future(self._pipe(up_reader, writer))
            while True:
                head = await _read_head(reader)
                if head is None:
                    return
                line = head.split(b"\r\n", 1)[0].decode("latin-1")
                headers = _headers(head)
                rule, delay, seen = self._decide(line)
                if delay:
                    await asyncio.sleep(delay)
                if rule is not None and rule.kind == "stall":
                    while rule.active(time.monotonic()):
                        await asyncio.sleep(0.1)
                    return  # the stall ends with the connection closed; the client retries on a new one
                if rule is not None and rule.kind in ("refuse", "deny"):
                    if headers.get("expect", "").lower() != "100-continue":
                        await _skip_body(reader, headers)
                    if rule.kind == "refuse" and not rule.status:
                        writer.transport.abort()
                        return
                    status, body = (403, DENIED_BODY) if rule.kind == "deny" else (rule.status, SLOW_DOWN_BODY)
                    reason = {403: "Forbidden", 500: "Internal Server Error", 503: "Slow Down"}.get(status, "Error")
                    writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: "
                                 f"{len(body)}\r\nx-amz-request-id: fault-proxy\r\nConnection: close\r\n\r\n".encode()
                                 + (b"" if line.startswith("HEAD ") else body))  # a HEAD answer has no body
                    await writer.drain()
                    return
                up_writer.write(head)
                await _copy_body(reader, up_writer, headers)
                await up_writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, OSError, asyncio.CancelledError):
            return  # a cut connection, or the proxy stopping
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    self._writers.discard(w)
                    w.transport.abort() if w.transport is not None else None
            if pipe is not None:
                pipe.cancel()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(1 << 16):
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass
        finally:
            writer.transport.abort()


async def _read_head(reader: asyncio.StreamReader) -> bytes | None:
    try:
        return await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    except asyncio.LimitOverrunError:
        raise ConnectionError("request head too long")


def _headers(head: bytes) -> dict[str, str]:
    out = {}
    for raw in head.split(b"\r\n")[1:]:
        if b":" in raw:
            k, v = raw.split(b":", 1)
            out[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
    return out


async def _copy_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter | None,
                     headers: dict[str, str]) -> None:
    """The request's body from reader to writer (None: read and dropped): Content-Length bytes, or chunks."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readuntil(b"\r\n")
            if writer is not None:
                writer.write(size_line)
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while True:  # trailers, up to the blank line
                    trailer = await reader.readuntil(b"\r\n")
                    if writer is not None:
                        writer.write(trailer)
                    if trailer == b"\r\n":
                        return
            data = await reader.readexactly(size + 2)
            if writer is not None:
                writer.write(data)
    left = int(headers.get("content-length", "0") or 0)
    while left > 0:
        chunk = await reader.read(min(left, 1 << 16))
        if not chunk:
            raise ConnectionError("body cut short")
        left -= len(chunk)
        if writer is not None:
            writer.write(chunk)
            await writer.drain()


async def _skip_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> None:
    await _copy_body(reader, None, headers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--upstream", required=True, help="host:port of the server")
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args()
    host, port = a.upstream.rsplit(":", 1)
    proxy = FaultProxy(host, int(port), port=a.port).start()
    print(f"fault proxy at {proxy.endpoint} -> {a.upstream}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        proxy.stop()


if __name__ == "__main__":
    main()
