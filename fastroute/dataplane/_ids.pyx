"""Request ids, compiled: 96 random bits as 24 lowercase hex characters behind a prefix.

An id is a correlation tag, not a secret (protocol.md 6.1 asks only that it be alphanumeric and
unique enough): the bits come from xoshiro256**, seeded from the OS at import and again in a
child started by fork, so processes never hand out the same sequence. As Python (a Mersenne
Twister's 96-bit int formatted with ``%024x``) an id cost ~3.5k instructions per request, 2% of a
PD request; this is a copy of the prefix and 24 table lookups.
"""

import os

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport uint64_t
from libc.string cimport memcpy

cdef uint64_t _state[4]
cdef const char *_HEX = b"0123456789abcdef"


cdef inline uint64_t _rotl(uint64_t x, int k) noexcept:
    return (x << k) | (x >> (64 - k))


cdef inline uint64_t _next() noexcept:
    # xoshiro256** (Blackman and Vigna): the published recurrence, 2^256 - 1 period.
    cdef uint64_t result = _rotl(_state[1] * 5, 7) * 9
    cdef uint64_t t = _state[1] << 17
    _state[2] ^= _state[0]
    _state[3] ^= _state[1]
    _state[1] ^= _state[2]
    _state[0] ^= _state[3]
    _state[2] ^= t
    _state[3] = _rotl(_state[3], 45)
    return result


cdef inline uint64_t _mix(uint64_t z) noexcept:
    # splitmix64's finaliser: spreads a seed word over all 64 bits (xoshiro's authors' advice
    # for seeding; a sparse state would give sparse first outputs).
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


def seed(key=None):
    """Seed the generator from 32 bytes: ``key``, or the OS's when None (import, fork child)."""
    cdef bytes b = os.urandom(32) if key is None else bytes(key)
    cdef int i, j
    cdef uint64_t w
    if len(b) != 32:
        raise ValueError("a seed is 32 bytes")
    for i in range(4):
        w = 0
        for j in range(8):
            w = (w << 8) | <unsigned char>b[i * 8 + j]
        _state[i] = _mix(w + <uint64_t>(i + 1) * 0x9E3779B97F4A7C15ULL)
    if (_state[0] | _state[1] | _state[2] | _state[3]) == 0:
        _state[0] = 1  # the one state the recurrence never leaves


cpdef bytes request_id(bytes prefix):
    """``prefix`` followed by 24 lowercase hex characters (96 fresh random bits)."""
    cdef Py_ssize_t n = len(prefix)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n + 24)
    cdef char *buf = PyBytes_AS_STRING(out)
    cdef uint64_t a = _next()
    cdef uint64_t b = _next() >> 32
    cdef int i
    memcpy(buf, PyBytes_AS_STRING(prefix), n)
    buf += n
    for i in range(16):
        buf[i] = _HEX[(a >> (60 - 4 * i)) & 15]
    for i in range(8):
        buf[16 + i] = _HEX[(b >> (28 - 4 * i)) & 15]
    return out


seed()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=seed)
