/*
 * SHA-256 for the C extensions (the FileStore's key digests, the queue's frame MAC): the x86 SHA
 * extensions where the CPU has them and they give the standard's answers, else portable rounds.
 * Compiled into each extension that uses it; checked against hashlib by tests.
 */
#include "sha256.h"

#include <string.h>

static const uint32_t K256[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

#define ROR32(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void blocks_portable(uint32_t st[8], const unsigned char *p, size_t nblocks)
{
    for (; nblocks--; p += 64) {
        uint32_t w[64];
        for (int t = 0; t < 16; t++)
            w[t] = (uint32_t)p[4 * t] << 24 | (uint32_t)p[4 * t + 1] << 16 | (uint32_t)p[4 * t + 2] << 8 | p[4 * t + 3];
        for (int t = 16; t < 64; t++) {
            uint32_t s0 = ROR32(w[t - 15], 7) ^ ROR32(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = ROR32(w[t - 2], 17) ^ ROR32(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        uint32_t a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6], h = st[7];
        for (int t = 0; t < 64; t++) {
            uint32_t t1 = h + (ROR32(e, 6) ^ ROR32(e, 11) ^ ROR32(e, 25)) + ((e & f) ^ (~e & g)) + K256[t] + w[t];
            uint32_t t2 = (ROR32(a, 2) ^ ROR32(a, 13) ^ ROR32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            h = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
        }
        st[0] += a, st[1] += b, st[2] += c, st[3] += d, st[4] += e, st[5] += f, st[6] += g, st[7] += h;
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_SHA_NI_PATH 1

__attribute__((target("sha,sse4.1,ssse3")))
static void sha256_blocks_ni(uint32_t st[8], const unsigned char *p, size_t nblocks)
{
    const __m128i mask = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)&st[0]);
    __m128i s1 = _mm_loadu_si128((const __m128i *)&st[4]);
    tmp = _mm_shuffle_epi32(tmp, 0xB1);              /* CDAB */
    s1 = _mm_shuffle_epi32(s1, 0x1B);                /* EFGH */
    __m128i s0 = _mm_alignr_epi8(tmp, s1, 8);        /* ABEF */
    s1 = _mm_blend_epi16(s1, tmp, 0xF0);             /* CDGH */
    for (; nblocks--; p += 64) {
        __m128i abef = s0, cdgh = s1, w[16];
        for (int j = 0; j < 4; j++)
            w[j] = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * j)), mask);
        for (int j = 4; j < 16; j++) {
            __m128i x = _mm_sha256msg1_epu32(w[j - 4], w[j - 3]);
            x = _mm_add_epi32(x, _mm_alignr_epi8(w[j - 1], w[j - 2], 4));
            w[j] = _mm_sha256msg2_epu32(x, w[j - 1]);
        }
        for (int j = 0; j < 16; j++) {
            __m128i m = _mm_add_epi32(w[j], _mm_loadu_si128((const __m128i *)&K256[4 * j]));
            s1 = _mm_sha256rnds2_epu32(s1, s0, m);
            m = _mm_shuffle_epi32(m, 0x0E);
            s0 = _mm_sha256rnds2_epu32(s0, s1, m);
        }
        s0 = _mm_add_epi32(s0, abef);
        s1 = _mm_add_epi32(s1, cdgh);
    }
    tmp = _mm_shuffle_epi32(s0, 0x1B);               /* FEBA */
    s1 = _mm_shuffle_epi32(s1, 0xB1);                /* DCHG */
    s0 = _mm_blend_epi16(tmp, s1, 0xF0);             /* DCBA */
    s1 = _mm_alignr_epi8(s1, tmp, 8);                /* HGFE */
    _mm_storeu_si128((__m128i *)&st[0], s0);
    _mm_storeu_si128((__m128i *)&st[4], s1);
}

static int cpu_has_sha_ni(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 19)) || !(c & (1u << 9)))   /* SSE4.1, SSSE3 */
        return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return 0;
    return (b >> 29) & 1;                                                          /* SHA */
}
#endif


const sha256_blocks_fn sha256_blocks_portable = blocks_portable;
sha256_blocks_fn sha256_blocks = blocks_portable;  /* the SHA-NI rounds where the CPU has them */

void sha256_init(uint32_t st[8])
{
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(st, h0, sizeof h0);
}

void sha256_finish(sha256_blocks_fn blocks, uint32_t st[8], uint64_t prior, const unsigned char *msg, size_t len,
                   unsigned char out[32])
{
    size_t full = len / 64;
    blocks(st, msg, full);
    unsigned char tail[128];
    size_t rest = len - full * 64;
    memcpy(tail, msg + full * 64, rest);
    tail[rest] = 0x80;
    size_t tlen = rest + 1 + 8 <= 64 ? 64 : 128;
    memset(tail + rest + 1, 0, tlen - rest - 1);
    uint64_t bits = (prior + (uint64_t)len) * 8;
    for (int i = 0; i < 8; i++)
        tail[tlen - 1 - i] = (unsigned char)(bits >> (8 * i));
    blocks(st, tail, tlen / 64);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(st[i] >> 24);
        out[4 * i + 1] = (unsigned char)(st[i] >> 16);
        out[4 * i + 2] = (unsigned char)(st[i] >> 8);
        out[4 * i + 3] = (unsigned char)st[i];
    }
}

void sha256_with(sha256_blocks_fn blocks, const unsigned char *msg, size_t len, unsigned char out[32])
{
    uint32_t st[8];
    sha256_init(st);
    sha256_finish(blocks, st, 0, msg, len, out);
}

/* FIPS 180-2's examples: one block and two blocks of padding. */
static int known_answers(sha256_blocks_fn blocks)
{
    static const char *msg[2] = {"abc", "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"};
    static const unsigned char want[2][32] = {
        {0xba, 0x78, 0x16, 0xbf, 0x8f, 0x01, 0xcf, 0xea, 0x41, 0x41, 0x40, 0xde, 0x5d, 0xae, 0x22, 0x23,
         0xb0, 0x03, 0x61, 0xa3, 0x96, 0x17, 0x7a, 0x9c, 0xb4, 0x10, 0xff, 0x61, 0xf2, 0x00, 0x15, 0xad},
        {0x24, 0x8d, 0x6a, 0x61, 0xd2, 0x06, 0x38, 0xb8, 0xe5, 0xc0, 0x26, 0x93, 0x0c, 0x3e, 0x60, 0x39,
         0xa3, 0x3c, 0xe4, 0x59, 0x64, 0xff, 0x21, 0x67, 0xf6, 0xec, 0xed, 0xd4, 0x19, 0xdb, 0x06, 0xc1},
    };
    for (int i = 0; i < 2; i++) {
        unsigned char out[32];
        sha256_with(blocks, (const unsigned char *)msg[i], strlen(msg[i]), out);
        if (memcmp(out, want[i], 32) != 0)
            return 0;
    }
    return 1;
}

int sha256_setup(void)
{
#ifdef HAVE_SHA_NI_PATH
    /* The SHA-NI rounds only when they give the standard's answers: a wrong key digest would
     * file every object under another name, a wrong MAC refuse every frame. */
    if (cpu_has_sha_ni() && known_answers(sha256_blocks_ni))
        sha256_blocks = sha256_blocks_ni;
#endif
    return sha256_blocks != blocks_portable;
}
