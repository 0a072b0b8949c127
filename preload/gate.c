/*
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
 * run outside the driver's lock, before it; the order in control.c passed
 * the same probe end to end (nothing moved while parked, no step lost). And
 * a signal stops a thread wherever it is, inside malloc or inside the
 * driver holding its own locks,
 * and the control thread's copies then need those locks (cuMemHostAlloc
 * allocates, the driver serialises on its context); it would also park the
 * driver's own threads, which its lock and checkpoint rely on. The gate stops
 * threads only at a point where they hold no lock of ours, the driver's or
 * libc's. Its limit: work submitted through an entry point the gate does not
 * know (cuGetExportTable's private tables) is not held back, hence the
 * capability checks (wrappers.c, bookkeeping.c).
 *
 * The collective barrier. The ranks of an NCCL job cannot be parked one by
 * one: a rank's collective kernel in flight waits for the same collective
 * of every other rank, and a rank parked before launching it never does, so
 * the first rank never drains. So the ranks are first brought to one
 * collective boundary: `collhold` stops each rank's next collective launch
 * (any kernel whose name, unmangled, starts with "nccl") and answers how many it
 * launched; `colluntil N` lets a rank launch until it has launched N (the
 * most any rank had) and holds it there. Then every collective launched
 * has its peers launched too, every one completes, and park drains. This
 * counts collectives per process, not per communicator: it holds for jobs
 * whose ranks launch the same sequence of collectives (data and tensor
 * parallel, one process group). A held launch waits outside the gate, so
 * park never waits for it; unpark, `collrelease` and the end of the
 * connection that held (while not parked) let it go.
 */
#include "internal.h"

static atomic_int gate_closed;
static atomic_long gate_inflight;
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_open_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t gate_drained_cv = PTHREAD_COND_INITIALIZER;
static __thread int gate_depth;
static pthread_mutex_t coll_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t coll_cv = PTHREAD_COND_INITIALIZER;
static long long coll_launched;
static long long coll_allow = -1; /* -1: no hold */

void gate_enter(void)
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

void gate_leave(void)
{
	if (internal || --gate_depth > 0)
		return;
	if (atomic_fetch_sub(&gate_inflight, 1) == 1 && atomic_load(&gate_closed)) {
		pthread_mutex_lock(&gate_mu);
		pthread_cond_broadcast(&gate_drained_cv);
		pthread_mutex_unlock(&gate_mu);
	}
}

/* deadline_in is the CLOCK_REALTIME time ms from now, for
 * pthread_cond_timedwait. */
static struct timespec deadline_in(long ms)
{
	struct timespec dl;
	clock_gettime(CLOCK_REALTIME, &dl);
	dl.tv_sec += ms / 1000;
	dl.tv_nsec += (ms % 1000) * 1000000L;
	if (dl.tv_nsec >= 1000000000L) {
		dl.tv_sec++;
		dl.tv_nsec -= 1000000000L;
	}
	return dl;
}

/* gate_close closes the gate and waits up to ms for in-flight calls to
 * leave; on timeout it opens it again and returns -1. */
int gate_close(long ms)
{
	struct timespec dl = deadline_in(ms);
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

void gate_open(void)
{
	pthread_mutex_lock(&gate_mu);
	atomic_store(&gate_closed, 0);
	pthread_cond_broadcast(&gate_open_cv);
	pthread_mutex_unlock(&gate_mu);
}

/* gate_reset: a forked child starts with the gate open and empty. */
void gate_reset(void)
{
	atomic_store(&gate_closed, 0);
	atomic_store(&gate_inflight, 0);
	pthread_mutex_init(&gate_mu, NULL);
	pthread_mutex_init(&coll_mu, NULL);
	coll_launched = 0;
	coll_allow = -1;
}


/* collective_name: an NCCL kernel's name, as the driver gives it (C++
 * mangled: "_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL...", or plain). */
static int collective_name(const char *name)
{
	if (!strncmp(name, "_Z", 2)) {
		name += 2;
		while (*name >= '0' && *name <= '9')
			name++;
	}
	return !strncmp(name, "nccl", 4);
}

/* is_collective says whether f is an NCCL kernel; answers are cached
 * per function (a job launches few distinct ones). */
static int is_collective(void *f)
{
	static struct {
		void *f;
		int yes;
	} seen[512];
	static int nseen;
	static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
	pthread_mutex_lock(&mu);
	for (int i = 0; i < nseen; i++)
		if (seen[i].f == f) {
			int y = seen[i].yes;
			pthread_mutex_unlock(&mu);
			return y;
		}
	pthread_mutex_unlock(&mu);
	const char *name = NULL;
	int yes = r_FuncGetName && r_FuncGetName(&name, f) == CUDA_SUCCESS && name && collective_name(name);
	pthread_mutex_lock(&mu);
	if (nseen < (int)(sizeof seen / sizeof seen[0]))
		seen[nseen++] = (typeof(seen[0])){f, yes};
	pthread_mutex_unlock(&mu);
	trace("kernel %s%s", name ? name : "(no name)", yes ? ": a collective" : "");
	return yes;
}

/* collective_enter is gate_enter for a launch of f: a collective beyond
 * what the barrier allows steps back out of the gate and waits. */
void collective_enter(void *f)
{
	for (;;) {
		gate_enter();
		if (internal || !f || !is_collective(f))
			return;
		pthread_mutex_lock(&coll_mu);
		if (coll_allow < 0 || coll_launched < coll_allow) {
			coll_launched++;
			pthread_cond_broadcast(&coll_cv);
			pthread_mutex_unlock(&coll_mu);
			return;
		}
		pthread_mutex_unlock(&coll_mu);
		gate_leave();
		pthread_mutex_lock(&coll_mu);
		while (coll_allow >= 0 && coll_launched >= coll_allow)
			pthread_cond_wait(&coll_cv, &coll_mu);
		pthread_mutex_unlock(&coll_mu);
	}
}

/* collectives_launched is how many collectives the program launched. */
long long collectives_launched(void)
{
	pthread_mutex_lock(&coll_mu);
	long long n = coll_launched;
	pthread_mutex_unlock(&coll_mu);
	return n;
}

/* collective_hold stops further collective launches and returns how many
 * were launched. */
long long collective_hold(void)
{
	pthread_mutex_lock(&coll_mu);
	coll_allow = coll_launched;
	long long n = coll_launched;
	pthread_mutex_unlock(&coll_mu);
	return n;
}

/* collective_until lets collectives be launched until n were, waiting up
 * to ms for it; -1 on timeout (still held, at *launched). */
int collective_until(long long n, long ms, long long *launched)
{
	struct timespec dl = deadline_in(ms);
	pthread_mutex_lock(&coll_mu);
	if (n > coll_allow)
		coll_allow = n;
	pthread_cond_broadcast(&coll_cv);
	int rc = 0;
	while (coll_launched < n && rc == 0)
		rc = pthread_cond_timedwait(&coll_cv, &coll_mu, &dl);
	*launched = coll_launched;
	int ok = coll_launched >= n;
	pthread_mutex_unlock(&coll_mu);
	return ok ? 0 : -1;
}

void collective_release(void)
{
	pthread_mutex_lock(&coll_mu);
	coll_allow = -1;
	pthread_cond_broadcast(&coll_cv);
	pthread_mutex_unlock(&coll_mu);
}
