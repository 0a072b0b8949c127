/*
 * dedup: the blocks a --dedup checkpoint takes from an earlier checkpoint
 * of the process in the same location instead of copying them out, so
 * that the kept copy holds only what changed (issue 36; docs/PRODUCERS.md,
 * "Blocks an earlier checkpoint holds"). gpucr-stream decides which; the
 * library hashes the memory on the device and leaves those blocks out:
 *
 *   `bases LOC`     the checkpoints of location LOC (gpucr-stream's 64-bit
 *                   name of it, hex) this process went into, the latest
 *                   first: where to look. Hints only: gpucr-stream opens
 *                   the checkpoint and compares its own record of it.
 *   `based LOC NAME` this checkpoint of LOC is NAME (its bytes in hex).
 *                   Kept in the process's memory, so CRIU carries it into
 *                   the checkpoint and a restore of it knows it too.
 *   `hashes KEY`    (one descriptor; parked, after `scan`) every block of
 *                   every mapping, as the scan cut them, hashed on the
 *                   device under KEY (devhash.c), written to the
 *                   descriptor, with which of them may be left out: those
 *                   stored now and in no range the program marked (the
 *                   marked part of a block is stored as zeros, so its
 *                   bytes are not the memory's).
 *   `skip`          (one descriptor; parked, after `hashes`) the blocks
 *                   gpucr-stream found unchanged in an earlier checkpoint
 *                   that holds them: each must be one `hashes` offered.
 *                   The copy out lays them out as stored and leaves their
 *                   places holes (BLK_EARLIER); gpucr-stream fills them
 *                   from that checkpoint, in the store and in an undo.
 *
 * The files, little-endian u64s (vram/unchanged.go reads and writes them):
 *   hashes: "GPUCRDH1", KEY, BLOCK, M, then M mappings in address order:
 *           VA, SIZE, a bitmap of its ceil(SIZE/BLOCK) blocks (bit b of
 *           byte b/8 set: may be left out) padded with zeros to 8 bytes,
 *           then 16 bytes a block (devhash.h's lanes a, b).
 *   skip:   "GPUCRSK1", M, then M mappings: VA, SIZE, BLOCK, a bitmap
 *           (set: leave it out) padded with zeros to 8 bytes; nothing
 *           after.
 * A kept copy without those blocks cannot refill the memory alone: the
 * library does not refill from it on its own (recover.c), gpucr-stream
 * does (`recover` with descriptors of whole files it composes).
 */
#include "internal.h"

int kept_delta;

int blk_in_file(unsigned char what) { return what == BLK_STORE || what == BLK_EARLIER; }

/* ---- the checkpoints a location holds of this process ---- */
#define NLOCS 4
#define NNAMES 4
#define NAMEHEX 510 /* a name of up to 255 bytes */
struct based {
	uint64_t loc;
	int n;
	char names[NNAMES][NAMEHEX + 1]; /* the latest first */
};
static struct based bases[NLOCS]; /* the location used last first */
static int nbases;

void bases_reset(void) { nbases = 0; }

static int hexname(const char *s)
{
	size_t k = strlen(s);
	if (k < 2 || k > NAMEHEX || k % 2)
		return 0;
	for (; *s; s++)
		if (!((*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'f')))
			return 0;
	return 1;
}

int cmd_based(const char *args, char *err, size_t n)
{
	char *end;
	uint64_t loc = strtoull(args, &end, 16);
	if (*end != ' ' || !hexname(end + 1)) {
		snprintf(err, n, "based LOC NAME: LOC in hex, NAME its bytes in hex (up to %d digits)", NAMEHEX);
		return -1;
	}
	const char *name = end + 1;
	int s = 0;
	while (s < nbases && bases[s].loc != loc)
		s++;
	if (s == nbases) { /* a new one takes the slot used least recently */
		if (nbases < NLOCS)
			nbases++;
		s = nbases - 1;
		bases[s].loc = loc;
		bases[s].n = 0;
	}
	struct based b = bases[s];
	memmove(&bases[1], &bases[0], s * sizeof b);
	int k = 0;
	while (k < b.n && strcmp(b.names[k], name))
		k++;
	if (k == b.n && b.n < NNAMES)
		b.n++;
	if (k == NNAMES)
		k = NNAMES - 1;
	memmove(b.names[1], b.names[0], k * sizeof b.names[0]);
	snprintf(b.names[0], sizeof b.names[0], "%s", name);
	bases[0] = b;
	return 0;
}

int cmd_bases(const char *args, char *out, size_t outn, char *err, size_t n)
{
	char *end;
	uint64_t loc = strtoull(args, &end, 16);
	if (*end || end == args) {
		snprintf(err, n, "bases LOC: LOC in hex");
		return -1;
	}
	size_t k = (size_t)snprintf(out, outn, "ok {\"names\":[");
	for (int s = 0; s < nbases; s++)
		if (bases[s].loc == loc)
			for (int i = 0; i < bases[s].n && k + NAMEHEX + 8 < outn; i++)
				k += (size_t)snprintf(out + k, outn - k, "%s\"%s\"", i ? "," : "", bases[s].names[i]);
	snprintf(out + k, outn - k, "]}\n");
	return 0;
}

/* ---- hashes and skip ---- */

static double mono(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* marked says whether [a, b) meets a range s's marks held when it ran. */
static int marked(const struct scan *s, CUdeviceptr a, CUdeviceptr b)
{
	for (int i = 0; i < s->nmarks; i++)
		if (s->marks[i].va < b && a < s->marks[i].va + s->marks[i].n)
			return 1;
	return 0;
}

/* eligible: block b of mapping m may come from an earlier checkpoint. */
static int eligible(const struct scan *s, const struct wmap *m, size_t b)
{
	CUdeviceptr a = m->va + b * s->block;
	size_t len = m->size - b * s->block < s->block ? m->size - b * s->block : s->block;
	return m->what[b] == BLK_STORE && !marked(s, a, a + len);
}

static const struct wmap *scan_map(CUdeviceptr va, size_t size)
{
	for (int i = 0; i < kept_scan.k; i++)
		if (kept_scan.m[i].va == va && kept_scan.m[i].size == size)
			return &kept_scan.m[i];
	return NULL;
}

static int need_scan(const char *cmd, char *err, size_t n)
{
	if (!parked || released) {
		snprintf(err, n, "%s: %s", cmd, released ? "memory is released" : "not parked");
		return -1;
	}
	if (!kept_scan.valid) {
		snprintf(err, n, "%s: scan first", cmd);
		return -1;
	}
	return 0;
}

int cmd_hashes(const char *args, int *fds, int nfds, char *out, size_t outn, char *err, size_t n)
{
	char *end;
	uint64_t key = strtoull(args, &end, 0);
	if (*end || end == args || nfds != 1) {
		snprintf(err, n, "hashes KEY takes one descriptor");
		return -1;
	}
	if (need_scan("hashes", err, n) < 0)
		return -1;
	struct dhmap *m;
	long long bytes, blocks;
	int contexts, k;
	double load = 0, kern = 0, fetch = 0, t0 = mono();
	if ((k = hash_maps(kept_scan.block, key, &m, &bytes, &blocks, &contexts, &load, &kern, &fetch, err, n)) < 0)
		return -1;
	uint64_t hdr[4];
	memcpy(hdr, "GPUCRDH1", 8);
	hdr[1] = key;
	hdr[2] = kept_scan.block;
	hdr[3] = (uint64_t)k;
	int rc = write_all(fds[0], hdr, sizeof hdr);
	long long offered = 0;
	for (int i = 0; rc == 0 && i < k; i++) {
		const struct wmap *w = scan_map(m[i].va, m[i].n);
		size_t bl = (m[i].nblk + 63) / 64 * 8;
		unsigned char *bm = calloc(bl ? bl : 1, 1);
		if (!bm) {
			rc = -1;
			break;
		}
		for (size_t b = 0; w && b < m[i].nblk; b++)
			if (eligible(&kept_scan, w, b)) {
				bm[b / 8] |= (unsigned char)(1u << (b % 8));
				offered++;
			}
		uint64_t mh[2] = {m[i].va, m[i].n};
		rc = write_all(fds[0], mh, sizeof mh);
		if (rc == 0)
			rc = write_all(fds[0], bm, bl);
		if (rc == 0)
			rc = write_all(fds[0], m[i].h, m[i].nblk * 16);
		free(bm);
	}
	free_maps(m, k);
	if (rc < 0) {
		snprintf(err, n, "hashes: write: %s", strerror(errno));
		return -1;
	}
	snprintf(out, outn,
		 "ok {\"mappings\":%d,\"bytes\":%lld,\"blocks\":%lld,\"block\":%zu,\"offered\":%lld,\"contexts\":%d,\"kernel_s\":%.6f,"
		 "\"hashes_s\":%.6f}\n",
		 k, bytes, blocks, kept_scan.block, offered, contexts, kern, mono() - t0);
	return 0;
}

/* unskip puts every block skip marked back to stored. */
static void unskip(void)
{
	for (int i = 0; i < kept_scan.k; i++)
		for (size_t b = 0; b < kept_scan.m[i].nblk; b++)
			if (kept_scan.m[i].what[b] == BLK_EARLIER)
				kept_scan.m[i].what[b] = BLK_STORE;
	kept_scan.w.earlier = 0;
}

/* skip_map applies one mapping's record of the skip file; -1 on a record
 * that is not one of the scan's mappings or names a block `hashes` did
 * not offer. */
static int skip_map(int fd, long long *bytes, char *err, size_t n)
{
	uint64_t h[3];
	if (read_full(fd, h, sizeof h)) {
		snprintf(err, n, "skip: truncated");
		return -1;
	}
	struct wmap *w = (struct wmap *)scan_map(h[0], h[1]);
	if (!w || h[2] != kept_scan.block) {
		snprintf(err, n, "skip: %#llx+%llu in blocks of %llu is no mapping as the scan cut them", (unsigned long long)h[0],
			 (unsigned long long)h[1], (unsigned long long)h[2]);
		return -1;
	}
	size_t bl = (w->nblk + 63) / 64 * 8;
	unsigned char *bm = malloc(bl ? bl : 1);
	if (!bm || read_full(fd, bm, bl)) {
		free(bm);
		snprintf(err, n, "skip: %s", bm ? "truncated" : "out of memory");
		return -1;
	}
	int rc = 0;
	for (size_t b = 0; b < bl * 8 && rc == 0; b++) {
		if (!(bm[b / 8] >> (b % 8) & 1))
			continue;
		if (b >= w->nblk || !eligible(&kept_scan, w, b)) {
			snprintf(err, n, "skip: block %zu of %#llx was not offered", b, w->va);
			rc = -1;
			break;
		}
		w->what[b] = BLK_EARLIER;
		*bytes += (long long)(w->size - b * kept_scan.block < kept_scan.block ? w->size - b * kept_scan.block : kept_scan.block);
	}
	free(bm);
	return rc;
}

int cmd_skip(int *fds, int nfds, char *out, size_t outn, char *err, size_t n)
{
	if (nfds != 1) {
		snprintf(err, n, "skip takes one descriptor");
		return -1;
	}
	if (need_scan("skip", err, n) < 0)
		return -1;
	uint64_t h[2];
	if (read_full(fds[0], h, sizeof h) || memcmp(h, "GPUCRSK1", 8) || h[1] > (uint64_t)kept_scan.k) {
		snprintf(err, n, "skip: not a skip file for this scan");
		return -1;
	}
	unskip();
	long long bytes = 0;
	char extra;
	for (uint64_t i = 0; i < h[1]; i++)
		if (skip_map(fds[0], &bytes, err, n) < 0) {
			unskip();
			return -1;
		}
	if (read(fds[0], &extra, 1) != 0) {
		unskip();
		snprintf(err, n, "skip: bytes after the last mapping");
		return -1;
	}
	kept_scan.w.earlier = bytes;
	snprintf(out, outn, "ok {\"skipped\":%lld}\n", bytes);
	return 0;
}
