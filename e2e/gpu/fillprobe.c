/*
 * fillprobe: can a restore fill a process's device memory before the
 * driver has restored the process (issue 36, item 5)? Three processes play
 * the parts of a fast-path restore, without CRIU (which the driver does
 * not see: it restores a checkpointed process in place either way):
 *
 *   target  (the restored program) reserves GIB of addresses, backs them
 *           with NH allocations of its own (cuMemCreate, no shareable
 *           type: what the library makes), fills them (today's copy in,
 *           timed), and releases them as the fast path's checkpoint does,
 *           keeping the reservation; then waits, checkpointed.
 *   main    (gpucr-stream) locks and checkpoints the target with the
 *           driver's checkpoint API, starts the helper, and only then
 *           restores and unlocks the target; it passes the helper's
 *           descriptors on.
 *   helper  (the filler) makes its own context while the target is
 *           checkpointed, creates NH allocations with a POSIX descriptor
 *           each, fills them (as it would during CRIU's restore), and
 *           exports them; it releases its own and exits once the target
 *           has mapped them.
 *
 * The target then imports the descriptors, maps them at its reserved
 * addresses (timed against cuMemCreate + map, today's remap), checks every
 * byte, checks again after the helper has exited, releases them, and the
 * driver checkpoints and restores it once more (a second checkpoint of a
 * process that imported memory). nvidia-smi's per-process memory is shown
 * at each point. It prints "fillprobe: PASS" or the first step that failed.
 *
 * Built by hand on the GPU machine (no CUDA headers):
 *   cc -O2 -o fillprobe e2e/gpu/fillprobe.c -ldl -lpthread
 * Usage: fillprobe [GIB [NH]]   (default 12 GiB in 24 allocations)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr, CUhandle;
typedef void *CUcontext;
typedef struct {
	int type, requestedHandleTypes;
	struct { int type, id; } location;
	void *win32;
	unsigned char flags[8];
} Prop;
typedef struct {
	struct { int type, id; } location;
	int flags;
} Access;

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, int);
static CUresult (*cuDevicePrimaryCtxRelease)(int);
static CUresult (*cuCtxSetCurrent)(CUcontext);
static CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
static CUresult (*cuMemCreate)(CUhandle *, size_t, const Prop *, unsigned long long);
static CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUhandle, unsigned long long);
static CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const Access *, size_t);
static CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
static CUresult (*cuMemRelease)(CUhandle);
static CUresult (*cuMemGetAllocationGranularity)(size_t *, const Prop *, int);
static CUresult (*cuMemExportToShareableHandle)(void *, CUhandle, int, unsigned long long);
static CUresult (*cuMemImportFromShareableHandle)(CUhandle *, void *, int);
static CUresult (*cuMemAllocHost)(void **, size_t);
static CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
static CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
static CUresult (*ckLock)(int, void *), (*ckCheckpoint)(int, void *), (*ckRestore)(int, void *), (*ckUnlock)(int, void *);

#define FD_TYPE 1 /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
#define CHUNK ((size_t)64 << 20)

static size_t total, each;
static int nh;
static const char *who = "main";

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

#define CK(x)                                                                 \
	do {                                                                  \
		CUresult r_ = (x);                                            \
		if (r_) {                                                     \
			printf("fillprobe: FAIL %s: %s: CUresult %d\n", who, #x, r_); \
			fflush(stdout);                                       \
			_exit(1);                                             \
		}                                                             \
	} while (0)

static void bind_driver(void)
{
	void *h = dlopen("libcuda.so.1", RTLD_NOW);
	if (!h) {
		printf("fillprobe: FAIL no libcuda.so.1: %s\n", dlerror());
		exit(1);
	}
#define SYM(v, name)                                                           \
	if (!(*(void **)&v = dlsym(h, name))) {                                \
		printf("fillprobe: FAIL no %s\n", name);                       \
		exit(1);                                                       \
	}
	SYM(cuInit, "cuInit");
	SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
	SYM(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
	SYM(cuCtxSetCurrent, "cuCtxSetCurrent");
	SYM(cuMemAddressReserve, "cuMemAddressReserve");
	SYM(cuMemCreate, "cuMemCreate");
	SYM(cuMemMap, "cuMemMap");
	SYM(cuMemSetAccess, "cuMemSetAccess");
	SYM(cuMemUnmap, "cuMemUnmap");
	SYM(cuMemRelease, "cuMemRelease");
	SYM(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
	SYM(cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
	SYM(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
	SYM(cuMemAllocHost, "cuMemAllocHost_v2");
	SYM(cuMemcpyHtoD, "cuMemcpyHtoD_v2");
	SYM(cuMemcpyDtoH, "cuMemcpyDtoH_v2");
	SYM(ckLock, "cuCheckpointProcessLock");
	SYM(ckCheckpoint, "cuCheckpointProcessCheckpoint");
	SYM(ckRestore, "cuCheckpointProcessRestore");
	SYM(ckUnlock, "cuCheckpointProcessUnlock");
}

static Prop prop(int types)
{
	Prop p;
	memset(&p, 0, sizeof p);
	p.type = 1;          /* pinned */
	p.location.type = 1; /* device 0 */
	p.requestedHandleTypes = types;
	return p;
}

static CUcontext context(void)
{
	CUcontext c;
	CK(cuInit(0));
	CK(cuDevicePrimaryCtxRetain(&c, 0));
	CK(cuCtxSetCurrent(c));
	return c;
}

static void map_rw(CUdeviceptr va, size_t n, CUhandle h)
{
	Access a = {{1, 0}, 3};
	CK(cuMemMap(va, n, 0, h, 0));
	CK(cuMemSetAccess(va, n, &a, 1));
}

/* The pattern: 64 MiB of pseudo-random words, each chunk's first word its
 * index (so a chunk copied to the wrong place shows). */
static uint64_t *pattern;
static void make_pattern(void)
{
	CK(cuMemAllocHost((void **)&pattern, CHUNK));
	uint64_t x = 0x9e3779b97f4a7c15ULL;
	for (size_t i = 0; i < CHUNK / 8; i++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		pattern[i] = x;
	}
}

static void fill(CUdeviceptr base)
{
	for (size_t off = 0; off < total; off += CHUNK) {
		pattern[0] = off / CHUNK;
		CK(cuMemcpyHtoD(base + off, pattern, CHUNK));
	}
}

static int check(CUdeviceptr base, const char *when)
{
	static uint64_t *buf;
	if (!buf)
		CK(cuMemAllocHost((void **)&buf, CHUNK));
	for (size_t off = 0; off < total; off += CHUNK) {
		CK(cuMemcpyDtoH(buf, base + off, CHUNK));
		pattern[0] = off / CHUNK;
		if (memcmp(buf, pattern, CHUNK)) {
			printf("fillprobe: FAIL %s: bytes differ at offset %zu %s\n", who, off, when);
			return -1;
		}
	}
	printf("  %s: all %zu bytes as written %s\n", who, total, when);
	return 0;
}

static void send_fds(int s, const int *fds, int n)
{
	char c = 0, cbuf[CMSG_SPACE(64 * sizeof(int))];
	struct iovec iov = {&c, 1};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = CMSG_SPACE(n * sizeof(int))};
	struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
	cm->cmsg_level = SOL_SOCKET, cm->cmsg_type = SCM_RIGHTS, cm->cmsg_len = CMSG_LEN(n * sizeof(int));
	memcpy(CMSG_DATA(cm), fds, n * sizeof(int));
	if (sendmsg(s, &m, 0) != 1)
		perror("sendmsg"), _exit(1);
}

static int recv_fds(int s, int *fds, int n)
{
	char c, cbuf[CMSG_SPACE(64 * sizeof(int))];
	struct iovec iov = {&c, 1};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
	if (recvmsg(s, &m, 0) != 1)
		return -1;
	struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
	if (!cm || cm->cmsg_len != CMSG_LEN(n * sizeof(int)))
		return -1;
	memcpy(fds, CMSG_DATA(cm), n * sizeof(int));
	return 0;
}

static void say(int s, char c) { (void)!write(s, &c, 1); }
static char hear(int s)
{
	char c = 0;
	if (read(s, &c, 1) != 1)
		return 0;
	return c;
}

static void smi(const char *when)
{
	printf("  nvidia-smi %s:\n", when);
	fflush(stdout);
	(void)!system("nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | sed 's/^/    /'");
}

/* ---- the target ---- */
static void target(int s)
{
	who = "target";
	context();
	make_pattern();
	Prop p = prop(0);
	CUdeviceptr va;
	CUhandle h[64];
	CK(cuMemAddressReserve(&va, total, 0, 0, 0));
	double t = now();
	for (int i = 0; i < nh; i++) {
		CK(cuMemCreate(&h[i], each, &p, 0));
		map_rw(va + i * each, each, h[i]);
	}
	double t_remap = now() - t;
	t = now();
	fill(va);
	double t_fill = now() - t;
	printf("  target: today's remap (cuMemCreate + map, %d allocations) %.3f s, copy in (pinned, one thread) %.3f s, %.1f GB/s\n",
	       nh, t_remap, t_fill, total / t_fill / 1e9);
	for (int i = 0; i < nh; i++) {
		CK(cuMemUnmap(va + i * each, each));
		CK(cuMemRelease(h[i]));
	}
	say(s, 'r'); /* released: checkpoint me */
	int fds[64];
	if (recv_fds(s, fds, nh) < 0)
		printf("fillprobe: FAIL target: no descriptors\n"), _exit(1);
	t = now();
	for (int i = 0; i < nh; i++)
		CK(cuMemImportFromShareableHandle(&h[i], (void *)(uintptr_t)fds[i], FD_TYPE));
	double t_imp = now() - t;
	t = now();
	for (int i = 0; i < nh; i++)
		map_rw(va + i * each, each, h[i]);
	double t_map = now() - t;
	for (int i = 0; i < nh; i++)
		close(fds[i]);
	printf("  target: import %.4f s, map at its own addresses %.4f s (%d allocations)\n", t_imp, t_map, nh);
	if (check(va, "after the import (helper alive)") < 0)
		_exit(1);
	say(s, 'm'); /* mapped */
	if (hear(s) != 'g') /* the helper is gone */
		_exit(1);
	if (check(va, "after the helper exited") < 0)
		_exit(1);
	say(s, 'c');
	if (hear(s) != 'k')
		_exit(1);
	/* As the library's next checkpoint: release, then the driver's. */
	for (int i = 0; i < nh; i++) {
		CK(cuMemUnmap(va + i * each, each));
		CK(cuMemRelease(h[i]));
	}
	say(s, 'r');
	if (hear(s) != 'u') /* checkpointed, restored and unlocked again */
		_exit(1);
	for (int i = 0; i < nh; i++) { /* today's remap once more */
		CK(cuMemCreate(&h[i], each, &p, 0));
		map_rw(va + i * each, each, h[i]);
	}
	fill(va);
	if (check(va, "after a second checkpoint and a plain remap") < 0)
		_exit(1);
	say(s, 'd');
	_exit(0);
}

/* ---- the helper ---- */
static void helper(int s)
{
	who = "helper";
	if (hear(s) != 'g') /* the target is checkpointed: fill */
		_exit(1);
	double t0 = now();
	context();
	double t_ctx = now() - t0;
	make_pattern();
	Prop p = prop(FD_TYPE);
	CUdeviceptr va;
	CUhandle h[64];
	int fds[64];
	double t = now();
	CK(cuMemAddressReserve(&va, total, 0, 0, 0));
	for (int i = 0; i < nh; i++) {
		CK(cuMemCreate(&h[i], each, &p, 0));
		map_rw(va + i * each, each, h[i]);
	}
	double t_create = now() - t;
	t = now();
	fill(va);
	double t_fill = now() - t;
	t = now();
	for (int i = 0; i < nh; i++)
		CK(cuMemExportToShareableHandle(&fds[i], h[i], FD_TYPE, 0));
	double t_exp = now() - t;
	printf("  helper: context %.3f s, create + map %.3f s, fill %.3f s (%.1f GB/s), export %.4f s; ready %.3f s after its start\n",
	       t_ctx, t_create, t_fill, total / t_fill / 1e9, t_exp, now() - t0);
	fflush(stdout);
	send_fds(s, fds, nh);
	if (hear(s) != 'm')
		_exit(1);
	for (int i = 0; i < nh; i++) {
		CK(cuMemUnmap(va + i * each, each));
		CK(cuMemRelease(h[i]));
		close(fds[i]);
	}
	CK(cuDevicePrimaryCtxRelease(0));
	_exit(0);
}

static void step(const char *what, CUresult r)
{
	if (r) {
		printf("fillprobe: FAIL main: %s: CUresult %d\n", what, r);
		exit(1);
	}
}

static double driver_cycle(int pid, int restore_too)
{
	unsigned char args[64] = {0};
	*(unsigned *)args = 10000;
	double t = now();
	step("lock", ckLock(pid, args));
	step("checkpoint", ckCheckpoint(pid, NULL));
	if (restore_too) {
		step("restore", ckRestore(pid, NULL));
		step("unlock", ckUnlock(pid, NULL));
	}
	return now() - t;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	size_t gib = argc > 1 ? strtoul(argv[1], 0, 10) : 12;
	nh = argc > 2 ? atoi(argv[2]) : 24;
	if (nh < 1 || nh > 64 || gib < 1) {
		fprintf(stderr, "usage: fillprobe [GIB [NH (1-64)]]\n");
		return 2;
	}
	int ts[2], hs_[2];
	socketpair(AF_UNIX, SOCK_STREAM, 0, ts);
	socketpair(AF_UNIX, SOCK_STREAM, 0, hs_);
	bind_driver();
	/* Sizes: NH allocations of the granularity's multiple. */
	{
		size_t g = 2 << 20;
		each = ((gib << 30) / nh + g - 1) / g * g;
		total = each * nh;
	}
	/* Both fork before any cuInit here (a child of a process that
	 * called cuInit cannot use the driver); the helper waits. */
	pid_t tp = fork();
	if (tp == 0) {
		close(ts[0]), close(hs_[0]), close(hs_[1]);
		target(ts[1]);
	}
	close(ts[1]);
	pid_t hp = fork();
	if (hp == 0) {
		close(ts[0]), close(hs_[0]);
		helper(hs_[1]);
	}
	close(hs_[1]);
	printf("fillprobe: %zu bytes in %d allocations of %zu, target pid %d\n", total, nh, each, tp);
	if (hear(ts[0]) != 'r')
		return printf("fillprobe: FAIL target did not start\n"), 1;
	CK(cuInit(0));
	printf("  main: driver lock + checkpoint of the target %.3f s\n", driver_cycle(tp, 0));
	say(hs_[0], 'g'); /* the filler: while the target is checkpointed */
	int fds[64];
	if (recv_fds(hs_[0], fds, nh) < 0)
		return printf("fillprobe: FAIL the helper sent no descriptors\n"), 1;
	smi("with the helper's filled memory, the target checkpointed");
	double t = now();
	step("restore", ckRestore(tp, NULL));
	double t_rst = now() - t;
	t = now();
	step("unlock", ckUnlock(tp, NULL));
	printf("  main: driver restore %.3f s, unlock %.3f s (beside the helper's memory)\n", t_rst, now() - t);
	send_fds(ts[0], fds, nh);
	if (hear(ts[0]) != 'm')
		return printf("fillprobe: FAIL target could not map the memory\n"), 1;
	smi("after the target's import, the helper alive");
	say(hs_[0], 'm');
	int st;
	waitpid(hp, &st, 0);
	if (!WIFEXITED(st) || WEXITSTATUS(st))
		return printf("fillprobe: FAIL helper exit %d\n", st), 1;
	smi("after the helper exited");
	say(ts[0], 'g');
	if (hear(ts[0]) != 'c')
		return printf("fillprobe: FAIL target lost its memory with the helper\n"), 1;
	say(ts[0], 'k');
	if (hear(ts[0]) != 'r')
		return printf("fillprobe: FAIL target could not release the imported memory\n"), 1;
	printf("  main: second driver checkpoint + restore of the target (it imported memory) %.3f s\n", driver_cycle(tp, 1));
	say(ts[0], 'u');
	if (hear(ts[0]) != 'd')
		return printf("fillprobe: FAIL target after its second checkpoint\n"), 1;
	waitpid(tp, &st, 0);
	if (!WIFEXITED(st) || WEXITSTATUS(st))
		return printf("fillprobe: FAIL target exit %d\n", st), 1;
	printf("fillprobe: PASS\n");
	return 0;
}
