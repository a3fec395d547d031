# Lean two-leg PD relay for benchmarks, written like /work/shared/bench/lean_relay.py (callbacks
# only, keep-alive upstreams, no body parsing): each request gets bootstrap fields spliced before
# its closing brace and is sent to the prefill and the decode at once; the decode's response is
# relayed, the prefill's is read and dropped. The floor of PD mode: what two legs cost, nothing else.
# Usage: python lean_pd_relay.py PORT http://PREFILL:P BOOTSTRAP_PORT http://DECODE:D
import asyncio
import collections
import random
import sys

import httptools
import uvloop

PORT = int(sys.argv[1])
PRE = tuple(sys.argv[2].split("//")[1].split(":"))
PRE = (PRE[0], int(PRE[1]))
BOOT = int(sys.argv[3])
DEC = tuple(sys.argv[4].split("//")[1].split(":"))
DEC = (DEC[0], int(DEC[1]))
FIELDS = b',"bootstrap_host":"%s","bootstrap_port":%d,"bootstrap_room":' % (PRE[0].encode(), BOOT)
pools = {PRE: collections.deque(), DEC: collections.deque()}
rand = random.getrandbits


class Upstream(asyncio.Protocol):
    def __init__(self, addr):
        self.addr = addr
        self.t = None
        self.client = None
        self.ctype = b"application/json"
        self.p = httptools.HttpResponseParser(self)

    def connection_made(self, t):
        self.t = t

    def data_received(self, d):
        self.p.feed_data(d)

    def on_header(self, n, v):
        if n.lower() == b"content-type":
            self.ctype = v

    def on_headers_complete(self):
        c = self.client
        if c is not None:
            c.t.write(
                b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n"
                % (self.p.get_status_code(), self.ctype)
            )

    def on_body(self, b):
        if self.client is not None:
            self.client.t.write(b"%x\r\n%s\r\n" % (len(b), b))

    def on_message_complete(self):
        c = self.client
        self.client = None
        pools[self.addr].append(self)
        if c is not None:
            c.t.write(b"0\r\n\r\n")
            c.done()

    def connection_lost(self, e):
        try:
            pools[self.addr].remove(self)
        except ValueError:
            pass


class Downstream(asyncio.Protocol):
    def connection_made(self, t):
        self.t = t
        self.p = httptools.HttpRequestParser(self)
        self.body = []
        self.url = b""
        self.busy = False
        self.q = collections.deque()

    def data_received(self, d):
        try:
            self.p.feed_data(d)
        except httptools.HttpParserError:
            self.t.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            self.t.close()

    def on_url(self, u):
        self.url += u

    def on_body(self, b):
        self.body.append(b)

    def on_message_complete(self):
        req = (self.url, b"".join(self.body))
        self.url = b""
        self.body = []
        if self.busy:
            self.q.append(req)
        else:
            self.start(req)

    def start(self, req):
        self.busy = True
        asyncio.ensure_future(self.forward(*req))

    async def leg(self, addr):
        pool = pools[addr]
        if pool:
            return pool.pop()
        _, up = await loop.create_connection(lambda: Upstream(addr), *addr)
        return up

    async def forward(self, url, body):
        pre = await self.leg(PRE)
        dec = await self.leg(DEC)
        end = body.rindex(b"}")
        out = b"%s%s%d}" % (body[:end], FIELDS, rand(62))
        head = b"POST %s HTTP/1.1\r\nhost: w\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % (
            url,
            len(out),
        )
        pre.client = None
        dec.client = self
        pre.t.writelines((head, out))
        dec.t.writelines((head, out))

    def done(self):
        self.busy = False
        if self.q:
            self.start(self.q.popleft())


uvloop.install()
loop = asyncio.new_event_loop()
asyncio.set_event_loop(loop)
srv = loop.run_until_complete(loop.create_server(Downstream, "127.0.0.1", PORT, backlog=4096, reuse_port=True))
loop.run_forever()
