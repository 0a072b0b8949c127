/*
 * libgpucr-preload: the in-process half of gpucr-stream's GPU fast path.
 *
 * Loaded with LD_PRELOAD (`gpucr-stream run -- CMD`), it sits between a CUDA
 * program and the driver (libcuda.so.1) and does three things:
 *
 * 1. Interposition. The CUDA runtime (so PyTorch) reaches the driver by
 *    dlopen("libcuda.so.1") + dlsym(h, "cuGetProcAddress_v2") and fetches
 *    every entry point through it. A preloaded symbol is not what dlsym on a
 *    handle finds, so this library interposes dlsym itself (the real one
 *    comes from dlvsym(RTLD_NEXT, "dlsym", ...), as HAMi-core does) and wraps
 *    the pointers cuGetProcAddress hands out. Wrappers are matched by the
 *    driver's own pointer, so the _ptsz/_ptds variants each get theirs. The
 *    same wrappers are exported under the driver's names for programs linked
 *    against libcuda directly.
 *
 * 2. Bookkeeping. cuMemAlloc_v2 / cuMemAllocPitch_v2 / cuMemFree_v2 are
 *    backed by a reservation plus one physical handle (cuMemAddressReserve,
 *    cuMemCreate, cuMemMap, cuMemSetAccess). The program's own virtual memory
 *    calls (PyTorch's expandable_segments, NCCL) are tracked: every handle
 *    (with its properties) and every mapping (with its access). Handles the
 *    program holds are virtualised: after a release and remap the program's
 *    handle value still works, this library translates it to the new one.
 *    Memory it cannot recreate (cuMemAllocManaged, stream-ordered pools,
 *    IPC and exported handles, entry points it does not know) marks the
 *    process "not capable": gpucr-stream then takes the driver-only path.
 *
 * 3. A control thread on a unix socket (GPUCR_PRELOAD_DIR, default
 *    /run/gpucr-stream, mode 0700; preload-PID.sock, mode 0600, peers of
 *    our uid or root only) that answers gpucr-stream: report, stage, park,
 *    copyout (fds by SCM_RIGHTS), release, remap, copyin (fds), unpark. The
 *    data format of copyout/copyin is in docs/PRODUCERS.md ("VRAM files");
 *    a copy answers with where its time went. The directory must be ours
 *    and no symlink; it is held open and the socket and the status file are
 *    made through it. PID is ours as we see it (gpucr-stream in another pid
 *    namespace reads our NSpid). One connection is served at a time; one
 *    that does not own the park waits at most GPUCR_PRELOAD_IDLE_MS for its
 *    next line (default 60 s). Nothing a client says makes the library open
 *    or unlink a path (docs/THREATS.md, "The GPU fast path across users").
 *
 * Quiescence: the gate, and the order with respect to the driver's lock.
 *
 * Every entry point that submits work touching device memory (kernel and
 * graph launches, host functions, every memcpy and memset, sync or async)
 * and every allocation entry point passes an enter/leave gate in its
 * wrapper. `park` closes the gate (new calls wait in the wrapper, before the
 * driver), waits until no thread is inside a gated call, then synchronizes
 * every context the program allocated in: nothing is in flight and nothing
 * can start. The control thread and its copy workers bypass the gate.
 *
 * The proposed alternative (driver lock first, park every thread with a
 * signal, unlock, copy, lock again) was rejected. Measured on an H100
 * (driver 580, e2e/gpu/quiesce_probe.py): this library's own CUDA calls
 * block while the driver holds the process locked (in one of two runs park's
 * cuCtxSynchronize returned only at the unlock, 3 s later), so the copy must
 * run outside the driver's lock, before it; the order below passed the same
 * probe end to end (nothing moved while parked, no step lost). And a signal
 * stops a thread
 * wherever it is, inside malloc or inside the driver holding its own locks,
 * and the control thread's copies then need those locks (cuMemHostAlloc
 * allocates, the driver serialises on its context); it would also park the
 * driver's own threads, which its lock and checkpoint rely on. The gate stops
 * threads only at a point where they hold no lock of ours, the driver's or
 * libc's. Its limit: work submitted through an entry point the gate does not
 * know (cuGetExportTable's private tables) is not held back, hence the
 * capability checks above.
 *
 * Order (gpucr-stream's side is vram/fastpath.go):
 *   checkpoint: stage (the copy threads' pinned buffers, the program still
 *     running) -> park (gate closed, in-flight calls drained, contexts synced)
 *     -> copyout (into the kept copy: regular files gpucr-stream created;
 *     only write(2), so a short write or ENOSPC fails the job, and nothing
 *     blocks on a reader) -> keep -> release (unmap + release physical
 *     memory; reservations, handles' properties, access kept) -> driver
 *     Lock -> driver Checkpoint (small now) -> CRIU dump. gpucr-stream stores
 *     the kept files into the checkpoint from the release on, beside the
 *     driver's steps and CRIU, and commits once they are in. The driver's
 *     lock finds threads waiting in the gate, outside the driver.
 *   restore: CRIU restore -> driver Restore -> driver Unlock (threads still
 *     wait in the gate) -> remap -> copyin -> unpark.
 *   failure after release (the store, CRIU, destination, driver): driver
 *     Restore/Unlock as today, then remap + copyin from the copy gpucr-stream
 *     kept, then unpark: the program never runs with its memory missing.
 *
 * Surviving gpucr-stream's death (SIGKILL between the release and the commit,
 * also while it still stores the kept files: they are complete before `keep`,
 * and the store only reads them). The connection that parks the process owns
 * it until it says `detach`. Before `release` (refused otherwise)
 * gpucr-stream hands over the kept copy with `keep` (a descriptor of its
 * directory, then read-only descriptors of its files; their paths, from
 * /proc/self/fd, only for messages). Before the driver's lock
 * it says `driver`: from then on the driver may hold the process locked, and
 * a CUDA call of ours would block (or fail) until its restore and unlock.
 * Before CRIU it says `detach` (CRIU refuses a socket connected outside the
 * tree, and must not find the kept files open: the descriptors are closed,
 * the paths kept).
 * If the owning connection ends without `detach`, gpucr-stream died:
 *   - `driver` not said: the driver never saw the process. The library
 *     remaps the memory at the same addresses, refills it from the kept
 *     descriptors (the copy-in checks: magic, every piece once, nothing
 *     else, end records), unparks, and removes the kept files it holds
 *     where it may (unlinkat in the kept directory, only a name that is
 *     still that very file; root's copy is not ours to remove, and
 *     gpucr-stream's next `gpu resume --pid` or checkpoint does).
 *   - `driver` said: no CUDA call is safe. The process stays parked;
 *     `gpucr-stream gpu resume --pid P` restores and unlocks the driver,
 *     then sends `recover` (with descriptors of the kept files).
 * `recover` (also what gpucr-stream's own undo sends) remaps if released,
 * refills from the descriptors that came with it (else the kept ones it
 * still holds; after `detach` it holds none, and opens no path), and
 * unparks; gpucr-stream, which keeps its own record of the copy, removes
 * it. A kept copy that is missing or does not pass the
 * checks leaves the process parked: never running on wrong memory. Every
 * decision taken without gpucr-stream is said on stderr and in
 * preload-PID.status next to the socket.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* ---- the few driver types (cuda.h, ABI-stable) ---- */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef struct {
	int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
	int id;
} CUmemLocation;
typedef struct {
	int type; /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
	int requestedHandleTypes;
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;
typedef struct {
	CUmemLocation location;
	int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} CUmemAccessDesc;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_FOUND 500
#define CU_STREAM_NON_BLOCKING 1

typedef unsigned long long U; /* every gated entry point takes integer-class arguments only */

/* ---- real entry points this library calls itself ---- */
static void *(*real_dlsym)(void *, const char *);
static CUresult (*r_GetProcAddress)(const char *, void **, int, unsigned long long);
static CUresult (*r_GetProcAddress_v2)(const char *, void **, int, unsigned long long, int *);
static CUresult (*r_MemAlloc)(CUdeviceptr *, size_t);
static CUresult (*r_MemAllocPitch)(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
static CUresult (*r_MemFree)(CUdeviceptr);
static CUresult (*r_AddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
static CUresult (*r_AddressFree)(CUdeviceptr, size_t);
static CUresult (*r_Create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
static CUresult (*r_Release)(CUmemGenericAllocationHandle);
static CUresult (*r_Map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
static CUresult (*r_Unmap)(CUdeviceptr, size_t);
static CUresult (*r_SetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
static CUresult (*r_RetainHandle)(CUmemGenericAllocationHandle *, void *);
static CUresult (*r_PropsFromHandle)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
static CUresult (*r_Granularity)(size_t *, const CUmemAllocationProp *, int);
static CUresult (*r_CtxGetCurrent)(CUcontext *);
static CUresult (*r_CtxSetCurrent)(CUcontext);
static CUresult (*r_CtxGetDevice)(CUdevice *);
static CUresult (*r_CtxSynchronize)(void);
static CUresult (*r_HostAlloc)(void **, size_t, unsigned);
static CUresult (*r_FreeHost)(void *);
static CUresult (*r_HostRegister)(void *, size_t, unsigned);
static CUresult (*r_HostUnregister)(void *);
static CUresult (*r_StreamCreate)(CUstream *, unsigned);
static CUresult (*r_StreamDestroy)(CUstream);
static CUresult (*r_StreamSync)(CUstream);
static CUresult (*r_DtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
static CUresult (*r_HtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*r_MemGetInfo)(size_t *, size_t *);

/* ---- state ---- */
static pthread_mutex_t tab_mu = PTHREAD_MUTEX_INITIALIZER;
static void *libcuda;
static char incapable[512]; /* why not (empty: capable) */
static atomic_int wrapped;  /* entry points handed out wrapped */
static __thread int internal; /* control thread and workers: no gate */
static __thread int gate_depth;

static void mark_incapable(const char *fmt, ...)
{
	pthread_mutex_lock(&tab_mu);
	if (!incapable[0]) {
		va_list ap;
		va_start(ap, fmt);
		vsnprintf(incapable, sizeof incapable, fmt, ap);
		va_end(ap);
	}
	pthread_mutex_unlock(&tab_mu);
}

/* ---- the gate ---- */
static atomic_int gate_closed;
static atomic_long gate_inflight;
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_open_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t gate_drained_cv = PTHREAD_COND_INITIALIZER;

static void gate_enter(void)
{
	if (internal || gate_depth++ > 0)
		return;
	for (;;) {
		atomic_fetch_add(&gate_inflight, 1);
		if (!atomic_load(&gate_closed))
			return;
		/* Closed: step back out and wait for it to open. */
		if (atomic_fetch_sub(&gate_inflight, 1) == 1) {
			pthread_mutex_lock(&gate_mu);
			pthread_cond_broadcast(&gate_drained_cv);
			pthread_mutex_unlock(&gate_mu);
		}
		pthread_mutex_lock(&gate_mu);
		while (atomic_load(&gate_closed))
			pthread_cond_wait(&gate_open_cv, &gate_mu);
		pthread_mutex_unlock(&gate_mu);
	}
}

static void gate_leave(void)
{
	if (internal || --gate_depth > 0)
		return;
	if (atomic_fetch_sub(&gate_inflight, 1) == 1 && atomic_load(&gate_closed)) {
		pthread_mutex_lock(&gate_mu);
		pthread_cond_broadcast(&gate_drained_cv);
		pthread_mutex_unlock(&gate_mu);
	}
}

/* gate_close closes the gate and waits up to ms for in-flight calls to
 * leave; on timeout it opens it again and returns -1. */
static int gate_close(long ms)
{
	struct timespec dl;
	clock_gettime(CLOCK_REALTIME, &dl);
	dl.tv_sec += ms / 1000;
	dl.tv_nsec += (ms % 1000) * 1000000L;
	if (dl.tv_nsec >= 1000000000L) {
		dl.tv_sec++;
		dl.tv_nsec -= 1000000000L;
	}
	atomic_store(&gate_closed, 1);
	pthread_mutex_lock(&gate_mu);
	int rc = 0;
	while (atomic_load(&gate_inflight) > 0 && rc == 0)
		rc = pthread_cond_timedwait(&gate_drained_cv, &gate_mu, &dl);
	int ok = atomic_load(&gate_inflight) == 0;
	pthread_mutex_unlock(&gate_mu);
	if (!ok) {
		atomic_store(&gate_closed, 0);
		pthread_mutex_lock(&gate_mu);
		pthread_cond_broadcast(&gate_open_cv);
		pthread_mutex_unlock(&gate_mu);
		return -1;
	}
	return 0;
}

static void gate_open(void)
{
	pthread_mutex_lock(&gate_mu);
	atomic_store(&gate_closed, 0);
	pthread_cond_broadcast(&gate_open_cv);
	pthread_mutex_unlock(&gate_mu);
}

/* ---- bookkeeping: handles and mappings ---- */
struct hrec {
	int live;
	int own;          /* backs one of our cuMemAlloc allocations */
	int app_released; /* the program released it (it lives while mapped) */
	int present;      /* physical memory exists now */
	CUmemGenericAllocationHandle app, real;
	size_t size;
	CUmemAllocationProp prop;
};
struct mrec {
	int live;
	int mapped;
	CUdeviceptr va;
	size_t size, offset;
	int h; /* index into hs */
	CUmemAccessDesc acc[4];
	int nacc;
	CUcontext ctx;
};
struct orec { /* our cuMemAlloc: one reservation, one handle, one mapping */
	int live;
	CUdeviceptr va;
	size_t size;
	int h, m;
};
static struct hrec *hs;
static int nh, caph;
static struct mrec *ms;
static int nm, capm;
static struct orec *os_;
static int no, capo;
static CUcontext ctxs[16];
static int nctx;
static int parked, released;
/* The copy gpucr-stream kept (see the top): descriptors until `detach`,
 * paths until the process runs again. */
static int keep_fds[64], nkeep;
static char *keep_paths[64]; /* for messages, and their names in keep_dir */
static int keep_dir = -1;    /* the directory they are in, from `keep` */
static int driver_next, detached;
/* unfilled: memory was mapped again but not yet copied in: the program
 * must not run on it. */
static int unfilled;
static U handle_seq = 0x6770000000000000ULL; /* handles we give out for ours: never used by the app */

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
	static int fn(void)                                            \
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
static int find_h_app(CUmemGenericAllocationHandle app)
{
	for (int i = 0; i < nh; i++)
		if (hs[i].live && !hs[i].own && hs[i].app == app)
			return i;
	return -1;
}
static void note_ctx(void)
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
static CUcontext cur_ctx(void)
{
	CUcontext c = NULL;
	if (r_CtxGetCurrent)
		r_CtxGetCurrent(&c);
	return c;
}
/* drop_h forgets a handle record once it is released and mapped nowhere. */
static void drop_h_if_unused(int h)
{
	if (!hs[h].live || !hs[h].app_released)
		return;
	for (int i = 0; i < nm; i++)
		if (ms[i].live && ms[i].h == h)
			return;
	hs[h].live = 0;
}

/* ---- init ---- */
static void start_control(void);
static void resolve_real(void);

static pthread_once_t dlsym_once = PTHREAD_ONCE_INIT;
static void init_dlsym(void)
{
	real_dlsym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
	if (!real_dlsym)
		real_dlsym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
	if (!real_dlsym)
		real_dlsym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.17"); /* aarch64 */
}

static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_int cuda_ready;
/* ensure_cuda binds the real driver once libcuda.so.1 is loaded (it never
 * loads it: a program that does not use CUDA is left alone). */
static int ensure_cuda(void)
{
	if (atomic_load(&cuda_ready))
		return 1;
	pthread_once(&dlsym_once, init_dlsym);
	pthread_mutex_lock(&init_mu);
	if (!atomic_load(&cuda_ready)) {
		void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
		if (h) {
			libcuda = h;
			resolve_real();
			atomic_store(&cuda_ready, 1);
			start_control();
		}
	}
	pthread_mutex_unlock(&init_mu);
	return atomic_load(&cuda_ready);
}

/* ---- wrappers ---- */
struct ent {
	const char *name;
	void *wrap;
	void **real;
};
static struct ent *find_by_name(const char *name);
static struct ent *find_by_real(void *p);

#define GATED_N(name, decl, call)                               \
	static CUresult (*real_##name) decl;                    \
	CUresult name decl                                      \
	{                                                       \
		ensure_cuda();                                  \
		if (!real_##name)                               \
			return CUDA_ERROR_NOT_FOUND;            \
		gate_enter();                                   \
		CUresult r = real_##name call;                  \
		gate_leave();                                   \
		return r;                                       \
	}
/* The argument lists of the wrappers, by count (every argument is integer
 * class, so U carries any of them). */
#define ARGS1 (U a)
#define ARGS2 (U a, U b)
#define ARGS3 (U a, U b, U c)
#define ARGS4 (U a, U b, U c, U d)
#define ARGS5 (U a, U b, U c, U d, U e)
#define ARGS6 (U a, U b, U c, U d, U e, U f)
#define ARGS9 (U a, U b, U c, U d, U e, U f, U g, U h, U i)
#define ARGS10 (U a, U b, U c, U d, U e, U f, U g, U h, U i, U j)
#define ARGS11 (U a, U b, U c, U d, U e, U f, U g, U h, U i, U j, U k)
#define CALL1 (a)
#define CALL2 (a, b)
#define CALL3 (a, b, c)
#define CALL4 (a, b, c, d)
#define CALL5 (a, b, c, d, e)
#define CALL6 (a, b, c, d, e, f)
#define CALL9 (a, b, c, d, e, f, g, h, i)
#define CALL10 (a, b, c, d, e, f, g, h, i, j)
#define CALL11 (a, b, c, d, e, f, g, h, i, j, k)

/* The work-submitting entry points, by argument count. */
#define GATED_LIST(X)                                                                                   \
	X(11, cuLaunchKernel) X(11, cuLaunchKernel_ptsz) X(4, cuLaunchKernelEx) X(4, cuLaunchKernelEx_ptsz) \
	X(10, cuLaunchCooperativeKernel) X(10, cuLaunchCooperativeKernel_ptsz)                             \
	X(3, cuLaunchCooperativeKernelMultiDevice) X(2, cuGraphLaunch) X(2, cuGraphLaunch_ptsz)            \
	X(3, cuLaunchHostFunc) X(3, cuLaunchHostFunc_ptsz)                                                 \
	X(3, cuMemcpy) X(3, cuMemcpy_ptds) X(4, cuMemcpyAsync) X(4, cuMemcpyAsync_ptsz)                    \
	X(5, cuMemcpyPeer) X(5, cuMemcpyPeer_ptds) X(6, cuMemcpyPeerAsync) X(6, cuMemcpyPeerAsync_ptsz)    \
	X(3, cuMemcpyHtoD_v2) X(3, cuMemcpyHtoD_v2_ptds) X(3, cuMemcpyDtoH_v2) X(3, cuMemcpyDtoH_v2_ptds)  \
	X(3, cuMemcpyDtoD_v2) X(3, cuMemcpyDtoD_v2_ptds)                                                   \
	X(4, cuMemcpyHtoDAsync_v2) X(4, cuMemcpyHtoDAsync_v2_ptsz) X(4, cuMemcpyDtoHAsync_v2)              \
	X(4, cuMemcpyDtoHAsync_v2_ptsz) X(4, cuMemcpyDtoDAsync_v2) X(4, cuMemcpyDtoDAsync_v2_ptsz)         \
	X(1, cuMemcpy2D_v2) X(1, cuMemcpy2D_v2_ptds) X(1, cuMemcpy2DUnaligned_v2)                          \
	X(1, cuMemcpy2DUnaligned_v2_ptds) X(2, cuMemcpy2DAsync_v2) X(2, cuMemcpy2DAsync_v2_ptsz)           \
	X(1, cuMemcpy3D_v2) X(1, cuMemcpy3D_v2_ptds) X(2, cuMemcpy3DAsync_v2) X(2, cuMemcpy3DAsync_v2_ptsz) \
	X(3, cuMemsetD8_v2) X(3, cuMemsetD8_v2_ptds) X(3, cuMemsetD16_v2) X(3, cuMemsetD16_v2_ptds)        \
	X(3, cuMemsetD32_v2) X(3, cuMemsetD32_v2_ptds) X(4, cuMemsetD8Async) X(4, cuMemsetD8Async_ptsz)    \
	X(4, cuMemsetD16Async) X(4, cuMemsetD16Async_ptsz) X(4, cuMemsetD32Async)                          \
	X(4, cuMemsetD32Async_ptsz) X(5, cuMemsetD2D8_v2) X(5, cuMemsetD2D8_v2_ptds) X(5, cuMemsetD2D16_v2) \
	X(5, cuMemsetD2D16_v2_ptds) X(5, cuMemsetD2D32_v2) X(5, cuMemsetD2D32_v2_ptds)                     \
	X(6, cuMemsetD2D8Async) X(6, cuMemsetD2D8Async_ptsz) X(6, cuMemsetD2D16Async)                      \
	X(6, cuMemsetD2D16Async_ptsz) X(6, cuMemsetD2D32Async) X(6, cuMemsetD2D32Async_ptsz)               \
	X(4, cuStreamWriteValue32_v2) X(4, cuStreamWriteValue64_v2) X(4, cuStreamBatchMemOp_v2)           \
	X(4, cuStreamWriteValue32_v2_ptsz) X(4, cuStreamWriteValue64_v2_ptsz) X(4, cuStreamBatchMemOp_v2_ptsz) \
	X(9, cuMemcpyBatchAsync) X(9, cuMemcpyBatchAsync_ptsz) X(5, cuMemcpy3DBatchAsync) X(5, cuMemcpy3DBatchAsync_ptsz)

#define DEF_GATED(n, name) GATED_N(name, ARGS##n, CALL##n)
GATED_LIST(DEF_GATED)

/* Entry points whose memory this library cannot recreate: passed through,
 * but the process is no longer fast-path capable. (cuIpcOpenMemHandle takes
 * a 64-byte struct by value, which these integer-argument wrappers cannot
 * forward; cuIpcGetMemHandle in the exporting process marks it.) */
#define INCAPABLE_N(name, decl, call)                                                   \
	static CUresult (*real_##name) decl;                                            \
	CUresult name decl                                                              \
	{                                                                               \
		ensure_cuda();                                                          \
		if (!real_##name)                                                       \
			return CUDA_ERROR_NOT_FOUND;                                    \
		gate_enter();                                                           \
		CUresult r = real_##name call;                                          \
		gate_leave();                                                           \
		if (r == CUDA_SUCCESS)                                                  \
			mark_incapable("the program called %s", #name);                 \
		return r;                                                               \
	}
#define INCAPABLE_LIST(X)                                                                                  \
	X(3, cuMemAllocManaged) X(3, cuMemAllocAsync) X(3, cuMemAllocAsync_ptsz) X(4, cuMemAllocFromPoolAsync) \
	X(4, cuMemAllocFromPoolAsync_ptsz) X(2, cuIpcGetMemHandle) X(4, cuMemExportToShareableHandle)         \
	X(3, cuMemImportFromShareableHandle) X(2, cuMemPoolCreate) X(2, cuArrayCreate_v2)                      \
	X(2, cuArray3DCreate_v2) X(3, cuMipmappedArrayCreate)
#define DEF_INCAP(n, name) INCAPABLE_N(name, ARGS##n, CALL##n)
INCAPABLE_LIST(DEF_INCAP)

static size_t granularity(const CUmemAllocationProp *p)
{
	size_t g = 0;
	if (!r_Granularity || r_Granularity(&g, p, 1 /* recommended */) != CUDA_SUCCESS || !g)
		if (!r_Granularity || r_Granularity(&g, p, 0) != CUDA_SUCCESS || !g)
			g = 2 << 20;
	return g;
}

/* own_alloc backs a cuMemAlloc with reserve + create + map + access. */
static CUresult own_alloc(CUdeviceptr *dptr, size_t size)
{
	CUdevice dev = 0;
	if (!r_CtxGetDevice || r_CtxGetDevice(&dev) != CUDA_SUCCESS)
		return r_MemAlloc ? r_MemAlloc(dptr, size) : CUDA_ERROR_NOT_FOUND;
	CUmemAllocationProp prop;
	memset(&prop, 0, sizeof prop);
	prop.type = 1;
	prop.location.type = 1;
	prop.location.id = dev;
	size_t g = granularity(&prop);
	size_t sz = (size + g - 1) / g * g;
	CUdeviceptr va = 0;
	CUmemGenericAllocationHandle h = 0;
	CUresult r = r_AddressReserve(&va, sz, 0, 0, 0);
	if (r != CUDA_SUCCESS)
		return r;
	if ((r = r_Create(&h, sz, &prop, 0)) != CUDA_SUCCESS) {
		r_AddressFree(va, sz);
		return r;
	}
	if ((r = r_Map(va, sz, 0, h, 0)) != CUDA_SUCCESS) {
		r_Release(h);
		r_AddressFree(va, sz);
		return r;
	}
	CUmemAccessDesc acc = {{1, dev}, 3};
	if ((r = r_SetAccess(va, sz, &acc, 1)) != CUDA_SUCCESS) {
		r_Unmap(va, sz);
		r_Release(h);
		r_AddressFree(va, sz);
		return r;
	}
	pthread_mutex_lock(&tab_mu);
	note_ctx();
	int hi = new_h(), mi = new_m(), oi = new_o();
	hs[hi] = (struct hrec){.live = 1, .own = 1, .present = 1, .app = handle_seq++, .real = h, .size = sz, .prop = prop};
	ms[mi] = (struct mrec){.live = 1, .mapped = 1, .va = va, .size = sz, .offset = 0, .h = hi, .nacc = 1, .ctx = cur_ctx()};
	ms[mi].acc[0] = acc;
	os_[oi] = (struct orec){.live = 1, .va = va, .size = sz, .h = hi, .m = mi};
	pthread_mutex_unlock(&tab_mu);
	*dptr = va;
	return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size)
{
	if (!ensure_cuda() || !r_Create)
		return CUDA_ERROR_NOT_FOUND;
	if (!dptr || size == 0)
		return r_MemAlloc(dptr, size);
	gate_enter();
	CUresult r = own_alloc(dptr, size);
	gate_leave();
	return r;
}

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned elem)
{
	if (!ensure_cuda() || !r_Create)
		return CUDA_ERROR_NOT_FOUND;
	if (!dptr || !pitch || !width || !height || (elem != 4 && elem != 8 && elem != 16))
		return r_MemAllocPitch(dptr, pitch, width, height, elem);
	size_t p = (width + 511) / 512 * 512;
	gate_enter();
	CUresult r = own_alloc(dptr, p * height);
	gate_leave();
	if (r == CUDA_SUCCESS)
		*pitch = p;
	return r;
}

CUresult cuMemFree_v2(CUdeviceptr va)
{
	if (!ensure_cuda() || !r_MemFree)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	pthread_mutex_lock(&tab_mu);
	int oi = -1;
	for (int i = 0; i < no; i++)
		if (os_[i].live && os_[i].va == va) {
			oi = i;
			break;
		}
	CUresult r;
	if (oi < 0) {
		pthread_mutex_unlock(&tab_mu);
		r = r_MemFree(va);
	} else {
		struct orec o = os_[oi];
		r = r_Unmap(o.va, o.size);
		if (r == CUDA_SUCCESS) {
			if (hs[o.h].present)
				r_Release(hs[o.h].real);
			r_AddressFree(o.va, o.size);
			os_[oi].live = 0;
			ms[o.m].live = 0;
			hs[o.h].live = 0;
		}
		pthread_mutex_unlock(&tab_mu);
	}
	gate_leave();
	return r;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *h, size_t size, const CUmemAllocationProp *prop, unsigned long long flags)
{
	if (!ensure_cuda() || !r_Create)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	CUresult r = r_Create(h, size, prop, flags);
	if (r == CUDA_SUCCESS) {
		pthread_mutex_lock(&tab_mu);
		if (flags)
			mark_incapable("cuMemCreate with flags %llu", flags);
		int i = new_h();
		hs[i] = (struct hrec){.live = 1, .present = 1, .app = *h, .real = *h, .size = size, .prop = *prop};
		note_ctx();
		pthread_mutex_unlock(&tab_mu);
	}
	gate_leave();
	return r;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle h)
{
	if (!ensure_cuda() || !r_Release)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	pthread_mutex_lock(&tab_mu);
	int i = find_h_app(h);
	CUresult r;
	if (i < 0) {
		r = r_Release(h);
	} else if (hs[i].app_released) {
		r = CUDA_ERROR_INVALID_VALUE;
	} else {
		r = hs[i].present ? r_Release(hs[i].real) : CUDA_SUCCESS;
		if (r == CUDA_SUCCESS) {
			hs[i].app_released = 1;
			drop_h_if_unused(i);
		}
	}
	pthread_mutex_unlock(&tab_mu);
	gate_leave();
	return r;
}

CUresult cuMemMap(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags)
{
	if (!ensure_cuda() || !r_Map)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	pthread_mutex_lock(&tab_mu);
	int i = find_h_app(h);
	CUresult r = r_Map(va, size, offset, i >= 0 ? hs[i].real : h, flags);
	if (r == CUDA_SUCCESS) {
		if (i < 0) {
			mark_incapable("cuMemMap of a handle the library did not see created");
		} else {
			int m = new_m();
			ms[m] = (struct mrec){.live = 1, .mapped = 1, .va = va, .size = size, .offset = offset, .h = i, .ctx = cur_ctx()};
		}
	}
	pthread_mutex_unlock(&tab_mu);
	gate_leave();
	return r;
}

CUresult cuMemUnmap(CUdeviceptr va, size_t size)
{
	if (!ensure_cuda() || !r_Unmap)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	pthread_mutex_lock(&tab_mu);
	CUresult r = r_Unmap(va, size);
	if (r == CUDA_SUCCESS) {
		for (int i = 0; i < nm; i++) {
			if (!ms[i].live || ms[i].va < va || ms[i].va + ms[i].size > va + size)
				continue;
			ms[i].live = 0;
			drop_h_if_unused(ms[i].h);
		}
	}
	pthread_mutex_unlock(&tab_mu);
	gate_leave();
	return r;
}

CUresult cuMemSetAccess(CUdeviceptr va, size_t size, const CUmemAccessDesc *desc, size_t count)
{
	if (!ensure_cuda() || !r_SetAccess)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	pthread_mutex_lock(&tab_mu);
	CUresult r = r_SetAccess(va, size, desc, count);
	if (r == CUDA_SUCCESS) {
		for (int i = 0; i < nm; i++) {
			struct mrec *m = &ms[i];
			if (!m->live || m->va + m->size <= va || m->va >= va + size)
				continue;
			for (size_t k = 0; k < count; k++) {
				int j;
				for (j = 0; j < m->nacc; j++)
					if (m->acc[j].location.type == desc[k].location.type && m->acc[j].location.id == desc[k].location.id)
						break;
				if (j == m->nacc) {
					if (m->nacc == 4) {
						mark_incapable("access set for more than 4 locations");
						continue;
					}
					m->nacc++;
				}
				m->acc[j] = desc[k];
			}
		}
	}
	pthread_mutex_unlock(&tab_mu);
	gate_leave();
	return r;
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *h, void *addr)
{
	if (!ensure_cuda() || !r_RetainHandle)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	CUresult r = r_RetainHandle(h, addr);
	if (r == CUDA_SUCCESS) {
		pthread_mutex_lock(&tab_mu);
		for (int i = 0; i < nh; i++)
			if (hs[i].live && hs[i].present && hs[i].real == *h) {
				if (hs[i].own)
					mark_incapable("cuMemRetainAllocationHandle on a cuMemAlloc allocation");
				else if (hs[i].app != hs[i].real)
					/* The program knows the handle by its old value. */
					*h = hs[i].app;
				/* A retain is a reference the program releases again; we
				 * keep one record and count it as not released. */
				if (hs[i].app_released)
					hs[i].app_released = 0;
				break;
			}
		pthread_mutex_unlock(&tab_mu);
	}
	gate_leave();
	return r;
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h)
{
	if (!ensure_cuda() || !r_PropsFromHandle)
		return CUDA_ERROR_NOT_FOUND;
	pthread_mutex_lock(&tab_mu);
	int i = find_h_app(h);
	CUmemGenericAllocationHandle real = i >= 0 ? hs[i].real : h;
	pthread_mutex_unlock(&tab_mu);
	return r_PropsFromHandle(prop, real);
}

/* The names cuGetProcAddress is asked for whose answer must be wrapped for
 * the process to be capable. */
static const char *must_wrap[] = {"cuMemAlloc", "cuMemFree", "cuMemCreate", "cuMemMap", "cuMemUnmap",
				  "cuMemRelease", "cuLaunchKernel", "cuMemcpyAsync", "cuMemcpyHtoDAsync",
				  "cuMemcpyDtoHAsync", "cuGraphLaunch", NULL};

static void *wrap_ptr(const char *asked, void *p)
{
	if (!p)
		return p;
	struct ent *e = find_by_real(p);
	if (e) {
		atomic_fetch_add(&wrapped, 1);
		return e->wrap;
	}
	if (asked)
		for (int i = 0; must_wrap[i]; i++)
			if (!strcmp(asked, must_wrap[i]) && !find_by_name(asked)) {
				/* Not one of the driver's exported entry points. */
				mark_incapable("cuGetProcAddress(%s) returned an entry point the library does not know", asked);
				break;
			}
	return p;
}

CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags, int *status)
{
	if (!ensure_cuda() || !r_GetProcAddress_v2)
		return CUDA_ERROR_NOT_FOUND;
	CUresult r = r_GetProcAddress_v2(sym, pfn, ver, flags, status);
	if (r == CUDA_SUCCESS && pfn)
		*pfn = wrap_ptr(sym, *pfn);
	return r;
}

CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags)
{
	if (!ensure_cuda() || !r_GetProcAddress)
		return CUDA_ERROR_NOT_FOUND;
	CUresult r = r_GetProcAddress(sym, pfn, ver, flags);
	if (r == CUDA_SUCCESS && pfn)
		*pfn = wrap_ptr(sym, *pfn);
	return r;
}

/* The table: every wrapper and where its real entry point goes. */
static void *r_dummy;
#define ENT_G(n, name) {#name, (void *)name, (void **)&real_##name},
static struct ent table[] = {
	GATED_LIST(ENT_G) INCAPABLE_LIST(ENT_G)
	{"cuMemAlloc_v2", (void *)cuMemAlloc_v2, (void **)&r_MemAlloc},
	{"cuMemAllocPitch_v2", (void *)cuMemAllocPitch_v2, (void **)&r_MemAllocPitch},
	{"cuMemFree_v2", (void *)cuMemFree_v2, (void **)&r_MemFree},
	{"cuMemCreate", (void *)cuMemCreate, (void **)&r_Create},
	{"cuMemRelease", (void *)cuMemRelease, (void **)&r_Release},
	{"cuMemMap", (void *)cuMemMap, (void **)&r_Map},
	{"cuMemUnmap", (void *)cuMemUnmap, (void **)&r_Unmap},
	{"cuMemSetAccess", (void *)cuMemSetAccess, (void **)&r_SetAccess},
	{"cuMemRetainAllocationHandle", (void *)cuMemRetainAllocationHandle, (void **)&r_RetainHandle},
	{"cuMemGetAllocationPropertiesFromHandle", (void *)cuMemGetAllocationPropertiesFromHandle, (void **)&r_PropsFromHandle},
	{"cuGetProcAddress", (void *)cuGetProcAddress, (void **)&r_GetProcAddress},
	{"cuGetProcAddress_v2", (void *)cuGetProcAddress_v2, (void **)&r_GetProcAddress_v2},
	{NULL, NULL, &r_dummy},
};
static void *realp[sizeof table / sizeof table[0]];

static struct ent *find_by_name(const char *name)
{
	for (struct ent *e = table; e->name; e++)
		if (!strcmp(e->name, name))
			return e;
	return NULL;
}
/* find_by_real finds the wrapper of the driver's entry point p. A driver
 * whose own tables resolve through the global scope hands out our exports
 * themselves: those are wrapped already. */
static struct ent *find_by_real(void *p)
{
	for (int i = 0; table[i].name; i++)
		if (realp[i] == p || table[i].wrap == p)
			return &table[i];
	return NULL;
}

static void resolve_real(void)
{
	for (int i = 0; table[i].name; i++) {
		realp[i] = real_dlsym(libcuda, table[i].name);
		*table[i].real = realp[i];
	}
#define R(var, sym) var = real_dlsym(libcuda, sym)
	R(r_AddressReserve, "cuMemAddressReserve");
	R(r_AddressFree, "cuMemAddressFree");
	R(r_Granularity, "cuMemGetAllocationGranularity");
	R(r_CtxGetCurrent, "cuCtxGetCurrent");
	R(r_CtxSetCurrent, "cuCtxSetCurrent");
	R(r_CtxGetDevice, "cuCtxGetDevice");
	R(r_CtxSynchronize, "cuCtxSynchronize");
	R(r_HostAlloc, "cuMemHostAlloc");
	R(r_FreeHost, "cuMemFreeHost");
	R(r_HostRegister, "cuMemHostRegister_v2");
	R(r_HostUnregister, "cuMemHostUnregister");
	R(r_StreamCreate, "cuStreamCreate");
	R(r_StreamDestroy, "cuStreamDestroy_v2");
	R(r_StreamSync, "cuStreamSynchronize");
	R(r_DtoHAsync, "cuMemcpyDtoHAsync_v2");
	R(r_HtoDAsync, "cuMemcpyHtoDAsync_v2");
	R(r_MemGetInfo, "cuMemGetInfo_v2");
#undef R
	if (!r_AddressReserve || !r_Create || !r_Map || !r_SetAccess || !r_HostAlloc || !r_DtoHAsync || !r_HtoDAsync)
		mark_incapable("the driver lacks the virtual memory API");
}

/* next_sym is dlsym(RTLD_NEXT, sym) for the caller at ret: called from
 * here, RTLD_NEXT would search after this library instead of the caller. */
#include <link.h>
static void *next_sym(const char *sym, void *ret)
{
	Dl_info info;
	struct link_map *lm = NULL;
	if (!dladdr1(ret, &info, (void **)&lm, RTLD_DL_LINKMAP) || !lm)
		return NULL;
	for (struct link_map *l = lm->l_next; l; l = l->l_next) {
		void *p = real_dlsym(l, sym);
		if (p)
			return p;
	}
	return NULL;
}

void *dlsym(void *h, const char *sym)
{
	pthread_once(&dlsym_once, init_dlsym);
	void *p = h == RTLD_NEXT ? next_sym(sym, __builtin_return_address(0)) : real_dlsym(h, sym);
	if (!p || sym[0] != 'c' || sym[1] != 'u' || !ensure_cuda())
		return p;
	struct ent *e = find_by_real(p);
	if (e) {
		atomic_fetch_add(&wrapped, 1);
		return e->wrap;
	}
	return p;
}

/* ---- the control channel ---- */
static pthread_t ctl_thread;
static int ctl_fd = -1;
/* The socket directory, held open: the socket and the status file are made
 * through it, so that a path swapped later leads nowhere else. */
static int ctl_dir_fd = -1;
static char sock_path[108]; /* for messages only */
static char sock_name[64];  /* preload-PID.sock in ctl_dir_fd */
static atomic_int ctl_started;

static int write_all(int fd, const void *b, size_t n)
{
	const char *p = b;
	while (n > 0) {
		ssize_t w = write(fd, p, n);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		if (w == 0) { /* a full file system may say nothing: do not spin */
			errno = ENOSPC;
			return -1;
		}
		p += w;
		n -= w;
	}
	return 0;
}
static int read_full(int fd, void *b, size_t n)
{
	char *p = b;
	while (n > 0) {
		ssize_t r = read(fd, p, n);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		if (r == 0)
			return 1; /* EOF */
		p += r;
		n -= r;
	}
	return 0;
}

/* fault names a step to fail on purpose (tests): GPUCR_PRELOAD_FAULT=park,
 * copyout, release (after the first mapping), remap or copyin. */
static atomic_int fault_fired;
static int fault(const char *step)
{
	const char *f = getenv("GPUCR_PRELOAD_FAULT");
	/* One shot, so that a retry of the step can succeed. */
	return f && !strcmp(f, step) && !atomic_exchange(&fault_fired, 1);
}

static size_t live_bytes(int *nmaps, int *nhandles, int *unmapped_handles)
{
	size_t b = 0;
	int m = 0, h = 0, u = 0;
	for (int i = 0; i < nm; i++)
		if (ms[i].live) {
			b += ms[i].size;
			m++;
		}
	for (int i = 0; i < nh; i++) {
		if (!hs[i].live)
			continue;
		h++;
		int mapped = 0;
		for (int j = 0; j < nm && !mapped; j++)
			mapped = ms[j].live && ms[j].h == i;
		if (!mapped)
			u++;
	}
	if (nmaps)
		*nmaps = m;
	if (nhandles)
		*nhandles = h;
	if (unmapped_handles)
		*unmapped_handles = u;
	return b;
}

static const char *capable_reason(void)
{
	int u = 0;
	live_bytes(NULL, NULL, &u);
	if (incapable[0])
		return incapable;
	if (!atomic_load(&wrapped))
		return "no driver entry point was reached through the library";
	if (u)
		return "a physical allocation is mapped nowhere (its contents could not be copied)";
	return "";
}

static void json_str(char *out, size_t n, const char *s)
{
	size_t k = 0;
	for (; *s && k + 2 < n; s++)
		if (*s != '"' && *s != '\\' && (unsigned char)*s >= 0x20)
			out[k++] = *s;
	out[k] = 0;
}

static int staged_count(void);

static void cmd_report(char *out, size_t n)
{
	pthread_mutex_lock(&tab_mu);
	int maps, handles, u;
	size_t b = live_bytes(&maps, &handles, &u);
	char why[512];
	json_str(why, sizeof why, capable_reason());
	size_t fr = 0, tot = 0;
	if (r_MemGetInfo && nctx) {
		r_CtxSetCurrent(ctxs[0]);
		r_MemGetInfo(&fr, &tot);
	}
	int own = 0;
	for (int i = 0; i < no; i++)
		own += os_[i].live;
	snprintf(out, n,
		 "ok {\"pid\":%d,\"capable\":%s,\"reason\":\"%s\",\"bytes\":%zu,\"mappings\":%d,\"handles\":%d,"
		 "\"allocs\":%d,\"contexts\":%d,\"wrapped\":%d,\"parked\":%s,\"released\":%s,\"unfilled\":%s,\"device_used\":%zu,"
		 "\"driver\":%s,\"detached\":%s,\"staged\":%d,\"kept\":[",
		 getpid(), why[0] ? "false" : "true", why, b, maps, handles, own, nctx, atomic_load(&wrapped),
		 parked ? "true" : "false", released ? "true" : "false", unfilled ? "true" : "false", tot - fr,
		 driver_next ? "true" : "false", detached ? "true" : "false", staged_count());
	pthread_mutex_unlock(&tab_mu);
	/* The kept files' paths, as far as they fit (with room for the end). */
	for (int i = 0; i < nkeep; i++) {
		char p[4096];
		json_str(p, sizeof p, keep_paths[i]);
		size_t k = strlen(out);
		if (k + strlen(p) + 8 >= n)
			break;
		snprintf(out + k, n - k, "%s\"%s\"", i ? "," : "", p);
	}
	size_t k = strlen(out);
	snprintf(out + k, n - k, "]}\n");
}

static int sync_all(char *err, size_t n)
{
	for (int i = 0; i < nctx; i++) {
		CUresult r;
		if ((r = r_CtxSetCurrent(ctxs[i])) != CUDA_SUCCESS || (r = r_CtxSynchronize()) != CUDA_SUCCESS) {
			snprintf(err, n, "synchronize context %d: CUresult %d", i, r);
			return -1;
		}
	}
	return 0;
}

/* ---- copy workers ---- */
#define MAGIC "GPUCRVM1"
#define PIECE (64ULL << 20)

struct piece {
	CUdeviceptr va;
	size_t n;
	CUcontext ctx;
};
struct job {
	int out; /* 1: device to fd; 0: fd to device */
	struct piece *pieces;
	int npieces;
	/* copy in: the first piece of each mapping in seen[], and which
	 * pieces came (each exactly once). */
	int *first;
	atomic_uchar *seen;
	int nseen;
	atomic_int next;
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
};
struct worker {
	struct job *j;
	int fd, idx;
	pthread_t t;
};

/* What a command answers with besides ok: a copy's bytes and where its
 * time went (seconds; wait and io are summed over the workers). */
struct stats {
	long long bytes;
	double setup, work, teardown, wait, io;
	int workers, staged;
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

static void unstage_all(void)
{
	for (int i = 0; i < 64; i++)
		if (staged[i].buf[0])
			stage_free(&staged[i]);
}

static int staged_count(void)
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
static int cmd_stage(int k, char *err, size_t n, struct stats *st)
{
	if (k < 1 || k > 64) {
		snprintf(err, n, "stage %d: want 1..64 workers", k);
		return -1;
	}
	if (released || driver_next) {
		snprintf(err, n, "stage: too late (memory released or the driver's step announced)");
		return -1;
	}
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

/* piece_of checks that [va, va+n) is one piece of a mapping as copy-out
 * cuts them (PIECE bytes from the mapping's start, the last one shorter)
 * and marks it arrived; -1 if it is none, -2 if it came before. It returns
 * the mapping's context in *ctx. */
static int piece_of(struct job *j, CUdeviceptr va, size_t n, CUcontext *ctx)
{
	int rc = -1;
	pthread_mutex_lock(&tab_mu);
	for (int i = 0; i < nm; i++) {
		struct mrec *m = &ms[i];
		if (!m->live || !m->mapped || va < m->va || va - m->va >= m->size)
			continue;
		size_t off = va - m->va;
		if (off % PIECE == 0 && n == (m->size - off < PIECE ? m->size - off : PIECE)) {
			int k = j->first[i] + off / PIECE;
			rc = atomic_exchange(&j->seen[k], 1) ? -2 : 0;
			*ctx = m->ctx;
		}
		break;
	}
	pthread_mutex_unlock(&tab_mu);
	return rc;
}

/* copy_out writes the job's pieces from the device into w->fd through two
 * pinned buffers, one copying from the device while the other is written. */
static void copy_out(struct worker *w, void *buf[2], CUstream st[2])
{
	struct job *j = w->j;
	CUresult r;
	if (write_all(w->fd, MAGIC, 8) < 0) {
		job_fail(j, "write: %s", strerror(errno));
		return;
	}
	for (;;) {
		int k = atomic_fetch_add(&j->next, 1);
		if (k >= j->npieces || atomic_load(&j->failed))
			break;
		struct piece *p = &j->pieces[k];
		if (p->ctx)
			r_CtxSetCurrent(p->ctx);
		uint64_t hdr[2] = {p->va, p->n};
		if (write_all(w->fd, hdr, sizeof hdr) < 0) {
			job_fail(j, "write: %s", strerror(errno));
			return;
		}
		size_t nch = (p->n + j->buf - 1) / j->buf, plen[2] = {0, 0};
		for (size_t i = 0; i <= nch; i++) {
			int b = i & 1;
			if (i < nch) {
				plen[b] = p->n - i * j->buf < j->buf ? p->n - i * j->buf : j->buf;
				if ((r = r_DtoHAsync(buf[b], p->va + i * j->buf, plen[b], st[b])) != CUDA_SUCCESS) {
					job_fail(j, "copy %#llx+%zu to host: CUresult %d", p->va, i * j->buf, r);
					return;
				}
			}
			if (i > 0) {
				int pb = b ^ 1;
				double t0 = mono();
				if ((r = r_StreamSync(st[pb])) != CUDA_SUCCESS) {
					job_fail(j, "copy to host: CUresult %d", r);
					return;
				}
				double t1 = mono();
				if (write_all(w->fd, buf[pb], plen[pb]) < 0) {
					job_fail(j, "write: %s", strerror(errno));
					return;
				}
				atomic_fetch_add(&j->wait_ns, (long long)((t1 - t0) * 1e9));
				atomic_fetch_add(&j->io_ns, (long long)((mono() - t1) * 1e9));
				atomic_fetch_add(&j->bytes, plen[pb]);
			}
		}
		if (fault("copyout")) {
			job_fail(j, "injected fault (copyout)");
			return;
		}
	}
	uint64_t end[2] = {0, 0};
	if (!atomic_load(&j->failed) && write_all(w->fd, end, sizeof end) < 0)
		job_fail(j, "write: %s", strerror(errno));
}

/* copy_in reads a VRAM file from w->fd and copies each piece to the device,
 * alternating the two pinned buffers; the caller synchronizes the streams. */
static void copy_in(struct worker *w, void *buf[2], CUstream st[2])
{
	struct job *j = w->j;
	CUresult r;
	char magic[8];
	int e = read_full(w->fd, magic, 8);
	if (e || memcmp(magic, MAGIC, 8)) {
		job_fail(j, "VRAM file: %s", e ? "truncated header" : "bad magic");
		return;
	}
	size_t pending[2] = {0, 0};
	int b = 0;
	for (;;) {
		uint64_t hdr[2];
		if (read_full(w->fd, hdr, sizeof hdr)) {
			job_fail(j, "VRAM file: truncated (no end record)");
			return;
		}
		if (hdr[0] == 0 && hdr[1] == 0)
			break;
		CUcontext c = NULL;
		int pc = piece_of(j, hdr[0], hdr[1], &c);
		if (pc < 0) {
			job_fail(j, "VRAM file: range %#llx+%llu %s", (unsigned long long)hdr[0], (unsigned long long)hdr[1],
				 pc == -2 ? "came twice" : "is not a mapping of this process (or not one of its pieces)");
			return;
		}
		if (c)
			r_CtxSetCurrent(c);
		for (size_t off = 0; off < hdr[1];) {
			size_t len = hdr[1] - off < j->buf ? hdr[1] - off : j->buf;
			double t0 = mono();
			if (pending[b] && (r = r_StreamSync(st[b])) != CUDA_SUCCESS) {
				job_fail(j, "copy to device: CUresult %d", r);
				return;
			}
			double t1 = mono();
			if (read_full(w->fd, buf[b], len)) {
				job_fail(j, "VRAM file: truncated in range %#llx", (unsigned long long)hdr[0]);
				return;
			}
			atomic_fetch_add(&j->wait_ns, (long long)((t1 - t0) * 1e9));
			atomic_fetch_add(&j->io_ns, (long long)((mono() - t1) * 1e9));
			if ((r = r_HtoDAsync(hdr[0] + off, buf[b], len, st[b])) != CUDA_SUCCESS) {
				job_fail(j, "copy %#llx to device: CUresult %d", (unsigned long long)hdr[0] + off, r);
				return;
			}
			pending[b] = len;
			atomic_fetch_add(&j->bytes, len);
			off += len;
			b ^= 1;
		}
		if (fault("copyin")) {
			job_fail(j, "injected fault (copyin)");
			return;
		}
	}
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
	/* Copy out writes the kept copy (a regular file): a delayed write
	 * error shows at close, and must fail the job. */
	if (close(w->fd) < 0 && j->out)
		job_fail(j, "close: %s", strerror(errno));
	return NULL;
}

static size_t buf_size(void)
{
	const char *e = getenv("GPUCR_PRELOAD_BUF_MIB");
	long v = e ? atol(e) : 0;
	return (size_t)(v > 0 && v <= 1024 ? v : 32) << 20;
}

static int run_job(int out, int *fds, int nfds, char *err, size_t n, struct stats *st)
{
	struct job j;
	memset(&j, 0, sizeof j);
	pthread_mutex_init(&j.err_mu, NULL);
	j.out = out;
	j.buf = buf_size();
	if (out) {
		pthread_mutex_lock(&tab_mu);
		int cap = 0;
		for (int i = 0; i < nm; i++)
			if (ms[i].live)
				cap += (ms[i].size + PIECE - 1) / PIECE;
		j.pieces = calloc(cap ? cap : 1, sizeof *j.pieces);
		for (int i = 0; i < nm; i++)
			for (size_t off = 0; ms[i].live && off < ms[i].size; off += PIECE)
				j.pieces[j.npieces++] = (struct piece){ms[i].va + off, ms[i].size - off < PIECE ? ms[i].size - off : PIECE, ms[i].ctx};
		pthread_mutex_unlock(&tab_mu);
	} else {
		pthread_mutex_lock(&tab_mu);
		j.first = calloc(nm ? nm : 1, sizeof *j.first);
		for (int i = 0; i < nm; i++) {
			j.first[i] = j.nseen;
			if (ms[i].live)
				j.nseen += (ms[i].size + PIECE - 1) / PIECE;
		}
		j.seen = calloc(j.nseen ? j.nseen : 1, sizeof *j.seen);
		pthread_mutex_unlock(&tab_mu);
	}
	struct worker *ws = calloc(nfds, sizeof *ws);
	int started = 0;
	for (int i = 0; i < nfds; i++) {
		ws[i].j = &j;
		ws[i].fd = fds[i];
		ws[i].idx = i;
		if (pthread_create(&ws[i].t, NULL, worker_main, &ws[i]) != 0) {
			job_fail(&j, "pthread_create failed");
			for (int k = i; k < nfds; k++)
				close(fds[k]);
			break;
		}
		started++;
	}
	for (int i = 0; i < started; i++)
		pthread_join(ws[i].t, NULL);
	free(ws);
	free(j.pieces);
	/* Copy in: every piece of every mapping must have come. */
	for (int k = 0; !out && k < j.nseen && !atomic_load(&j.failed); k++)
		if (!atomic_load(&j.seen[k])) {
			CUdeviceptr va = 0;
			pthread_mutex_lock(&tab_mu);
			for (int i = nm - 1; i >= 0; i--)
				if (ms[i].live && j.first[i] <= k) {
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
			     atomic_load(&j.io_ns) / 1e9, started, atomic_load(&j.nstaged)};
	if (atomic_load(&j.failed)) {
		snprintf(err, n, "%s", j.err);
		return -1;
	}
	return 0;
}

/* release unmaps and releases every physical allocation; reservations,
 * handle properties and access stay recorded for remap. */
static int do_release(char *err, size_t n)
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
	released = 1;
	pthread_mutex_unlock(&tab_mu);
	return rc;
}

/* remap recreates what release took: a physical allocation per handle
 * with its properties, mapped where it was, with its access. Idempotent:
 * what is present stays. */
static int do_remap(char *err, size_t n)
{
	pthread_mutex_lock(&tab_mu);
	if (nctx)
		r_CtxSetCurrent(ctxs[0]);
	int rc = 0;
	if (fault("remap")) {
		snprintf(err, n, "injected fault (remap)");
		rc = -1;
	}
	for (int i = 0; i < nh && rc == 0; i++) {
		if (!hs[i].live || hs[i].present)
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
	}
	for (int i = 0; i < nm && rc == 0; i++) {
		struct mrec *m = &ms[i];
		if (!m->live || m->mapped)
			continue;
		CUresult r = r_Map(m->va, m->size, m->offset, hs[m->h].real, 0);
		if (r == CUDA_SUCCESS && m->nacc)
			r = r_SetAccess(m->va, m->size, m->acc, m->nacc);
		if (r != CUDA_SUCCESS) {
			snprintf(err, n, "map %#llx: CUresult %d", m->va, r);
			rc = -1;
			break;
		}
		m->mapped = 1;
	}
	/* Handles the program had released live only while mapped. */
	for (int i = 0; i < nh && rc == 0; i++)
		if (hs[i].live && hs[i].present && hs[i].app_released && hs[i].real != hs[i].app) {
			r_Release(hs[i].real);
			/* The program released its handle: no value of its names
			 * this record any more (the driver may reuse values). */
			hs[i].app = handle_seq++;
		}
	if (rc == 0) {
		released = 0;
		unfilled = 1;
	}
	pthread_mutex_unlock(&tab_mu);
	return rc;
}

/* MAXFDS: a copy takes up to 64 files (one per worker), keep their
 * directory too. */
#define MAXFDS 65
static int recv_cmd(int c, char *line, size_t n, int *fds, int *nfds)
{
	struct iovec iov = {line, n - 1};
	char ctrl[CMSG_SPACE(MAXFDS * sizeof(int))];
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctrl, .msg_controllen = sizeof ctrl};
	ssize_t r;
	do
		r = recvmsg(c, &mh, MSG_CMSG_CLOEXEC);
	while (r < 0 && errno == EINTR);
	if (r <= 0)
		return -1;
	line[r] = 0;
	*nfds = 0;
	for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
		if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
			int k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
			for (int i = 0; i < k && *nfds < MAXFDS; i++)
				memcpy(&fds[(*nfds)++], CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
		}
	char *nl = strchr(line, '\n');
	if (nl)
		*nl = 0;
	return 0;
}

/* cmd_park closes the gate, waits up to ms for calls in flight to leave it
 * and synchronizes the contexts; on failure the gate opens again. */
static int cmd_park(long ms, char *err, size_t n)
{
	if (parked) {
		snprintf(err, n, "already parked");
		return -1;
	}
	if (gate_close(ms > 0 ? ms : 10000) < 0) {
		snprintf(err, n, "threads still inside gated CUDA calls after %ld ms", ms);
		return -1;
	}
	if (sync_all(err, n) < 0 || fault("park")) {
		if (!err[0])
			snprintf(err, n, "injected fault (park)");
		gate_open();
		return -1;
	}
	parked = 1;
	return 0;
}

/* cmd_copy runs copyout or copyin over the descriptors that came with the
 * line; the workers close them (*nfds is set to 0 once they own them). */
static int cmd_copy(const char *line, int *fds, int *nfds, char *err, size_t n, struct stats *st)
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
	int rc = run_job(outdir, fds, *nfds, err, n, st);
	*nfds = 0;
	if (rc == 0 && !outdir)
		unfilled = 0;
	return rc;
}

/* ---- the kept copy, and recovery without gpucr-stream ---- */

/* say writes a decision taken on our own to stderr and, replacing what was
 * there, to preload-PID.status next to the control socket. */
static int said; /* say spoke since the last park: recover says how it ended */
static void say(const char *state, const char *fmt, ...)
{
	said = 1;
	char msg[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	fprintf(stderr, "gpucr-preload[%d]: %s: %s\n", getpid(), state, msg);
	char path[sizeof sock_name + 16], tmp[sizeof path + 8];
	size_t k = strlen(sock_name);
	if (ctl_dir_fd < 0 || k < 5 || strcmp(sock_name + k - 5, ".sock"))
		return;
	snprintf(path, sizeof path, "%.*s.status", (int)(k - 5), sock_name);
	snprintf(tmp, sizeof tmp, "%s.tmp", path);
	int fd = openat(ctl_dir_fd, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
	if (fd < 0)
		return;
	char line[1200];
	snprintf(line, sizeof line, "%s: %s\n", state, msg);
	int ok = write_all(fd, line, strlen(line)) == 0;
	close(fd);
	if (ok)
		renameat(ctl_dir_fd, tmp, ctl_dir_fd, path);
}

static void keep_close_fds(void)
{
	for (int i = 0; i < nkeep; i++)
		if (keep_fds[i] >= 0)
			close(keep_fds[i]);
	for (int i = 0; i < nkeep; i++)
		keep_fds[i] = -1;
	if (keep_dir >= 0)
		close(keep_dir);
	keep_dir = -1;
}

/* keep_clear forgets the kept copy. With rm (only when the library
 * refilled on its own: gpucr-stream is gone) it removes the kept files it
 * still holds, each only where the name in the directory it was handed
 * is that very file: nothing it is told can make it unlink anything else
 * (where it may not, root's copy, gpucr-stream's next run does). */
static void keep_clear(int rm)
{
	for (int i = 0; i < nkeep; i++) {
		const char *name = strrchr(keep_paths[i], '/');
		struct stat a, b;
		if (rm && name && keep_dir >= 0 && keep_fds[i] >= 0 && fstat(keep_fds[i], &a) == 0 &&
		    fstatat(keep_dir, name + 1, &b, AT_SYMLINK_NOFOLLOW) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino)
			unlinkat(keep_dir, name + 1, 0);
	}
	keep_close_fds();
	for (int i = 0; i < nkeep; i++) {
		free(keep_paths[i]);
		keep_paths[i] = NULL;
	}
	nkeep = 0;
	driver_next = detached = 0;
}

/* cmd_keep takes the descriptors of the kept copy, its directory first
 * then its files (the library owns them now), and learns their paths for
 * its messages. */
static int cmd_keep(int *fds, int *nfds, char *err, size_t n)
{
	if (!parked || released) {
		snprintf(err, n, "%s", parked ? "memory is released already" : "not parked");
		return -1;
	}
	if (*nfds < 2) {
		snprintf(err, n, "keep takes the kept copy's directory and its files");
		return -1;
	}
	struct stat st;
	for (int i = 0; i < *nfds; i++)
		if (fstat(fds[i], &st) < 0 || (i == 0 ? !S_ISDIR(st.st_mode) : !S_ISREG(st.st_mode))) {
			snprintf(err, n, "keep: descriptor %d is not %s", i, i == 0 ? "a directory" : "a regular file");
			return -1;
		}
	keep_clear(0);
	keep_dir = fds[0];
	fds++;
	(*nfds)--;
	for (int i = 0; i < *nfds; i++) {
		char link[64], path[4096];
		snprintf(link, sizeof link, "/proc/self/fd/%d", fds[i]);
		ssize_t k = readlink(link, path, sizeof path - 1);
		path[k > 0 ? k : 0] = 0;
		keep_fds[i] = fds[i];
		keep_paths[i] = strdup(path);
		if (!keep_paths[i])
			abort();
	}
	nkeep = *nfds;
	*nfds = 0;
	return 0;
}

/* keep_open gives copies of the kept descriptors, rewound. It never opens
 * a path: after `detach` only gpucr-stream, which keeps its own record of
 * the copy, sends them. The caller's job closes them. */
static int keep_open(int *out, char *err, size_t n)
{
	if (nkeep == 0) {
		snprintf(err, n, "no kept copy of the released memory (gpucr-stream gpu resume --pid PID --from SRC brings it from a checkpoint)");
		return -1;
	}
	if (keep_fds[0] < 0) {
		snprintf(err, n, "the kept copy's descriptors were let go before CRIU: gpucr-stream gpu resume --pid %d sends them", getpid());
		return -1;
	}
	for (int i = 0; i < nkeep; i++) {
		int fd = dup(keep_fds[i]);
		if (fd < 0 || lseek(fd, 0, SEEK_SET) < 0) {
			snprintf(err, n, "kept copy %s: %s", keep_paths[i], strerror(errno));
			for (int k = 0; k < i; k++)
				close(out[k]);
			if (fd >= 0)
				close(fd);
			return -1;
		}
		out[i] = fd;
	}
	return nkeep;
}

/* do_recover brings the memory back and lets the program run: remap if
 * released, refill from fds (else the kept copy), unpark. On failure the
 * program stays parked. It owns fds. rm: remove the kept files after
 * (on our own only: `recover` leaves that to gpucr-stream). */
static int do_recover(int *fds, int nfds, int rm, char *err, size_t n)
{
	int own[64];
	if (nfds > 64) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		snprintf(err, n, "recover with %d descriptors, want at most 64", nfds);
		return -1;
	}
	if (!parked || !(released || unfilled)) {
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		nfds = 0;
	} else {
		if (nfds == 0) {
			if ((nfds = keep_open(own, err, n)) < 0)
				return -1;
			fds = own;
		}
		if (released && do_remap(err, n) < 0) {
			for (int i = 0; i < nfds; i++)
				close(fds[i]);
			return -1;
		}
		struct stats st;
		if (run_job(0, fds, nfds, err, n, &st) < 0)
			return -1;
		unfilled = 0;
	}
	if (parked) {
		parked = 0;
		gate_open();
		/* After the gate: freeing GBs of tmpfs need not hold the
		 * program back. */
		keep_clear(rm);
		if (said)
			say("resumed", "recover: the device memory is back, the program runs on");
	}
	return 0;
}

/* on_orphan runs when the connection that parked the process ended
 * without `detach`: gpucr-stream is gone (the top of this file). */
static void on_orphan(void)
{
	char err[512] = "";
	if (driver_next) {
		say("waiting", "gpucr-stream's connection ended (gpucr-stream died?) after it handed the process to the driver's checkpoint; the program stays "
			       "paused with its device memory %s: run `gpucr-stream gpu resume --pid %d` (it restores the driver's "
			       "state, then the memory from the kept copy%s%s)",
		    released ? "released" : "in place", getpid(), nkeep ? " " : "", nkeep ? keep_paths[0] : "");
		return;
	}
	int was = released;
	if (do_recover(NULL, 0, 1, err, sizeof err) < 0) {
		say("NOT RESUMED", "gpucr-stream's connection ended (gpucr-stream died?) with the device memory released, and the kept copy cannot refill it: "
				   "%s. The program stays paused: it never runs on wrong memory",
		    err);
		return;
	}
	say("resumed", "gpucr-stream's connection ended (gpucr-stream died?) before the driver's checkpoint; %s, the program runs on",
	    was ? "the device memory was mapped again and refilled from the kept copy" : "the device memory was never released");
}

static int need_parked(char *err, size_t n)
{
	if (parked)
		return 0;
	snprintf(err, n, "not parked");
	return -1;
}

/* dispatch runs one command; *owns says whether this connection owns the
 * park (its end without `detach` is gpucr-stream's death). */
static int dispatch(const char *line, int *fds, int *nfds, char *err, size_t n, struct stats *st, int *owns)
{
	if (!strncmp(line, "park", 4)) {
		int rc = cmd_park(atol(line + 4), err, n);
		if (rc == 0) {
			*owns = 1;
			said = 0;
			keep_clear(0);
		}
		return rc;
	}
	if (!strcmp(line, "unpark")) {
		if (released || unfilled) {
			snprintf(err, n, "memory is %s: %s first", released ? "released" : "mapped again but not refilled",
				 released ? "remap and copy in" : "copy in");
			return -1;
		}
		keep_clear(0);
		unstage_all();
		parked = 0;
		gate_open();
		return 0;
	}
	if (!strcmp(line, "copyout") || !strcmp(line, "copyin"))
		return cmd_copy(line, fds, nfds, err, n, st);
	if (!strncmp(line, "stage ", 6))
		return cmd_stage(atoi(line + 6), err, n, st);
	if (!strcmp(line, "keep"))
		return cmd_keep(fds, nfds, err, n);
	if (!strcmp(line, "recover")) {
		int k = *nfds;
		*nfds = 0;
		return do_recover(fds, k, 0, err, n);
	}
	if (need_parked(err, n) < 0)
		return -1;
	if (!strcmp(line, "release")) {
		if (nkeep == 0) {
			snprintf(err, n, "no kept copy: keep comes before release");
			return -1;
		}
		return do_release(err, n);
	}
	if (!strcmp(line, "remap"))
		return do_remap(err, n);
	if (!strcmp(line, "driver")) {
		driver_next = 1;
		return 0;
	}
	if (!strcmp(line, "detach")) {
		keep_close_fds(); /* CRIU must not find them open */
		detached = 1;
		*owns = 0;
		return 0;
	}
	snprintf(err, n, "unknown command %.40s", line);
	return -1;
}

/* idle_ms bounds how long a connection that does not own the park may
 * keep the control thread waiting for its next line (it serves one
 * connection at a time): GPUCR_PRELOAD_IDLE_MS, default 60 s. The owner's
 * connection waits as long as the checkpoint's store takes. */
static long idle_ms(void)
{
	const char *e = getenv("GPUCR_PRELOAD_IDLE_MS");
	long ms = e ? atol(e) : 0;
	return ms > 0 ? ms : 60000;
}

static void set_timeout(int c, int opt, long ms)
{
	struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
	setsockopt(c, SOL_SOCKET, opt, &tv, sizeof tv);
}

static void serve_conn(int c)
{
	static char out[16384];
	char line[256], err[512];
	int fds[MAXFDS], nfds, owns = 0;
	long idle = idle_ms();
	set_timeout(c, SO_RCVTIMEO, idle);
	set_timeout(c, SO_SNDTIMEO, idle);
	while (recv_cmd(c, line, sizeof line, fds, &nfds) == 0) {
		err[0] = 0;
		struct stats st = {0};
		int rc = 0;
		if (!strcmp(line, "report"))
			cmd_report(out, sizeof out);
		else
			rc = dispatch(line, fds, &nfds, err, sizeof err, &st, &owns);
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		if (rc < 0) {
			char e[512];
			json_str(e, sizeof e, err);
			snprintf(out, sizeof out, "err %s\n", e);
		} else if (strcmp(line, "report")) {
			snprintf(out, sizeof out,
				 "ok {\"bytes\":%lld,\"workers\":%d,\"setup_s\":%.6f,\"work_s\":%.6f,\"teardown_s\":%.6f,"
				 "\"wait_s\":%.6f,\"io_s\":%.6f,\"staged\":%d}\n",
				 st.bytes, st.workers, st.setup, st.work, st.teardown, st.wait, st.io, st.staged);
		}
		if (write_all(c, out, strlen(out)) < 0)
			break;
		set_timeout(c, SO_RCVTIMEO, owns ? 0 : idle);
	}
	unstage_all();
	if (owns && parked && !detached)
		on_orphan();
}

static void *control_main(void *arg)
{
	(void)arg;
	internal = 1;
	sigset_t all;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, NULL); /* the program's signals go to its threads */
	for (;;) {
		int c = accept4(ctl_fd, NULL, NULL, SOCK_CLOEXEC);
		if (c < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			usleep(100000);
			continue;
		}
		struct ucred cr;
		socklen_t cl = sizeof cr;
		if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cr, &cl) == 0 && (cr.uid == 0 || cr.uid == geteuid()))
			serve_conn(c);
		close(c);
	}
	return NULL;
}

/* open_sock_dir opens GPUCR_PRELOAD_DIR (made 0700 if missing) without
 * following a symlink, and only if it is ours; it is then made 0700
 * through the descriptor. */
static int open_sock_dir(const char *dir)
{
	if (mkdir(dir, 0700) < 0 && errno != EEXIST)
		return -1;
	int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	struct stat st;
	if (fd < 0)
		return -1;
	if (fstat(fd, &st) < 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() ||
	    ((st.st_mode & 0777) != 0700 && fchmod(fd, 0700) < 0)) {
		close(fd);
		return -1;
	}
	return fd;
}

static void start_control(void)
{
	if (atomic_exchange(&ctl_started, 1))
		return;
	const char *dir = getenv("GPUCR_PRELOAD_DIR");
	if (!dir || !*dir)
		dir = "/run/gpucr-stream";
	int dfd = open_sock_dir(dir);
	if (dfd < 0)
		return;
	/* Named by our pid as we see it: gpucr-stream, maybe in another pid
	 * namespace, finds it by the NSpid of /proc/PID/status. */
	snprintf(sock_name, sizeof sock_name, "preload-%d.sock", getpid());
	/* Bound by its path (CRIU binds a restored socket to the address it
	 * was bound to), then checked to be in the directory held open. */
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	if (snprintf(a.sun_path, sizeof a.sun_path, "%s/%s", dir, sock_name) >= (int)sizeof a.sun_path) {
		close(dfd);
		return;
	}
	snprintf(sock_path, sizeof sock_path, "%s", a.sun_path);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		close(dfd);
		return;
	}
	/* The socket's mode before bind is the file's (less the umask). */
	fchmod(fd, 0600);
	unlinkat(dfd, sock_name, 0);
	struct stat st;
	if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || fstatat(dfd, sock_name, &st, AT_SYMLINK_NOFOLLOW) < 0 ||
	    !S_ISSOCK(st.st_mode) || ((st.st_mode & 0777) != 0600 && fchmodat(dfd, sock_name, 0600, 0) < 0) || listen(fd, 4) < 0) {
		close(fd);
		close(dfd);
		return;
	}
	ctl_fd = fd;
	ctl_dir_fd = dfd;
	/* The thread is created with every signal blocked, so none of the
	 * program's signals lands on it. */
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	pthread_attr_t at;
	pthread_attr_init(&at);
	pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
	if (pthread_create(&ctl_thread, &at, control_main, NULL) != 0) {
		close(fd);
		ctl_fd = -1;
		unlinkat(dfd, sock_name, 0);
		close(dfd);
		ctl_dir_fd = -1;
	}
	pthread_attr_destroy(&at);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* A forked child has none of the parent's CUDA state or threads: it starts
 * over, and gets its own control socket if it uses CUDA itself. */
static void atfork_child(void)
{
	atomic_store(&ctl_started, 0);
	atomic_store(&cuda_ready, 0);
	ctl_fd = -1;
	if (ctl_dir_fd >= 0)
		close(ctl_dir_fd);
	ctl_dir_fd = -1;
	nh = nm = no = nctx = 0;
	parked = released = unfilled = said = 0;
	keep_clear(0);
	incapable[0] = 0;
	atomic_store(&wrapped, 0);
	atomic_store(&gate_closed, 0);
	atomic_store(&gate_inflight, 0);
	pthread_mutex_init(&tab_mu, NULL);
	pthread_mutex_init(&init_mu, NULL);
	pthread_mutex_init(&gate_mu, NULL);
}

__attribute__((constructor)) static void preload_init(void)
{
	pthread_once(&dlsym_once, init_dlsym);
	pthread_atfork(NULL, NULL, atfork_child);
	/* A program linked against libcuda has it loaded already. */
	ensure_cuda();
}

__attribute__((destructor)) static void preload_fini(void)
{
	if (ctl_fd >= 0 && ctl_dir_fd >= 0)
		unlinkat(ctl_dir_fd, sock_name, 0);
}
