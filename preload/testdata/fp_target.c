/*
 * Test target for libgpucr-preload: reaches the driver the way the CUDA
 * runtime does (dlopen("libcuda.so.1"), dlsym(h, "cuGetProcAddress_v2"),
 * every other entry point through it), allocates with cuMemAlloc,
 * cuMemAllocPitch and the virtual memory API, fills every allocation with
 * a known pattern, and keeps "launching kernels" on a second thread: each
 * launch adds one to a device counter, and the thread counts its launches.
 *
 * Usage: fp_target DIR. Writes DIR/addrs (name va size per line) and
 * DIR/ready (the pid); whenever DIR/check appears it reads every allocation
 * back, compares, and writes DIR/result ("ok" or "bad: why"); whenever
 * DIR/rewrite appears (holding a region's number K) it writes region K
 * with its next pattern (the one check expects from then on). With
 * FP_MANAGED=1 it also calls cuMemAllocManaged; with FP_CREATE_FLAGS=1 it
 * calls cuMemCreate with flags; with FP_WIDE_ACCESS=1 it sets access for
 * five devices (each makes it incapable where the library holds its own
 * lock); with FP_POOL=1 it creates a memory pool and allocates nothing
 * from it (still capable); with FP_SELF_SHARE=1 it exports a 2 MiB
 * allocation as a POSIX descriptor and imports it again at another
 * address (region "imported", the same memory, as an NCCL rank maps a
 * peer's buffer); with FP_EXTRA_MB=N it allocates N MiB more.
 *
 * Last, region "kv" (KV_BYTES), as an inference server's KV cache: zeroed
 * with cuMemsetD8 (the driver's memory is not zero), then a few runs of 32
 * KiB blocks written (kv_written) with its pattern; the check wants the
 * rest zero. With FP_MARK=1 the target marks it as a cache
 * (gpucr_mark_cache, found with dlsym as a Python program finds it with
 * ctypes): then the check also takes it back all zero, and says which it
 * found (kv=intact or kv=dropped; FP_MARK=bad marks a range outside the
 * target's memory, and the target dies unless that is refused; FP_MARK=part
 * marks all of it but 16 KiB at each end, which the check does not
 * understand: for tests of the files alone).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long U;
typedef struct {
	int type, requestedHandleTypes;
	struct {
		int type, id;
	} location;
	void *win32;
	unsigned char flags[8];
} Prop;
typedef struct {
	struct {
		int type, id;
	} location;
	int flags;
} Access;

static CUresult (*pInit)(unsigned), (*pDeviceGet)(int *, int), (*pRetain)(void **, int), (*pSetCurrent)(void *);
static CUresult (*pAlloc)(U *, size_t), (*pAllocPitch)(U *, size_t *, size_t, size_t, unsigned), (*pFree)(U);
static CUresult (*pReserve)(U *, size_t, size_t, U, U), (*pCreate)(U *, size_t, const Prop *, U);
static CUresult (*pMap)(U, size_t, size_t, U, U), (*pSetAccess)(U, size_t, const Access *, size_t), (*pRelease)(U);
static CUresult (*pHtoD)(U, const void *, size_t), (*pDtoH)(void *, U, size_t), (*pManaged)(U *, size_t, unsigned);
static CUresult (*pPoolCreate)(U *, const void *), (*pMemset)(U, unsigned char, size_t);
static CUresult (*pExport)(void *, U, int, U), (*pImport)(U *, void *, int, U);
static CUresult (*pLaunch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **, void **);

static void die(const char *what, int r)
{
	fprintf(stderr, "fp_target: %s: CUresult %d\n", what, r);
	exit(3);
}
#define CK(call, what)                  \
	do {                            \
		int r_ = (call);        \
		if (r_)                 \
			die(what, r_);  \
	} while (0)

static unsigned gen[8]; /* rewrites of each region */
/* pat is region k's byte i: a hash, so that the memory does not compress
 * and a deduplicated checkpoint's new bytes are those of what changed
 * (vram/producer_test.go has the same function). */
static unsigned char pat(int k, size_t i)
{
	unsigned long long h = (unsigned long long)i * 0x9E3779B97F4A7C15ULL ^ (unsigned long long)(k + 1) * 0xC2B2AE3D27D4EB4FULL;
	h ^= h >> 29;
	h *= 0xBF58476D1CE4E5B9ULL;
	h ^= h >> 32;
	return (unsigned char)(h >> 24) ^ (unsigned char)(gen[k] * 0x5b);
}

struct region {
	const char *name;
	U va;
	size_t size;
	int alias; /* holds region alias's memory (an import of it); -1: its own */
};
static struct region rs[8];
static int nrs;
static U counter; /* device memory the "kernel" increments */
static atomic_ullong launches;
static void *ctx;

static void kernel(void **params)
{
	U *c = (U *)params[0];
	*(U *)*c += 1;
}

static void *launcher(void *arg)
{
	(void)arg;
	pSetCurrent(ctx);
	for (;;) {
		void *params[1] = {&counter};
		CK(pLaunch((void *)kernel, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL), "launch");
		atomic_fetch_add(&launches, 1);
		usleep(200);
	}
	return NULL;
}

#define KV_BYTES (8u << 20)
#define KV_BLOCK (32u << 10)
static int kv = -1; /* its region */

/* kv_written: block b of the KV cache was written by a "request": runs at
 * odd and even blocks, a single one, the last. */
static int kv_written(size_t b)
{
	return (b >= 1 && b <= 3) || b == 40 || (b >= 100 && b < 108) || b == KV_BYTES / KV_BLOCK - 1;
}

/* want is region k's byte i as the check expects it (kv: 0 off the
 * written blocks). */
static unsigned char want(int k, size_t i)
{
	return k == kv && !kv_written(i / KV_BLOCK) ? 0 : pat(k, i);
}

static void fill(int k)
{
	unsigned char *b = malloc(rs[k].size);
	for (size_t i = 0; i < rs[k].size; i++)
		b[i] = want(k, i);
	CK(pHtoD(rs[k].va, b, rs[k].size), "fill");
	free(b);
}

static void get(void **p, void *gpa, const char *name)
{
	CUresult (*gp)(const char *, void **, int, U, int *) = gpa;
	int st;
	CK(gp(name, p, 12000, 0, &st), name);
}

/* bind_driver takes every entry point through cuGetProcAddress, as the
 * CUDA runtime does. */
static void bind_driver(void *gpa)
{
	get((void **)&pInit, gpa, "cuInit");
	get((void **)&pDeviceGet, gpa, "cuDeviceGet");
	get((void **)&pRetain, gpa, "cuDevicePrimaryCtxRetain");
	get((void **)&pSetCurrent, gpa, "cuCtxSetCurrent");
	get((void **)&pAlloc, gpa, "cuMemAlloc");
	get((void **)&pAllocPitch, gpa, "cuMemAllocPitch");
	get((void **)&pFree, gpa, "cuMemFree");
	get((void **)&pReserve, gpa, "cuMemAddressReserve");
	get((void **)&pCreate, gpa, "cuMemCreate");
	get((void **)&pMap, gpa, "cuMemMap");
	get((void **)&pSetAccess, gpa, "cuMemSetAccess");
	get((void **)&pRelease, gpa, "cuMemRelease");
	get((void **)&pHtoD, gpa, "cuMemcpyHtoD");
	get((void **)&pDtoH, gpa, "cuMemcpyDtoH");
	get((void **)&pManaged, gpa, "cuMemAllocManaged");
	get((void **)&pPoolCreate, gpa, "cuMemPoolCreate");
	get((void **)&pExport, gpa, "cuMemExportToShareableHandle");
	get((void **)&pImport, gpa, "cuMemImportFromShareableHandle");
	get((void **)&pLaunch, gpa, "cuLaunchKernel");
	get((void **)&pMemset, gpa, "cuMemsetD8");
}

/* allocate makes the regions of every kind the library tracks and fills
 * them with their patterns. */
static void allocate(int dev)
{
	U a, gone, p;
	size_t pitch;
	CK(pAlloc(&a, (3 << 20) + 5), "cuMemAlloc");
	rs[nrs++] = (struct region){"alloc", a, (3 << 20) + 5, -1};
	CK(pAlloc(&gone, 1 << 20), "cuMemAlloc 2");
	/* A kernel still queued when the program frees: cuMemFree must wait for
	 * it, as the driver's does (the fake faults otherwise). */
	U in_gone = gone;
	void *params[1] = {&in_gone};
	CK(pLaunch((void *)kernel, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL), "launch before cuMemFree");
	CK(pFree(gone), "cuMemFree");
	CK(pAllocPitch(&p, &pitch, 1000, 300, 4), "cuMemAllocPitch");
	rs[nrs++] = (struct region){"pitch", p, pitch * 300, -1};

	/* The virtual memory API, as expandable_segments uses it: a large
	 * reservation, handles mapped into it one after another. */
	Prop prop = {.type = 1, .location = {1, dev}};
	Access acc = {{1, dev}, 3};
	U r, h1, h2;
	CK(pReserve(&r, 16 << 20, 0, 0, 0), "reserve");
	CK(pCreate(&h1, 2 << 20, &prop, 0), "create 1");
	CK(pMap(r, 2 << 20, 0, h1, 0), "map 1");
	CK(pCreate(&h2, 4 << 20, &prop, 0), "create 2");
	CK(pMap(r + (2 << 20), 4 << 20, 0, h2, 0), "map 2");
	CK(pSetAccess(r, 6 << 20, &acc, 1), "access");
	CK(pRelease(h1), "release 1"); /* lives on while mapped */
	rs[nrs++] = (struct region){"vmm", r, 6 << 20, -1};
	CK(pAlloc(&counter, 8), "counter");
	U zero = 0;
	CK(pHtoD(counter, &zero, 8), "zero");
	if (getenv("FP_EXTRA_MB")) { /* a larger allocation, for dedup's shares */
		U x;
		size_t n = (size_t)atoi(getenv("FP_EXTRA_MB")) << 20;
		CK(pAlloc(&x, n), "cuMemAlloc extra");
		rs[nrs++] = (struct region){"extra", x, n, -1};
	}
	if (getenv("FP_MANAGED")) {
		U m;
		CK(pManaged(&m, 1 << 20, 1), "managed");
	}
	if (getenv("FP_POOL")) {
		U pool;
		Prop pp = {.type = 1, .location = {1, dev}};
		CK(pPoolCreate(&pool, &pp), "pool");
	}
	if (getenv("FP_SELF_SHARE")) {
		Prop sp = {.type = 1, .requestedHandleTypes = 1, .location = {1, dev}};
		U ra, rb, ha, hb;
		int fd = -1;
		CK(pReserve(&ra, 2 << 20, 0, 0, 0), "reserve shared");
		CK(pCreate(&ha, 2 << 20, &sp, 0), "create shared");
		CK(pMap(ra, 2 << 20, 0, ha, 0), "map shared");
		CK(pSetAccess(ra, 2 << 20, &acc, 1), "access shared");
		CK(pExport(&fd, ha, 1, 0), "export");
		CK(pImport(&hb, (void *)(uintptr_t)fd, 1, 0), "import");
		close(fd);
		CK(pReserve(&rb, 2 << 20, 0, 0, 0), "reserve imported");
		CK(pMap(rb, 2 << 20, 0, hb, 0), "map imported");
		CK(pSetAccess(rb, 2 << 20, &acc, 1), "access imported");
		CK(pRelease(hb), "release imported"); /* lives on while mapped */
		int sk = nrs;
		rs[nrs++] = (struct region){"shared", ra, 2 << 20, -1};
		rs[nrs++] = (struct region){"imported", rb, 2 << 20, sk};
	}
	if (getenv("FP_CREATE_FLAGS")) {
		U h;
		CK(pCreate(&h, 2 << 20, &prop, 1), "create with flags");
		CK(pRelease(h), "release flags");
	}
	if (getenv("FP_WIDE_ACCESS")) {
		Access wide[5];
		for (int i = 0; i < 5; i++)
			wide[i] = (Access){{1, dev + i}, 3};
		CK(pSetAccess(r, 6 << 20, wide, 5), "wide access");
	}
	for (int k = 0; k < nrs; k++)
		if (rs[k].alias < 0)
			fill(k);
	/* The KV cache: zeroed by the driver, then the requests' blocks. */
	U c;
	CK(pAlloc(&c, KV_BYTES), "cuMemAlloc kv");
	CK(pMemset(c, 0, KV_BYTES), "cuMemsetD8 kv");
	kv = nrs;
	rs[nrs++] = (struct region){"kv", c, KV_BYTES, -1};
	for (size_t b = 0; b < KV_BYTES / KV_BLOCK; b++)
		if (kv_written(b)) {
			unsigned char blk[KV_BLOCK];
			for (size_t i = 0; i < KV_BLOCK; i++)
				blk[i] = want(kv, b * KV_BLOCK + i);
			CK(pHtoD(c + b * KV_BLOCK, blk, KV_BLOCK), "write kv");
		}
	const char *mark = getenv("FP_MARK");
	if (mark) {
		int (*m)(uint64_t, uint64_t) = (int (*)(uint64_t, uint64_t))dlsym(RTLD_DEFAULT, "gpucr_mark_cache");
		if (!m) {
			fprintf(stderr, "fp_target: gpucr_mark_cache not found\n");
			exit(3);
		}
		int r = !strcmp(mark, "bad")    ? m(c + KV_BYTES - 4096, 1 << 30)
			: !strcmp(mark, "part") ? m(c + (16 << 10), KV_BYTES - (32 << 10))
						: m(c, KV_BYTES);
		if (r != (strcmp(mark, "bad") ? 0 : -2)) {
			fprintf(stderr, "fp_target: gpucr_mark_cache: %d\n", r);
			exit(3);
		}
		/* A marked allocation freed: its mark goes with it. */
		U x;
		CK(pAlloc(&x, 2 << 20), "cuMemAlloc marked");
		if ((r = m(x, 2 << 20)) != 0) {
			fprintf(stderr, "fp_target: gpucr_mark_cache of a scratch allocation: %d\n", r);
			exit(3);
		}
		CK(pFree(x), "cuMemFree marked");
	}
}

/* serve_checks answers DIR/check forever: it reads every region and the
 * kernel's counter back and writes the verdict to DIR/result. */
static void serve_checks(const char *dir)
{
	FILE *f;
	char check[4096], result[4096], tmp[4200], rewrite[4096];
	snprintf(check, sizeof check, "%s/check", dir);
	snprintf(rewrite, sizeof rewrite, "%s/rewrite", dir);
	snprintf(result, sizeof result, "%s/result", dir);
	snprintf(tmp, sizeof tmp, "%s/result.tmp", dir);
	for (;;) {
		if ((f = fopen(rewrite, "r"))) {
			int k = -1;
			if (fscanf(f, "%d", &k) == 1 && k >= 0 && k < nrs) {
				gen[k]++;
				fill(k);
			}
			fclose(f);
			unlink(rewrite);
			snprintf(tmp, sizeof tmp, "%s/rewritten", dir);
			fclose(fopen(tmp, "w"));
		}
		if (access(check, F_OK) != 0) {
			usleep(5000);
			continue;
		}
		unlink(check);
		char msg[512] = "ok";
		const char *kvs = "intact";
		for (int k = 0; k < nrs && !strcmp(msg, "ok"); k++) {
			unsigned char *b = malloc(rs[k].size);
			CK(pDtoH(b, rs[k].va, rs[k].size), "read back");
			int pk = rs[k].alias < 0 ? k : rs[k].alias;
			size_t nz = 0;
			for (size_t i = 0; k == kv && i < rs[k].size; i++)
				nz += b[i] != 0;
			if (k == kv && nz == 0 && getenv("FP_MARK"))
				kvs = "dropped"; /* a marked cache comes back as zeros */
			else
				for (size_t i = 0; i < rs[k].size; i++)
					if (b[i] != want(pk, i)) {
						snprintf(msg, sizeof msg, "bad: %s byte %zu is %u, want %u", rs[k].name, i, b[i], want(pk, i));
						break;
					}
			free(b);
		}
		/* Launches and the device counter move together; read the count
		 * on both sides of the counter so a launch in between is allowed. */
		U before = atomic_load(&launches), c = 0;
		CK(pDtoH(&c, counter, 8), "read counter");
		U after = atomic_load(&launches);
		if (!strcmp(msg, "ok") && (c < before || c > after + 1))
			snprintf(msg, sizeof msg, "bad: device counter %llu, launches %llu..%llu", c, before, after);
		f = fopen(tmp, "w");
		fprintf(f, "%s launches=%llu kv=%s\n", msg, after, kvs);
		fclose(f);
		rename(tmp, result);
	}
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: fp_target DIR\n");
		return 2;
	}
	const char *dir = argv[1];
	void *h = dlopen("libcuda.so.1", RTLD_NOW);
	if (!h) {
		fprintf(stderr, "dlopen: %s\n", dlerror());
		return 3;
	}
	void *gpa = dlsym(h, "cuGetProcAddress_v2");
	if (!gpa)
		return 3;
	void *gpa2;
	get(&gpa2, gpa, "cuGetProcAddress"); /* the runtime asks for it again */
	gpa = gpa2;
	bind_driver(gpa);

	int dev;
	CK(pInit(0), "cuInit");
	CK(pDeviceGet(&dev, 0), "cuDeviceGet");
	CK(pRetain(&ctx, dev), "retain");
	CK(pSetCurrent(ctx), "set current");
	allocate(dev);

	char path[4096];
	snprintf(path, sizeof path, "%s/addrs", dir);
	FILE *f = fopen(path, "w");
	for (int k = 0; k < nrs; k++)
		fprintf(f, "%s %llu %zu\n", rs[k].name, rs[k].va, rs[k].size);
	fprintf(f, "counter %llu 8\n", counter);
	fclose(f);

	pthread_t t;
	pthread_create(&t, NULL, launcher, NULL);
	while (atomic_load(&launches) == 0) /* the counter is written memory from now on */
		usleep(100);
	snprintf(path, sizeof path, "%s/ready", dir);
	f = fopen(path, "w");
	fprintf(f, "%d\n", getpid());
	fclose(f);

	serve_checks(dir);
}
