/* fr_jsonscan.h: the inner loop of fastroute's request-body scanner (dataplane/_jsonscan.pyx).
 *
 * A request body is mostly the prompt: long runs of plain string bytes.  fr_plain_end finds the
 * end of such a run, the first byte that a JSON string scanner has to look at: a quote, a
 * backslash, a control character (< 0x20, invalid in a JSON string) or a non-ASCII byte (the
 * scanner leaves UTF-8 to the full decoder).  On x86-64 it tests 32 bytes per step with SSE2
 * (part of the x86-64 baseline): one signed compare catches both the control characters and the
 * bytes >= 0x80, which are negative as signed chars.  A long run (a 48 KB prompt) goes 64 bytes
 * per step with AVX2 where the CPU has it, asked once per process (GCC and clang build the AVX2
 * function alone with the target attribute, so the module itself stays baseline x86-64).
 * Elsewhere the same test runs one byte at a time.
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

#if defined(__SSE2__) && defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FR_JSONSCAN_AVX2 1
#include <immintrin.h>

/* Runs of at least this many bytes take the AVX2 loop (below it the SSE2 loop is as quick). */
#define FR_AVX2_MIN 256

/* 1 where the CPU runs AVX2, 0 where not, -1 before the first ask. */
static int fr_avx2_state = -1;

static int fr_have_avx2(void) {
    if (fr_avx2_state < 0) {
        __builtin_cpu_init();
        fr_avx2_state = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return fr_avx2_state;
}

/* fr_plain_end's long-run loop: 64 bytes per step; stops with under 64 bytes left. */
__attribute__((target("avx2"))) static const unsigned char *fr_plain_end_avx2(const unsigned char *p,
                                                                              const unsigned char *end) {
    const __m256i quote = _mm256_set1_epi8('"');
    const __m256i backslash = _mm256_set1_epi8('\\');
    const __m256i space = _mm256_set1_epi8(0x20);
    while (end - p >= 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)p);
        __m256i b = _mm256_loadu_si256((const __m256i *)(p + 32));
        __m256i ma = _mm256_or_si256(_mm256_or_si256(_mm256_cmpeq_epi8(a, quote), _mm256_cmpeq_epi8(a, backslash)),
                                     _mm256_cmpgt_epi8(space, a));
        __m256i mb = _mm256_or_si256(_mm256_or_si256(_mm256_cmpeq_epi8(b, quote), _mm256_cmpeq_epi8(b, backslash)),
                                     _mm256_cmpgt_epi8(space, b));
        if (!_mm256_testz_si256(_mm256_or_si256(ma, mb), _mm256_or_si256(ma, mb))) {
            unsigned long long bits = (unsigned long long)(unsigned int)_mm256_movemask_epi8(ma) |
                                      ((unsigned long long)(unsigned int)_mm256_movemask_epi8(mb) << 32);
            return p + __builtin_ctzll(bits);
        }
        p += 64;
    }
    return p;
}
#endif

/* For tests: 1 lets long runs take the AVX2 loop (where the CPU has it), 0 keeps them on SSE2.
 * Answers whether the AVX2 loop is now in use. */
static inline int fr_use_avx2(int on) {
#if defined(FR_JSONSCAN_AVX2)
    fr_avx2_state = on ? -1 : 0;
    return fr_have_avx2();
#else
    (void)on;
    return 0;
#endif
}

/* The first byte in [p, end) that is not a plain string byte, or end. */
static inline const unsigned char *fr_plain_end(const unsigned char *p, const unsigned char *end) {
#if defined(FR_JSONSCAN_AVX2)
    if (end - p >= FR_AVX2_MIN && fr_have_avx2()) {
        p = fr_plain_end_avx2(p, end);
        if (end - p >= 64)
            return p; /* stopped on a byte that is not plain */
    }
#endif
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
