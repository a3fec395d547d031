"""The top-level keys of a request body that the router reads, found in one pass over the bytes.

The fast path of ``fields.FieldPicker.pick``. A body is mostly its prompt; decoding it with a
general JSON decoder costs a byte-at-a-time scan of every string (msgspec: ~11 us per 48 KB,
whether it builds the string or skips it). This scanner walks the body's structure, validates every
value it skips, and runs through string contents 32 bytes per step (64 with AVX2,
csrc/fr_jsonscan.h). Only the values of the keys asked for become Python objects: strings, numbers,
booleans and null are built here (a string in one copy, escapes translated; a float as json's
``float()`` parses it), objects and arrays (``sampling_params``, ``input_ids``) are decoded from
their slice by msgspec. A chat body's ``messages`` become one ``Chat`` (count, input estimate,
routing text on demand) when every content is absent, null or a plain string; other shapes (content
parts) are left undecided, for msgspec's typed decode into ``fields.Message`` objects. A flat
``input_ids`` array of non-negative integers becomes one ``Ids`` (count, routing text and the list
on demand): a 12k-token prompt is ~90 KB of digits, whose list of ints cost ~300 us to build on
every request that only needed its length.

It answers a dict only where json.loads would accept the body and give the same values for
those keys; anything it does not decide answers None, and the caller takes its slower path,
which decides (and answers 400 where json refuses). None for: a byte >= 0x80 anywhere (UTF-8 is
left to the full decoders), a control character in a string, an invalid escape or an escaped
surrogate, a key spelled with an escape, NaN/Infinity, a number over 600 characters (json
refuses integers over ``sys.int_max_str_digits``, whose least setting is 640), nesting deeper
than 128, a top level that is not one object, and any syntax error.
"""

from libc.stdlib cimport free, realloc
from libc.string cimport memcmp, memcpy
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.object cimport PyObject

import msgspec

cdef extern from "fr_jsonscan.h" nogil:
    const unsigned char *fr_plain_end(const unsigned char *p, const unsigned char *end)
    int fr_use_avx2(int on)

cdef extern from "Python.h":
    object PyUnicode_New(Py_ssize_t size, Py_UCS4 maxchar)
    void *PyUnicode_DATA(object o)
    double PyOS_string_to_double(const char *s, char **endptr, PyObject *overflow_exception) except? -1.0

cdef enum:
    QUOTE = 34
    BACKSLASH = 92
    MAX_DEPTH = 128
    MAX_NUMBER = 600
    # _string_end's flags
    ESCAPED = 1        # holds an escape (the str is built by translating them)
    WIDE = 2           # holds a \\u escape above 0x7f (the str is left to msgspec)

cdef object _decode = msgspec.json.Decoder().decode
cdef tuple _DECODE_ERRORS = (msgspec.DecodeError, RecursionError, ValueError)
cdef bytes _CONTENT = b"content"
cdef object _UNDECIDED = object()  # what a value builder answers for "leave it to msgspec"


cdef inline bint _is_ws(unsigned char c) noexcept nogil:
    return c == 32 or c == 10 or c == 13 or c == 9


cdef inline const unsigned char *_skip_ws(const unsigned char *p, const unsigned char *end) noexcept nogil:
    while p < end and _is_ws(p[0]):
        p += 1
    return p


cdef inline int _hex(unsigned char c) noexcept nogil:
    if 48 <= c <= 57:
        return c - 48
    if 97 <= c <= 102:
        return c - 87
    if 65 <= c <= 70:
        return c - 55
    return -1


cdef inline int _hex4(const unsigned char *p) noexcept nogil:
    """The value of four hex digits at p (the caller checked they are there), or -1."""
    cdef int a = _hex(p[0]), b = _hex(p[1]), c = _hex(p[2]), d = _hex(p[3])
    if a < 0 or b < 0 or c < 0 or d < 0:
        return -1
    return (a << 12) | (b << 8) | (c << 4) | d


cdef const unsigned char *_string_end(
    const unsigned char *p, const unsigned char *end, Py_ssize_t *chars, int *flags
) noexcept nogil:
    """p: just after a string's opening quote. The pointer after its closing quote, with the
    decoded length in ``chars`` and ESCAPED/WIDE in ``flags``; NULL where the scan does not
    decide (see the module docstring)."""
    cdef const unsigned char *start = p
    cdef Py_ssize_t removed = 0
    cdef unsigned char c
    cdef int f = 0, code
    while True:
        p = fr_plain_end(p, end)
        if p >= end:
            return NULL
        c = p[0]
        if c == QUOTE:
            chars[0] = (p - start) - removed
            flags[0] = f
            return p + 1
        if c != BACKSLASH or end - p < 2:
            return NULL  # a control character or a byte >= 0x80, or a cut escape
        c = p[1]
        if c == 117:  # \uXXXX
            if end - p < 6:
                return NULL
            code = _hex4(p + 2)
            if code < 0 or 0xD800 <= code <= 0xDFFF:
                return NULL
            if code > 0x7F:
                f |= WIDE
            f |= ESCAPED
            removed += 5
            p += 6
        elif c == QUOTE or c == BACKSLASH or c == 47 or c == 98 or c == 102 or c == 110 or c == 114 or c == 116:
            f |= ESCAPED
            removed += 1
            p += 2
        else:
            return NULL


cdef const unsigned char *_number_end(const unsigned char *p, const unsigned char *end) noexcept nogil:
    cdef const unsigned char *start = p
    if p < end and p[0] == 45:  # -
        p += 1
    if p >= end:
        return NULL
    if p[0] == 48:  # a leading 0 stands alone
        p += 1
    elif 49 <= p[0] <= 57:
        while p < end and 48 <= p[0] <= 57:
            p += 1
    else:
        return NULL
    if p < end and p[0] == 46:  # .
        p += 1
        if p >= end or not (48 <= p[0] <= 57):
            return NULL
        while p < end and 48 <= p[0] <= 57:
            p += 1
    if p < end and (p[0] == 101 or p[0] == 69):  # e E
        p += 1
        if p < end and (p[0] == 43 or p[0] == 45):
            p += 1
        if p >= end or not (48 <= p[0] <= 57):
            return NULL
        while p < end and 48 <= p[0] <= 57:
            p += 1
    if p - start > MAX_NUMBER:
        return NULL
    return p


cdef inline const unsigned char *_word_end(
    const unsigned char *p, const unsigned char *end, const char *word, Py_ssize_t n
) noexcept nogil:
    if end - p < n or memcmp(p, word, n) != 0:
        return NULL
    return p + n


cdef inline const unsigned char *_open(
    const unsigned char *p, const unsigned char *end, unsigned char opening, bint *closed
) noexcept nogil:
    """p: where an object (``{``) or array (``[``) must open. Past the opening byte and the
    whitespace after it; when the container is empty, past its closing byte with ``closed``
    True. NULL when it does not open at p."""
    if p >= end or p[0] != opening:
        closed[0] = False
        return NULL
    p = _skip_ws(p + 1, end)
    closed[0] = p < end and p[0] == opening + 2  # } is { + 2, ] is [ + 2
    return p + 1 if closed[0] else p


cdef inline bint _is_content(const unsigned char *key, Py_ssize_t n) noexcept:
    return n == 7 and memcmp(key, PyBytes_AS_STRING(_CONTENT), 7) == 0


cdef inline const unsigned char *_member(
    const unsigned char *p, const unsigned char *end, const unsigned char **key, Py_ssize_t *n, bint escaped_ok
) noexcept nogil:
    """p: an object member's opening quote. The pointer to its value (past the colon and the
    whitespace after it), the key's raw bytes in ``key``/``n``; NULL on a syntax error, or for a
    key spelled with an escape unless ``escaped_ok`` (a key the scan compares must be plain)."""
    cdef Py_ssize_t chars
    cdef int flags
    if p >= end or p[0] != QUOTE:
        return NULL
    key[0] = p + 1
    p = _string_end(p + 1, end, &chars, &flags)
    if p == NULL or (flags and not escaped_ok):
        return NULL
    n[0] = p - 1 - key[0]
    p = _skip_ws(p, end)
    if p >= end or p[0] != 58:  # :
        return NULL
    return _skip_ws(p + 1, end)


cdef inline const unsigned char *_after(
    const unsigned char *p, const unsigned char *end, unsigned char close, bint *closed
) noexcept nogil:
    """p: just after a member or an item. Past the comma and the whitespace after it (``closed``
    False) or past the ``close`` byte (``closed`` True); NULL on anything else."""
    p = _skip_ws(p, end)
    if p >= end:
        return NULL
    if p[0] == 44:  # ,
        closed[0] = False
        return _skip_ws(p + 1, end)
    if p[0] == close:
        closed[0] = True
        return p + 1
    return NULL


cdef const unsigned char *_skip_value(const unsigned char *p, const unsigned char *end, int depth) noexcept nogil:
    """p: a value's first byte. The pointer after the value, or NULL (invalid or undecided)."""
    cdef const unsigned char *key
    cdef Py_ssize_t chars
    cdef int flags
    cdef bint closed
    cdef unsigned char c
    if p >= end:
        return NULL
    c = p[0]
    if c == QUOTE:
        return _string_end(p + 1, end, &chars, &flags)
    if c == 123 or c == 91:  # { [
        if depth >= MAX_DEPTH:
            return NULL
        p = _open(p, end, c, &closed)
        if closed:
            return p
        while True:
            if c == 123:
                p = _member(p, end, &key, &chars, True)
                if p == NULL:
                    return NULL
            p = _skip_value(p, end, depth + 1)
            if p == NULL:
                return NULL
            p = _after(p, end, c + 2, &closed)
            if p == NULL or closed:
                return p
    if c == 116:
        return _word_end(p, end, b"true", 4)
    if c == 102:
        return _word_end(p, end, b"false", 5)
    if c == 110:
        return _word_end(p, end, b"null", 4)
    return _number_end(p, end)


cdef unsigned char *_ascii_into(unsigned char *w, const unsigned char *p, Py_ssize_t raw, int flags) noexcept:
    """Write the decoded ASCII text of a scanned string (``raw`` bytes at p, no WIDE escape) at
    w; the position after it."""
    cdef const unsigned char *end = p + raw
    cdef const unsigned char *run
    cdef unsigned char c
    if not (flags & ESCAPED):
        memcpy(w, p, raw)
        return w + raw
    while p < end:
        run = p
        while p < end and p[0] != BACKSLASH:
            p += 1
        memcpy(w, run, p - run)
        w += p - run
        if p >= end:
            break
        c = p[1]
        if c == 117:
            w[0] = <unsigned char>_hex4(p + 2)
            p += 6
        else:
            if c == 98:
                c = 8
            elif c == 102:
                c = 12
            elif c == 110:
                c = 10
            elif c == 114:
                c = 13
            elif c == 116:
                c = 9
            w[0] = c  # \\ \" \/ stand for themselves
            p += 2
        w += 1
    return w


cdef object _ascii_str(const unsigned char *p, Py_ssize_t raw, Py_ssize_t chars, int flags):
    """The str of a scanned string without WIDE escapes: ``raw`` bytes at p, ``chars`` decoded."""
    cdef object s = PyUnicode_New(chars, 127)
    _ascii_into(<unsigned char *>PyUnicode_DATA(s), p, raw, flags)
    return s


cdef class Chat:
    """A chat body's ``messages`` when every message is an object whose ``content`` is absent,
    null or a string without escapes above 0x7f (ASCII: one character per byte): how many
    messages, the input estimate of their contents (the sum of ``ceil(len / 4)``, as
    body.estimate_tokens gives for ASCII), and the routing text, built only when asked. No
    per-message object or string is made."""

    # (fields and add() declared in _jsonscan.pxd: body.py reads count and tokens in C)

    def __dealloc__(self):
        free(self.parts)

    cdef int add(self, Py_ssize_t start, Py_ssize_t raw, Py_ssize_t chars, int flags) except -1:
        cdef _Part *grown
        if self.nparts == self.cap:
            grown = <_Part *>realloc(self.parts, (self.cap * 2 + 16) * sizeof(_Part))
            if grown == NULL:
                raise MemoryError()
            self.parts = grown
            self.cap = self.cap * 2 + 16
        self.parts[self.nparts] = _Part(start, raw, chars, flags)
        self.nparts += 1
        self.tokens += (chars + 3) >> 2
        return 0

    def routing_text(self):
        """The string contents joined by newlines (body.RequestMeta.routing_text's chat
        rule), or None when no message has one."""
        cdef Py_ssize_t i, total
        cdef unsigned char *w
        cdef const unsigned char *base = <const unsigned char *>PyBytes_AS_STRING(self.body)
        if self.nparts == 0:
            return None
        total = self.nparts - 1
        for i in range(self.nparts):
            total += self.parts[i].chars
        s = PyUnicode_New(total, 127)
        w = <unsigned char *>PyUnicode_DATA(s)
        for i in range(self.nparts):
            if i:
                w[0] = 10
                w += 1
            w = _ascii_into(w, base + self.parts[i].start, self.parts[i].raw, self.parts[i].flags)
        return s

    def __repr__(self):
        return f"Chat(count={self.count}, tokens={self.tokens})"


cdef object _number(const unsigned char *p, const unsigned char *end):
    """The value json gives a number token [p, end) (checked by _number_end): an int, or a
    float parsed as json's float() does (correctly rounded; 1e999 is inf); _UNDECIDED if the
    parser stops short."""
    cdef const unsigned char *q = p
    cdef long long v = 0
    cdef char *stop
    cdef double d
    while q < end:
        if q[0] == 46 or q[0] == 101 or q[0] == 69:  # . e E
            d = PyOS_string_to_double(<const char *>p, &stop, NULL)
            if <const unsigned char *>stop != end:
                return _UNDECIDED  # (a checked token always parses whole)
            return d
        q += 1
    if end - p > 18:  # over int64: json's int() of the digits
        return int(PyBytes_FromStringAndSize(<const char *>p, end - p))
    q = p + 1 if p[0] == 45 else p
    while q < end:
        v = v * 10 + (q[0] - 48)
        q += 1
    return -v if p[0] == 45 else v


cdef object _value(const unsigned char **at, const unsigned char *end):
    """The value at ``*at`` as json gives it, moving ``*at`` past it; _UNDECIDED when the scan
    does not decide it (invalid, or a float or escape msgspec refuses)."""
    cdef const unsigned char *start = at[0]
    cdef const unsigned char *after
    cdef Py_ssize_t chars
    cdef int flags
    cdef unsigned char c
    if start < end and start[0] == QUOTE:
        after = _string_end(start + 1, end, &chars, &flags)
        if after == NULL:
            return _UNDECIDED
        at[0] = after
        if not (flags & WIDE):
            return _ascii_str(start + 1, after - start - 2, chars, flags)
    else:
        after = _skip_value(start, end, 1)
        if after == NULL:
            return _UNDECIDED
        at[0] = after
        c = start[0]
        if c == 116 or c == 102 or c == 110:  # true false null
            return True if c == 116 else (False if c == 102 else None)
        if c != 123 and c != 91:  # a number
            return _number(start, after)
    try:  # an object, an array, a string with escapes above 0x7f
        return _decode(PyBytes_FromStringAndSize(<const char *>start, after - start))
    except _DECODE_ERRORS:
        return _UNDECIDED


cdef object _chat(const unsigned char **at, const unsigned char *end, bytes body):
    """The ``messages`` value at ``*at`` as a Chat, moving ``*at`` past it. Not an array: the
    value as json gives it. _UNDECIDED when a message is not an object, or its content is not
    absent, null or a plain string (a list of parts, a number, an escape above 0x7f): msgspec's
    typed decode reads those as ``fields.Message`` objects."""
    cdef const unsigned char *p = at[0]
    cdef const unsigned char *key
    cdef const unsigned char *text
    cdef Py_ssize_t n, raw = 0, text_chars = 0
    cdef int text_flags = 0
    cdef bint closed, done
    cdef Chat chat
    if p >= end or p[0] != 91:
        return _value(at, end)
    chat = Chat.__new__(Chat)
    chat.body = body
    p = _open(p, end, 91, &closed)
    while not closed:
        text = NULL
        p = _open(p, end, 123, &done)
        if p == NULL:
            return _UNDECIDED
        while not done:
            p = _member(p, end, &key, &n, False)
            if p == NULL:
                return _UNDECIDED
            if _is_content(key, n):
                if p < end and p[0] == QUOTE:
                    text = p + 1
                    p = _string_end(text, end, &text_chars, &text_flags)
                    if p == NULL or (text_flags & WIDE):
                        return _UNDECIDED
                    raw = p - 1 - text
                else:
                    p = _word_end(p, end, b"null", 4)
                    text = NULL
            else:
                p = _skip_value(p, end, 3)
            if p == NULL:
                return _UNDECIDED
            p = _after(p, end, 125, &done)
            if p == NULL:
                return _UNDECIDED
        if text != NULL:
            chat.add(text - <const unsigned char *>PyBytes_AS_STRING(body), raw, text_chars, text_flags)
        chat.count += 1
        p = _after(p, end, 93, &closed)
        if p == NULL:
            return _UNDECIDED
    at[0] = p
    return chat


cdef class Ids:
    """``input_ids`` as a flat array of non-negative integers of at most 18 digits, kept as its
    bytes in the body: ``len()`` is the count, ``text(limit)`` the prefix tree's text of the
    first ``limit`` ids (idtext.ids_text's spelling: the digits, one space between ids),
    ``tolist()`` the list json gives."""

    def __len__(self):
        return self.count

    def tolist(self):
        """The ids as json decodes them (a list of ints)."""
        return _decode(self.body[self.start:self.stop])

    def text(self, Py_ssize_t limit):
        """The first ``limit`` ids, digits separated by single spaces; None when there are none."""
        cdef const unsigned char *base = <const unsigned char *>PyBytes_AS_STRING(self.body)
        cdef const unsigned char *p = base + self.start + 1
        cdef const unsigned char *end = base + self.stop
        cdef const unsigned char *q
        cdef Py_ssize_t n = 0, size = 0, i
        cdef unsigned char *w
        if self.count == 0 or limit <= 0:
            return None
        if limit > self.count:
            limit = self.count
        q = p
        for i in range(limit):  # the length first: each id's digits and a space after all but the last
            while not (48 <= q[0] <= 57):
                q += 1
            while q < end and 48 <= q[0] <= 57:
                q += 1
                size += 1
        size += limit - 1
        s = PyUnicode_New(size, 127)
        w = <unsigned char *>PyUnicode_DATA(s)
        for i in range(limit):
            while not (48 <= p[0] <= 57):
                p += 1
            q = p
            while q < end and 48 <= q[0] <= 57:
                q += 1
            if i:
                w[0] = 32
                w += 1
            memcpy(w, p, q - p)
            w += q - p
            p = q
        return s

    def __repr__(self):
        return f"Ids(count={self.count})"


cdef object _ids(const unsigned char **at, const unsigned char *end, bytes body):
    """The ``input_ids`` value at ``*at`` as an Ids when it is a flat array of non-negative
    integers of at most 18 digits (moving ``*at`` past it); any other value as json gives it
    (``_value``: a batch, a negative or float item, a syntax error for the decoders)."""
    cdef const unsigned char *p = at[0]
    cdef const unsigned char *d
    cdef const unsigned char *base = <const unsigned char *>PyBytes_AS_STRING(body)
    cdef Py_ssize_t count = 0
    cdef bint closed
    cdef Ids ids
    if p >= end or p[0] != 91:
        return _value(at, end)
    p = _open(p, end, 91, &closed)
    while not closed:
        d = p
        if p < end and p[0] == 48:  # a leading 0 stands alone (0123 is left to _value: refused)
            p += 1
        else:
            while p < end and 48 <= p[0] <= 57:
                p += 1
        if p == d or p - d > 18 or (p < end and (p[0] == 46 or p[0] == 101 or p[0] == 69)):
            return _value(at, end)
        count += 1
        p = _after(p, end, 93, &closed)
        if p == NULL:
            return _value(at, end)
    ids = Ids.__new__(Ids)
    ids.body = body
    ids.start = at[0] - base
    ids.stop = p - base
    ids.count = count
    at[0] = p
    return ids


cdef class FieldScan:
    """The scan of one endpoint's read keys (``fields.READ_FIELDS``); a chat endpoint's
    ``messages`` become a Chat, ``/generate``'s flat ``input_ids`` an Ids."""

    def __init__(self, tuple names):
        self.names = names
        self.keys = tuple(n.encode("ascii") for n in names)
        self.messages_at = names.index("messages") if "messages" in names else -1
        self.ids_at = names.index("input_ids") if "input_ids" in names else -1

    cpdef object scan(self, bytes body):
        """The read keys present in ``body`` as json would decode them, or None (undecided)."""
        cdef const unsigned char *p = <const unsigned char *>PyBytes_AS_STRING(body)
        cdef const unsigned char *end = p + PyBytes_GET_SIZE(body)
        cdef const unsigned char *key
        cdef Py_ssize_t chars, i, n = len(self.keys)
        cdef bint closed
        cdef bytes k
        cdef object value
        cdef dict out = {}
        p = _open(_skip_ws(p, end), end, 123, &closed)
        if p == NULL:
            return None
        while not closed:
            p = _member(p, end, &key, &chars, False)
            if p == NULL:
                return None
            for i in range(n):
                k = <bytes>self.keys[i]
                if PyBytes_GET_SIZE(k) == chars and memcmp(key, PyBytes_AS_STRING(k), chars) == 0:
                    break
            else:
                i = -1
            if i >= 0:
                if i == self.messages_at:
                    value = _chat(&p, end, body)
                elif i == self.ids_at:
                    value = _ids(&p, end, body)
                else:
                    value = _value(&p, end)
                if value is _UNDECIDED:
                    return None
                out[self.names[i]] = value
            else:
                p = _skip_value(p, end, 1)
                if p == NULL:
                    return None
            p = _after(p, end, 125, &closed)
            if p == NULL:
                return None
        if _skip_ws(p, end) != end:
            return None
        return out


def use_avx2(bint on):
    """Tests: whether long string runs may take the AVX2 loop (where the CPU has it; the default)
    or stay on the SSE2 one. Answers whether the AVX2 loop is now in use."""
    return bool(fr_use_avx2(on))
