"""Splicing fields into a client body, compiled: the bounds of the top-level object, and a leg's
whole request (framed head, body with the fields spliced in) built in one allocation.

The client's response head copies the worker's header lines but the hop-by-hop ones
(``copied_headers``): classified by length and a case-insensitive compare, no lower-cased copy
and no dict lookup per name, written into one buffer. A chunked response's body piece is framed
behind the pending head in one allocation (``chunk``), and the pieces of one upstream read are
joined without the buffer protocol per piece (``joined``).

A PD request splices its bootstrap fields into the client's body once per leg. As Python the
bounds were a byte loop with a set test per byte, the pieces two memoryview slices and a join,
and the room a ``%d`` format of the whole field list: ~10k instructions of a 2 KB PD request under
callgrind. Here they are a scan of the few whitespace bytes at each end, a size sum and four
``memcpy`` calls, and the room's digits written behind a prefix built once per prefill target.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdlib cimport free, malloc
from libc.string cimport memchr, memcpy


cdef inline bint _ws(unsigned char c) noexcept:
    return c == 32 or c == 9 or c == 10 or c == 13  # JSON whitespace


cdef tuple _bounds(const unsigned char *body, Py_ssize_t n):
    cdef Py_ssize_t end = n - 1
    cdef Py_ssize_t start = 0
    cdef Py_ssize_t j
    while end >= 0 and _ws(body[end]):
        end -= 1
    while start < end and _ws(body[start]):
        start += 1
    if end <= start or body[end] != 0x7D or body[start] != 0x7B:
        raise ValueError("not a JSON object")
    j = end - 1
    while j > start and _ws(body[j]):
        j -= 1
    return end, j == start


cpdef tuple object_bounds(body):
    """(index of the top-level closing brace, whether the object is empty) of a body that is,
    modulo JSON whitespace, ``{...}``; ValueError for anything else. The body is assumed to be
    valid JSON (parse_request read it): in a valid object the token before the closing brace is
    the object's own opening brace (empty) or the end of a value, never ``{``. Bytes are read
    in place; any other buffer through a memoryview."""
    cdef const unsigned char[::1] view
    if type(body) is bytes:
        return _bounds(<const unsigned char *>PyBytes_AS_STRING(body), PyBytes_GET_SIZE(body))
    view = body
    if view.shape[0] == 0:
        raise ValueError("not a JSON object")
    return _bounds(&view[0], view.shape[0])


cpdef bytes framed(bytes head, bytes body, Py_ssize_t end, bytes mid):
    """``head + body[:end] + mid + body[end:]`` in one allocation (a leg's whole request)."""
    cdef Py_ssize_t nh = PyBytes_GET_SIZE(head)
    cdef Py_ssize_t nb = PyBytes_GET_SIZE(body)
    cdef Py_ssize_t nm = PyBytes_GET_SIZE(mid)
    if not 0 <= end <= nb:
        raise ValueError("splice point outside the body")
    cdef bytes out = PyBytes_FromStringAndSize(NULL, nh + nb + nm)
    cdef char *p = PyBytes_AS_STRING(out)
    cdef const char *b = PyBytes_AS_STRING(body)
    memcpy(p, PyBytes_AS_STRING(head), nh)
    p += nh
    memcpy(p, b, end)
    p += end
    memcpy(p, PyBytes_AS_STRING(mid), nm)
    memcpy(p + nm, b + end, nb - end)
    return out


cdef inline Py_ssize_t _digits(char *digits, unsigned long long v, unsigned int base) noexcept:
    """Writes ``v`` in ``base`` (10, or 16 in lower case) at the end of the 24-byte ``digits``;
    returns where it starts."""
    cdef Py_ssize_t k = 24
    while True:
        k -= 1
        digits[k] = b"0123456789abcdef"[v % base]
        v //= base
        if v == 0:
            return k


cpdef bytes with_int(bytes prefix, long long value):
    """``prefix`` followed by the decimal digits of ``value`` (a bootstrap room behind its keys)."""
    cdef char digits[24]
    cdef Py_ssize_t k = _digits(digits, <unsigned long long>(-value) if value < 0 else <unsigned long long>value, 10)
    if value < 0:
        k -= 1
        digits[k] = b"-"
    cdef Py_ssize_t n = PyBytes_GET_SIZE(prefix)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n + 24 - k)
    cdef char *p = PyBytes_AS_STRING(out)
    memcpy(p, PyBytes_AS_STRING(prefix), n)
    memcpy(p + n, &digits[k], 24 - k)
    return out


cpdef bytes post_head(bytes url, bytes host_part, Py_ssize_t length, bytes fwd, bytes auth):
    """``POST <url>`` + ``host_part`` (`` HTTP/1.1`` up to ``Content-Length: ``, fixed per
    route) + the length's digits + CRLF + the forwarded headers + the Authorization line + the
    blank line: an upstream request head, without parsing a format string."""
    cdef char digits[24]
    cdef Py_ssize_t k = _digits(digits, <unsigned long long>length if length > 0 else 0, 10)
    cdef Py_ssize_t nu = PyBytes_GET_SIZE(url)
    cdef Py_ssize_t nh = PyBytes_GET_SIZE(host_part)
    cdef Py_ssize_t nf = PyBytes_GET_SIZE(fwd)
    cdef Py_ssize_t na = PyBytes_GET_SIZE(auth)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 5 + nu + nh + (24 - k) + 2 + nf + na + 2)
    cdef char *p = PyBytes_AS_STRING(out)
    memcpy(p, b"POST ", 5)
    p += 5
    memcpy(p, PyBytes_AS_STRING(url), nu)
    p += nu
    memcpy(p, PyBytes_AS_STRING(host_part), nh)
    p += nh
    memcpy(p, &digits[k], 24 - k)
    p += 24 - k
    memcpy(p, b"\r\n", 2)
    p += 2
    memcpy(p, PyBytes_AS_STRING(fwd), nf)
    p += nf
    memcpy(p, PyBytes_AS_STRING(auth), na)
    p += na
    memcpy(p, b"\r\n", 2)
    return out


cpdef bytes target_path(bytes url):
    """The path of a request target: ``url`` itself (no copy) when it has no query, else the
    bytes before the first ``?`` (``url.partition(b"?")[0]`` without the tuple)."""
    cdef const char *p = PyBytes_AS_STRING(url)
    cdef const char *q = <const char *>memchr(p, 63, PyBytes_GET_SIZE(url))
    if q == NULL:
        return url
    return PyBytes_FromStringAndSize(p, q - p)


cpdef bytes chunk(bytes head, bytes data):
    """``head`` (None: nothing) then ``data`` framed as one HTTP/1.1 chunk (hex size, CRLF, the
    bytes, CRLF), in one allocation: a response body piece, behind the head while that is
    still unsent. ``data`` must not be empty (an empty chunk ends the body)."""
    cdef Py_ssize_t nh = 0 if head is None else PyBytes_GET_SIZE(head)
    cdef Py_ssize_t nd = PyBytes_GET_SIZE(data)
    cdef char digits[24]
    if nd == 0:
        raise ValueError("an empty chunk ends the body")
    cdef Py_ssize_t k = _digits(digits, <unsigned long long>nd, 16)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, nh + (24 - k) + 2 + nd + 2)
    cdef char *p = PyBytes_AS_STRING(out)
    if nh:
        memcpy(p, PyBytes_AS_STRING(head), nh)
        p += nh
    memcpy(p, &digits[k], 24 - k)
    p += 24 - k
    memcpy(p, b"\r\n", 2)
    memcpy(p + 2, PyBytes_AS_STRING(data), nd)
    memcpy(p + 2 + nd, b"\r\n", 2)
    return out


cpdef bytes joined(list parts):
    """``b"".join(parts)`` for a list of bytes objects: one size sum and one copy each, without
    the buffer protocol per item. TypeError for an item that is not bytes."""
    cdef Py_ssize_t n = PyList_GET_SIZE(parts)
    cdef Py_ssize_t i, total = 0, m
    cdef object item
    for i in range(n):
        item = <object>PyList_GET_ITEM(parts, i)
        if type(item) is not bytes:
            raise TypeError("joined: item %d is %s, not bytes" % (i, type(item).__name__))
        total += PyBytes_GET_SIZE(item)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, total)
    cdef char *p = PyBytes_AS_STRING(out)
    for i in range(n):
        item = <object>PyList_GET_ITEM(parts, i)
        m = PyBytes_GET_SIZE(item)
        memcpy(p, PyBytes_AS_STRING(item), m)
        p += m
    return out


# What the client head does with a worker header (copied_headers).
cdef enum:
    COPY = 0
    DROP = 1
    LENGTH = 2
    CTYPE = 3


cdef inline bint _named(const unsigned char *p, const char *lower, Py_ssize_t n) noexcept:
    """Whether the n bytes at p are ``lower`` (lower-case letters and '-') as bytes.lower()
    sees them: a letter in either case, '-' itself."""
    cdef Py_ssize_t i
    cdef unsigned char t
    for i in range(n):
        t = <unsigned char>lower[i]
        if p[i] != t and (t == 45 or (p[i] | 0x20) != t):
            return False
    return True


cdef struct _Name:
    const char *lower  # the name in lower case
    Py_ssize_t n
    int kind

# The worker headers the client head does not copy as they are: hop-by-hop ones, those the
# router sets itself, and the two it reads (Content-Length kept for a byte-exact relay,
# Content-Type dropped where the router sets its own).
cdef _Name _NAMES[15]
_NAMES[:] = [
    _Name(b"te", 2, DROP),
    _Name(b"host", 4, DROP),
    _Name(b"trailer", 7, DROP),
    _Name(b"upgrade", 7, DROP),
    _Name(b"trailers", 8, DROP),
    _Name(b"connection", 10, DROP),
    _Name(b"keep-alive", 10, DROP),
    _Name(b"content-type", 12, CTYPE),
    _Name(b"x-request-id", 12, DROP),
    _Name(b"content-length", 14, LENGTH),
    _Name(b"proxy-connection", 16, DROP),
    _Name(b"content-encoding", 16, DROP),
    _Name(b"transfer-encoding", 17, DROP),
    _Name(b"proxy-authenticate", 18, DROP),
    _Name(b"proxy-authorization", 19, DROP),
]


cdef int _kind(const unsigned char *p, Py_ssize_t n) noexcept:
    """COPY, DROP, LENGTH or CTYPE for a header name (_NAMES; a length compare first)."""
    cdef int i
    for i in range(15):
        if _NAMES[i].n == n and _named(p, _NAMES[i].lower, n):
            return _NAMES[i].kind
    return COPY


cpdef tuple copied_headers(list headers, bint drop_ctype):
    """(the ``name: value`` CRLF lines of the worker headers the client gets, the value of the
    first Content-Length or None) for ``headers``, a list of (name, value) bytes pairs. Not
    copied: hop-by-hop headers, Host, Content-Encoding, Content-Length and X-Request-Id (the
    router sets its own), and Content-Type when ``drop_ctype`` (the router sets it)."""
    cdef Py_ssize_t count = PyList_GET_SIZE(headers)
    cdef Py_ssize_t i, size = 0, nn, nv
    cdef int k
    cdef object pair, name, value
    cdef object length = None
    cdef unsigned char small[32]
    cdef unsigned char *keep = &small[0]
    cdef char *w
    if count > 32:
        keep = <unsigned char *>malloc(count)
        if keep == NULL:
            raise MemoryError()
    try:
        for i in range(count):  # which lines go, and their size
            pair = <object>PyList_GET_ITEM(headers, i)
            if type(pair) is not tuple or PyTuple_GET_SIZE(pair) != 2:
                raise TypeError("headers must be (name, value) pairs of bytes")
            name = <object>PyTuple_GET_ITEM(pair, 0)
            value = <object>PyTuple_GET_ITEM(pair, 1)
            if type(name) is not bytes or type(value) is not bytes:
                raise TypeError("headers must be (name, value) pairs of bytes")
            nn = PyBytes_GET_SIZE(<bytes>name)
            k = _kind(<const unsigned char *>PyBytes_AS_STRING(<bytes>name), nn)
            keep[i] = k == COPY or (k == CTYPE and not drop_ctype)
            if k == LENGTH and length is None:
                length = value
            if keep[i]:
                size += nn + PyBytes_GET_SIZE(<bytes>value) + 4
        out = PyBytes_FromStringAndSize(NULL, size)
        w = PyBytes_AS_STRING(out)
        for i in range(count):
            if not keep[i]:
                continue
            pair = <object>PyList_GET_ITEM(headers, i)
            name = <object>PyTuple_GET_ITEM(pair, 0)
            value = <object>PyTuple_GET_ITEM(pair, 1)
            nn = PyBytes_GET_SIZE(<bytes>name)
            nv = PyBytes_GET_SIZE(<bytes>value)
            memcpy(w, PyBytes_AS_STRING(<bytes>name), nn)
            w[nn] = 58  # :
            w[nn + 1] = 32
            memcpy(w + nn + 2, PyBytes_AS_STRING(<bytes>value), nv)
            w[nn + 2 + nv] = 13
            w[nn + 3 + nv] = 10
            w += nn + nv + 4
        return out, length
    finally:
        if keep != &small[0]:
            free(keep)
