/*
 * regprobe: how fast can a restore's copy in move a staged VRAM file (on a
 * tmpfs of huge pages) to the device? Two ways, T threads each:
 *   read:     read() the file into two pinned buffers per thread, copy
 *             each to the device (what the library's copy in does);
 *   register: map the file, cuMemHostRegister each thread's part (read
 *             only), copy from the mapping itself (no memcpy on the host).
 * Prints seconds and GB/s of each step. Built by hand on the GPU machine
 * (no CUDA headers): cc -O2 -o regprobe regprobe.c -ldl -lpthread
 * Usage: regprobe FILE GIB THREADS
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
static const size_t BUF = 8 << 20;

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
};

static void *by_read(void *p)
{
	struct arg *a = p;
	CK(cuCtxSetCurrent(ctx));
	void *buf[2];
	CUstream st[2];
	for (int b = 0; b < 2; b++) {
		CK(cuMemAllocHost(&buf[b], BUF));
		CK(cuStreamCreate(&st[b], 1));
	}
	double t0 = now();
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
	a->t_copy = now() - t0;
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
	CK(cuMemHostRegister(base, part, 8 /* READ_ONLY */));
	double t1 = now();
	for (size_t off = 0; off < part; off += 64 << 20) {
		size_t n = part - off < (64 << 20) ? part - off : (64 << 20);
		CK(cuMemcpyHtoDAsync(dev + a->i * part + off, base + off, n, st));
	}
	CK(cuStreamSynchronize(st));
	double t2 = now();
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
	double t0 = now();
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
	}
	double all = now() - t0;
	printf("%-9s threads %2d: all %.3f s (%.1f GB/s); slowest thread: register %.3f s, copy %.3f s (%.1f GB/s), unregister %.3f s\n",
	       what, nthreads, all, size / all / 1e9, reg, copy, size / copy / 1e9, unreg);
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: regprobe FILE GIB THREADS\n");
		return 2;
	}
	size = (size_t)atol(argv[2]) << 30;
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
	run("read", by_read);
	run("register", by_register);
	run("read", by_read);
	run("register", by_register);
	return 0;
}
