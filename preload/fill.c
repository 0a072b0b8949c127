/*
 * fill: a restore's copy in moved ahead of the driver's restore (issue 36,
 * item 5). The driver restores a process only once CRIU has, and every
 * CUDA call of the process waits for that restore; so the copy in, done
 * by the process's library afterwards, adds its 0.3-0.5 s to every
 * restore. Another process may fill device memory meanwhile (the driver
 * allows it: e2e/gpu/fillprobe.c), and the restored process then maps that
 * memory in a few milliseconds instead of copying it.
 *
 * The handle table (text, GPUCRHT1) describes what copy-out copies:
 *
 *   GPUCRHT1
 *   d ORD UUID          device ORD (the process's numbering) is GPU UUID (32 hex digits)
 *   h IDX SIZE ORD      handle record IDX: SIZE bytes on device ORD
 *   m IDX VA SIZE OFF   a mapping of handle IDX: SIZE bytes at VA, from its byte OFF
 *   end
 *
 * `handles` writes it at a checkpoint, while parked; gpucr-stream stores
 * it beside the VRAM files. At a restore gpucr-stream starts a filler (its
 * own `gpu fill`, which loads this library and calls gpucr_fill) while CRIU
 * restores, rewrites the d rows for the GPUs the process is restored onto,
 * and hands the filler the table (`table`) and the VRAM files (`copyin`,
 * the ordinary copy in: the filler's mappings carry the process's
 * addresses in va and its own in at). The filler creates each handle on
 * that GPU as an exportable allocation and exports them (`export`).
 *
 * After the driver's restore, the process's library adopts them (`adopt`):
 * only if the table is the one it writes itself now, d rows aside, does it
 * import each handle and map it where the handle was. So a table from
 * anywhere but this process's checkpoint is refused before anything is
 * mapped, and a filled handle lands only where the copy in that filled it
 * meant it to. The remap then creates what was not adopted, and a copy in
 * follows unless nothing was left to create.
 */
#include "internal.h"

#define TABLE_MAGIC "GPUCRHT1\n"
#define MAX_TABLE (64 << 20)
#define MAX_DEVS 64

/* table_rows lists, in table order, the handle records copy-out copies
 * (under tab_mu); the caller frees it. */
static int *table_rows(int *k)
{
	unsigned char *want = calloc(nh ? nh : 1, 1);
	int *rows = calloc(nh ? nh : 1, sizeof *rows);
	*k = 0;
	if (!want || !rows) {
		free(want);
		free(rows);
		return NULL;
	}
	for (int i = 0; i < nm; i++)
		if (copied(i))
			want[ms[i].h] = 1;
	for (int i = 0; i < nh; i++)
		if (want[i] && hs[i].live)
			rows[(*k)++] = i;
	free(want);
	return rows;
}

/* dev_uuid writes the UUID of device ordinal ord as 32 hex digits into
 * hex (all zero where the driver does not say) and its CUdevice into *d;
 * it returns 0 where the driver gave both, else -1. */
static int dev_uuid(int ord, char hex[33], CUdevice *d)
{
	CUresult (*uuid)(unsigned char *, CUdevice) = real_dlsym(libcuda, "cuDeviceGetUuid_v2");
	CUresult (*get)(CUdevice *, int) = real_dlsym(libcuda, "cuDeviceGet");
	unsigned char u[16] = {0};
	int rc = 0;
	*d = ord;
	if (!uuid)
		uuid = real_dlsym(libcuda, "cuDeviceGetUuid");
	if (!get || get(d, ord) != CUDA_SUCCESS || !uuid || uuid(u, *d) != CUDA_SUCCESS) {
		memset(u, 0, sizeof u);
		rc = -1;
	}
	for (int b = 0; b < 16; b++)
		snprintf(hex + 2 * b, 3, "%02x", u[b]);
	return rc;
}

/* table_text is the handle table of rows (table_rows: k of them), with d
 * rows if devs (under tab_mu); the caller frees it. */
static char *table_text(const int *rows, int k, int devs, size_t *len)
{
	char *buf = NULL;
	size_t n = 0;
	FILE *f = open_memstream(&buf, &n);
	if (!f)
		return NULL;
	fputs(TABLE_MAGIC, f);
	unsigned char seen[MAX_DEVS] = {0};
	for (int r = 0; devs && r < k; r++) {
		int o = hs[rows[r]].prop.location.id;
		char hex[33];
		CUdevice d;
		if (o >= 0 && o < MAX_DEVS && !seen[o]++) {
			dev_uuid(o, hex, &d);
			fprintf(f, "d %d %s\n", o, hex);
		}
	}
	for (int r = 0; r < k; r++)
		fprintf(f, "h %d %zu %d\n", rows[r], hs[rows[r]].size, hs[rows[r]].prop.location.id);
	for (int i = 0; i < nm; i++)
		if (copied(i))
			fprintf(f, "m %d %#llx %zu %zu\n", ms[i].h, ms[i].va, ms[i].size, ms[i].offset);
	fputs("end\n", f);
	fclose(f);
	*len = n;
	return buf;
}

/* cmd_handles writes the table to the descriptor that came with it. */
int cmd_handles(int *fds, int nfds, char *out, size_t outn, char *err, size_t n)
{
	if (!parked || released) {
		snprintf(err, n, "handles: not parked with the memory mapped");
		return -1;
	}
	if (nfds != 1) {
		snprintf(err, n, "handles with %d descriptors, want 1", nfds);
		return -1;
	}
	size_t len;
	int k;
	pthread_mutex_lock(&tab_mu);
	int *rows = table_rows(&k);
	char *t = rows ? table_text(rows, k, 1, &len) : NULL;
	pthread_mutex_unlock(&tab_mu);
	free(rows);
	if (!t) {
		snprintf(err, n, "handles: out of memory");
		return -1;
	}
	int rc = write_all(fds[0], t, len);
	free(t);
	if (rc < 0) {
		snprintf(err, n, "handles: write: %s", strerror(errno));
		return -1;
	}
	snprintf(out, outn, "ok {\"handles\":%d,\"bytes\":%zu}\n", k, len);
	return 0;
}

/* read_table reads fd from its start, at most max bytes; NULL if longer. */
static char *read_table(int fd, size_t max, size_t *len)
{
	char *b = malloc(max + 1);
	size_t n = 0;
	while (b && n <= max) {
		ssize_t r = pread(fd, b + n, max + 1 - n, (off_t)n);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		n += (size_t)r;
	}
	if (!b || n > max) {
		free(b);
		return NULL;
	}
	b[n] = 0;
	*len = n;
	return b;
}

/* strip_d drops the d rows of table t in place. */
static void strip_d(char *t)
{
	char *w = t;
	for (char *r = t; *r;) {
		char *nl = strchr(r, '\n');
		size_t l = nl ? (size_t)(nl - r + 1) : strlen(r);
		if (!(r[0] == 'd' && r[1] == ' ')) {
			memmove(w, r, l);
			w += l;
		}
		r += l;
	}
	*w = 0;
}

/* cmd_adopt maps handles a filler filled (fds[1..], the table's h rows
 * from row `from` on) where the process's handles were, once the table
 * (fds[0]) is found to be the process's own. */
int cmd_adopt(int from, int *fds, int nfds, char *out, size_t outn, char *err, size_t n)
{
	if (!parked || !released) {
		snprintf(err, n, "adopt: not parked with the memory released");
		return -1;
	}
	if (nfds < 2 || from < 0) {
		snprintf(err, n, "adopt %d with %d descriptors, want the table and 1..%d handles", from, nfds, MAXFDS - 1);
		return -1;
	}
	pthread_mutex_lock(&tab_mu);
	size_t len, glen;
	int k, rc = 0, done = 0;
	int *rows = table_rows(&k);
	char *own = rows ? table_text(rows, k, 0, &len) : NULL;
	char *given = own ? read_table(fds[0], len + 4096 + MAX_DEVS * 48, &glen) : NULL;
	if (given)
		strip_d(given);
	if (!own || !rows) {
		snprintf(err, n, "adopt: out of memory");
		rc = -1;
	} else if (!given || strcmp(own, given)) {
		snprintf(err, n, "adopt: the handle table is not this process's");
		rc = -1;
	} else if (from + nfds - 1 > k) {
		snprintf(err, n, "adopt: rows %d..%d of %d", from, from + nfds - 2, k);
		rc = -1;
	}
	if (rc == 0 && nctx)
		r_CtxSetCurrent(ctxs[0]);
	for (int j = 1; j < nfds && rc == 0; j++) {
		int h = rows[from + j - 1];
		if (hs[h].present || hs[h].imported) {
			snprintf(err, n, "adopt: handle %d is present already", h);
			rc = -1;
		} else if ((rc = import_as(h, fds[j], err, n)) == 0) {
			done++;
		}
	}
	pthread_mutex_unlock(&tab_mu);
	free(own);
	free(rows);
	free(given);
	if (rc == 0)
		snprintf(out, outn, "ok {\"adopted\":%d}\n", done);
	return rc;
}

/* ---- the filler ---- */

struct fdev {
	int ord;
	CUdevice dev;
	CUcontext ctx;
};
static struct fdev fdevs[MAX_DEVS];
static int nfdev;
static int *row_h, *row_idx; /* table row -> our handle record, and the process's */
static int nrow;
static int exported[256];
static int nexported;

static CUresult (*f_DeviceGetCount)(int *);
static CUresult (*f_Retain)(CUcontext *, CUdevice);
static CUresult (*f_CtxRelease)(CUdevice);
static CUresult (*f_Init)(unsigned);

static struct fdev *fdev_of(int ord)
{
	for (int i = 0; i < nfdev; i++)
		if (fdevs[i].ord == ord)
			return &fdevs[i];
	return NULL;
}

/* fill_dev finds the GPU of UUID hex here and makes it device ord. */
static int fill_dev(int ord, const char *hex, char *err, size_t n)
{
	if (nfdev == MAX_DEVS || fdev_of(ord)) {
		snprintf(err, n, "table: device %d twice, or too many", ord);
		return -1;
	}
	int cnt = 0;
	f_DeviceGetCount(&cnt);
	for (int i = 0; i < cnt; i++) {
		char h[33];
		CUdevice d;
		/* A device whose UUID the driver does not give is no match,
		 * whatever the (untrusted) table names. */
		if (dev_uuid(i, h, &d) < 0 || strcmp(h, hex))
			continue;
		struct fdev *fd = &fdevs[nfdev];
		CUresult r = f_Retain(&fd->ctx, d);
		if (r != CUDA_SUCCESS) {
			snprintf(err, n, "context on GPU %s: CUresult %d", hex, r);
			return -1;
		}
		fd->ord = ord;
		fd->dev = d;
		nfdev++;
		if (nctx < 16)
			ctxs[nctx++] = fd->ctx;
		return 0;
	}
	snprintf(err, n, "table: no GPU %s here", hex);
	return -1;
}

/* fill_handle creates row IDX's handle: SIZE bytes, exportable, on ord. */
static int fill_handle(int idx, unsigned long long size, int ord, char *err, size_t n)
{
	struct fdev *d = fdev_of(ord);
	if (!d || idx < 0 || (nrow && idx <= row_idx[nrow - 1]) || size == 0 || size > (1ULL << 42)) {
		snprintf(err, n, "table: bad h row %d", idx);
		return -1;
	}
	CUmemAllocationProp p = {.type = 1, .requestedHandleTypes = 1, .location = {1, d->dev}};
	CUmemGenericAllocationHandle h;
	r_CtxSetCurrent(d->ctx);
	CUresult r = r_Create(&h, size, &p, 0);
	if (r != CUDA_SUCCESS) {
		snprintf(err, n, "cuMemCreate(%llu) on device %d: CUresult %d", size, ord, r);
		return -1;
	}
	int i = new_h();
	hs[i] = (struct hrec){.live = 1, .present = 1, .app = h, .real = h, .size = size, .prop = p};
	int *g = realloc(row_h, (nrow + 1) * sizeof *g), *x = g ? realloc(row_idx, (nrow + 1) * sizeof *x) : NULL;
	if (g)
		row_h = g;
	if (!x) {
		snprintf(err, n, "table: out of memory");
		return -1;
	}
	row_idx = x;
	row_h[nrow] = i;
	row_idx[nrow++] = idx;
	return 0;
}

/* fill_map maps row IDX's handle at an address of ours for the process's
 * VA (its at). */
static int fill_map(int idx, CUdeviceptr va, unsigned long long size, unsigned long long off, char *err, size_t n)
{
	/* The h rows come in ascending order (fill_handle checks). */
	int i = -1;
	for (int lo = 0, hi = nrow; lo < hi && i < 0;) {
		int mid = lo + (hi - lo) / 2;
		if (row_idx[mid] == idx)
			i = row_h[mid];
		else if (row_idx[mid] < idx)
			lo = mid + 1;
		else
			hi = mid;
	}
	if (i < 0 || size == 0 || off > hs[i].size || size > hs[i].size - off) {
		snprintf(err, n, "table: bad m row for handle %d", idx);
		return -1;
	}
	struct fdev *d = fdev_of(hs[i].prop.location.id);
	CUdeviceptr at;
	r_CtxSetCurrent(d->ctx);
	CUresult r = r_AddressReserve(&at, size, 0, 0, 0);
	if (r != CUDA_SUCCESS) {
		snprintf(err, n, "reserve %llu bytes: CUresult %d", size, r);
		return -1;
	}
	int m = new_m();
	ms[m] = (struct mrec){.live = 1, .va = va, .at = at, .size = size, .offset = off, .h = i, .nacc = 1, .ctx = d->ctx};
	ms[m].acc[0] = (CUmemAccessDesc){{1, d->dev}, 3};
	if ((r = r_Map(at, size, off, hs[i].real, 0)) == CUDA_SUCCESS)
		r = r_SetAccess(at, size, ms[m].acc, 1);
	if (r != CUDA_SUCCESS) {
		snprintf(err, n, "map %llu bytes: CUresult %d", size, r);
		return -1;
	}
	ms[m].mapped = 1;
	return 0;
}

/* fill_table reads the table (fd) and makes its devices, handles and
 * mappings, if each device has room for the process: its handles, or
 * used bytes (what it was recorded to use, its context and the memory the
 * driver restores included) where that is more, and margin bytes more.
 * The table is untrusted here: it only sizes what this process creates;
 * the process that adopts checks it is its own. */
static int fill_table(int fd, long long used, long long margin, char *out, size_t outn, char *err, size_t n)
{
	size_t len;
	char *t = read_table(fd, MAX_TABLE, &len);
	if (!t || strncmp(t, TABLE_MAGIC, strlen(TABLE_MAGIC))) {
		snprintf(err, n, "table: %s", t ? "bad magic" : "unreadable or too long");
		free(t);
		return -1;
	}
	int rc = 0, end = 0;
	long long bytes = 0, need[MAX_DEVS] = {0};
	/* Pass 1: the devices, and what each must hold; pass 2: the rest. */
	for (int pass = 1; pass <= 2 && rc == 0; pass++) {
		end = 0;
		for (char *l = t + strlen(TABLE_MAGIC), *nl; *l && rc == 0 && !end; l = nl ? nl + 1 : l + strlen(l)) {
			if ((nl = strchr(l, '\n')))
				*nl = 0;
			int a, o;
			unsigned long long sz, off, va;
			char hex[33];
			if (sscanf(l, "d %d %32[0-9a-f]", &a, hex) == 2 && strlen(hex) == 32) {
				rc = pass == 1 ? fill_dev(a, hex, err, n) : 0;
			} else if (sscanf(l, "h %d %llu %d", &a, &sz, &o) == 3) {
				if (pass == 1 && o >= 0 && o < MAX_DEVS && sz <= (1ULL << 42))
					need[o] += (long long)sz;
				else if (pass == 2 && (rc = fill_handle(a, sz, o, err, n)) == 0)
					bytes += (long long)sz;
			} else if (sscanf(l, "m %d %llx %llu %llu", &a, &va, &sz, &off) == 4) {
				rc = pass == 2 ? fill_map(a, va, sz, off, err, n) : 0;
			} else if (!strcmp(l, "end")) {
				end = 1;
			} else {
				snprintf(err, n, "table: bad row \"%.40s\"", l);
				rc = -1;
			}
			if (nl)
				*nl = '\n';
		}
		for (int i = 0; pass == 1 && rc == 0 && i < nfdev; i++) {
			size_t fr = 0, tot = 0;
			r_CtxSetCurrent(fdevs[i].ctx);
			r_MemGetInfo(&fr, &tot);
			long long want = need[fdevs[i].ord];
			if ((long long)fr < (want > used ? want : used) + margin) {
				snprintf(err, n, "device %d: %zu bytes free, the fill needs %lld and leaves %lld for the driver's restore",
					 fdevs[i].ord, fr, want, (used > want ? used - want : 0) + margin);
				rc = -1;
			}
		}
	}
	free(t);
	if (rc == 0 && !end) {
		snprintf(err, n, "table: no end row");
		rc = -1;
	}
	if (rc == 0)
		snprintf(out, outn, "ok {\"handles\":%d,\"bytes\":%lld}\n", nrow, bytes);
	return rc;
}

static void exported_close(void)
{
	for (int i = 0; i < nexported; i++)
		close(exported[i]);
	nexported = 0;
}

/* fill_export exports the handles of rows from.. (up to 256), open until
 * the next command: gpucr-stream takes them with pidfd_getfd. */
static int fill_export(int from, char *out, size_t outn, char *err, size_t n)
{
	size_t w = (size_t)snprintf(out, outn, "ok {\"fds\":[");
	for (int r = from; r >= 0 && r < nrow && nexported < 256; r++) {
		int fd = -1;
		struct fdev *d = fdev_of(hs[row_h[r]].prop.location.id);
		r_CtxSetCurrent(d->ctx);
		CUresult cr = r_Export(&fd, hs[row_h[r]].real, 1, 0);
		if (cr != CUDA_SUCCESS) {
			snprintf(err, n, "cuMemExportToShareableHandle (row %d): CUresult %d", r, cr);
			return -1;
		}
		exported[nexported++] = fd;
		w += (size_t)snprintf(out + w, outn - w, "%s%d", nexported > 1 ? "," : "", fd);
	}
	snprintf(out + w, outn - w, "]}\n");
	return 0;
}

/* fill_end unmaps and releases what the filler made (the exported
 * descriptors, once imported, keep the memory alive in the importer). */
static void fill_end(void)
{
	exported_close();
	for (int i = 0; i < nm; i++)
		if (ms[i].live && ms[i].mapped) {
			r_Unmap(ms[i].at, ms[i].size);
			r_AddressFree(ms[i].at, ms[i].size);
		}
	for (int i = 0; i < nh; i++)
		if (hs[i].live)
			r_Release(hs[i].real);
	for (int i = 0; i < nfdev; i++)
		f_CtxRelease(fdevs[i].dev);
}

static int fill_bind(const char *driver, char *err, size_t n)
{
	pthread_once(&dlsym_once, init_dlsym);
	libcuda = dlopen(driver, RTLD_NOW | RTLD_GLOBAL);
	if (!libcuda) {
		snprintf(err, n, "dlopen %s: %s", driver, dlerror());
		return -1;
	}
	resolve_real();
#define F(var, sym) var = real_dlsym(libcuda, sym)
	F(f_Init, "cuInit");
	F(f_DeviceGetCount, "cuDeviceGetCount");
	F(f_Retain, "cuDevicePrimaryCtxRetain");
	F(f_CtxRelease, "cuDevicePrimaryCtxRelease_v2");
#undef F
	if (!f_CtxRelease)
		f_CtxRelease = real_dlsym(libcuda, "cuDevicePrimaryCtxRelease");
	if (!f_Init || !f_DeviceGetCount || !real_dlsym(libcuda, "cuDeviceGet") ||
	    (!real_dlsym(libcuda, "cuDeviceGetUuid_v2") && !real_dlsym(libcuda, "cuDeviceGetUuid")) || !f_Retain || !f_CtxRelease || incapable()) {
		snprintf(err, n, "the driver lacks what a filler needs%s%s", incapable() ? ": " : "", incapable() ? incapable() : "");
		return -1;
	}
	CUresult r = f_Init(0);
	if (r != CUDA_SUCCESS) {
		snprintf(err, n, "cuInit: CUresult %d", r);
		return -1;
	}
	return 0;
}

/* gpucr_fill serves one restore's filler on socket c (the commands table,
 * copyin, export; its end ends the filler) with the driver library driver
 * (a name or path for dlopen), and returns 0, or 1 if the driver could not
 * be bound. Exported for gpucr-stream's `gpu fill`. */
__attribute__((visibility("default"))) int gpucr_fill(int c, const char *driver)
{
	static char out[16384];
	char line[1024], err[512] = "";
	int fds[MAXFDS], nfds;
	long long used, margin;
	internal = 1;
	parked = 1; /* the copy in's precondition: nothing of a program runs here */
	int bound = fill_bind(driver && *driver ? driver : "libcuda.so.1", err, sizeof err);
	while (recv_cmd(c, line, sizeof line, fds, &nfds) == 0) {
		struct stats st = {0};
		int rc = bound, custom = 1;
		exported_close();
		if (bound < 0) {
			/* err says why */
		} else if (sscanf(line, "table %lld %lld", &used, &margin) == 2 && nfds == 1) {
			rc = fill_table(fds[0], used, margin, out, sizeof out, err, sizeof err);
		} else if (!strcmp(line, "copyin")) {
			rc = cmd_copy(line, fds, &nfds, err, sizeof err, &st);
			custom = 0;
		} else if (!strncmp(line, "export ", 7)) {
			rc = fill_export(atoi(line + 7), out, sizeof out, err, sizeof err);
		} else {
			snprintf(err, sizeof err, "filler: unknown command %.40s", line);
			rc = -1;
		}
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		answer(out, sizeof out, rc, err, custom ? NULL : &st);
		if (rc < 0 && bound == 0)
			err[0] = 0;
		if (write_all(c, out, strlen(out)) < 0)
			break;
	}
	if (bound == 0)
		fill_end();
	return bound < 0;
}
