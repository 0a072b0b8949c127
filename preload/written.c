/*
 * written: which blocks of the process's device memory hold anything to
 * keep (issue 36). Inference servers allocate most of the GPU at start-up
 * as a KV cache made with zeros and write a small part of it; a copy out
 * that moved every allocated byte would move, keep in host memory and
 * store mostly zeros. So before a copy out the library finds the all-zero
 * blocks on the device (devhash.c's gpucr_zero kernel: one byte a block
 * crosses the bus, not the block), and the VRAM files (copy.c, format
 * GPUCRVM3) describe them by a bitmap without their bytes; a copy in sets
 * them with a device memset.
 *
 * A block is zero_block() bytes from its mapping's start (64 KiB;
 * GPUCR_PRELOAD_ZERO_BLOCK_KIB to measure others, a power of two from 4
 * KiB to a piece's 64 MiB, so that every piece starts at a block). Why 64
 * KiB: a vLLM-like KV cache is written in blocks of 32 KiB (16 tokens x 8
 * heads x 128 x bf16, per layer, K and V apart), in runs of consecutive
 * blocks per request; a run of n such blocks costs at most one 64 KiB
 * block more than its bytes (half a block at each end, 32 KiB on
 * average), under 1% for runs of the 128 blocks a request holds on
 * average in e2e/gpu/infer_target.py, while the bitmap of 141 GB is 270
 * KiB, the scan's output 2.2 MB, and a deduplicated checkpoint's content
 * hashes (devhash, the same 64 KiB) could use the same blocks.
 *
 * The program may also name device ranges it can rebuild (a KV cache
 * after traffic): gpucr_mark_cache. Blocks wholly inside a marked range
 * are not stored either (they come back as zeros); the marked bytes of a
 * block a range covers only in part are stored as zeros. The marks live in
 * the process's memory (CRIU carries them), by device address: a release
 * and remap keep the addresses, a free or unmap by the program drops what
 * it covered.
 */
#include "internal.h"

struct scan kept_scan;

size_t zero_block(void)
{
	const char *e = getenv("GPUCR_PRELOAD_ZERO_BLOCK_KIB");
	long v = e ? atol(e) : 0;
	if (v >= 4 && v <= 65536 && !(v & (v - 1)))
		return (size_t)v << 10;
	return 64 << 10;
}

/* ---- the marked caches, under tab_mu: sorted, disjoint ---- */
static struct crange *marks;
static int nmarks, capmarks;

/* mark_sub removes [va, va+n) from the marks (a range may split in two). */
static int mark_sub(CUdeviceptr va, size_t n)
{
	CUdeviceptr end = va + n;
	for (int i = 0; i < nmarks; i++) {
		CUdeviceptr a = marks[i].va, b = a + marks[i].n;
		if (b <= va || a >= end)
			continue;
		if (a < va && b > end) { /* split */
			if (nmarks == capmarks) {
				int nc = capmarks ? capmarks * 2 : 16;
				struct crange *p = realloc(marks, nc * sizeof *marks);
				if (!p)
					return -1;
				marks = p;
				capmarks = nc;
			}
			memmove(&marks[i + 2], &marks[i + 1], (nmarks - i - 1) * sizeof *marks);
			marks[i].n = va - a;
			marks[i + 1] = (struct crange){end, b - end};
			nmarks++;
			return 0;
		}
		if (a < va) {
			marks[i].n = va - a;
		} else if (b > end) {
			marks[i] = (struct crange){end, b - end};
		} else {
			memmove(&marks[i], &marks[i + 1], (nmarks - i - 1) * sizeof *marks);
			nmarks--;
			i--;
		}
	}
	return 0;
}

/* mark_add adds [va, va+n), merging what it touches. */
static int mark_add(CUdeviceptr va, size_t n)
{
	CUdeviceptr end = va + n;
	for (int i = 0; i < nmarks; i++) {
		CUdeviceptr a = marks[i].va, b = a + marks[i].n;
		if (b >= va && a <= end) { /* overlapping or adjacent: take it in */
			va = a < va ? a : va;
			end = b > end ? b : end;
			memmove(&marks[i], &marks[i + 1], (nmarks - i - 1) * sizeof *marks);
			nmarks--;
			i--;
		}
	}
	if (nmarks == capmarks) {
		int nc = capmarks ? capmarks * 2 : 16;
		struct crange *p = realloc(marks, nc * sizeof *marks);
		if (!p)
			return -1;
		marks = p;
		capmarks = nc;
	}
	int at = 0;
	while (at < nmarks && marks[at].va < va)
		at++;
	memmove(&marks[at + 1], &marks[at], (nmarks - at) * sizeof *marks);
	marks[at] = (struct crange){va, end - va};
	nmarks++;
	return 0;
}

/* owned says whether [va, va+n) lies wholly in mappings of the process's
 * own memory (under tab_mu). */
static int owned(CUdeviceptr va, size_t n)
{
	CUdeviceptr cur = va, end = va + n;
	while (cur < end) {
		int found = 0;
		for (int i = 0; i < nm && !found; i++)
			if (copied(i) && ms[i].va <= cur && cur < ms[i].va + ms[i].size) {
				cur = ms[i].va + ms[i].size;
				found = 1;
			}
		if (!found)
			return 0;
	}
	return 1;
}

/* The program's calls (docs/PRODUCERS.md, "Caches the program names"):
 * 0 done; -1 bytes is 0 or the range wraps around; -2 the range is not
 * wholly in the process's own device memory as the library tracks it (its
 * cuMemAlloc allocations and mappings of the program's own cuMemCreate
 * memory; not memory imported from another process); -3 out of host
 * memory. Neither waits for a checkpoint in progress: one that has
 * scanned already goes by the marks it found then. */
__attribute__((visibility("default"))) int gpucr_mark_cache(uint64_t dptr, uint64_t bytes);
__attribute__((visibility("default"))) int gpucr_unmark_cache(uint64_t dptr, uint64_t bytes);

int gpucr_mark_cache(uint64_t dptr, uint64_t bytes)
{
	if (bytes == 0 || dptr + bytes < dptr)
		return -1;
	pthread_mutex_lock(&tab_mu);
	int rc = !owned(dptr, bytes) ? -2 : mark_add(dptr, bytes) < 0 ? -3 : 0;
	pthread_mutex_unlock(&tab_mu);
	trace("gpucr_mark_cache(%#llx, %llu) = %d", (unsigned long long)dptr, (unsigned long long)bytes, rc);
	return rc;
}

/* gpucr_unmark_cache stores [dptr, dptr+bytes) again from the next
 * checkpoint on: 0, or -1 (bytes 0, or wraps), -3 (out of memory). */
int gpucr_unmark_cache(uint64_t dptr, uint64_t bytes)
{
	if (bytes == 0 || dptr + bytes < dptr)
		return -1;
	pthread_mutex_lock(&tab_mu);
	int rc = mark_sub(dptr, bytes) < 0 ? -3 : 0;
	pthread_mutex_unlock(&tab_mu);
	return rc;
}

/* cache_forget: the program unmapped or freed [va, va+n) (under tab_mu):
 * memory mapped there later is not the cache it marked. */
void cache_forget(CUdeviceptr va, size_t n)
{
	if (nmarks)
		mark_sub(va, n);
}

/* cached_bytes: the bytes marked, and in how many ranges (under tab_mu). */
long long cached_bytes(int *ranges)
{
	long long b = 0;
	for (int i = 0; i < nmarks; i++)
		b += (long long)marks[i].n;
	if (ranges)
		*ranges = nmarks;
	return b;
}

/* cache_reset: a forked child starts without the parent's device memory. */
void cache_reset(void)
{
	nmarks = 0;
}

/* ---- the scan ---- */

void scan_free(struct scan *s)
{
	for (int i = 0; i < s->k; i++)
		free(s->m[i].what);
	free(s->m);
	free(s->marks);
	memset(s, 0, sizeof *s);
}

static double mono(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* still_there: mapping m of a live scan is mapped as it was (under tab_mu). */
static int still_there(const struct wmap *m)
{
	for (int i = 0; i < nm; i++)
		if (copied(i) && ms[i].mapped && ms[i].va == m->va && ms[i].size == m->size)
			return 1;
	return 0;
}

/* scan_ctx runs gpucr_zero over the maps of context ctx and sets their
 * blocks' what[] from its answer. Live (the program runs: a peek), each
 * launch runs under tab_mu once its mapping is checked to be still there,
 * as copy.c's live copies do, and a mapping gone is left as stored. */
static int scan_ctx(struct scan *s, CUcontext ctx, int live, char *err, size_t n)
{
	void *fn;
	CUdeviceptr out = 0;
	CUstream st = NULL;
	unsigned char *host = NULL;
	size_t total = 0;
	CUresult r = CUDA_SUCCESS;
	int rc = -1;
	if (kernel_fn(ctx, "gpucr_zero", &fn, err, n) < 0)
		return -1;
	r_CtxSetCurrent(ctx);
	for (int i = 0; i < s->k; i++)
		if (s->m[i].ctx == ctx)
			total += s->m[i].nblk;
	if (!(host = malloc(total ? total : 1))) {
		snprintf(err, n, "out of memory");
		return -1;
	}
	memset(host, 1, total);
	if ((r = r_MemAlloc(&out, total ? total : 1)) != CUDA_SUCCESS || (r = r_StreamCreate(&st, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) {
		snprintf(err, n, "zero scan: %zu bytes and a stream: CUresult %d", total, r);
		goto out;
	}
	size_t at = 0;
	for (int i = 0; i < s->k; i++) {
		struct wmap *m = &s->m[i];
		if (m->ctx != ctx)
			continue;
		uint64_t nwords = m->size / 8, bwords = s->block / 8;
		CUdeviceptr ptr = m->va, dst = out + at;
		void *params[] = {&ptr, &nwords, &bwords, &dst};
		at += m->nblk;
		if (m->size % 8)
			continue; /* not whole words: stored whole */
		if (live) {
			pthread_mutex_lock(&tab_mu);
			if (still_there(m) && (r = kernel_launch(fn, (unsigned)m->nblk, st, params)) == CUDA_SUCCESS)
				r = r_StreamSync(st);
			pthread_mutex_unlock(&tab_mu);
		} else {
			r = kernel_launch(fn, (unsigned)m->nblk, st, params);
		}
		if (r != CUDA_SUCCESS) {
			snprintf(err, n, "zero scan over %#llx+%zu: CUresult %d", m->va, m->size, r);
			goto out;
		}
	}
	if ((r = r_DtoHAsync(host, out, total, st)) != CUDA_SUCCESS || (r = r_StreamSync(st)) != CUDA_SUCCESS) {
		snprintf(err, n, "zero scan: the kernels or fetching their answer: CUresult %d", r);
		goto out;
	}
	at = 0;
	for (int i = 0; i < s->k; i++) {
		struct wmap *m = &s->m[i];
		if (m->ctx != ctx)
			continue;
		for (size_t b = 0; b < m->nblk; b++)
			m->what[b] = host[at + b] ? BLK_STORE : BLK_ZERO;
		at += m->nblk;
	}
	rc = 0;
out:
	if (st)
		r_StreamDestroy(st);
	if (out)
		r_MemFree(out);
	free(host);
	return rc;
}

/* inside: block [a, b) lies wholly in one of s's marks. */
static int inside(const struct scan *s, CUdeviceptr a, CUdeviceptr b)
{
	for (int i = 0; i < s->nmarks; i++)
		if (s->marks[i].va <= a && b <= s->marks[i].va + s->marks[i].n)
			return 1;
	return 0;
}

/* scan_run finds, for every mapping of the process's own memory, which
 * blocks are zero (on the device) and which lie in a marked cache. A scan
 * that fails leaves every block stored (w.scan_err says why): the copy is
 * whole, only larger. It returns -1 only when it cannot even say that. */
int scan_run(int live, struct scan *s)
{
	double t0 = mono();
	memset(s, 0, sizeof *s);
	s->block = zero_block();
	pthread_mutex_lock(&tab_mu);
	s->m = calloc(nm ? nm : 1, sizeof *s->m);
	s->marks = malloc((nmarks ? nmarks : 1) * sizeof *s->marks);
	for (int i = 0; s->m && i < nm; i++)
		if (copied(i) && ms[i].mapped)
			s->m[s->k++] = (struct wmap){.va = ms[i].va, .size = ms[i].size, .ctx = ms[i].ctx ? ms[i].ctx : (nctx ? ctxs[0] : NULL)};
	if (s->marks && nmarks) {
		memcpy(s->marks, marks, nmarks * sizeof *marks);
		s->nmarks = nmarks;
	}
	pthread_mutex_unlock(&tab_mu);
	if (!s->m || !s->marks) {
		scan_free(s);
		return -1;
	}
	for (int i = 0; i < s->k; i++) {
		struct wmap *m = &s->m[i];
		m->nblk = (m->size + s->block - 1) / s->block;
		if (!(m->what = calloc(m->nblk ? m->nblk : 1, 1))) {
			scan_free(s);
			return -1;
		}
		s->w.allocated += (long long)m->size;
	}
	char err[sizeof s->w.scan_err] = "";
	for (int c = 0; c < nctx && !err[0]; c++) {
		int any = 0;
		for (int i = 0; i < s->k && !any; i++)
			any = s->m[i].ctx == ctxs[c];
		if (any)
			scan_ctx(s, ctxs[c], live, err, sizeof err);
	}
	for (int i = 0; i < s->k; i++) {
		struct wmap *m = &s->m[i];
		if (err[0])
			memset(m->what, BLK_STORE, m->nblk);
		for (size_t b = 0; b < m->nblk; b++) {
			CUdeviceptr a = m->va + b * s->block;
			size_t len = m->size - b * s->block < s->block ? m->size - b * s->block : s->block;
			if (m->what[b] == BLK_STORE && inside(s, a, a + len))
				m->what[b] = BLK_CACHED;
			if (m->what[b] == BLK_ZERO)
				s->w.zero += (long long)len;
			else if (m->what[b] == BLK_CACHED)
				s->w.cached += (long long)len;
		}
	}
	if (err[0])
		trace("zero scan failed, every block is copied: %s", err);
	snprintf(s->w.scan_err, sizeof s->w.scan_err, "%s", err);
	s->w.scan = mono() - t0;
	s->valid = 1;
	return 0;
}

/* scan_find is the map of s that holds [va, va+size), or NULL. */
const struct wmap *scan_find(const struct scan *s, CUdeviceptr va, size_t size)
{
	for (int i = 0; s->valid && i < s->k; i++)
		if (s->m[i].va <= va && va + size <= s->m[i].va + s->m[i].size)
			return &s->m[i];
	return NULL;
}

/* scan_unmark zeroes what of buf, a copy of [va, va+len), lies in a
 * marked cache: the marked part of a block stored for its other bytes. */
void scan_unmark(const struct scan *s, void *buf, CUdeviceptr va, size_t len)
{
	for (int i = 0; i < s->nmarks; i++) {
		CUdeviceptr a = s->marks[i].va, b = a + s->marks[i].n;
		a = a > va ? a : va;
		b = b < va + len ? b : va + len;
		if (a < b)
			memset((char *)buf + (a - va), 0, b - a);
	}
}

/* cmd_scan runs the scan for the next copy out (parked) and answers what
 * it found: how much the kept copy will hold. */
int cmd_scan(char *out, size_t outn, char *err, size_t n)
{
	if (!parked || released) {
		snprintf(err, n, "scan: %s", released ? "memory is released" : "not parked");
		return -1;
	}
	scan_free(&kept_scan);
	if (scan_run(0, &kept_scan) < 0) {
		snprintf(err, n, "scan: out of memory");
		return -1;
	}
	struct written_stats *w = &kept_scan.w;
	char e[sizeof w->scan_err];
	json_str(e, sizeof e, w->scan_err);
	long long pieces = 0; /* copy.c's: 64 MiB of a mapping each */
	for (int i = 0; i < kept_scan.k; i++)
		pieces += (long long)((kept_scan.m[i].size + (64ULL << 20) - 1) / (64ULL << 20));
	snprintf(out, outn,
		 "ok {\"allocated\":%lld,\"zero_bytes\":%lld,\"cached_bytes\":%lld,\"stored\":%lld,\"pieces\":%lld,\"block\":%zu,"
		 "\"scan_s\":%.6f,\"scan_error\":\"%s\"}\n",
		 w->allocated, w->zero, w->cached, w->allocated - w->zero - w->cached, pieces, kept_scan.block, w->scan, e);
	return 0;
}
