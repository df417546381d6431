"""A lean HTTP/1.1 client for the proxy's upstream calls: keep-alive pools per instance, httptools' C parser.

Measured (scripts/bench_proxy.py): aiohttp's client was over 40% of the proxy's CPU per P/D request (request
objects, header multidicts, cookie jar, tracing hooks); the proxy only ever POSTs JSON to known instances and
passes the answer through, so a pooled protocol with a C parser does the same for a fraction of it.

Errors: `ConnectFailed` (nothing listens there: the proxy routes around the instance), `FirstByteTimeout` (sent,
no answer in time), `ReadTimeout` (an answer stopped between two bytes), and their
base `UpstreamError` (connection lost, unparseable answer). A reused keep-alive connection that dies before any
byte of the answer is retried once on a new one: the server closed it idle, and never saw the request.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import httptools

IDLE_S = 4.0  # keep-alive connections idle longer are dropped: uvicorn (vLLM's server) closes them after 5 s
MAX_BUFFER = 1 << 20  # stop reading an upstream whose client is slower than it, past this many bytes


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    pass


class ReadTimeout(UpstreamError):
    pass


class FirstByteTimeout(ReadTimeout):
    """The request was sent and nothing came back in time (a prefill stuck on its prompt, a decode waiting for
    KV that never arrives)."""


class _Conn(asyncio.Protocol):
    """One connection and the response being read on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.got_bytes = False
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.waiter: asyncio.Future | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(UpstreamError(f"unparseable HTTP answer: {e}"))
            self.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        if not self.complete:
            self._fail(UpstreamError(f"connection lost{f': {exc}' if exc else ''}"))

    # -- httptools callbacks -----------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > MAX_BUFFER and self.transport:
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the callback returns
        self.complete = True
        self._wake()

    # -- consumer side -----------------------------------------------------------------------------------------

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, e: Exception) -> None:
        if self.error is None:
            self.error = e
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(e)

    async def wait(self, timeout: float, first_byte: bool = False) -> None:
        """Until something new arrived (headers, body, the end) or the timeout passed."""
        if self.error is not None:
            raise self.error
        self.waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, self._fail_timeout, self.waiter, timeout, first_byte)
        try:
            await self.waiter
        finally:
            timer.cancel()
            self.waiter = None

    def _fail_timeout(self, waiter: asyncio.Future, timeout: float, first_byte: bool) -> None:
        if not waiter.done():
            self.error = (FirstByteTimeout(f"no answer within the first-byte timeout ({timeout:g} s)")
                          if first_byte else
                          ReadTimeout(f"nothing more within the read timeout between bytes ({timeout:g} s)"))
            waiter.set_exception(self.error)
            self.close()

    def take(self) -> bytes:
        out = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        if self.buffered > MAX_BUFFER and self.transport and not self.closed:
            self.transport.resume_reading()
        self.buffered = 0
        return out

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """An upstream answer whose body is read whole (`read`) or as it arrives (`chunks`); `close` always."""

    def __init__(self, upstream: Upstream, conn: _Conn):
        self._up, self._conn = upstream, conn
        self.status = conn.status
        self.headers = conn.headers
        self._done = False

    async def read(self) -> bytes:
        parts = []
        async for chunk in self.chunks():
            parts.append(chunk)
        return b"".join(parts)

    async def chunks(self, first_timeout: float | None = None):
        """The body as it arrives; `first_timeout` bounds the wait for its first bytes (then the read timeout)."""
        conn = self._conn
        first = first_timeout is not None
        while True:
            if conn.chunks:
                first = False
                yield conn.take()
            elif conn.complete:
                self._finish()
                return
            else:
                await conn.wait(first_timeout if first else self._up.read_timeout_s, first_byte=first)

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._up._release(self._conn)

    def close(self) -> None:
        """Give the connection back when the answer was read whole; otherwise drop it (the server sees the
        client go, e.g. a decode whose client disconnected stops generating)."""
        if not self._done:
            self._done = True
            self._conn.close()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class Upstream:
    """Keep-alive connections to one instance (scheme://host:port)."""

    def __init__(self, url: str, connect_timeout_s: float, read_timeout_s: float,
                 first_byte_timeout_s: float | None = None):
        u = urlsplit(url)
        if u.scheme != "http":
            raise ValueError(f"{url}: the proxy speaks plain http to its instances")
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.base_path = u.path.rstrip("/")
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s or read_timeout_s
        self._host_header = f"Host: {self.host}:{self.port}\r\n".encode()
        self._idle: list[_Conn] = []

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(lambda: _Conn(loop), self.host, self.port),
                                             self.connect_timeout_s)
        except TimeoutError:
            raise ConnectFailed(f"connect timed out after {self.connect_timeout_s:g} s") from None
        except OSError as e:
            raise ConnectFailed(f"cannot connect: {e.strerror or e}") from None
        return conn

    def _pooled(self) -> _Conn | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()
            # is_closing: the peer went away and its connection_lost callback has not run yet.
            if not conn.closed and not conn.transport.is_closing() and now - conn.idle_since < IDLE_S:
                return conn
            conn.close()
        return None

    def _release(self, conn: _Conn) -> None:
        if conn.closed or not conn.keep_alive:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> Response:
        """Send the request; returns once the answer's status and headers arrived."""
        head = [f"{method} {self.base_path}{path} HTTP/1.1\r\n".encode(), self._host_header]
        if body or method == "POST":
            head.append(b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body))
        for k, v in (headers or {}).items():
            head.append(f"{k}: {v}\r\n".encode("latin-1"))
        head.append(b"\r\n")
        wire = b"".join(head) + body
        conn = self._pooled()
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect()
            conn._reset()
            try:
                conn.transport.write(wire)
            except RuntimeError as e:  # uvloop: the transport closed under us (the server died)
                conn.close()
                if reused:
                    conn, reused = None, False
                    continue
                raise ConnectFailed(f"connection closed before the request was sent: {e}") from None
            try:
                while not conn.headers_done:
                    await conn.wait(self.first_byte_timeout_s if not conn.got_bytes else self.read_timeout_s,
                                    first_byte=not conn.got_bytes)
            except UpstreamError:
                conn.close()
                if reused and not conn.got_bytes and not isinstance(conn.error, ReadTimeout):
                    conn, reused = None, False  # closed while idle: the server never saw this request
                    continue
                raise
            except BaseException:  # cancelled: the answer will never be read
                conn.close()
                raise
            return Response(self, conn)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
