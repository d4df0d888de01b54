/*
 * SHA-256 shared by the C extensions (sha256.c).
 */
#ifndef CTM_SHA256_H
#define CTM_SHA256_H

#include <stddef.h>
#include <stdint.h>

/* Runs the compression function over whole 64-byte blocks. */
typedef void (*sha256_blocks_fn)(uint32_t st[8], const unsigned char *p, size_t nblocks);

extern sha256_blocks_fn sha256_blocks;                /* the fastest rounds that passed sha256_setup */
extern const sha256_blocks_fn sha256_blocks_portable; /* plain C rounds */

/* Picks the SHA-NI rounds where the CPU has them and they pass FIPS 180-2's examples; 1 if it did. */
int sha256_setup(void);

void sha256_init(uint32_t st[8]);

/* Hashes msg after ``prior`` bytes (a multiple of 64) already in st, pads, writes the digest. */
void sha256_finish(sha256_blocks_fn blocks, uint32_t st[8], uint64_t prior, const unsigned char *msg, size_t len,
                   unsigned char out[32]);

void sha256_with(sha256_blocks_fn blocks, const unsigned char *msg, size_t len, unsigned char out[32]);

#endif
