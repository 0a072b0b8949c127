/*
 * devhash: the library's device kernels, and the block hashes of the
 * process's device memory computed on the device, to find which memory
 * changed since a copy without moving it (issue 22: hashing on the device
 * against copying at bus speed and hashing on the host). The kernels are
 * PTX text loaded once into each context with the driver API (no CUDA
 * headers, no toolkit: the driver compiles it): gpucr_hash (devhash.h
 * defines the hash and computes it on the host) and gpucr_zero, which
 * finds the all-zero blocks a copy out leaves behind (written.c).
 *
 * `devhash BLOCK KEY [check]`, parked (nothing runs, nothing is released):
 * every mapping of the process's own memory (what a copy out copies) is
 * cut into blocks of BLOCK bytes from its start, and each block hashed into
 * two 64-bit lanes by one CTA of 256 threads (each thread sums its words'
 * terms, a warp's sums are added by shuffles, the eight warps' in shared
 * memory). The answer says how long the load, the kernels and the fetch of
 * the hashes took, a digest of all of them, and, against the previous
 * call's (same BLOCK and KEY; mappings matched by address and size), how
 * many bytes changed. With `check`, every block is also copied to the host
 * and hashed there: the blocks whose hashes differ are counted (a wrong
 * kernel, or a wrong driver), and the time the copy and the host's hash
 * took is the other way's, measured beside it.
 */
#include "internal.h"
#include "devhash.h"

typedef void *CUmodule;
typedef void *CUfunction;

/* The kernel gpucr_hash(ptr, nwords, bwords, key, out): CTA k hashes words
 * [k*bwords, min((k+1)*bwords, nwords)) of ptr into out[2k], out[2k+1].
 * The constants of devhash.h are written as signed decimals (the low 64
 * bits of a product are the same either way), as nvcc writes them. */
#define FMIX(X, T, S1, M1, S2, M2, S3)                                    \
	"shr.u64 " T ", " X ", " S1 ";\n xor.b64 " X ", " X ", " T ";\n"     \
	"mul.lo.s64 " X ", " X ", " M1 ";\n"                                  \
	"shr.u64 " T ", " X ", " S2 ";\n xor.b64 " X ", " X ", " T ";\n"     \
	"mul.lo.s64 " X ", " X ", " M2 ";\n"                                  \
	"shr.u64 " T ", " X ", " S3 ";\n xor.b64 " X ", " X ", " T ";\n"
#define SHFL(ACC, OFF)                                                    \
	"mov.b64 {%r4, %r5}, " ACC ";\n"                                      \
	"shfl.sync.bfly.b32 %r6, %r4, " OFF ", 31, -1;\n"                     \
	"shfl.sync.bfly.b32 %r7, %r5, " OFF ", 31, -1;\n"                     \
	"mov.b64 %rd20, {%r6, %r7};\n add.u64 " ACC ", " ACC ", %rd20;\n"
#define WARP_SUM(ACC) SHFL(ACC, "16") SHFL(ACC, "8") SHFL(ACC, "4") SHFL(ACC, "2") SHFL(ACC, "1")

/* The kernel gpucr_zero(ptr, nwords, bwords, out): CTA k ORs words
 * [k*bwords, min((k+1)*bwords, nwords)) of ptr, each thread its share, the
 * CTA's threads' results by a barrier reduction (bar.red.or), and writes
 * out[k] = 1 if any word is not zero, else 0. One byte a block: a 141 GB
 * device in 64 KiB blocks sends 2.2 MB to the host. */
static const char ptx[] =
	".version 7.0\n"
	".target sm_70\n"
	".address_size 64\n"
	".visible .entry gpucr_zero(.param .u64 p_ptr, .param .u64 p_nwords, .param .u64 p_bwords, .param .u64 p_out)\n"
	"{\n"
	".reg .pred %p<4>;\n"
	".reg .b32 %r<8>;\n"
	".reg .b64 %rd<20>;\n"
	"ld.param.u64 %rd1, [p_ptr];\n"
	"ld.param.u64 %rd2, [p_nwords];\n"
	"ld.param.u64 %rd3, [p_bwords];\n"
	"ld.param.u64 %rd5, [p_out];\n"
	"cvta.to.global.u64 %rd1, %rd1;\n"
	"cvta.to.global.u64 %rd5, %rd5;\n"
	"mov.u32 %r1, %ctaid.x;\n"
	"mov.u32 %r2, %tid.x;\n"
	"mov.u32 %r3, %ntid.x;\n"
	"cvt.u64.u32 %rd6, %r1;\n"
	"mul.lo.u64 %rd7, %rd6, %rd3;\n" /* base */
	"add.u64 %rd8, %rd7, %rd3;\n"
	"min.u64 %rd8, %rd8, %rd2;\n"
	"sub.u64 %rd8, %rd8, %rd7;\n" /* words in this block */
	"cvt.u64.u32 %rd9, %r2;\n"
	"cvt.u64.u32 %rd10, %r3;\n"
	"shl.b64 %rd11, %rd7, 3;\n"
	"add.u64 %rd11, %rd1, %rd11;\n"
	"mov.u64 %rd12, 0;\n"
	"$Lzloop:\n"
	"setp.ge.u64 %p1, %rd9, %rd8;\n"
	"@%p1 bra $Lzdone;\n"
	"shl.b64 %rd14, %rd9, 3;\n"
	"add.u64 %rd14, %rd11, %rd14;\n"
	"ld.global.nc.u64 %rd15, [%rd14];\n"
	"or.b64 %rd12, %rd12, %rd15;\n"
	"add.u64 %rd9, %rd9, %rd10;\n"
	"bra $Lzloop;\n"
	"$Lzdone:\n"
	"setp.ne.u64 %p2, %rd12, 0;\n"
	"bar.red.or.pred %p3, 0, %p2;\n"
	"setp.ne.u32 %p1, %r2, 0;\n"
	"@%p1 bra $Lzend;\n"
	"selp.u32 %r4, 1, 0, %p3;\n"
	"add.u64 %rd13, %rd5, %rd6;\n"
	"st.global.u8 [%rd13], %r4;\n"
	"$Lzend:\n"
	"ret;\n"
	"}\n"
	".shared .align 8 .b64 gpucr_red[64];\n"
	".visible .entry gpucr_hash(.param .u64 p_ptr, .param .u64 p_nwords, .param .u64 p_bwords,\n"
	"                           .param .u64 p_key, .param .u64 p_out)\n"
	"{\n"
	".reg .pred %p<4>;\n"
	".reg .b32 %r<12>;\n"
	".reg .b64 %rd<32>;\n"
	"ld.param.u64 %rd1, [p_ptr];\n"
	"ld.param.u64 %rd2, [p_nwords];\n"
	"ld.param.u64 %rd3, [p_bwords];\n"
	"ld.param.u64 %rd4, [p_key];\n"
	"ld.param.u64 %rd5, [p_out];\n"
	"cvta.to.global.u64 %rd1, %rd1;\n"
	"cvta.to.global.u64 %rd5, %rd5;\n"
	"mov.u32 %r1, %ctaid.x;\n"
	"mov.u32 %r2, %tid.x;\n"
	"mov.u32 %r3, %ntid.x;\n"
	"cvt.u64.u32 %rd6, %r1;\n"
	"mul.lo.u64 %rd7, %rd6, %rd3;\n" /* base */
	"add.u64 %rd8, %rd7, %rd3;\n"
	"min.u64 %rd8, %rd8, %rd2;\n"
	"sub.u64 %rd8, %rd8, %rd7;\n" /* words in this block */
	"cvt.u64.u32 %rd9, %r2;\n"    /* i, from the block's start */
	"cvt.u64.u32 %rd10, %r3;\n"
	"shl.b64 %rd11, %rd7, 3;\n"
	"add.u64 %rd11, %rd1, %rd11;\n"
	"mov.u64 %rd12, 0;\n"
	"mov.u64 %rd13, 0;\n"
	"$Lloop:\n"
	"setp.ge.u64 %p1, %rd9, %rd8;\n"
	"@%p1 bra $Ldone;\n"
	"shl.b64 %rd14, %rd9, 3;\n"
	"add.u64 %rd14, %rd11, %rd14;\n"
	"ld.global.nc.u64 %rd15, [%rd14];\n"
	"mul.lo.s64 %rd16, %rd9, -7046029254386353131;\n"
	"add.u64 %rd16, %rd16, %rd4;\n"
	"xor.b64 %rd16, %rd16, %rd15;\n"
	FMIX("%rd16", "%rd17", "33", "-49064778989728563", "33", "-4265267296055464877", "33")
	"add.u64 %rd12, %rd12, %rd16;\n"
	"mul.lo.s64 %rd18, %rd9, -2960836687051489901;\n"
	"add.u64 %rd18, %rd18, %rd15;\n"
	"xor.b64 %rd18, %rd18, %rd4;\n"
	FMIX("%rd18", "%rd17", "30", "-4658895280553007687", "27", "-7723592293110705685", "31")
	"add.u64 %rd13, %rd13, %rd18;\n"
	"add.u64 %rd9, %rd9, %rd10;\n"
	"bra $Lloop;\n"
	"$Ldone:\n"
	WARP_SUM("%rd12")
	WARP_SUM("%rd13")
	"and.b32 %r8, %r2, 31;\n"
	"shr.u32 %r9, %r2, 5;\n"
	"mov.u64 %rd21, gpucr_red;\n"
	"setp.ne.u32 %p2, %r8, 0;\n"
	"@%p2 bra $Lwarped;\n"
	"mul.wide.u32 %rd22, %r9, 16;\n"
	"add.u64 %rd22, %rd21, %rd22;\n"
	"st.shared.u64 [%rd22], %rd12;\n"
	"st.shared.u64 [%rd22+8], %rd13;\n"
	"$Lwarped:\n"
	"bar.sync 0;\n"
	"setp.ne.u32 %p3, %r2, 0;\n"
	"@%p3 bra $Lend;\n"
	"shr.u32 %r10, %r3, 5;\n" /* warps */
	"mov.u64 %rd12, 0;\n"
	"mov.u64 %rd13, 0;\n"
	"mov.u32 %r11, 0;\n"
	"$Lsum:\n"
	"ld.shared.u64 %rd23, [%rd21];\n"
	"ld.shared.u64 %rd24, [%rd21+8];\n"
	"add.u64 %rd12, %rd12, %rd23;\n"
	"add.u64 %rd13, %rd13, %rd24;\n"
	"add.u64 %rd21, %rd21, 16;\n"
	"add.u32 %r11, %r11, 1;\n"
	"setp.lt.u32 %p1, %r11, %r10;\n"
	"@%p1 bra $Lsum;\n"
	"shl.b64 %rd25, %rd6, 4;\n"
	"add.u64 %rd25, %rd5, %rd25;\n"
	"st.global.u64 [%rd25], %rd12;\n"
	"st.global.u64 [%rd25+8], %rd13;\n"
	"$Lend:\n"
	"ret;\n"
	"}\n";

#define THREADS 256
#define CU_JIT_ERROR_LOG_BUFFER 5
#define CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES 6

static CUresult (*r_ModuleLoadDataEx)(CUmodule *, const void *, unsigned, int *, void **);
static CUresult (*r_ModuleGetFunction)(CUfunction *, CUmodule, const char *);
static CUresult (*r_ModuleUnload)(CUmodule);
static CUresult (*r_Launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
			    CUstream, void **, void **);

/* prev holds the last call's blocks, for "changed". */
static struct dhmap *prev;
static int nprev;
static uint64_t prev_block, prev_key;

static double mono(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

void free_maps(struct dhmap *m, int k)
{
	for (int i = 0; i < k; i++)
		free(m[i].h);
	free(m);
}

static int by_va(const void *a, const void *b)
{
	CUdeviceptr x = ((const struct dhmap *)a)->va, y = ((const struct dhmap *)b)->va;
	return x < y ? -1 : x > y;
}

/* The library's module, loaded once into each context (a load compiles
 * the PTX: tens of milliseconds the first time in a process, so `stage`
 * loads it while the program still runs). Modules are part of the
 * context: they survive the driver's checkpoint and restore. */
static struct {
	CUcontext ctx;
	CUmodule mod;
} kmods[16];
static int nkmods;
static pthread_mutex_t kmu = PTHREAD_MUTEX_INITIALIZER;

static int resolve(char *err, size_t n);

int kernel_fn(CUcontext ctx, const char *name, void **fn, char *err, size_t n)
{
	if (resolve(err, n) < 0)
		return -1;
	pthread_mutex_lock(&kmu);
	CUmodule mod = NULL;
	for (int i = 0; i < nkmods && !mod; i++)
		if (kmods[i].ctx == ctx)
			mod = kmods[i].mod;
	CUresult r = CUDA_SUCCESS;
	if (!mod) {
		char log[2048] = "";
		int opt[2] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
		void *val[2] = {log, (void *)(uintptr_t)sizeof log};
		if (ctx)
			r_CtxSetCurrent(ctx);
		if ((r = r_ModuleLoadDataEx(&mod, ptx, 2, opt, val)) != CUDA_SUCCESS) {
			pthread_mutex_unlock(&kmu);
			snprintf(err, n, "load the library's kernels: CUresult %d: %.300s", r, log);
			return -1;
		}
		if (nkmods < 16) { /* always: the library tracks at most 16 contexts */
			kmods[nkmods].ctx = ctx;
			kmods[nkmods++].mod = mod;
		}
	}
	r = r_ModuleGetFunction((CUfunction *)fn, mod, name);
	pthread_mutex_unlock(&kmu);
	if (r != CUDA_SUCCESS) {
		snprintf(err, n, "the kernel %s: CUresult %d", name, r);
		return -1;
	}
	return 0;
}

CUresult kernel_launch(void *fn, unsigned grid, CUstream st, void **params)
{
	return r_Launch(fn, grid, 1, 1, THREADS, 1, 1, 0, st, params, NULL);
}

/* kernels_load loads the module into every context now (best effort). */
void kernels_load(void)
{
	char err[400];
	void *fn;
	for (int c = 0; c < nctx; c++)
		kernel_fn(ctxs[c], "gpucr_zero", &fn, err, sizeof err);
}

/* kernels_forget: a forked child has none of the parent's contexts. */
void kernels_forget(void)
{
	nkmods = 0;
	pthread_mutex_init(&kmu, NULL);
}

/* hash_ctx hashes the maps of context ctx on its device into their h. */
static int hash_ctx(CUcontext ctx, struct dhmap *m, int k, uint64_t block, uint64_t key, double *load, double *kern,
		    double *fetch, char *err, size_t n)
{
	void *fn;
	CUdeviceptr out = 0;
	CUresult r;
	size_t total = 0;
	int rc = -1;
	double t0 = mono();
	if (kernel_fn(ctx, "gpucr_hash", &fn, err, n) < 0)
		return -1;
	if (ctx)
		r_CtxSetCurrent(ctx);
	for (int i = 0; i < k; i++)
		if (m[i].ctx == ctx)
			total += m[i].nblk;
	if ((r = r_MemAlloc(&out, total ? total * 16 : 16)) != CUDA_SUCCESS) {
		snprintf(err, n, "devhash: %zu bytes for the hashes: CUresult %d", total * 16, r);
		goto out;
	}
	double t1 = mono();
	*load += t1 - t0;
	size_t at = 0;
	for (int i = 0; i < k; i++) {
		if (m[i].ctx != ctx)
			continue;
		uint64_t nwords = m[i].n / 8, bwords = block / 8, key_ = key;
		CUdeviceptr ptr = m[i].va, dst = out + at * 16;
		void *params[] = {&ptr, &nwords, &bwords, &key_, &dst};
		if ((r = kernel_launch(fn, (unsigned)m[i].nblk, NULL, params)) != CUDA_SUCCESS) {
			snprintf(err, n, "devhash: launch over %#llx+%zu: CUresult %d", m[i].va, m[i].n, r);
			goto out;
		}
		at += m[i].nblk;
	}
	if ((r = r_CtxSynchronize()) != CUDA_SUCCESS) {
		snprintf(err, n, "devhash: the kernels: CUresult %d", r);
		goto out;
	}
	double t2 = mono();
	*kern += t2 - t1;
	at = 0;
	for (int i = 0; i < k; i++) {
		if (m[i].ctx != ctx)
			continue;
		if ((r = r_DtoHAsync(m[i].h, out + at * 16, m[i].nblk * 16, NULL)) != CUDA_SUCCESS ||
		    (r = r_CtxSynchronize()) != CUDA_SUCCESS) {
			snprintf(err, n, "devhash: fetch the hashes: CUresult %d", r);
			goto out;
		}
		at += m[i].nblk;
	}
	*fetch += mono() - t2;
	rc = 0;
out:
	if (out)
		r_MemFree(out);
	return rc;
}

/* check_host copies every block of m to the host and hashes it there;
 * it returns the blocks whose hashes differ from the device's, or -1. */
static long long check_host(struct dhmap *m, int k, uint64_t block, uint64_t key, char *err, size_t n)
{
	size_t bufn = block > (8u << 20) ? block : (8u << 20) / block * block;
	void *buf;
	CUstream st;
	long long bad = 0;
	CUresult r;
	if ((r = r_HostAlloc(&buf, bufn, 0)) != CUDA_SUCCESS) {
		snprintf(err, n, "devhash check: a host buffer: CUresult %d", r);
		return -1;
	}
	if ((r = r_StreamCreate(&st, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) {
		r_FreeHost(buf);
		snprintf(err, n, "devhash check: a stream: CUresult %d", r);
		return -1;
	}
	for (int i = 0; i < k && bad >= 0; i++) {
		if (m[i].ctx)
			r_CtxSetCurrent(m[i].ctx);
		for (size_t off = 0; off < m[i].n; off += bufn) {
			size_t len = m[i].n - off < bufn ? m[i].n - off : bufn;
			if ((r = r_DtoHAsync(buf, m[i].va + off, len, st)) != CUDA_SUCCESS || (r = r_StreamSync(st)) != CUDA_SUCCESS) {
				snprintf(err, n, "devhash check: copy %#llx+%zu: CUresult %d", m[i].va, off, r);
				bad = -1;
				break;
			}
			for (size_t b = 0; b < len; b += block) {
				uint64_t h[2];
				size_t bl = len - b < block ? len - b : block;
				dh_block((const uint64_t *)((const char *)buf + b), bl / 8, key, h);
				const uint64_t *d = m[i].h + 2 * ((off + b) / block);
				bad += h[0] != d[0] || h[1] != d[1];
			}
		}
	}
	r_StreamDestroy(st);
	r_FreeHost(buf);
	return bad;
}

static int resolve(char *err, size_t n)
{
	if (!libcuda) {
		snprintf(err, n, "the driver is not loaded");
		return -1;
	}
	if (!r_ModuleLoadDataEx) {
		r_ModuleLoadDataEx = real_dlsym(libcuda, "cuModuleLoadDataEx");
		r_ModuleGetFunction = real_dlsym(libcuda, "cuModuleGetFunction");
		r_ModuleUnload = real_dlsym(libcuda, "cuModuleUnload");
		r_Launch = real_dlsym(libcuda, "cuLaunchKernel");
	}
	if (!r_ModuleLoadDataEx || !r_ModuleGetFunction || !r_ModuleUnload || !r_Launch) {
		snprintf(err, n, "the driver lacks the module or launch API");
		return -1;
	}
	return 0;
}

/* hash_maps hashes every mapping of the process's own memory (what a copy
 * out copies: copied() and mapped) on its device, in blocks of block bytes
 * under key: *out gets them in address order (free_maps frees them), and
 * the bytes, blocks and contexts covered and where the time went. It
 * returns how many mappings, or -1. Parked only: nothing may change them
 * meanwhile. */
int hash_maps(uint64_t block, uint64_t key, struct dhmap **out, long long *bytes_, long long *blocks_, int *contexts_,
	      double *load, double *kern, double *fetch, char *err, size_t n)
{
	pthread_mutex_lock(&tab_mu);
	struct dhmap *m = calloc(nm ? nm : 1, sizeof *m);
	int k = 0;
	for (int i = 0; m && i < nm; i++)
		if (copied(i) && ms[i].mapped)
			m[k++] = (struct dhmap){.va = ms[i].va, .n = ms[i].size, .ctx = ms[i].ctx};
	pthread_mutex_unlock(&tab_mu);
	if (!m) {
		snprintf(err, n, "devhash: out of memory");
		return -1;
	}
	qsort(m, k, sizeof *m, by_va);
	long long bytes = 0, blocks = 0;
	for (int i = 0; i < k; i++) {
		if (m[i].n % 8) {
			snprintf(err, n, "devhash: mapping %#llx of %zu bytes is not whole words", m[i].va, m[i].n);
			free_maps(m, k);
			return -1;
		}
		m[i].nblk = (m[i].n + block - 1) / block;
		if (!(m[i].h = calloc(m[i].nblk * 2, sizeof *m[i].h))) {
			snprintf(err, n, "devhash: out of memory");
			free_maps(m, k);
			return -1;
		}
		bytes += m[i].n;
		blocks += m[i].nblk;
	}
	/* A mapping without a context of its own is the first one's, as a
	 * copy's workers take it. */
	for (int i = 0; i < k; i++) {
		if (!m[i].ctx && nctx)
			m[i].ctx = ctxs[0];
		int known = 0;
		for (int c = 0; c < nctx && !known; c++)
			known = m[i].ctx == ctxs[c];
		if (!known) {
			snprintf(err, n, "devhash: mapping %#llx is in a context the library does not know", m[i].va);
			free_maps(m, k);
			return -1;
		}
	}
	int contexts = 0;
	for (int c = 0; c < nctx; c++) {
		int any = 0;
		for (int i = 0; i < k && !any; i++)
			any = m[i].ctx == ctxs[c];
		if (!any)
			continue;
		contexts++;
		if (hash_ctx(ctxs[c], m, k, block, key, load, kern, fetch, err, n) < 0) {
			free_maps(m, k);
			return -1;
		}
	}
	*out = m;
	*bytes_ = bytes;
	*blocks_ = blocks;
	*contexts_ = contexts;
	return k;
}

int cmd_devhash(const char *args, char *out, size_t outn, char *err, size_t n)
{
	char *end;
	uint64_t block = strtoull(args, &end, 10), key = strtoull(end, &end, 0);
	int check = !strcmp(end, " check");
	if (block < 4096 || block > (1ULL << 30) || block % 4096 || (*end && !check)) {
		snprintf(err, n, "devhash %.60s: want BLOCK (a multiple of 4096, up to 1 GiB) KEY [check]", args);
		return -1;
	}
	if (!parked || released) {
		snprintf(err, n, "devhash: %s", released ? "memory is released" : "not parked");
		return -1;
	}
	struct dhmap *m;
	int k, contexts;
	long long bytes, blocks;
	double load = 0, kern = 0, fetch = 0;
	if ((k = hash_maps(block, key, &m, &bytes, &blocks, &contexts, &load, &kern, &fetch, err, n)) < 0)
		return -1;
	/* Against the previous call's blocks: changed, or not seen then. */
	long long changed = 0, same = 0;
	int compared = prev && prev_block == block && prev_key == key;
	for (int i = 0; compared && i < k; i++)
		for (int p = 0; p < nprev; p++)
			if (prev[p].va == m[i].va && prev[p].n == m[i].n) {
				for (size_t b = 0; b < m[i].nblk; b++) {
					size_t bl = m[i].n - b * block < block ? m[i].n - b * block : block;
					if (memcmp(prev[p].h + 2 * b, m[i].h + 2 * b, 16))
						changed += bl;
					else
						same += bl;
				}
				break;
			}
	double check_s = 0;
	long long bad = 0;
	if (check) {
		double t0 = mono();
		if ((bad = check_host(m, k, block, key, err, n)) < 0) {
			free_maps(m, k);
			return -1;
		}
		check_s = mono() - t0;
	}
	/* The digest: the hashes of every block, in address order, hashed. */
	uint64_t dig[2] = {0, 0};
	for (int i = 0; i < k; i++) {
		uint64_t h[2];
		dh_block(m[i].h, m[i].nblk * 2, m[i].va, h);
		dig[0] += h[0];
		dig[1] += h[1];
	}
	free_maps(prev, nprev);
	prev = m;
	nprev = k;
	prev_block = block;
	prev_key = key;
	snprintf(out, outn,
		 "ok {\"bytes\":%lld,\"blocks\":%lld,\"block\":%llu,\"mappings\":%d,\"contexts\":%d,\"load_s\":%.6f,"
		 "\"kernel_s\":%.6f,\"fetch_s\":%.6f,\"digest\":\"%016llx%016llx\",\"compared\":%s,\"changed_bytes\":%lld,"
		 "\"unchanged_bytes\":%lld,\"checked\":%s,\"mismatched_blocks\":%lld,\"check_s\":%.6f}\n",
		 bytes, blocks, (unsigned long long)block, k, contexts, load, kern, fetch, (unsigned long long)dig[0],
		 (unsigned long long)dig[1], compared ? "true" : "false", changed, same, check ? "true" : "false", bad,
		 check_s);
	return 0;
}
