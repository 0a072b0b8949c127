/*
 * init: the driver's entry points this library calls itself (bound once
 * the program has loaded libcuda.so.1), the state every room shares, and
 * the library's load, a fork and its unload.
 */
#include "internal.h"

/* ---- real entry points this library calls itself ---- */
void *(*real_dlsym)(void *, const char *);
CUresult (*r_GetProcAddress)(const char *, void **, int, unsigned long long);
CUresult (*r_GetProcAddress_v2)(const char *, void **, int, unsigned long long, int *);
CUresult (*r_MemAlloc)(CUdeviceptr *, size_t);
CUresult (*r_MemAllocPitch)(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
CUresult (*r_MemFree)(CUdeviceptr);
CUresult (*r_AddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult (*r_AddressFree)(CUdeviceptr, size_t);
CUresult (*r_Create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult (*r_Release)(CUmemGenericAllocationHandle);
CUresult (*r_Map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult (*r_Unmap)(CUdeviceptr, size_t);
CUresult (*r_SetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
CUresult (*r_RetainHandle)(CUmemGenericAllocationHandle *, void *);
CUresult (*r_PropsFromHandle)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
CUresult (*r_Granularity)(size_t *, const CUmemAllocationProp *, int);
CUresult (*r_CtxGetCurrent)(CUcontext *);
CUresult (*r_CtxSetCurrent)(CUcontext);
CUresult (*r_CtxGetDevice)(CUdevice *);
CUresult (*r_CtxSynchronize)(void);
CUresult (*r_FuncGetName)(const char **, void *);
CUresult (*r_Export)(void *, CUmemGenericAllocationHandle, int, unsigned long long);
CUresult (*r_Import)(CUmemGenericAllocationHandle *, void *, int, unsigned long long);
CUresult (*r_HostAlloc)(void **, size_t, unsigned);
CUresult (*r_FreeHost)(void *);
CUresult (*r_HostRegister)(void *, size_t, unsigned);
CUresult (*r_HostUnregister)(void *);
CUresult (*r_StreamCreate)(CUstream *, unsigned);
CUresult (*r_StreamDestroy)(CUstream);
CUresult (*r_StreamSync)(CUstream);
CUresult (*r_DtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
CUresult (*r_HtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
CUresult (*r_MemGetInfo)(size_t *, size_t *);
CUresult (*r_MemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
CUresult (*r_MemsetD32Async)(CUdeviceptr, unsigned, size_t, CUstream);

/* ---- state ---- */
pthread_mutex_t tab_mu = PTHREAD_MUTEX_INITIALIZER;
void *libcuda;
/* Why the process is not fast-path capable: written once, by the first
 * mark_incapable, which may run with tab_mu held (so it has a lock of its
 * own), and read only once incapable_set says it is whole. */
static char incapable_why[512];
static atomic_int incapable_set;
static pthread_mutex_t incapable_mu = PTHREAD_MUTEX_INITIALIZER;
atomic_int wrapped;  /* entry points handed out wrapped */
__thread int internal; /* control thread and workers: no gate */

/* trace_on: GPUCR_PRELOAD_TRACE is set: every reason the process is not
 * fast-path capable, not only the first that the report keeps, and what
 * the driver was asked to allocate, go to stderr (what a job shares and
 * where is found this way). */
int trace_on(void)
{
	static int on = -1;
	if (on < 0)
		on = getenv("GPUCR_PRELOAD_TRACE") != NULL;
	return on;
}

void trace(const char *fmt, ...)
{
	if (!trace_on())
		return;
	char line[600];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line, sizeof line, fmt, ap);
	va_end(ap);
	fprintf(stderr, "gpucr-preload[%d]: %s\n", (int)getpid(), line);
}

void mark_incapable(const char *fmt, ...)
{
	char why[sizeof incapable_why];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(why, sizeof why, fmt, ap);
	va_end(ap);
	trace("incapable: %s", why);
	pthread_mutex_lock(&incapable_mu);
	if (!atomic_load(&incapable_set)) {
		memcpy(incapable_why, why, sizeof why);
		atomic_store(&incapable_set, 1);
	}
	pthread_mutex_unlock(&incapable_mu);
}

/* incapable: why the process is not fast-path capable, or NULL. */
const char *incapable(void)
{
	return atomic_load(&incapable_set) ? incapable_why : NULL;
}

/* ---- init ---- */
pthread_once_t dlsym_once = PTHREAD_ONCE_INIT;
void init_dlsym(void)
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
int ensure_cuda(void)
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
	memset(&kept_scan, 0, sizeof kept_scan); /* the parent's */
	cache_reset();
	bases_reset();
	kernels_forget();
	atomic_store(&incapable_set, 0);
	pthread_mutex_init(&incapable_mu, NULL);
	atomic_store(&wrapped, 0);
	gate_reset();
	pthread_mutex_init(&tab_mu, NULL);
	pthread_mutex_init(&init_mu, NULL);
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
