/* fr_jsonscan.h: the inner loop of fastroute's request-body scanner (dataplane/_jsonscan.pyx).
 *
 * A request body is mostly the prompt: long runs of plain string bytes.  fr_plain_end finds the
 * end of such a run, the first byte that a JSON string scanner has to look at: a quote, a
 * backslash, a control character (< 0x20, invalid in a JSON string) or a non-ASCII byte (the
 * scanner leaves UTF-8 to the full decoder).  On x86-64 it tests 16 bytes per step with SSE2
 * (part of the x86-64 baseline, so no runtime dispatch): one signed compare catches both the
 * control characters and the bytes >= 0x80, which are negative as signed chars.  Elsewhere it
 * runs the same test one byte at a time.
 */
#ifndef FR_JSONSCAN_H
#define FR_JSONSCAN_H

#include <stddef.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

static inline int fr_plain_byte(unsigned char c) {
    return c >= 0x20 && c < 0x80 && c != '"' && c != '\\';
}

/* The first byte in [p, end) that is not a plain string byte, or end. */
static inline const unsigned char *fr_plain_end(const unsigned char *p, const unsigned char *end) {
#if defined(__SSE2__)
    const __m128i quote = _mm_set1_epi8('"');
    const __m128i backslash = _mm_set1_epi8('\\');
    const __m128i space = _mm_set1_epi8(0x20);
    while (end - p >= 32) {
        __m128i a = _mm_loadu_si128((const __m128i *)p);
        __m128i b = _mm_loadu_si128((const __m128i *)(p + 16));
        __m128i ma = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(a, quote), _mm_cmpeq_epi8(a, backslash)),
                                  _mm_cmplt_epi8(a, space));
        __m128i mb = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(b, quote), _mm_cmpeq_epi8(b, backslash)),
                                  _mm_cmplt_epi8(b, space));
        unsigned int bits = (unsigned int)_mm_movemask_epi8(ma) | ((unsigned int)_mm_movemask_epi8(mb) << 16);
        if (bits)
            return p + __builtin_ctz(bits);
        p += 32;
    }
    if (end - p >= 16) {
        __m128i a = _mm_loadu_si128((const __m128i *)p);
        __m128i ma = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(a, quote), _mm_cmpeq_epi8(a, backslash)),
                                  _mm_cmplt_epi8(a, space));
        unsigned int bits = (unsigned int)_mm_movemask_epi8(ma);
        if (bits)
            return p + __builtin_ctz(bits);
        p += 16;
    }
#endif
    while (p < end && fr_plain_byte(*p))
        p++;
    return p;
}

#endif
