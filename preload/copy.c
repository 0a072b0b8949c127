/*
 * copy workers: a copy out or in runs one thread per descriptor, each with
 * two pinned buffers and two streams (staged ahead where `stage` came), over
 * the VRAM file format (docs/PRODUCERS.md, "VRAM files").
 *
 * The layout of a copy out is a function of the mappings alone (layout()):
 * the pieces sorted by device address, cut into as many runs of about
 * equal bytes as there are files, each piece at a fixed offset of its file.
 * Thread i copies the pieces of file i and then helps with the others'
 * (so a slow thread does not hold the copy back), pwriting each where the
 * layout put it. Mostly one writer a file: writes to one file are
 * serialized by its inode's lock (tmpfs, ext4, xfs alike). Two
 * copies of unchanged memory are byte-identical files, and a changed
 * allocation changes only its own bytes: a deduplicated checkpoint's
 * content-defined chunks find the rest again (docs/FORMAT.md section 17).
 * Each piece's bytes start at a 4 KiB boundary of its file, so that an
 * allocation added or freed, which moves the pieces after it, moves them
 * by whole pages, and the chunker, which cuts at pages by their content,
 * still finds them.
 *
 * GPUCRVM3 (issue 36) stores only what is written: a piece's header names
 * its blocks (written.c) and a bitmap says which are not stored (zero, or
 * in a cache the program marked); only the others' bytes follow, and a
 * copy in sets the rest with a device memset. The files are then a
 * function of the mappings and their content. Files of GPUCRVM2 and
 * GPUCRVM1 (every byte) are read too.
 */
#include "internal.h"

#define MAGIC "GPUCRVM3"    /* written: stored blocks only, each piece at a 4 KiB boundary */
#define MAGIC_V2 "GPUCRVM2" /* read too: every byte, each piece at a 4 KiB boundary */
#define MAGIC_V1 "GPUCRVM1" /* read too: every byte, right after the header */
#define ALIGN 4096ULL
#define PIECE (64ULL << 20)
#define HDR 32 /* a GPUCRVM3 record: va, size, block, cached (u64 each) */
#define MAXBITMAP (PIECE / 4096 / 8)

struct piece {
	CUdeviceptr va;
	size_t n;
	CUcontext ctx;
	CUdeviceptr at; /* copy in: where va is in this process (a filler maps elsewhere) */
	int m;      /* its mapping, for a live copy's check */
	int file;   /* copy out: index into the job's fds */
	off_t off;  /* where its record header is in that file */
	off_t data; /* and its bytes: the next 4 KiB boundary after the header */
	/* Its blocks as the scan found them (NULL: every block stored), the
	 * bytes stored, and those left out as a marked cache. */
	const unsigned char *what;
	size_t block, nblk, stored;
	uint64_t cached;
};
struct job {
	int out;  /* 1: device to fd; 0: fd to device */
	int live; /* a copy out while the program runs (peek) */
	struct piece *pieces;
	int npieces;
	/* copy in: the first piece of each mapping in seen[], and which
	 * pieces came (each exactly once). */
	int *first;
	atomic_uchar *seen;
	int nseen;
	/* copy out: every file (any worker may write any), and the pieces
	 * of file f, [next[f], hi[f]) still to take. */
	int *fds;
	int nfiles;
	atomic_int next[64];
	int hi[64];
	size_t buf;
	atomic_int failed;
	char err[256];
	pthread_mutex_t err_mu;
	atomic_llong bytes;
	/* Where a job's time goes, for the reply: the slowest worker's
	 * setup (pinned buffers, streams), copy and teardown, and summed over
	 * the workers the time blocked on the device and in read/write. */
	double setup, work, teardown;
	atomic_llong wait_ns, io_ns;
	atomic_int nstaged; /* workers that took staged buffers */
	/* copy out: the scan it goes by (kept_scan, or own); copy in: what
	 * the files said, and the bytes set by memsets. */
	struct scan *scan, own;
	atomic_llong allocated, zeroed, cached;
};
struct worker {
	struct job *j;
	int fd, idx;
	pthread_t t;
};

static double mono(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static size_t buf_size(void);

/* Staged copy buffers. `stage N` allocates the pinned buffers and streams of
 * N copy workers while the program still runs, so that the copy out after
 * park does not wait for the driver to pin a gigabyte (worker i takes slot
 * i). Whatever a job leaves is freed at its end, and a stage no copy took
 * at unpark or when the connection ends: pinned host memory must not be
 * there at the driver's checkpoint, which would carry it into the dump.
 * Only the control thread stages and frees; workers take their slot while
 * it waits for them. */
struct stage {
	void *buf[2];
	int mapped[2]; /* our own mapping, registered; else cuMemHostAlloc's */
	CUstream st[2];
	size_t size;
};
static struct stage staged[64];

#define CU_MEMHOSTREGISTER_PORTABLE 1

/* pin_alloc returns size bytes of pinned host memory. Pinning costs per
 * page: a gigabyte of cuMemHostAlloc's small pages took 0.5 s to pin and
 * 0.2 s to free on an H100 host, on the path of every copy. So the
 * buffers are our own anonymous mappings, asked to be transparent huge
 * pages, then registered with the driver; where that fails (no THP, a
 * driver without registration) cuMemHostAlloc as before. */
static CUresult pin_alloc(void **p, int *mapped, size_t size)
{
	*mapped = 0;
	if (r_HostRegister && r_HostUnregister) {
		void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (m != MAP_FAILED) {
			madvise(m, size, MADV_HUGEPAGE);
			if (r_HostRegister(m, size, CU_MEMHOSTREGISTER_PORTABLE) == CUDA_SUCCESS) {
				*p = m;
				*mapped = 1;
				return CUDA_SUCCESS;
			}
			munmap(m, size);
		}
	}
	return r_HostAlloc(p, size, 0);
}

static void stage_free(struct stage *sg)
{
	for (int b = 0; b < 2; b++) {
		if (sg->st[b]) {
			r_StreamSync(sg->st[b]);
			r_StreamDestroy(sg->st[b]);
		}
		if (sg->buf[b] && sg->mapped[b]) {
			r_HostUnregister(sg->buf[b]);
			munmap(sg->buf[b], sg->size);
		} else if (sg->buf[b]) {
			r_FreeHost(sg->buf[b]);
		}
	}
	memset(sg, 0, sizeof *sg);
}

/* stage_alloc fills sg with two pinned buffers of size bytes and two
 * streams; on failure it frees what it took and returns the CUresult. */
static CUresult stage_alloc(struct stage *sg, size_t size)
{
	CUresult r = CUDA_SUCCESS;
	sg->size = size;
	for (int b = 0; b < 2 && r == CUDA_SUCCESS; b++)
		if ((r = pin_alloc(&sg->buf[b], &sg->mapped[b], size)) == CUDA_SUCCESS)
			r = r_StreamCreate(&sg->st[b], CU_STREAM_NON_BLOCKING);
	if (r != CUDA_SUCCESS)
		stage_free(sg);
	return r;
}

void unstage_all(void)
{
	for (int i = 0; i < 64; i++)
		if (staged[i].buf[0])
			stage_free(&staged[i]);
}

int staged_count(void)
{
	int k = 0;
	for (int i = 0; i < 64; i++)
		k += staged[i].buf[0] != NULL;
	return k;
}

struct stager {
	struct stage *sg;
	size_t size;
	CUresult r;
	pthread_t t;
};

static void *stager_main(void *arg)
{
	struct stager *a = arg;
	internal = 1;
	r_CtxSetCurrent(ctxs[0]);
	a->r = stage_alloc(a->sg, a->size);
	return NULL;
}

/* cmd_stage stages k workers' buffers, allocated at once by k threads as a
 * job's workers would. GPUCR_PRELOAD_STAGE=0 stages nothing (the workers
 * then allocate their own), to measure what staging saves. */
int cmd_stage(int k, char *err, size_t n, struct stats *st)
{
	if (k < 1 || k > 64) {
		snprintf(err, n, "stage %d: want 1..64 workers", k);
		return -1;
	}
	if (released || driver_next) {
		snprintf(err, n, "stage: too late (memory released or the driver's step announced)");
		return -1;
	}
	/* The zero scan's kernel too: its first load compiles it. */
	kernels_load();
	const char *e = getenv("GPUCR_PRELOAD_STAGE");
	if ((e && !strcmp(e, "0")) || !nctx)
		return 0;
	double t0 = mono();
	struct stager a[64];
	int started = 0;
	for (int i = 0; i < k; i++) {
		if (staged[i].buf[0])
			stage_free(&staged[i]);
		a[i] = (struct stager){&staged[i], buf_size(), CUDA_SUCCESS, 0};
		if (pthread_create(&a[i].t, NULL, stager_main, &a[i]) != 0)
			break;
		started++;
	}
	CUresult r = CUDA_SUCCESS;
	for (int i = 0; i < started; i++) {
		pthread_join(a[i].t, NULL);
		if (a[i].r != CUDA_SUCCESS)
			r = a[i].r;
	}
	if (r != CUDA_SUCCESS || started < k) {
		unstage_all();
		snprintf(err, n, "stage: pinned buffers of %zu bytes: CUresult %d", buf_size(), r);
		return -1;
	}
	st->workers = st->staged = k;
	st->setup = mono() - t0;
	return 0;
}

static void job_time(struct job *j, double *max, double d)
{
	pthread_mutex_lock(&j->err_mu);
	if (d > *max)
		*max = d;
	pthread_mutex_unlock(&j->err_mu);
}

static void job_fail(struct job *j, const char *fmt, ...)
{
	pthread_mutex_lock(&j->err_mu);
	if (!atomic_exchange(&j->failed, 1)) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(j->err, sizeof j->err, fmt, ap);
		va_end(ap);
	}
	pthread_mutex_unlock(&j->err_mu);
}

int copied(int i) { return ms[i].live && !hs[ms[i].h].imported; }

/* piece_of checks that [va, va+n) is one piece of a mapping as copy-out
 * cuts them (PIECE bytes from the mapping's start, the last one shorter)
 * and marks it arrived; -1 if it is none, -2 if it came before. It returns
 * the mapping's context in *ctx and where va is mapped in this process in
 * *at. */
static int piece_of(struct job *j, CUdeviceptr va, size_t n, CUcontext *ctx, CUdeviceptr *at)
{
	int rc = -1;
	pthread_mutex_lock(&tab_mu);
	for (int i = 0; i < nm; i++) {
		struct mrec *m = &ms[i];
		if (!copied(i) || !m->mapped || va < m->va || va - m->va >= m->size)
			continue;
		size_t off = va - m->va;
		if (off % PIECE == 0 && n == (m->size - off < PIECE ? m->size - off : PIECE)) {
			int k = j->first[i] + off / PIECE;
			rc = atomic_exchange(&j->seen[k], 1) ? -2 : 0;
			*ctx = m->ctx;
			*at = mapped_at(m) + off;
		}
		break;
	}
	pthread_mutex_unlock(&tab_mu);
	return rc;
}

static int pwrite_all(int fd, const void *b, size_t n, off_t off)
{
	const char *p = b;
	while (n > 0) {
		ssize_t k = pwrite(fd, p, n, off);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0) {
			if (k == 0)
				errno = ENOSPC;
			return -1;
		}
		p += k;
		n -= (size_t)k;
		off += k;
	}
	return 0;
}

static int by_va(const void *a, const void *b)
{
	CUdeviceptr x = ((const struct piece *)a)->va, y = ((const struct piece *)b)->va;
	return x < y ? -1 : x > y;
}

static off_t align_up(off_t o) { return (off_t)(((unsigned long long)o + ALIGN - 1) & ~(ALIGN - 1)); }

static size_t blk_len(const struct piece *p, size_t b) { return p->n - b * p->block < p->block ? p->n - b * p->block : p->block; }
static size_t bitmap_len(size_t nblk) { return (nblk + 7) / 8; }

/* piece_blocks gives p its blocks from the scan s. */
static void piece_blocks(struct piece *p, const struct scan *s)
{
	const struct wmap *m = scan_find(s, p->va, p->n);
	p->block = s->block ? s->block : zero_block();
	p->nblk = (p->n + p->block - 1) / p->block;
	p->what = m ? m->what + (p->va - m->va) / p->block : NULL;
	p->stored = p->cached = 0;
	for (size_t b = 0; b < p->nblk; b++)
		if (!p->what || blk_in_file(p->what[b]))
			p->stored += blk_len(p, b);
		else if (p->what[b] == BLK_CACHED)
			p->cached += blk_len(p, b);
}

/* layout sorts the pieces by device address and places them: the sorted
 * run is cut into nfiles runs of about equal stored bytes (a piece goes to
 * the file its middle byte falls in), each file the magic, its pieces'
 * records in address order (each header and bitmap followed by zeros up
 * to a 4 KiB boundary, where its stored blocks start), and the end record.
 * It writes the magic and end record of every file; the zeros are holes.
 * Nothing in it depends on timing: the files are a function of the
 * mappings and of which blocks the scan found written. */
static int layout(struct job *j, int nfiles)
{
	qsort(j->pieces, j->npieces, sizeof *j->pieces, by_va);
	unsigned long long total = 0, before = 0;
	for (int k = 0; k < j->npieces; k++) {
		piece_blocks(&j->pieces[k], j->scan);
		total += j->pieces[k].stored + ALIGN;
	}
	off_t end[64];
	int count[64];
	for (int f = 0; f < nfiles; f++) {
		end[f] = 8;
		count[f] = 0;
	}
	for (int k = 0; k < j->npieces; k++) {
		struct piece *p = &j->pieces[k];
		unsigned long long w = p->stored + ALIGN, mid = before + w / 2;
		int f = (int)(mid / ((total + nfiles - 1) / nfiles));
		p->file = f < nfiles ? f : nfiles - 1;
		p->off = end[p->file];
		p->data = align_up(p->off + HDR + (off_t)bitmap_len(p->nblk));
		end[p->file] = p->data + (off_t)p->stored;
		count[p->file]++;
		before += w;
	}
	/* The files' pieces are consecutive runs of the sorted ones. */
	j->nfiles = nfiles;
	for (int f = 0, lo = 0; f < nfiles; lo += count[f++]) {
		atomic_init(&j->next[f], lo);
		j->hi[f] = lo + count[f];
	}
	uint64_t rec[4] = {0, 0, 0, 0};
	for (int f = 0; f < nfiles; f++)
		if (pwrite_all(j->fds[f], MAGIC, 8, 0) < 0 || pwrite_all(j->fds[f], rec, sizeof rec, end[f]) < 0) {
			job_fail(j, "write: %s", strerror(errno));
			return -1;
		}
	return 0;
}

/* write_header writes p's record header and bitmap (bit b set: block b is
 * not stored). */
static int write_header(struct job *j, const struct piece *p)
{
	unsigned char h[HDR + MAXBITMAP];
	uint64_t v[4] = {p->va, p->n, p->block, p->cached};
	size_t bl = bitmap_len(p->nblk);
	memcpy(h, v, HDR);
	memset(h + HDR, 0, bl);
	for (size_t b = 0; p->what && b < p->nblk; b++)
		if (!blk_in_file(p->what[b]))
			h[HDR + b / 8] |= (unsigned char)(1u << (b % 8));
	if (pwrite_all(j->fds[p->file], h, HDR + bl, p->off) < 0) {
		job_fail(j, "write: %s", strerror(errno));
		return -1;
	}
	return 0;
}

/* A cursor over a piece's stored bytes: next_chunk gives the next run of
 * at most max bytes that are to be copied and consecutive on the device,
 * at device offset *off of the piece, *len bytes, for file offset *at.
 * Blocks an earlier checkpoint holds have their place in the file, left
 * a hole. */
struct cursor {
	size_t pos; /* device offset in the piece */
	off_t at;   /* file offset of the next stored byte */
};

static int next_chunk(const struct piece *p, struct cursor *c, size_t max, size_t *off, size_t *len, off_t *at)
{
	while (c->pos < p->n) {
		size_t b = c->pos / p->block;
		if (p->what && p->what[b] != BLK_STORE) {
			if (p->what[b] == BLK_EARLIER)
				c->at += (off_t)(blk_len(p, b) - c->pos % p->block);
			c->pos = (b + 1) * p->block;
			continue;
		}
		size_t e = b + 1;
		while (e < p->nblk && (!p->what || p->what[e] == BLK_STORE))
			e++;
		size_t end = e * p->block < p->n ? e * p->block : p->n;
		*off = c->pos;
		*len = end - c->pos < max ? end - c->pos : max;
		*at = c->at;
		c->pos += *len;
		c->at += (off_t)*len;
		return 1;
	}
	return 0;
}

/* take_piece returns the next piece for worker idx to copy: one of its
 * own file's, else of the next file that has one left; -1 when none is. */
static int take_piece(struct job *j, int idx)
{
	for (int s = 0; s < j->nfiles && !atomic_load(&j->failed); s++) {
		int f = (idx + s) % j->nfiles;
		if (atomic_load(&j->next[f]) >= j->hi[f])
			continue;
		int k = atomic_fetch_add(&j->next[f], 1);
		if (k < j->hi[f])
			return k;
	}
	return -1;
}

/* copy_out copies the stored blocks of pieces from the device into their
 * places in the files through two pinned buffers, one copying from the
 * device while the other is written. */
static void copy_out_live(struct worker *w, void *buf, CUstream st);

static void copy_out(struct worker *w, void *buf[2], CUstream st[2])
{
	struct job *j = w->j;
	CUresult r;
	if (j->live) {
		copy_out_live(w, buf[0], st[0]);
		return;
	}
	for (int k; (k = take_piece(j, w->idx)) >= 0;) {
		struct piece *p = &j->pieces[k];
		int fd = j->fds[p->file];
		if (p->ctx)
			r_CtxSetCurrent(p->ctx);
		if (write_header(j, p) < 0)
			return;
		struct cursor c = {0, p->data};
		size_t off[2] = {0, 0}, len[2] = {0, 0};
		off_t at[2] = {0, 0};
		int have[2] = {0, 0};
		for (int i = 0;; i++) {
			int b = i & 1, pb = b ^ 1;
			have[b] = next_chunk(p, &c, j->buf, &off[b], &len[b], &at[b]);
			if (have[b] && (r = r_DtoHAsync(buf[b], p->va + off[b], len[b], st[b])) != CUDA_SUCCESS) {
				job_fail(j, "copy %#llx+%zu to host: CUresult %d", p->va, off[b], r);
				return;
			}
			if (have[pb]) {
				double t0 = mono();
				if ((r = r_StreamSync(st[pb])) != CUDA_SUCCESS) {
					job_fail(j, "copy to host: CUresult %d", r);
					return;
				}
				double t1 = mono();
				scan_unmark(j->scan, buf[pb], p->va + off[pb], len[pb]);
				if (pwrite_all(fd, buf[pb], len[pb], at[pb]) < 0) {
					job_fail(j, "write: %s", strerror(errno));
					return;
				}
				atomic_fetch_add(&j->wait_ns, (long long)((t1 - t0) * 1e9));
				atomic_fetch_add(&j->io_ns, (long long)((mono() - t1) * 1e9));
				atomic_fetch_add(&j->bytes, len[pb]);
				have[pb] = 0;
			}
			if (!have[b])
				break;
		}
		if (fault("copyout")) {
			job_fail(j, "injected fault (copyout)");
			return;
		}
	}
}

/* copy_out_live is copy_out while the program runs (a migration's
 * pre-copy round: what it copies is a hint, which the final copy out,
 * parked, makes exact). The program may free or unmap memory meanwhile,
 * and a copy from an address no longer mapped would be a fault of the
 * whole context: each buffer is copied under tab_mu, which every wrapper
 * that unmaps takes, once its mapping is checked to be still there; a
 * piece whose mapping went is left as zeros. One buffer at a time, so
 * that the lock is held for one copy (milliseconds), never a write. */
static void copy_out_live(struct worker *w, void *buf, CUstream st)
{
	struct job *j = w->j;
	CUresult r;
	for (int k; (k = take_piece(j, w->idx)) >= 0;) {
		struct piece *p = &j->pieces[k];
		int fd = j->fds[p->file];
		if (write_header(j, p) < 0)
			return;
		struct cursor c = {0, p->data};
		size_t off, len;
		off_t at;
		while (next_chunk(p, &c, j->buf, &off, &len, &at)) {
			double t0 = mono();
			pthread_mutex_lock(&tab_mu);
			struct mrec *m = &ms[p->m];
			int there = m->live && m->mapped && p->va >= m->va && p->va + p->n <= m->va + m->size;
			if (there) {
				if (p->ctx)
					r_CtxSetCurrent(p->ctx);
				r = r_DtoHAsync(buf, p->va + off, len, st);
				if (r == CUDA_SUCCESS)
					r = r_StreamSync(st);
			}
			pthread_mutex_unlock(&tab_mu);
			if (!there)
				break; /* gone: zeros (holes) */
			if (r != CUDA_SUCCESS) {
				job_fail(j, "copy %#llx+%zu to host: CUresult %d", p->va, off, r);
				return;
			}
			double t1 = mono();
			scan_unmark(j->scan, buf, p->va + off, len);
			if (pwrite_all(fd, buf, len, at) < 0) {
				job_fail(j, "write: %s", strerror(errno));
				return;
			}
			atomic_fetch_add(&j->wait_ns, (long long)((t1 - t0) * 1e9));
			atomic_fetch_add(&j->io_ns, (long long)((mono() - t1) * 1e9));
			atomic_fetch_add(&j->bytes, len);
		}
	}
}

/* zero_dev sets n bytes at va to zero on stream st. */
static CUresult zero_dev(CUdeviceptr va, size_t n, CUstream st)
{
	if (va % 4 == 0 && n % 4 == 0)
		return r_MemsetD32Async(va, 0, n / 4, st);
	return r_MemsetD8Async(va, 0, n, st);
}

/* The reader of one VRAM file (copy_in): the descriptor may be a pipe, so
 * it reads in order and counts where it is. */
struct reader {
	struct worker *w;
	int version; /* 1, 2 or 3 */
	unsigned long long pos;
};

/* read_record reads a record's header, checks it names one piece of a
 * mapping not seen yet, and reads its bitmap (bm: bit set, the block is
 * not stored) and padding. 1: the end record; 0: a piece (p); -1: failed. */
static int read_record(struct reader *rd, struct piece *p, unsigned char *bm)
{
	struct job *j = rd->w->j;
	uint64_t h[4] = {0, 0, 0, 0};
	size_t hn = rd->version == 3 ? HDR : 16;
	if (read_full(rd->w->fd, h, hn)) {
		job_fail(j, "VRAM file: truncated (no end record)");
		return -1;
	}
	rd->pos += hn;
	if (h[0] == 0 && h[1] == 0 && h[2] == 0 && h[3] == 0)
		return 1;
	if (rd->version == 3 && (h[2] < 4096 || h[2] % 4096 || h[2] > (1ULL << 30))) {
		job_fail(j, "VRAM file: range %#llx: block size %llu is not a multiple of 4096 up to 1 GiB", (unsigned long long)h[0],
			 (unsigned long long)h[2]);
		return -1;
	}
	CUcontext c = NULL;
	CUdeviceptr at = 0;
	int pc = piece_of(j, h[0], h[1], &c, &at);
	if (pc < 0) {
		job_fail(j, "VRAM file: range %#llx+%llu %s", (unsigned long long)h[0], (unsigned long long)h[1],
			 pc == -2 ? "came twice" : "is not a mapping of this process (or not one of its pieces)");
		return -1;
	}
	*p = (struct piece){.va = h[0], .n = h[1], .ctx = c, .at = at, .block = rd->version == 3 ? h[2] : h[1], .cached = h[3]};
	p->nblk = (p->n + p->block - 1) / p->block; /* a piece is at most PIECE: the bitmap fits */
	size_t bl = rd->version == 3 ? bitmap_len(p->nblk) : 0;
	memset(bm, 0, MAXBITMAP);
	if (read_full(rd->w->fd, bm, bl)) {
		job_fail(j, "VRAM file: truncated in the bitmap of range %#llx", p->va);
		return -1;
	}
	rd->pos += bl;
	unsigned long long unstored = 0;
	for (size_t b = 0; b < bl * 8; b++)
		if (bm[b / 8] & (1u << (b % 8))) {
			if (b >= p->nblk) {
				job_fail(j, "VRAM file: range %#llx: the bitmap marks block %zu of %zu", p->va, b, p->nblk);
				return -1;
			}
			unstored += blk_len(p, b);
		}
	if (p->cached > unstored) {
		job_fail(j, "VRAM file: range %#llx: %llu bytes cached, more than the %llu not stored", p->va,
			 (unsigned long long)p->cached, unstored);
		return -1;
	}
	if (rd->version > 1 && rd->pos % ALIGN) {
		unsigned char pad[ALIGN];
		size_t np = ALIGN - rd->pos % ALIGN;
		if (read_full(rd->w->fd, pad, np)) {
			job_fail(j, "VRAM file: truncated at offset %llu", rd->pos);
			return -1;
		}
		for (size_t i = 0; i < np; i++)
			if (pad[i]) {
				job_fail(j, "VRAM file: byte %llu is not zero (padding before range %#llx)", rd->pos + i, p->va);
				return -1;
			}
		rd->pos += np;
	}
	atomic_fetch_add(&j->allocated, (long long)p->n);
	atomic_fetch_add(&j->cached, (long long)p->cached);
	return 0;
}

/* copy_in reads a VRAM file from w->fd and puts each piece back: its
 * stored blocks copied through the two pinned buffers in turn, the others
 * set to zero on the device. */
static void copy_in(struct worker *w, void *buf[2], CUstream st[2])
{
	struct job *j = w->j;
	CUresult r;
	char magic[8];
	struct reader rd = {w, 0, 8};
	int e = read_full(w->fd, magic, 8);
	if (!e)
		rd.version = !memcmp(magic, MAGIC, 8) ? 3 : !memcmp(magic, MAGIC_V2, 8) ? 2 : !memcmp(magic, MAGIC_V1, 8) ? 1 : 0;
	if (e || !rd.version) {
		job_fail(j, "VRAM file: %s", e ? "truncated header" : "bad magic");
		return;
	}
	size_t pending[2] = {0, 0};
	int b = 0;
	unsigned char bm[MAXBITMAP];
	struct piece p;
	for (int rc; (rc = read_record(&rd, &p, bm)) == 0;) {
		if (p.ctx)
			r_CtxSetCurrent(p.ctx);
		/* Runs of blocks alike: a memset for those not stored, the
		 * buffers for the rest. */
		for (size_t blk = 0; blk < p.nblk;) {
			int zero = bm[blk / 8] >> (blk % 8) & 1;
			size_t e2 = blk + 1;
			while (e2 < p.nblk && (bm[e2 / 8] >> (e2 % 8) & 1) == zero)
				e2++;
			size_t lo = blk * p.block, hi = e2 * p.block < p.n ? e2 * p.block : p.n;
			blk = e2;
			if (zero) {
				if ((r = zero_dev(p.at + lo, hi - lo, st[0])) != CUDA_SUCCESS) {
					job_fail(j, "set %#llx+%zu to zero: CUresult %d", p.va, lo, r);
					return;
				}
				pending[0] = 1;
				atomic_fetch_add(&j->zeroed, (long long)(hi - lo));
				continue;
			}
			for (size_t off = lo; off < hi;) {
				size_t len = hi - off < j->buf ? hi - off : j->buf;
				double t0 = mono();
				if (pending[b] && (r = r_StreamSync(st[b])) != CUDA_SUCCESS) {
					job_fail(j, "copy to device: CUresult %d", r);
					return;
				}
				double t1 = mono();
				if (read_full(w->fd, buf[b], len)) {
					job_fail(j, "VRAM file: truncated in range %#llx", p.va);
					return;
				}
				atomic_fetch_add(&j->wait_ns, (long long)((t1 - t0) * 1e9));
				atomic_fetch_add(&j->io_ns, (long long)((mono() - t1) * 1e9));
				if ((r = r_HtoDAsync(p.at + off, buf[b], len, st[b])) != CUDA_SUCCESS) {
					job_fail(j, "copy %#llx to device: CUresult %d", p.va + off, r);
					return;
				}
				pending[b] = len;
				atomic_fetch_add(&j->bytes, len);
				off += len;
				rd.pos += len;
				b ^= 1;
			}
		}
		if (fault("copyin")) {
			job_fail(j, "injected fault (copyin)");
			return;
		}
	}
	for (int k = 0; k < 2 && !atomic_load(&j->failed); k++)
		if (pending[k] && (r = r_StreamSync(st[k])) != CUDA_SUCCESS)
			job_fail(j, "copy to device: CUresult %d", r);
}

/* worker_main is one copy thread of a job: two pinned buffers and two
 * streams, then copy_out or copy_in over its fd. */
static void *worker_main(void *arg)
{
	struct worker *w = arg;
	struct job *j = w->j;
	internal = 1;
	double t0 = mono();
	CUresult r;
	if (nctx)
		r_CtxSetCurrent(ctxs[0]);
	struct stage sg = {0};
	if (staged[w->idx].buf[0] && staged[w->idx].size == j->buf) {
		sg = staged[w->idx];
		memset(&staged[w->idx], 0, sizeof sg);
		atomic_fetch_add(&j->nstaged, 1);
	} else if ((r = stage_alloc(&sg, j->buf)) != CUDA_SUCCESS) {
		job_fail(j, "pinned buffers of %zu bytes and their streams: CUresult %d", j->buf, r);
		goto out;
	}
	double t1 = mono();
	job_time(j, &j->setup, t1 - t0);
	if (j->out)
		copy_out(w, sg.buf, sg.st);
	else
		copy_in(w, sg.buf, sg.st);
	t0 = mono();
	job_time(j, &j->work, t0 - t1);
	stage_free(&sg);
	job_time(j, &j->teardown, mono() - t0);
out:
	/* A copy out's files are every worker's: run_job closes them. */
	if (!j->out)
		close(w->fd);
	return NULL;
}

/* buf_size is each pinned buffer's size, 4 MiB (GPUCR_PRELOAD_BUF_MIB to
 * measure others). Small buffers are faster twice on H200 hosts: pinning
 * costs per byte (16 threads of 2 x 8 MiB took 0.06 s, of 2 x 4 MiB 0.03
 * s, on the copy in's path), and a copy in's DMA reads what read() just
 * wrote while it is still in the CPU's cache: e2e/gpu/regprobe.c moved 12
 * GiB from a staged file at 44-47 GB/s with 4 MiB against 31-33 with 8 and
 * 25-26 with 16; 2 MiB was no faster (41-44). The restore's copy in of
 * 12.07 GiB took 0.30 s against 0.37-0.39 s, bound by the device now. The
 * driver's cost per copy (some microseconds) stays small beside the copy
 * (4 MiB: about 0.1 ms at 43 GB/s). */
static size_t buf_size(void)
{
	const char *e = getenv("GPUCR_PRELOAD_BUF_MIB");
	long v = e ? atol(e) : 0;
	return (size_t)(v > 0 && v <= 1024 ? v : 4) << 20;
}

int run_job(int out, int live, int *fds, int nfds, char *err, size_t n, struct stats *st)
{
	struct job j;
	memset(&j, 0, sizeof j);
	pthread_mutex_init(&j.err_mu, NULL);
	j.out = out;
	j.live = live;
	j.buf = buf_size();
	if (out) {
		/* Which blocks to store: the scan `scan` ran for this park, else
		 * one now (a peek's while the program runs). */
		j.scan = &kept_scan;
		if (live || !kept_scan.valid) {
			j.scan = &j.own;
			scan_run(live, &j.own);
		}
		pthread_mutex_lock(&tab_mu);
		int cap = 0;
		for (int i = 0; i < nm; i++)
			if (copied(i))
				cap += (ms[i].size + PIECE - 1) / PIECE;
		j.pieces = calloc(cap ? cap : 1, sizeof *j.pieces);
		for (int i = 0; i < nm; i++)
			for (size_t off = 0; copied(i) && off < ms[i].size; off += PIECE)
				j.pieces[j.npieces++] = (struct piece){.va = ms[i].va + off, .n = ms[i].size - off < PIECE ? ms[i].size - off : PIECE, .ctx = ms[i].ctx, .m = i};
		pthread_mutex_unlock(&tab_mu);
		j.fds = fds;
		layout(&j, nfds);
	} else {
		pthread_mutex_lock(&tab_mu);
		j.first = calloc(nm ? nm : 1, sizeof *j.first);
		for (int i = 0; i < nm; i++) {
			j.first[i] = j.nseen;
			if (copied(i))
				j.nseen += (ms[i].size + PIECE - 1) / PIECE;
		}
		j.seen = calloc(j.nseen ? j.nseen : 1, sizeof *j.seen);
		pthread_mutex_unlock(&tab_mu);
	}
	struct worker *ws = calloc(nfds, sizeof *ws);
	int started = 0;
	for (int i = 0; i < nfds && !atomic_load(&j.failed); i++) {
		ws[i].j = &j;
		ws[i].fd = fds[i];
		ws[i].idx = i;
		if (pthread_create(&ws[i].t, NULL, worker_main, &ws[i]) != 0) {
			job_fail(&j, "pthread_create failed");
			break;
		}
		started++;
	}
	for (int i = 0; i < started; i++)
		pthread_join(ws[i].t, NULL);
	/* Copy out writes the kept copy (regular files): a delayed write
	 * error shows at close, and must fail the job. A copy in's workers
	 * closed theirs; the rest were never started. */
	for (int i = out ? 0 : started; i < nfds; i++)
		if (close(fds[i]) < 0 && out)
			job_fail(&j, "close: %s", strerror(errno));
	free(ws);
	free(j.pieces);
	/* Copy in: every piece of every mapping must have come. */
	for (int k = 0; !out && k < j.nseen && !atomic_load(&j.failed); k++)
		if (!atomic_load(&j.seen[k])) {
			CUdeviceptr va = 0;
			pthread_mutex_lock(&tab_mu);
			for (int i = nm - 1; i >= 0; i--)
				if (copied(i) && j.first[i] <= k) {
					va = ms[i].va + (CUdeviceptr)(k - j.first[i]) * PIECE;
					break;
				}
			pthread_mutex_unlock(&tab_mu);
			job_fail(&j, "VRAM files: range at %#llx missing (the files do not cover the process's memory)", va);
		}
	free(j.first);
	free((void *)j.seen);
	unstage_all();
	*st = (struct stats){atomic_load(&j.bytes), j.setup, j.work, j.teardown, atomic_load(&j.wait_ns) / 1e9,
			     atomic_load(&j.io_ns) / 1e9, started, atomic_load(&j.nstaged), 0, {0}};
	if (out) {
		st->w = j.scan->w;
	} else {
		st->w.allocated = atomic_load(&j.allocated);
		st->w.zero = atomic_load(&j.zeroed);
		st->w.cached = atomic_load(&j.cached);
	}
	scan_free(&j.own);
	if (atomic_load(&j.failed)) {
		snprintf(err, n, "%s", j.err);
		return -1;
	}
	return 0;
}

/* cmd_copy runs copyout or copyin over the descriptors that came with the
 * line; the workers close them (*nfds is set to 0 once they own them). */
int cmd_copy(const char *line, int *fds, int *nfds, char *err, size_t n, struct stats *st)
{
	int outdir = line[4] == 'o';
	if (!parked) {
		snprintf(err, n, "not parked");
		return -1;
	}
	if (*nfds == 0 || *nfds > 64) {
		snprintf(err, n, "%s with %d descriptors, want 1..64", line, *nfds);
		return -1;
	}
	if (released) {
		snprintf(err, n, "%s", outdir ? "memory is released" : "memory is released: remap first");
		return -1;
	}
	int rc = run_job(outdir, 0, fds, *nfds, err, n, st);
	*nfds = 0;
	if (rc == 0 && !outdir)
		unfilled = 0;
	return rc;
}

/* cmd_peek copies the memory out while the program runs (copy_out_live),
 * into the descriptors that came with the line, in copyout's layout. */
int cmd_peek(int *fds, int *nfds, char *err, size_t n, struct stats *st)
{
	if (parked || released || driver_next) {
		snprintf(err, n, "peek: the program is parked (copyout copies it then)");
		return -1;
	}
	if (*nfds == 0 || *nfds > 64) {
		snprintf(err, n, "peek with %d descriptors, want 1..64", *nfds);
		return -1;
	}
	int rc = run_job(1, 1, fds, *nfds, err, n, st);
	*nfds = 0;
	return rc;
}
