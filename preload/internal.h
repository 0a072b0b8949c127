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
 *    copyout (fds by SCM_RIGHTS), release, remap, copyin (fds), unpark; peek
 *    (fds) copies the memory out while the program runs (a migration's
 *    pre-copy round). The
 *    data format of copyout/copyin is in docs/PRODUCERS.md ("VRAM files");
 *    a copy answers with where its time went. The directory must be ours
 *    and no symlink; it is held open and the socket and the status file are
 *    made through it. PID is ours as we see it (gpucr-stream in another pid
 *    namespace reads our NSpid). One connection is served at a time; one
 *    that does not own the park waits at most GPUCR_PRELOAD_IDLE_MS for its
 *    next line (default 60 s). Nothing a client says makes the library open
 *    or unlink a path (docs/THREATS.md, "The GPU fast path across users").
 *
 * The library is one file per room; this header is what they share:
 *
 *   init.c         the real driver's entry points, the library's load, fork
 *   gate.c         quiescence: the gate every work-submitting call passes
 *   bookkeeping.c  handles, mappings and our allocations; release, remap
 *   wrappers.c     the interposed entry points, dlsym, cuGetProcAddress
 *   control.c      the control socket and its protocol (the order of a
 *                  checkpoint and a restore)
 *   copy.c         copy workers: staged pinned buffers, copy out and in
 *   devhash.c      the device kernels (block hashes, zero blocks), and
 *                  `devhash`
 *   written.c      which blocks are written: the zero scan, and the device
 *                  ranges the program marks as caches (gpucr_mark_cache)
 *   recover.c      the kept copy, and recovery without gpucr-stream
 *   fill.c         the handle table, a restore's filler, and adopt
 *
 * Nothing declared here is exported: the library's interface is the
 * driver's entry points in wrappers.c (and dlsym), the two functions of
 * written.c a program calls itself, gpucr_mark_cache and
 * gpucr_unmark_cache, and fill.c's gpucr_fill, which only gpucr-stream's
 * filler calls.
 */
#ifndef GPUCR_PRELOAD_INTERNAL_H
#define GPUCR_PRELOAD_INTERNAL_H

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

/* Shared between the files, hidden from the program. */
#pragma GCC visibility push(hidden)

/* ---- init.c: real entry points this library calls itself ---- */
extern void *(*real_dlsym)(void *, const char *);
extern CUresult (*r_GetProcAddress)(const char *, void **, int, unsigned long long);
extern CUresult (*r_GetProcAddress_v2)(const char *, void **, int, unsigned long long, int *);
extern CUresult (*r_MemAlloc)(CUdeviceptr *, size_t);
extern CUresult (*r_MemAllocPitch)(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
extern CUresult (*r_MemFree)(CUdeviceptr);
extern CUresult (*r_AddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
extern CUresult (*r_AddressFree)(CUdeviceptr, size_t);
extern CUresult (*r_Create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
extern CUresult (*r_Release)(CUmemGenericAllocationHandle);
extern CUresult (*r_Map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
extern CUresult (*r_Unmap)(CUdeviceptr, size_t);
extern CUresult (*r_SetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
extern CUresult (*r_RetainHandle)(CUmemGenericAllocationHandle *, void *);
extern CUresult (*r_PropsFromHandle)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
extern CUresult (*r_Granularity)(size_t *, const CUmemAllocationProp *, int);
extern CUresult (*r_CtxGetCurrent)(CUcontext *);
extern CUresult (*r_CtxSetCurrent)(CUcontext);
extern CUresult (*r_CtxGetDevice)(CUdevice *);
extern CUresult (*r_CtxSynchronize)(void);
extern CUresult (*r_FuncGetName)(const char **, void *);
extern CUresult (*r_Export)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
extern CUresult (*r_Import)(CUmemGenericAllocationHandle *, void *, int, unsigned long long);
extern CUresult (*r_HostAlloc)(void **, size_t, unsigned);
extern CUresult (*r_FreeHost)(void *);
extern CUresult (*r_HostRegister)(void *, size_t, unsigned);
extern CUresult (*r_HostUnregister)(void *);
extern CUresult (*r_StreamCreate)(CUstream *, unsigned);
extern CUresult (*r_StreamDestroy)(CUstream);
extern CUresult (*r_StreamSync)(CUstream);
extern CUresult (*r_DtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
extern CUresult (*r_HtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
extern CUresult (*r_MemGetInfo)(size_t *, size_t *);
extern CUresult (*r_MemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
extern CUresult (*r_MemsetD32Async)(CUdeviceptr, unsigned, size_t, CUstream);
extern void *libcuda;
extern pthread_mutex_t tab_mu; /* guards bookkeeping.c's tables */
extern atomic_int wrapped;     /* entry points handed out wrapped */
extern __thread int internal;  /* control thread and workers: no gate */
extern pthread_once_t dlsym_once;
void init_dlsym(void);
int ensure_cuda(void);
void mark_incapable(const char *fmt, ...);
const char *incapable(void);
int trace_on(void);
void trace(const char *fmt, ...);

/* ---- gate.c ---- */
void gate_enter(void);
void gate_leave(void);
int gate_close(long ms);
void gate_open(void);
void gate_reset(void);
void collective_enter(void *f);
long long collective_hold(void);
long long collectives_launched(void);
int collective_until(long long n, long ms, long long *launched);
void collective_release(void);

/* ---- bookkeeping.c: handles and mappings ---- */
struct hrec {
	int live;
	int own;          /* backs one of our cuMemAlloc allocations */
	int app_released; /* the program released it (it lives while mapped) */
	int present;      /* physical memory exists now */
	CUmemGenericAllocationHandle app, real;
	size_t size;
	CUmemAllocationProp prop;
	/* imported: from another process's shareable handle (its memory, not
	 * ours: never copied; released with the rest, imported again after a
	 * remap by `import`). src_pid, src_h: whose, and that process's
	 * handle record, as gpucr-stream matched them (`source`). */
	int imported, src_pid, src_h;
};
/* A shareable descriptor the program exported or imported, the library's
 * own duplicate of it: gpucr-stream matches an import to its export by
 * comparing the two (kcmp), while both exist (until the release). */
struct srec {
	int live;
	int h; /* index into hs */
	int fd;
	int import;
};
struct mrec {
	int live;
	int mapped;
	CUdeviceptr va;
	/* at: where a filler (fill.c) mapped what the restored process maps
	 * at va; 0 everywhere else (mapped_at). */
	CUdeviceptr at;
	size_t size, offset;
	int h; /* index into hs */
	CUmemAccessDesc acc[4];
	int nacc;
	CUcontext ctx;
};
static inline CUdeviceptr mapped_at(const struct mrec *m) { return m->at ? m->at : m->va; }
struct orec { /* our cuMemAlloc: one reservation, one handle, one mapping */
	int live;
	CUdeviceptr va;
	size_t size;
	int h, m;
};
extern struct hrec *hs;
extern int nh;
extern struct mrec *ms;
extern int nm;
extern struct orec *os_;
extern int no;
extern CUcontext ctxs[16];
extern int nctx;
extern int parked, released;
/* unfilled: memory was mapped again but not yet copied in: the program
 * must not run on it. */
extern int unfilled;
extern U handle_seq; /* handles we give out for ours: never used by the app */
extern struct srec *ss;
extern int nsh;
int new_s(void);
void note_shared(int h, int fd, int import);
void close_shared(void);
int imports_pending(void);
int do_import(int h, int fd, char *err, size_t n);
int import_as(int h, int fd, char *err, size_t n);
int new_h(void);
int new_m(void);
int new_o(void);
int find_h_app(CUmemGenericAllocationHandle app);
void note_ctx(void);
CUcontext cur_ctx(void);
void drop_h_if_unused(int h);
int do_release(char *err, size_t n);
int do_remap(char *err, size_t n);

/* ---- wrappers.c ---- */
void resolve_real(void);

/* ---- control.c ---- */
extern int ctl_fd;
extern int ctl_dir_fd;
extern char sock_name[64]; /* preload-PID.sock in ctl_dir_fd */
extern atomic_int ctl_started;
/* MAXFDS: a copy takes up to 64 files (one per worker), keep their
 * directory too. */
#define MAXFDS 65
int recv_cmd(int c, char *line, size_t n, int *fds, int *nfds);
void start_control(void);
int write_all(int fd, const void *b, size_t n);
int read_full(int fd, void *b, size_t n);
int fault(const char *step);
void json_str(char *out, size_t n, const char *s);

/* ---- copy.c ---- */
/* What a copy out left behind of the allocated memory (written.c's scan),
 * and what a copy in set with memsets instead of copies. */
struct written_stats {
	long long allocated, zero, cached;
	long long earlier; /* stored, not copied: an earlier checkpoint holds it (dedup.c) */
	double scan;
	char scan_err[160]; /* the scan failed: everything was copied */
};
/* What a command answers with besides ok: a copy's bytes and where its
 * time went (seconds; wait and io are summed over the workers). */
struct stats {
	long long bytes;
	double setup, work, teardown, wait, io;
	int workers, staged;
	long long collectives; /* collhold, colluntil: launched so far */
	struct written_stats w;
};
int run_job(int out, int live, int *fds, int nfds, char *err, size_t n, struct stats *st);
int cmd_stage(int k, char *err, size_t n, struct stats *st);
int cmd_copy(const char *line, int *fds, int *nfds, char *err, size_t n, struct stats *st);
int cmd_peek(int *fds, int *nfds, char *err, size_t n, struct stats *st);
void unstage_all(void);
int staged_count(void);
/* copied: mapping i is one of the process's own memory, which the VRAM
 * files hold (an imported one is its exporter's). Under tab_mu. */
int copied(int i);
void answer(char *out, size_t n, int rc, const char *err, const struct stats *st);

/* ---- fill.c: the handle table, the filler, adoption ---- */
int cmd_handles(int *fds, int nfds, char *out, size_t outn, char *err, size_t n);
int cmd_adopt(int from, int *fds, int nfds, char *out, size_t outn, char *err, size_t n);

/* ---- devhash.c: the device kernels, block hashes on the device ---- */
int cmd_devhash(const char *args, char *out, size_t outn, char *err, size_t n);
/* One mapping's block hashes: 2 words a block (devhash.h's lanes). */
struct dhmap {
	CUdeviceptr va;
	size_t n;
	CUcontext ctx;
	uint64_t *h;
	size_t nblk;
};
int hash_maps(uint64_t block, uint64_t key, struct dhmap **out, long long *bytes, long long *blocks, int *contexts,
	      double *load, double *kern, double *fetch, char *err, size_t n);
void free_maps(struct dhmap *m, int k);
/* kernel_fn finds kernel name ("gpucr_hash", "gpucr_zero") of the
 * library's module in context ctx, loading the module once per context. */
int kernel_fn(CUcontext ctx, const char *name, void **fn, char *err, size_t n);
CUresult kernel_launch(void *fn, unsigned grid, CUstream st, void **params);
void kernels_load(void);
void kernels_forget(void);

/* ---- written.c: the zero scan and the marked caches ---- */
/* One mapping's blocks as a scan found them: what[b] is BLK_STORE,
 * BLK_ZERO (all zero) or BLK_CACHED (written, inside a range the program
 * marked as a cache); both of the latter are not stored. BLK_EARLIER
 * (dedup.c): stored, but an earlier checkpoint holds it already, so the
 * copy out leaves its place in the file a hole and gpucr-stream fills it
 * from there. */
enum { BLK_STORE = 0, BLK_ZERO = 1, BLK_CACHED = 2, BLK_EARLIER = 3 };
struct wmap {
	CUdeviceptr va;
	size_t size;
	CUcontext ctx;
	unsigned char *what;
	size_t nblk;
};
struct crange {
	CUdeviceptr va;
	size_t n;
};
struct scan {
	int valid;
	size_t block;
	struct wmap *m;
	int k;
	struct crange *marks; /* the marks when it ran, sorted */
	int nmarks;
	struct written_stats w;
};
extern struct scan kept_scan; /* `scan`'s, for the next copy out while parked */
size_t zero_block(void);
int scan_run(int live, struct scan *s);
void scan_free(struct scan *s);
const struct wmap *scan_find(const struct scan *s, CUdeviceptr va, size_t size);
void scan_unmark(const struct scan *s, void *buf, CUdeviceptr va, size_t len);
int cmd_scan(char *out, size_t outn, char *err, size_t n);
void cache_forget(CUdeviceptr va, size_t n);
long long cached_bytes(int *ranges);
void cache_reset(void);

/* ---- dedup.c: blocks an earlier checkpoint holds ---- */
int cmd_hashes(const char *args, int *fds, int nfds, char *out, size_t outn, char *err, size_t n);
int cmd_skip(int *fds, int nfds, char *out, size_t outn, char *err, size_t n);
int cmd_bases(const char *args, char *out, size_t outn, char *err, size_t n);
int cmd_based(const char *args, char *err, size_t n);
int blk_in_file(unsigned char what); /* BLK_STORE or BLK_EARLIER: its bytes are in the VRAM file */
void bases_reset(void);
/* kept_delta: the last copy out left the blocks an earlier checkpoint
 * holds out of the kept copy: it cannot refill the memory alone. */
extern int kept_delta;

/* ---- recover.c: the kept copy ---- */
extern int said;
extern int nkeep;
extern char *keep_paths[64];
extern int driver_next, detached;
void keep_close_fds(void);
void keep_clear(int rm);
int cmd_keep(int *fds, int *nfds, char *err, size_t n);
int do_recover(int *fds, int nfds, int rm, char *err, size_t n);
void run_again(void);
void on_orphan(void);

#pragma GCC visibility pop

#endif
