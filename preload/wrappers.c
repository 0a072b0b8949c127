/*
 * wrappers: the driver's entry points this library interposes (exported
 * under the driver's names, and handed out by dlsym and cuGetProcAddress in
 * place of the driver's own): the gated ones, the ones that make the
 * process incapable, and the memory calls bookkeeping.c records.
 */
#include "internal.h"

#include <link.h>

struct ent {
	const char *name;
	void *wrap;
	void **real;
};
static struct ent *find_by_name(const char *name);
static struct ent *find_by_real(void *p);

/* WRAP_IN defines a wrapper that enters the gate with `enter`, calls the
 * real entry point, leaves, and then runs `after` (which may look at its
 * result r); WRAP_N enters plainly. */
#define WRAP_IN(name, decl, call, enter, after)                 \
	static CUresult (*real_##name) decl;                    \
	CUresult name decl                                      \
	{                                                       \
		ensure_cuda();                                  \
		if (!real_##name)                               \
			return CUDA_ERROR_NOT_FOUND;            \
		enter;                                          \
		CUresult r = real_##name call;                  \
		gate_leave();                                   \
		after;                                          \
		return r;                                       \
	}
#define WRAP_N(name, decl, call, after) WRAP_IN(name, decl, call, gate_enter(), after)
#define GATED_N(name, decl, call) WRAP_N(name, decl, call, (void)0)
/* LAUNCH_N is GATED_N for a kernel launch of function fn: a collective's
 * launch may also wait at the collective barrier (gate.c). */
#define LAUNCH_N(name, decl, call, fn) WRAP_IN(name, decl, call, collective_enter((void *)(fn)), (void)0)
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
#define LAUNCH_LIST(X) X(11, cuLaunchKernel, a) X(11, cuLaunchKernel_ptsz, a) X(4, cuLaunchKernelEx, b) X(4, cuLaunchKernelEx_ptsz, b)
#define DEF_LAUNCH(n, name, fn) LAUNCH_N(name, ARGS##n, CALL##n, fn)
LAUNCH_LIST(DEF_LAUNCH)
#define GATED_LIST(X)                                                                                   \
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
 * forward; cuIpcGetMemHandle in the exporting process marks it.) A pool
 * alone holds nothing the library must recreate (NCCL creates one in every
 * rank and never allocates from it): allocating from one, or sharing one,
 * marks. */
#define INCAPABLE_N(name, decl, call) \
	WRAP_N(name, decl, call, if (r == CUDA_SUCCESS) mark_incapable("the program called %s", #name))
#define INCAPABLE_LIST(X)                                                                                  \
	X(3, cuMemAllocManaged) X(3, cuMemAllocAsync) X(3, cuMemAllocAsync_ptsz) X(4, cuMemAllocFromPoolAsync) \
	X(4, cuMemAllocFromPoolAsync_ptsz) X(2, cuIpcGetMemHandle) X(4, cuMemPoolExportToShareableHandle)    \
	X(4, cuMemPoolImportFromShareableHandle) X(3, cuMemPoolImportPointer) X(2, cuArrayCreate_v2)          \
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

/* own_ctx: the context of our allocation at va, or NULL where va is not
 * one of ours. */
static CUcontext own_ctx(CUdeviceptr va)
{
	CUcontext c = NULL;
	pthread_mutex_lock(&tab_mu);
	for (int i = 0; i < no; i++)
		if (os_[i].live && os_[i].va == va) {
			c = ms[os_[i].m].ctx;
			if (!c)
				c = cur_ctx();
			break;
		}
	pthread_mutex_unlock(&tab_mu);
	return c;
}

/* wait_idle waits until nothing queued in context c runs. cudaFree and
 * cuMemFree wait for the device before they free, and PyTorch's caching
 * allocator counts on it: a block it hands back to the driver may still be
 * read or written by kernels queued before. cuMemUnmap does not wait, so our
 * cuMemFree waits first: without it, a process filling the device (PyTorch
 * releasing its cache to retry an allocation) faulted on an H200 (Xid 31,
 * FAULT_PDE, a kernel writing to an address just unmapped). Outside tab_mu:
 * a kernel may wait on a host function that allocates. */
static void wait_idle(CUcontext c)
{
	CUcontext prev = NULL;
	if (!c || !r_CtxSynchronize)
		return;
	if (r_CtxGetCurrent && r_CtxSetCurrent && r_CtxGetCurrent(&prev) == CUDA_SUCCESS && prev != c) {
		if (r_CtxSetCurrent(c) == CUDA_SUCCESS) {
			r_CtxSynchronize();
			r_CtxSetCurrent(prev);
		}
		return;
	}
	r_CtxSynchronize();
}

CUresult cuMemFree_v2(CUdeviceptr va)
{
	if (!ensure_cuda() || !r_MemFree)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	wait_idle(own_ctx(va));
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
			cache_forget(o.va, o.size);
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
	trace("cuMemCreate %zu bytes at location %d/%d, handle types %d, flags %llu: %d", size, prop->location.type,
	      prop->location.id, prop->requestedHandleTypes, flags, r);
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
		cache_forget(va, size);
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

/* Shareable handles (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 1) of the
 * program's own cuMemCreate allocations, and imports of them (NCCL's P2P
 * transport maps each rank's buffers into the others): the library keeps
 * a duplicate of each descriptor so that gpucr-stream can tell which
 * export an import came from, releases imports with the rest, and imports
 * the exporter's new handle after a remap (`import`). Other handle types
 * (fabric, Win32) make the process incapable. */
CUresult cuMemExportToShareableHandle(void *sh, CUmemGenericAllocationHandle h, int type, unsigned long long flags)
{
	if (!ensure_cuda() || !r_Export)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	pthread_mutex_lock(&tab_mu);
	int i = find_h_app(h);
	CUresult r = r_Export(sh, i >= 0 ? hs[i].real : h, type, flags);
	if (r == CUDA_SUCCESS) {
		if (i < 0 || hs[i].own || hs[i].imported)
			mark_incapable("cuMemExportToShareableHandle of a handle the library did not create for the program");
		else if (type != 1)
			mark_incapable("cuMemExportToShareableHandle of type %d (only POSIX descriptors are recreated)", type);
		else
			note_shared(i, *(int *)sh, 0);
	}
	pthread_mutex_unlock(&tab_mu);
	gate_leave();
	return r;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *os, int type, unsigned long long flags)
{
	if (!ensure_cuda() || !r_Import)
		return CUDA_ERROR_NOT_FOUND;
	gate_enter();
	CUresult r = r_Import(h, os, type, flags);
	if (r == CUDA_SUCCESS) {
		pthread_mutex_lock(&tab_mu);
		if (type != 1) {
			mark_incapable("cuMemImportFromShareableHandle of type %d (only POSIX descriptors are recreated)", type);
		} else {
			int i = new_h();
			hs[i] = (struct hrec){.live = 1, .present = 1, .imported = 1, .app = *h, .real = *h};
			if (r_PropsFromHandle)
				r_PropsFromHandle(&hs[i].prop, *h);
			note_shared(i, (int)(uintptr_t)os, 1);
			note_ctx();
		}
		pthread_mutex_unlock(&tab_mu);
	}
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
#define ENT_L(n, name, fn) ENT_G(n, name)
static struct ent table[] = {
	LAUNCH_LIST(ENT_L) GATED_LIST(ENT_G) INCAPABLE_LIST(ENT_G)
	{"cuMemAlloc_v2", (void *)cuMemAlloc_v2, (void **)&r_MemAlloc},
	{"cuMemAllocPitch_v2", (void *)cuMemAllocPitch_v2, (void **)&r_MemAllocPitch},
	{"cuMemFree_v2", (void *)cuMemFree_v2, (void **)&r_MemFree},
	{"cuMemCreate", (void *)cuMemCreate, (void **)&r_Create},
	{"cuMemRelease", (void *)cuMemRelease, (void **)&r_Release},
	{"cuMemMap", (void *)cuMemMap, (void **)&r_Map},
	{"cuMemUnmap", (void *)cuMemUnmap, (void **)&r_Unmap},
	{"cuMemSetAccess", (void *)cuMemSetAccess, (void **)&r_SetAccess},
	{"cuMemRetainAllocationHandle", (void *)cuMemRetainAllocationHandle, (void **)&r_RetainHandle},
	{"cuMemExportToShareableHandle", (void *)cuMemExportToShareableHandle, (void **)&r_Export},
	{"cuMemImportFromShareableHandle", (void *)cuMemImportFromShareableHandle, (void **)&r_Import},
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

void resolve_real(void)
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
	R(r_FuncGetName, "cuFuncGetName");
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
	R(r_MemsetD8Async, "cuMemsetD8Async");
	R(r_MemsetD32Async, "cuMemsetD32Async");
#undef R
	if (!r_AddressReserve || !r_Create || !r_Map || !r_SetAccess || !r_HostAlloc || !r_DtoHAsync || !r_HtoDAsync ||
	    !r_MemsetD8Async || !r_MemsetD32Async)
		mark_incapable("the driver lacks the virtual memory API");
}

/* next_sym is dlsym(RTLD_NEXT, sym) for the caller at ret: called from
 * here, RTLD_NEXT would search after this library instead of the caller. */
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
