/*
 * A fake libcuda.so.1 for testing libgpucr-preload without a GPU: the same
 * entry points, host memory behind them. A reservation is an mmap PROT_NONE
 * range, a physical allocation a memfd, a map an mmap MAP_FIXED|MAP_SHARED of
 * it (inaccessible until cuMemSetAccess), copies are memcpy, streams and
 * contexts are tokens. cuLaunchKernel runs the "kernel" f(kernelParams) on
 * the calling thread; a module's functions are the library's kernels, on
 * the host: devhash's (devhash.h; GPUCR_FAKE_DEVHASH_WRONG=1 makes it
 * answer a wrong hash for every block at the start of a mapping, as a
 * broken kernel would) and the zero scan's (GPUCR_FAKE_NO_ZERO_KERNEL=1: the
 * module lacks it). cuMemGetInfo reports the physical bytes alive, so
 * tests can see that a release frees "device memory". A kernel counts as
 * queued on its thread until the next synchronize: cuMemUnmap on a thread
 * with work queued fails with CUDA_ERROR_ILLEGAL_ADDRESS (700), as the real
 * device faults when a queued kernel reaches memory unmapped under it.
 * Memory the driver hands out is not zeroed on a real device: with
 * GPUCR_FAKE_POISON=1 every physical allocation starts filled with 0xA5,
 * so that a test sees a copy in that leaves a block it should have zeroed.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../devhash.h"

typedef int CUresult;
typedef unsigned long long U;
#define OK 0
#define BAD 1

static int locked(const char *call);
#define LOCKED 999
#define TOTAL (1ULL << 40)
static atomic_llong phys; /* bytes of live physical allocations */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
struct h {
	int fd;
	size_t size;
	int live;
};
static struct h hs[100000];
static int nhs;

CUresult cuInit(unsigned f) { (void)f; return OK; }
CUresult cuDriverGetVersion(int *v) { *v = 12080; return OK; }
CUresult cuDeviceGet(int *d, int o) { *d = o; return OK; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { *c = (void *)(uintptr_t)(0x1000 + d); return OK; }
CUresult cuDevicePrimaryCtxRelease_v2(int d) { (void)d; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = 2; return OK; }
/* GPU d's UUID: "fake-gpu" and d in its last byte. */
CUresult cuDeviceGetUuid_v2(unsigned char *u, int d)
{
	memset(u, 0, 16);
	memcpy(u, "fake-gpu", 8);
	u[15] = (unsigned char)d;
	return OK;
}
static __thread void *cur;
CUresult cuCtxSetCurrent(void *c) { cur = c; return OK; }
CUresult cuCtxGetCurrent(void **c) { *c = cur; return OK; }
CUresult cuCtxGetDevice(int *d) { if (!cur) return 201; *d = (int)((uintptr_t)cur - 0x1000); return OK; }
static atomic_llong syncs;             /* synchronizes so far */
static __thread long long queued = -1; /* syncs when this thread last launched */
static void synced(void) { atomic_fetch_add(&syncs, 1); }
CUresult cuCtxSynchronize(void)
{
	if (locked("cuCtxSynchronize"))
		return LOCKED;
	synced();
	return OK;
}
CUresult cuMemGetInfo_v2(size_t *fr, size_t *tot) { *tot = TOTAL; *fr = TOTAL - atomic_load(&phys); return OK; }
CUresult cuMemGetAllocationGranularity(size_t *g, const void *prop, int opt) { (void)prop; *g = opt ? 2 << 20 : 64 << 10; return OK; }

CUresult cuMemAddressReserve(U *ptr, size_t size, size_t align, U addr, U flags)
{
	(void)align; (void)flags;
	void *p = mmap((void *)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (p == MAP_FAILED)
		return 2;
	*ptr = (U)p;
	return OK;
}
CUresult cuMemAddressFree(U ptr, size_t size) { return munmap((void *)ptr, size) ? BAD : OK; }

CUresult cuMemCreate(U *h, size_t size, const void *prop, U flags)
{
	(void)prop; (void)flags;
	if (locked("cuMemCreate"))
		return LOCKED;
	int fd = memfd_create("fakevram", MFD_CLOEXEC);
	if (fd < 0 || ftruncate(fd, size) < 0)
		return 2;
	if (getenv("GPUCR_FAKE_POISON")) {
		void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (p == MAP_FAILED)
			return 2;
		memset(p, 0xA5, size);
		munmap(p, size);
	}
	pthread_mutex_lock(&mu);
	int i = nhs++;
	hs[i] = (struct h){fd, size, 1};
	pthread_mutex_unlock(&mu);
	atomic_fetch_add(&phys, size);
	*h = 0x5000 + i;
	return OK;
}
static struct h *geth(U h)
{
	if (h < 0x5000 || h >= 0x5000 + (U)nhs || !hs[h - 0x5000].live)
		return NULL;
	return &hs[h - 0x5000];
}
/* The physical memory lives while mapped: the byte count drops when the
 * handle is released (the fake does not follow the last unmap). */
CUresult cuMemRelease(U h)
{
	pthread_mutex_lock(&mu);
	struct h *x = geth(h);
	if (!x) {
		pthread_mutex_unlock(&mu);
		return BAD;
	}
	x->live = 0;
	close(x->fd);
	pthread_mutex_unlock(&mu);
	atomic_fetch_sub(&phys, x->size);
	return OK;
}
/* A shareable handle is a duplicate of the handle's memfd; an import is a
 * new handle on it (the same memory, released on its own). */
CUresult cuMemExportToShareableHandle(void *sh, U h, int type, U flags)
{
	(void)flags;
	if (type != 1)
		return BAD;
	pthread_mutex_lock(&mu);
	struct h *x = geth(h);
	int fd = x ? fcntl(x->fd, F_DUPFD_CLOEXEC, 3) : -1;
	pthread_mutex_unlock(&mu);
	if (fd < 0)
		return BAD;
	*(int *)sh = fd;
	return OK;
}
CUresult cuMemImportFromShareableHandle(U *h, void *os, int type, U flags)
{
	(void)flags;
	struct stat st;
	int fd = type == 1 ? fcntl((int)(uintptr_t)os, F_DUPFD_CLOEXEC, 3) : -1;
	if (fd < 0 || fstat(fd, &st) < 0)
		return BAD;
	pthread_mutex_lock(&mu);
	int i = nhs++;
	hs[i] = (struct h){fd, (size_t)st.st_size, 1};
	pthread_mutex_unlock(&mu);
	atomic_fetch_add(&phys, (size_t)st.st_size);
	*h = 0x5000 + i;
	return OK;
}
CUresult cuMemMap(U va, size_t size, size_t off, U h, U flags)
{
	(void)flags;
	if (locked("cuMemMap"))
		return LOCKED;
	pthread_mutex_lock(&mu);
	struct h *x = geth(h);
	int fd = x ? x->fd : -1;
	pthread_mutex_unlock(&mu);
	if (fd < 0 || off + size > x->size)
		return BAD;
	void *p = mmap((void *)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, fd, off);
	return p == MAP_FAILED ? 2 : OK;
}
CUresult cuMemUnmap(U va, size_t size)
{
	if (queued >= 0 && queued == atomic_load(&syncs)) {
		fprintf(stderr, "fake cuda: cuMemUnmap(0x%llx) with a kernel of this thread still queued\n", va);
		return 700;
	}
	void *p = mmap((void *)va, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
	return p == MAP_FAILED ? BAD : OK;
}
CUresult cuMemSetAccess(U va, size_t size, const void *desc, size_t n)
{
	(void)desc; (void)n;
	return mprotect((void *)va, size, PROT_READ | PROT_WRITE) ? BAD : OK;
}
CUresult cuMemAlloc_v2(U *p, size_t size)
{
	void *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (m == MAP_FAILED)
		return 2;
	*p = (U)m;
	return OK;
}
CUresult cuMemAllocPitch_v2(U *p, size_t *pitch, size_t w, size_t h, unsigned e) { (void)e; *pitch = w; return cuMemAlloc_v2(p, w * h); }
CUresult cuMemFree_v2(U p) { (void)p; return OK; }
CUresult cuMemAllocManaged(U *p, size_t size, unsigned f) { (void)f; return cuMemAlloc_v2(p, size); }
/* A pool object, and nothing in it (as NCCL makes one in every rank). */
CUresult cuMemPoolCreate(U *pool, const void *props) { (void)props; *pool = 0x900d; return OK; }
CUresult cuMemHostAlloc(void **p, size_t size, unsigned f) { (void)f; *p = malloc(size); return *p ? OK : 2; }
CUresult cuMemFreeHost(void *p) { free(p); return OK; }
/* GPUCR_FAKE_NO_REGISTER: a driver that cannot register host memory (the
 * library then allocates its pinned buffers with cuMemHostAlloc). */
CUresult cuMemHostRegister_v2(void *p, size_t n, unsigned f) { (void)p; (void)n; (void)f; return getenv("GPUCR_FAKE_NO_REGISTER") ? 1 : OK; }
CUresult cuMemHostUnregister(void *p) { (void)p; return OK; }
CUresult cuStreamCreate(void **s, unsigned f) { (void)f; *s = (void *)0x77; return OK; }
CUresult cuStreamDestroy_v2(void *s) { (void)s; return OK; }
CUresult cuStreamSynchronize(void *s) { (void)s; synced(); return OK; }
CUresult cuMemcpyDtoHAsync_v2(void *d, U s, size_t n, void *st) { (void)st; if (locked("cuMemcpyDtoHAsync")) return LOCKED; memcpy(d, (void *)s, n); return OK; }
CUresult cuMemcpyHtoDAsync_v2(U d, const void *s, size_t n, void *st) { (void)st; if (locked("cuMemcpyHtoDAsync")) return LOCKED; memcpy((void *)d, s, n); return OK; }
CUresult cuMemcpyDtoH_v2(void *d, U s, size_t n) { memcpy(d, (void *)s, n); return OK; }
CUresult cuMemcpyHtoD_v2(U d, const void *s, size_t n) { memcpy((void *)d, s, n); return OK; }
CUresult cuMemsetD8_v2(U d, unsigned char c, size_t n) { memset((void *)d, c, n); return OK; }
CUresult cuMemsetD8Async(U d, unsigned char c, size_t n, void *st) { (void)st; if (locked("cuMemsetD8Async")) return LOCKED; memset((void *)d, c, n); return OK; }
CUresult cuMemsetD32Async(U d, unsigned v, size_t n, void *st)
{
	(void)st;
	if (locked("cuMemsetD32Async"))
		return LOCKED;
	if (d % 4)
		return BAD;
	for (size_t i = 0; i < n; i++)
		((unsigned *)d)[i] = v;
	return OK;
}
/* Every kernel is named GPUCR_FAKE_KERNEL_NAME (default "fakeKernel"):
 * an NCCL-like name makes every launch a collective for the library. */
CUresult cuFuncGetName(const char **name, void *f)
{
	(void)f;
	const char *n = getenv("GPUCR_FAKE_KERNEL_NAME");
	*name = n ? n : "fakeKernel";
	return OK;
}

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
			unsigned shm, void *st, void **params, void **extra)
{
	(void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shm; (void)st; (void)extra;
	((void (*)(void **))f)(params);
	queued = atomic_load(&syncs);
	return OK;
}

static const char *fake_image; /* the module's PTX: which kernels it has */
static void fake_devhash(void **params)
{
	const uint64_t *w = *(const uint64_t **)params[0];
	uint64_t nwords = *(uint64_t *)params[1], bwords = *(uint64_t *)params[2], key = *(uint64_t *)params[3];
	uint64_t *out = *(uint64_t **)params[4];
	dh_blocks(w, nwords, bwords, key, out);
	if (getenv("GPUCR_FAKE_DEVHASH_WRONG"))
		out[0] ^= 1;
}
/* fake_zero is gpucr_zero: out[k] = 1 if block k holds a word that is not zero. */
static void fake_zero(void **params)
{
	const uint64_t *w = *(const uint64_t **)params[0];
	uint64_t nwords = *(uint64_t *)params[1], bwords = *(uint64_t *)params[2];
	unsigned char *out = *(unsigned char **)params[3];
	for (uint64_t k = 0, base = 0; base < nwords; k++, base += bwords) {
		uint64_t end = base + bwords < nwords ? base + bwords : nwords, any = 0;
		for (uint64_t i = base; i < end && !any; i++)
			any = w[i];
		out[k] = any != 0;
	}
}
CUresult cuModuleLoadDataEx(void **mod, const void *image, unsigned n, int *opts, void **vals)
{
	(void)n; (void)opts; (void)vals;
	if (!strstr(image, ".entry gpucr_hash("))
		return 200; /* CUDA_ERROR_INVALID_IMAGE */
	fake_image = image;
	*mod = (void *)0x4d0d;
	return OK;
}
CUresult cuModuleGetFunction(void **f, void *mod, const char *name)
{
	if (mod == (void *)0x4d0d && !strcmp(name, "gpucr_zero") && !getenv("GPUCR_FAKE_NO_ZERO_KERNEL") &&
	    strstr(fake_image, ".entry gpucr_zero(")) {
		*f = (void *)fake_zero;
		return OK;
	}
	if (mod != (void *)0x4d0d || strcmp(name, "gpucr_hash"))
		return 500;
	*f = (void *)fake_devhash;
	return OK;
}
CUresult cuModuleUnload(void *mod) { return mod == (void *)0x4d0d ? OK : 400; }

/* cuGetProcAddress answers from a table, as the driver does: base names,
 * the newest version of each. */
static const struct {
	const char *name;
	void *p;
} procs[] = {
	{"cuInit", cuInit}, {"cuDriverGetVersion", cuDriverGetVersion}, {"cuDeviceGet", cuDeviceGet},
	{"cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain}, {"cuCtxSetCurrent", cuCtxSetCurrent},
	{"cuCtxGetCurrent", cuCtxGetCurrent}, {"cuCtxGetDevice", cuCtxGetDevice}, {"cuCtxSynchronize", cuCtxSynchronize},
	{"cuMemGetInfo", cuMemGetInfo_v2}, {"cuMemGetAllocationGranularity", cuMemGetAllocationGranularity},
	{"cuMemAddressReserve", cuMemAddressReserve}, {"cuMemAddressFree", cuMemAddressFree}, {"cuMemCreate", cuMemCreate},
	{"cuMemRelease", cuMemRelease}, {"cuMemMap", cuMemMap}, {"cuMemUnmap", cuMemUnmap},
	{"cuMemSetAccess", cuMemSetAccess}, {"cuMemAlloc", cuMemAlloc_v2}, {"cuMemAllocPitch", cuMemAllocPitch_v2},
	{"cuMemFree", cuMemFree_v2}, {"cuMemAllocManaged", cuMemAllocManaged}, {"cuMemPoolCreate", cuMemPoolCreate},
	{"cuMemExportToShareableHandle", cuMemExportToShareableHandle}, {"cuMemImportFromShareableHandle", cuMemImportFromShareableHandle}, {"cuMemHostAlloc", cuMemHostAlloc},
	{"cuMemFreeHost", cuMemFreeHost}, {"cuMemHostRegister", cuMemHostRegister_v2}, {"cuMemHostUnregister", cuMemHostUnregister}, {"cuStreamCreate", cuStreamCreate}, {"cuStreamDestroy", cuStreamDestroy_v2},
	{"cuStreamSynchronize", cuStreamSynchronize}, {"cuMemcpyDtoHAsync", cuMemcpyDtoHAsync_v2},
	{"cuMemcpyHtoDAsync", cuMemcpyHtoDAsync_v2}, {"cuMemcpyDtoH", cuMemcpyDtoH_v2}, {"cuMemcpyHtoD", cuMemcpyHtoD_v2},
	{"cuMemsetD8", cuMemsetD8_v2}, {"cuMemsetD8Async", cuMemsetD8Async}, {"cuMemsetD32Async", cuMemsetD32Async},
	{"cuLaunchKernel", cuLaunchKernel}, {NULL, NULL},
};
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, U flags, int *status);
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, U flags, int *status)
{
	(void)ver; (void)flags;
	if (!strcmp(sym, "cuGetProcAddress")) {
		*pfn = (void *)cuGetProcAddress_v2;
		if (status)
			*status = 0;
		return OK;
	}
	for (int i = 0; procs[i].name; i++)
		if (!strcmp(procs[i].name, sym)) {
			*pfn = procs[i].p;
			if (status)
				*status = 0;
			return OK;
		}
	*pfn = NULL;
	if (status)
		*status = 1;
	return 500;
}

/* The process checkpoint API, as gpucr-stream (not the target) calls it:
 * a state per pid (0 running, 1 locked, 2 checkpointed); no device state
 * moves. In this process's memory, or with GPUCR_FAKE_CUDA_STATE=DIR in
 * DIR/KEY (state_key), so that it outlives a killed gpucr-stream and the
 * target sees it: then a memory call of the target while it is locked
 * fails, as the real driver's would block, and is recorded in
 * DIR/violation. */
static struct {
	int pid, state;
} pstate[64];
/* gpucr-stream steps the processes of a tree from several threads at once. */
static pthread_mutex_t pstate_mu = PTHREAD_MUTEX_INITIALIZER;
static int *state_of(int pid)
{
	pthread_mutex_lock(&pstate_mu);
	int *st = &pstate[63].state;
	for (int i = 0; i < 64; i++)
		if (pstate[i].pid == pid || pstate[i].pid == 0) {
			pstate[i].pid = pid;
			st = &pstate[i].state;
			break;
		}
	pthread_mutex_unlock(&pstate_mu);
	return st;
}
/* state_key names the state file of process who ("self": the caller; else a
 * PID as gpucr-stream gives it): its PID in its own namespace, the last of
 * NSpid in its /proc status. gpucr-stream passes host PIDs, a target in a
 * container sees itself as PID 1 there, and only that PID is the same for
 * both; CRIU also keeps it across a restore into a new namespace (runc
 * restore gives the process a new host PID), as the real driver's state
 * travels in the process. Outside a container it is the PID itself. One
 * DIR therefore serves one PID namespace at a time. The PID itself where
 * the status cannot be read (the process is gone). */
static int state_key(const char *who)
{
	char path[64], line[256];
	snprintf(path, sizeof path, "/proc/%s/status", who);
	FILE *f = fopen(path, "r");
	int key = atoi(who);
	if (!f)
		return key;
	while (fgets(line, sizeof line, f))
		if (!strncmp(line, "NSpid:", 6)) {
			char *last = NULL, *save;
			for (char *tok = strtok_r(line + 6, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save))
				last = tok;
			if (last && atoi(last) > 0)
				key = atoi(last);
			break;
		}
	fclose(f);
	return key;
}
static int pid_key(int pid)
{
	char who[16];
	snprintf(who, sizeof who, "%d", pid);
	return state_key(who);
}
/* read_state is the state in DIR/key. */
static int read_state(const char *d, int key)
{
	char path[4096], b[4] = "0";
	snprintf(path, sizeof path, "%s/%d", d, key);
	FILE *f = fopen(path, "r");
	if (f) {
		if (!fgets(b, sizeof b, f))
			b[0] = '0';
		fclose(f);
	}
	return b[0] - '0';
}
static int get_state(int pid)
{
	const char *d = getenv("GPUCR_FAKE_CUDA_STATE");
	return d ? read_state(d, pid_key(pid)) : *state_of(pid);
}
static void set_state(int pid, int st)
{
	const char *d = getenv("GPUCR_FAKE_CUDA_STATE");
	if (!d) {
		*state_of(pid) = st;
		return;
	}
	char path[4096];
	snprintf(path, sizeof path, "%s/%d", d, pid_key(pid));
	FILE *f = fopen(path, "w");
	if (f) {
		fprintf(f, "%d\n", st);
		fclose(f);
	}
}
static CUresult step(int pid, int from, int to)
{
	if (get_state(pid) != from)
		return BAD;
	set_state(pid, to);
	return OK;
}
CUresult cuCheckpointProcessGetState(int pid, int *st) { *st = get_state(pid); return OK; }
CUresult cuCheckpointProcessLock(int pid, void *a) { (void)a; return step(pid, 0, 1); }
CUresult cuCheckpointProcessCheckpoint(int pid, void *a) { (void)a; return step(pid, 1, 2); }
CUresult cuCheckpointProcessRestore(int pid, void *a) { (void)a; return step(pid, 2, 1); }
CUresult cuCheckpointProcessUnlock(int pid, void *a) { (void)a; return step(pid, 1, 0); }

/* locked says whether this process may not call the driver now. */
static int locked(const char *call)
{
	const char *d = getenv("GPUCR_FAKE_CUDA_STATE");
	if (!d || read_state(d, state_key("self")) == 0)
		return 0;
	char path[4096];
	snprintf(path, sizeof path, "%s/violation", d);
	FILE *f = fopen(path, "a");
	if (f) {
		fprintf(f, "%d: %s while locked\n", getpid(), call);
		fclose(f);
	}
	return 1;
}
