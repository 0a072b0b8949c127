/*
 * bookkeeping: every handle (with its properties), every mapping (with its
 * access) and every cuMemAlloc this library backs, under tab_mu; and the
 * two steps that use them, release (physical memory gone, the rest kept)
 * and remap (the same addresses, new physical memory).
 */
#include "internal.h"

struct hrec *hs;
int nh;
static int caph;
struct mrec *ms;
int nm;
static int capm;
struct orec *os_;
int no;
static int capo;
struct srec *ss;
int nsh;
static int caps;
CUcontext ctxs[16];
int nctx;
int parked, released;
int unfilled;
static int remade; /* handles remap created since the release */
U handle_seq = 0x6770000000000000ULL;

#define GROW(arr, n, cap)                                              \
	do {                                                           \
		if ((n) == (cap)) {                                    \
			int nc = (cap) ? (cap) * 2 : 64;               \
			void *p = realloc((arr), nc * sizeof *(arr));  \
			if (!p)                                        \
				abort();                               \
			memset((char *)p + (cap) * sizeof *(arr), 0,   \
			       (nc - (cap)) * sizeof *(arr));          \
			(arr) = p;                                     \
			(cap) = nc;                                    \
		}                                                      \
	} while (0)

/* NEW_SLOT defines a function that returns a cleared slot of a table: a
 * dead one reused, else a new one at the end (the table grows). */
#define NEW_SLOT(fn, arr, n, cap)                                      \
	int fn(void)                                                   \
	{                                                              \
		for (int i = 0; i < (n); i++)                          \
			if (!(arr)[i].live)                            \
				return memset(&(arr)[i], 0, sizeof(arr)[i]), i; \
		GROW(arr, n, cap);                                     \
		memset(&(arr)[n], 0, sizeof(arr)[n]);                  \
		return (n)++;                                          \
	}
NEW_SLOT(new_h, hs, nh, caph)
NEW_SLOT(new_m, ms, nm, capm)
NEW_SLOT(new_o, os_, no, capo)
NEW_SLOT(new_s, ss, nsh, caps)

/* map_again maps physical memory h where mapping m was, with its access
 * (under tab_mu). */
static int map_again(struct mrec *m, CUmemGenericAllocationHandle h, char *err, size_t n)
{
	CUresult r = r_Map(m->va, m->size, m->offset, h, 0);
	if (r == CUDA_SUCCESS && m->nacc)
		r = r_SetAccess(m->va, m->size, m->acc, m->nacc);
	if (r != CUDA_SUCCESS) {
		snprintf(err, n, "map %#llx: CUresult %d", m->va, r);
		return -1;
	}
	m->mapped = 1;
	return 0;
}

/* note_shared keeps a duplicate of a shareable descriptor of handle h
 * (under tab_mu). */
void note_shared(int h, int fd, int import)
{
	int d = fcntl(fd, F_DUPFD_CLOEXEC, 3);
	if (d < 0) {
		mark_incapable("duplicating a shareable descriptor: %s", strerror(errno));
		return;
	}
	int i = new_s();
	ss[i] = (struct srec){.live = 1, .h = h, .fd = d, .import = import};
}

/* close_shared closes the duplicates (under tab_mu): at the release, so
 * that CRIU finds none, and the match was made before. */
void close_shared(void)
{
	for (int i = 0; i < nsh; i++)
		if (ss[i].live) {
			close(ss[i].fd);
			ss[i].live = 0;
		}
}

/* imports_pending: an imported handle with mappings is not imported again
 * yet (the program must not run). */
int imports_pending(void)
{
	for (int i = 0; i < nm; i++)
		if (ms[i].live && !ms[i].mapped && hs[ms[i].h].imported)
			return 1;
	return 0;
}

/* import_as imports fd as handle record h's physical memory and maps it
 * wherever h was mapped, with its access (under tab_mu, a context
 * current). */
int import_as(int h, int fd, char *err, size_t n)
{
	CUmemGenericAllocationHandle real = 0;
	CUresult r = r_Import(&real, (void *)(uintptr_t)fd, 1, 0);
	if (r != CUDA_SUCCESS) {
		snprintf(err, n, "cuMemImportFromShareableHandle: CUresult %d", r);
		return -1;
	}
	hs[h].real = real;
	hs[h].present = 1;
	for (int i = 0; i < nm; i++) {
		struct mrec *m = &ms[i];
		if (m->live && !m->mapped && m->h == h && map_again(m, real, err, n) < 0)
			return -1;
	}
	/* A handle the program released lives only while mapped. */
	if (hs[h].app_released && hs[h].real != hs[h].app) {
		r_Release(hs[h].real);
		hs[h].app = handle_seq++;
	}
	return 0;
}

/* do_import imports fd (an exporter's new shareable handle) as handle
 * record h and maps it wherever h was mapped, with its access. */
int do_import(int h, int fd, char *err, size_t n)
{
	pthread_mutex_lock(&tab_mu);
	int rc = 0;
	if (h < 0 || h >= nh || !hs[h].live || !hs[h].imported) {
		snprintf(err, n, "import: %d is no imported handle", h);
		rc = -1;
	} else if (hs[h].present) {
		snprintf(err, n, "import: handle %d is present already", h);
		rc = -1;
	}
	if (rc == 0 && nctx)
		r_CtxSetCurrent(ctxs[0]);
	if (rc == 0)
		rc = import_as(h, fd, err, n);
	pthread_mutex_unlock(&tab_mu);
	return rc;
}
int find_h_app(CUmemGenericAllocationHandle app)
{
	for (int i = 0; i < nh; i++)
		if (hs[i].live && !hs[i].own && hs[i].app == app)
			return i;
	return -1;
}
void note_ctx(void)
{
	CUcontext c = NULL;
	if (!r_CtxGetCurrent || r_CtxGetCurrent(&c) != CUDA_SUCCESS || !c)
		return;
	for (int i = 0; i < nctx; i++)
		if (ctxs[i] == c)
			return;
	if (nctx < 16)
		ctxs[nctx++] = c;
	else
		mark_incapable("more than 16 CUDA contexts");
}
CUcontext cur_ctx(void)
{
	CUcontext c = NULL;
	if (r_CtxGetCurrent)
		r_CtxGetCurrent(&c);
	return c;
}
/* drop_h forgets a handle record once it is released and mapped nowhere,
 * and closes the duplicates of its shareable descriptors (they would keep
 * the memory alive, and the record's slot is reused). */
void drop_h_if_unused(int h)
{
	if (!hs[h].live || !hs[h].app_released)
		return;
	for (int i = 0; i < nm; i++)
		if (ms[i].live && ms[i].h == h)
			return;
	hs[h].live = 0;
	for (int i = 0; i < nsh; i++)
		if (ss[i].live && ss[i].h == h) {
			close(ss[i].fd);
			ss[i].live = 0;
		}
}

/* ---- release and remap ---- */

/* release unmaps and releases every physical allocation; reservations,
 * handle properties and access stay recorded for remap. */
int do_release(char *err, size_t n)
{
	pthread_mutex_lock(&tab_mu);
	if (nctx)
		r_CtxSetCurrent(ctxs[0]);
	int rc = 0, done = 0;
	for (int i = 0; i < nm && rc == 0; i++) {
		if (!ms[i].live || !ms[i].mapped)
			continue;
		if (done > 0 && fault("release")) {
			snprintf(err, n, "injected fault (release) after %d mappings", done);
			rc = -1;
			break;
		}
		CUresult r = r_Unmap(ms[i].va, ms[i].size);
		if (r != CUDA_SUCCESS) {
			snprintf(err, n, "unmap %#llx: CUresult %d", ms[i].va, r);
			rc = -1;
			break;
		}
		ms[i].mapped = 0;
		done++;
	}
	for (int i = 0; i < nh && rc == 0; i++) {
		if (!hs[i].live || !hs[i].present)
			continue;
		int still = 0;
		for (int k = 0; k < nm; k++)
			still |= ms[k].live && ms[k].mapped && ms[k].h == i;
		if (still)
			continue;
		/* A handle the program released is freed by its last unmap. */
		if (!hs[i].app_released) {
			CUresult r = r_Release(hs[i].real);
			if (r != CUDA_SUCCESS) {
				snprintf(err, n, "release handle: CUresult %d", r);
				rc = -1;
				break;
			}
		}
		hs[i].present = 0;
	}
	if (rc == 0)
		close_shared();
	released = 1;
	remade = 0;
	pthread_mutex_unlock(&tab_mu);
	return rc;
}

/* remap recreates what release took: a physical allocation per handle
 * with its properties, mapped where it was, with its access. Idempotent:
 * what is present stays. Memory a filler filled (adopt, fill.c) is
 * present: if remap creates nothing, nothing waits for a copy in. */
int do_remap(char *err, size_t n)
{
	pthread_mutex_lock(&tab_mu);
	if (nctx)
		r_CtxSetCurrent(ctxs[0]);
	int rc = 0, created = 0;
	if (fault("remap")) {
		snprintf(err, n, "injected fault (remap)");
		rc = -1;
	}
	for (int i = 0; i < nh && rc == 0; i++) {
		if (!hs[i].live || hs[i].present || hs[i].imported)
			continue;
		CUmemGenericAllocationHandle h;
		CUresult r = r_Create(&h, hs[i].size, &hs[i].prop, 0);
		if (r != CUDA_SUCCESS) {
			snprintf(err, n, "cuMemCreate(%zu): CUresult %d", hs[i].size, r);
			rc = -1;
			break;
		}
		hs[i].real = h;
		hs[i].present = 1;
		created++;
	}
	for (int i = 0; i < nm && rc == 0; i++) {
		struct mrec *m = &ms[i];
		if (!m->live || m->mapped || hs[m->h].imported)
			continue;
		if (map_again(m, hs[m->h].real, err, n) < 0)
			rc = -1;
	}
	/* Handles the program had released live only while mapped. */
	for (int i = 0; i < nh && rc == 0; i++)
		if (hs[i].live && hs[i].present && !hs[i].imported && hs[i].app_released && hs[i].real != hs[i].app) {
			r_Release(hs[i].real);
			/* The program released its handle: no value of its names
			 * this record any more (the driver may reuse values). */
			hs[i].app = handle_seq++;
		}
	/* Once every handle is back after a release: what remap created
	 * (this call or a failed one before) waits for a copy in; a retry
	 * afterwards leaves that as it was. */
	remade += created;
	if (rc == 0 && released)
		unfilled = remade > 0;
	if (rc == 0)
		released = 0;
	pthread_mutex_unlock(&tab_mu);
	return rc;
}
