/*
 * The block hash of `devhash` (devhash.c), on the host: what the device's
 * kernel computes, for its check and for the fake driver of the tests
 * (testdata/fake_cuda.c), which runs its "kernels" on the host.
 *
 * A block of n 64-bit words w[0..n) hashes to two lanes,
 *   a = sum over i of fmix1(w[i] ^ (i*K1 + key))
 *   b = sum over i of fmix2((w[i] + i*K2) ^ key)   (mod 2^64)
 * with fmix1 MurmurHash3's 64-bit finalizer and fmix2 SplitMix64's. Both
 * are bijections, so a change of one word always changes both lanes; a
 * change of several goes unseen only where the changes' terms cancel in
 * both sums at once, about 2^-128 for changes that do not aim at it. Not a
 * cryptographic hash: a program can craft its memory to collide (the
 * functions are invertible). What that could do is in docs/THREATS.md
 * ("Device hashes"). A sum, not a chain, so that the device's threads
 * each add their share of the words in any order.
 */
#ifndef GPUCR_PRELOAD_DEVHASH_H
#define GPUCR_PRELOAD_DEVHASH_H

#include <stdint.h>

#define DH_K1 0x9E3779B97F4A7C15ULL
#define DH_K2 0xD6E8FEB86659FD93ULL

static inline uint64_t dh_fmix1(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xFF51AFD7ED558CCDULL;
	x ^= x >> 33;
	x *= 0xC4CEB9FE1A85EC53ULL;
	x ^= x >> 33;
	return x;
}

static inline uint64_t dh_fmix2(uint64_t x)
{
	x ^= x >> 30;
	x *= 0xBF58476D1CE4E5B9ULL;
	x ^= x >> 27;
	x *= 0x94D049BB133111EBULL;
	x ^= x >> 31;
	return x;
}

/* dh_block hashes the n words at w into out[0] and out[1]. */
static inline void dh_block(const uint64_t *w, uint64_t n, uint64_t key, uint64_t out[2])
{
	uint64_t a = 0, b = 0;
	for (uint64_t i = 0; i < n; i++) {
		a += dh_fmix1(w[i] ^ (i * DH_K1 + key));
		b += dh_fmix2((w[i] + i * DH_K2) ^ key);
	}
	out[0] = a;
	out[1] = b;
}

/* dh_blocks is the kernel's whole launch: nwords words at w in blocks of
 * bwords (the last one shorter), block k's lanes at out[2k], out[2k+1]. */
static inline void dh_blocks(const uint64_t *w, uint64_t nwords, uint64_t bwords, uint64_t key, uint64_t *out)
{
	for (uint64_t k = 0, base = 0; base < nwords; k++, base += bwords)
		dh_block(w + base, nwords - base < bwords ? nwords - base : bwords, key, out + 2 * k);
}

#endif
