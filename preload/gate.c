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
 */
#include "internal.h"

static atomic_int gate_closed;
static atomic_long gate_inflight;
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_open_cv = PTHREAD_COND_INITIALIZER;
static pthread_cond_t gate_drained_cv = PTHREAD_COND_INITIALIZER;
static __thread int gate_depth;

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

/* gate_close closes the gate and waits up to ms for in-flight calls to
 * leave; on timeout it opens it again and returns -1. */
int gate_close(long ms)
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
}
