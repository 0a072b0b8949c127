/*
 * regprobe: how fast can a restore's copy in move a staged VRAM file (on a
 * tmpfs of huge pages) to the device? Four ways, T threads each:
 *   read:     read() the file into two pinned buffers per thread
 *             (cuMemAllocHost), copy each to the device;
 *   readthp:  the same with the library's buffers: anonymous mappings of
 *             transparent huge pages, each registered on its own (what
 *             the library's copy in does), pinning timed;
 *   readone:  the same buffers carved out of one mapping registered once
 *             by the first thread, the others waiting for it;
 *   register: map the file, cuMemHostRegister each thread's part (read
 *             only), copy from the mapping itself (no memcpy on the host).
 * Prints seconds and GB/s of each step. Built by hand on the GPU machine
 * (no CUDA headers): cc -O2 -o regprobe regprobe.c -ldl -lpthread
 * Usage: [REGPROBE_BUF_MIB=8] regprobe FILE GIB THREADS
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef void *CUstream;

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(int *, int);
static CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, int);
static CUresult (*cuCtxSetCurrent)(CUcontext);
static CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*cuMemHostRegister)(void *, size_t, unsigned);
static CUresult (*cuMemHostUnregister)(void *);
static CUresult (*cuMemAllocHost)(void **, size_t);
static CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*cuStreamCreate)(CUstream *, unsigned);
static CUresult (*cuStreamSynchronize)(CUstream);

static CUcontext ctx;
static CUdeviceptr dev;
static char *map;
static size_t size, part;
static int fd, nthreads;
static size_t BUF = 8 << 20; /* REGPROBE_BUF_MIB */

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

#define CK(x)                                                                   \
	do {                                                                    \
		CUresult r_ = (x);                                              \
		if (r_) {                                                       \
			fprintf(stderr, "%s: CUresult %d\n", #x, r_);           \
			exit(1);                                                \
		}                                                               \
	} while (0)

struct arg {
	int i;
	double t_reg, t_copy, t_unreg;
	double end_copy; /* when its copies were done, from the run's start */
};
static double start;
#define REG_READ_ONLY 8 /* CU_MEMHOSTREGISTER_READ_ONLY */

enum { ALLOC_HOST, THP_EACH, THP_ONE };
static int alloc_mode;
static char *one;
static pthread_mutex_t one_mu = PTHREAD_MUTEX_INITIALIZER;

static void *thp(size_t n)
{
	void *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (m == MAP_FAILED) {
		perror("mmap");
		exit(1);
	}
	madvise(m, n, MADV_HUGEPAGE);
	return m;
}

static void *by_read(void *p)
{
	struct arg *a = p;
	CK(cuCtxSetCurrent(ctx));
	void *buf[2];
	CUstream st[2];
	double tp = now();
	if (alloc_mode == THP_ONE) {
		pthread_mutex_lock(&one_mu);
		if (!one) {
			one = thp(2 * BUF * nthreads);
			CK(cuMemHostRegister(one, 2 * BUF * nthreads, 1));
		}
		pthread_mutex_unlock(&one_mu);
	}
	for (int b = 0; b < 2; b++) {
		if (alloc_mode == ALLOC_HOST)
			CK(cuMemAllocHost(&buf[b], BUF));
		else if (alloc_mode == THP_EACH) {
			buf[b] = thp(BUF);
			CK(cuMemHostRegister(buf[b], BUF, 1));
		} else
			buf[b] = one + (2 * a->i + b) * BUF;
		CK(cuStreamCreate(&st[b], 1));
	}
	double t0 = now();
	a->t_reg = t0 - tp;
	size_t off = a->i * part, end = off + part;
	int pending[2] = {0, 0}, b = 0;
	for (; off < end; off += BUF, b ^= 1) {
		if (pending[b])
			CK(cuStreamSynchronize(st[b]));
		size_t n = end - off < BUF ? end - off : BUF;
		if (pread(fd, buf[b], n, off) != (ssize_t)n) {
			perror("pread");
			exit(1);
		}
		CK(cuMemcpyHtoDAsync(dev + off, buf[b], n, st[b]));
		pending[b] = 1;
	}
	CK(cuStreamSynchronize(st[0]));
	CK(cuStreamSynchronize(st[1]));
	double t1 = now();
	a->t_copy = t1 - t0;
	a->end_copy = t1 - start;
	if (alloc_mode == THP_EACH)
		for (int b = 0; b < 2; b++) {
			CK(cuMemHostUnregister(buf[b]));
			munmap(buf[b], BUF);
		}
	a->t_unreg = now() - t1;
	return NULL;
}

static void *by_register(void *p)
{
	struct arg *a = p;
	CK(cuCtxSetCurrent(ctx));
	CUstream st;
	CK(cuStreamCreate(&st, 1));
	char *base = map + a->i * part;
	double t0 = now();
	CK(cuMemHostRegister(base, part, REG_READ_ONLY));
	double t1 = now();
	for (size_t off = 0; off < part; off += 64 << 20) {
		size_t n = part - off < (64 << 20) ? part - off : (64 << 20);
		CK(cuMemcpyHtoDAsync(dev + a->i * part + off, base + off, n, st));
	}
	CK(cuStreamSynchronize(st));
	double t2 = now();
	a->end_copy = t2 - start;
	CK(cuMemHostUnregister(base));
	a->t_reg = t1 - t0;
	a->t_copy = t2 - t1;
	a->t_unreg = now() - t2;
	return NULL;
}

static void run(const char *what, void *(*fn)(void *))
{
	pthread_t t[64];
	struct arg a[64];
	double t0 = now(), done = 0;
	start = t0;
	for (int i = 0; i < nthreads; i++) {
		a[i] = (struct arg){.i = i};
		pthread_create(&t[i], NULL, fn, &a[i]);
	}
	double reg = 0, copy = 0, unreg = 0;
	for (int i = 0; i < nthreads; i++) {
		pthread_join(t[i], NULL);
		reg = a[i].t_reg > reg ? a[i].t_reg : reg;
		copy = a[i].t_copy > copy ? a[i].t_copy : copy;
		unreg = a[i].t_unreg > unreg ? a[i].t_unreg : unreg;
		done = a[i].end_copy > done ? a[i].end_copy : done;
	}
	double all = now() - t0;
	if (one) {
		double t1 = now();
		CK(cuMemHostUnregister(one));
		munmap(one, 2 * BUF * nthreads);
		one = NULL;
		unreg = now() - t1;
	}
	printf("%-9s threads %2d: all %.3f s (%.1f GB/s), every copy done at %.3f s (%.1f GB/s); slowest thread: pin/register %.3f s, copy %.3f s, unpin/unregister %.3f s\n",
	       what, nthreads, all, size / all / 1e9, done, size / done / 1e9, reg, copy, unreg);
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: regprobe FILE GIB THREADS\n");
		return 2;
	}
	size = (size_t)atol(argv[2]) << 30;
	if (getenv("REGPROBE_BUF_MIB"))
		BUF = (size_t)atol(getenv("REGPROBE_BUF_MIB")) << 20;
	nthreads = atoi(argv[3]);
	part = size / nthreads;
	void *h = dlopen("libcuda.so.1", RTLD_NOW);
	if (!h) {
		fprintf(stderr, "%s\n", dlerror());
		return 1;
	}
#define SYM(v, name) *(void **)&v = dlsym(h, name)
	SYM(cuInit, "cuInit");
	SYM(cuDeviceGet, "cuDeviceGet");
	SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
	SYM(cuCtxSetCurrent, "cuCtxSetCurrent");
	SYM(cuMemAlloc, "cuMemAlloc_v2");
	SYM(cuMemHostRegister, "cuMemHostRegister_v2");
	SYM(cuMemHostUnregister, "cuMemHostUnregister");
	SYM(cuMemAllocHost, "cuMemAllocHost_v2");
	SYM(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
	SYM(cuStreamCreate, "cuStreamCreate");
	SYM(cuStreamSynchronize, "cuStreamSynchronize");
	double t0 = now();
	CK(cuInit(0));
	printf("cuInit %.3f s\n", now() - t0);
	int d;
	CK(cuDeviceGet(&d, 0));
	CK(cuDevicePrimaryCtxRetain(&ctx, d));
	CK(cuCtxSetCurrent(ctx));
	CK(cuMemAlloc(&dev, size));
	fd = open(argv[1], O_RDWR | O_CREAT | O_TRUNC, 0600);
	if (fd < 0 || ftruncate(fd, size) < 0) {
		perror(argv[1]);
		return 1;
	}
	char *w = malloc(BUF);
	memset(w, 0x5a, BUF);
	t0 = now();
	for (size_t off = 0; off < size; off += BUF)
		if (pwrite(fd, w, BUF, off) != (ssize_t)BUF) {
			perror("pwrite");
			return 1;
		}
	printf("filled %zu GiB in %.3f s\n", size >> 30, now() - t0);
	map = mmap(NULL, size, PROT_READ, MAP_SHARED, fd, 0);
	if (map == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	madvise(map, size, MADV_HUGEPAGE);
	for (int k = 0; k < 2; k++) {
		alloc_mode = ALLOC_HOST;
		run("read", by_read);
		alloc_mode = THP_EACH;
		run("readthp", by_read);
		alloc_mode = THP_ONE;
		run("readone", by_read);
		run("register", by_register);
	}
	return 0;
}
