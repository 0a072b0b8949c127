/*
 * control: the control socket (the top of internal.h) and the commands it
 * answers, one connection at a time, on the control thread.
 *
 * Order (gpucr-stream's side is vram/producer.go):
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
 */
#include "internal.h"

static pthread_t ctl_thread;
int ctl_fd = -1;
/* The socket directory, held open: the socket and the status file are made
 * through it, so that a path swapped later leads nowhere else. */
int ctl_dir_fd = -1;
static char sock_path[108]; /* for messages only */
char sock_name[64];  /* preload-PID.sock in ctl_dir_fd */
atomic_int ctl_started;

int write_all(int fd, const void *b, size_t n)
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
int read_full(int fd, void *b, size_t n)
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
int fault(const char *step)
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
			if (!hs[ms[i].h].imported)
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
	const char *why = incapable();
	if (why)
		return why;
	if (!atomic_load(&wrapped))
		return "no driver entry point was reached through the library";
	if (u)
		return "a physical allocation is mapped nowhere (its contents could not be copied)";
	return "";
}

void json_str(char *out, size_t n, const char *s)
{
	size_t k = 0;
	for (; *s && k + 2 < n; s++)
		if (*s != '"' && *s != '\\' && (unsigned char)*s >= 0x20)
			out[k++] = *s;
	out[k] = 0;
}

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
	int own = 0, ranges = 0;
	for (int i = 0; i < no; i++)
		own += os_[i].live;
	long long cached = cached_bytes(&ranges);
	snprintf(out, n,
		 "ok {\"pid\":%d,\"capable\":%s,\"reason\":\"%s\",\"bytes\":%zu,\"mappings\":%d,\"handles\":%d,"
		 "\"allocs\":%d,\"contexts\":%d,\"wrapped\":%d,\"parked\":%s,\"released\":%s,\"unfilled\":%s,\"device_used\":%zu,"
		 "\"driver\":%s,\"detached\":%s,\"staged\":%d,\"collectives\":%lld,\"cached\":%lld,\"cache_ranges\":%d,\"kept\":[",
		 getpid(), why[0] ? "false" : "true", why, b, maps, handles, own, nctx, atomic_load(&wrapped),
		 parked ? "true" : "false", released ? "true" : "false", unfilled ? "true" : "false", tot - fr,
		 driver_next ? "true" : "false", detached ? "true" : "false", staged_count(), collectives_launched(), cached, ranges);
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

/* cmd_shared lists the shareable descriptors the library holds (exports
 * and imports, for gpucr-stream's kcmp) and every imported handle with the
 * export it came from, as far as gpucr-stream told (`source`). */
static void cmd_shared(char *out, size_t n)
{
	pthread_mutex_lock(&tab_mu);
	size_t k = (size_t)snprintf(out, n, "ok {\"descriptors\":[");
	int first = 1;
	for (int i = 0; i < nsh && k + 80 < n; i++)
		if (ss[i].live) {
			k += (size_t)snprintf(out + k, n - k, "%s{\"h\":%d,\"fd\":%d,\"import\":%s}", first ? "" : ",", ss[i].h, ss[i].fd,
					      ss[i].import ? "true" : "false");
			first = 0;
		}
	k += (size_t)snprintf(out + k, n - k, "],\"imports\":[");
	first = 1;
	for (int i = 0; i < nh && k + 80 < n; i++)
		if (hs[i].live && hs[i].imported) {
			k += (size_t)snprintf(out + k, n - k, "%s{\"h\":%d,\"src_pid\":%d,\"src_h\":%d,\"present\":%s}", first ? "" : ",", i,
					      hs[i].src_pid, hs[i].src_h, hs[i].present ? "true" : "false");
			first = 0;
		}
	pthread_mutex_unlock(&tab_mu);
	snprintf(out + k, n > k ? n - k : 0, "]}\n");
}

/* export_fd: the descriptor the last `export` made, open until the next
 * command of the connection (gpucr-stream takes its own copy meanwhile,
 * pidfd_getfd) or its end. */
static int export_fd = -1;

static void export_close(void)
{
	if (export_fd >= 0)
		close(export_fd);
	export_fd = -1;
}

/* cmd_export exports handle record h (present, the program's own) as a
 * POSIX descriptor for an importer's `import`. */
static int cmd_export(int h, char *out, size_t on, char *err, size_t n)
{
	pthread_mutex_lock(&tab_mu);
	int rc = 0, fd = -1;
	if (h < 0 || h >= nh || !hs[h].live || !hs[h].present || hs[h].imported || hs[h].own) {
		snprintf(err, n, "export: %d is no present handle of the program's", h);
		rc = -1;
	} else {
		if (nctx)
			r_CtxSetCurrent(ctxs[0]);
		CUresult r = r_Export(&fd, hs[h].real, 1, 0);
		if (r != CUDA_SUCCESS) {
			snprintf(err, n, "cuMemExportToShareableHandle: CUresult %d", r);
			rc = -1;
		}
	}
	pthread_mutex_unlock(&tab_mu);
	if (rc == 0) {
		export_fd = fd;
		snprintf(out, on, "ok {\"fd\":%d}\n", fd);
	}
	return rc;
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

int recv_cmd(int c, char *line, size_t n, int *fds, int *nfds)
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
	scan_free(&kept_scan); /* of an earlier park */
	return 0;
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
		if (imports_pending()) {
			snprintf(err, n, "memory of another process is not imported again: import first");
			return -1;
		}
		keep_clear(0);
		unstage_all();
		run_again();
		return 0;
	}
	if (!strcmp(line, "collhold")) {
		st->collectives = collective_hold();
		*owns = 1;
		return 0;
	}
	if (!strncmp(line, "colluntil ", 10)) {
		long long want = 0;
		long ms = 0;
		if (sscanf(line + 10, "%lld %ld", &want, &ms) != 2 || want < 0 || ms <= 0) {
			snprintf(err, n, "colluntil N MS");
			return -1;
		}
		if (collective_until(want, ms, &st->collectives) < 0) {
			snprintf(err, n, "launched %lld collectives, not %lld, within %ld ms", st->collectives, want, ms);
			return -1;
		}
		return 0;
	}
	if (!strncmp(line, "source ", 7)) {
		int h, pid, sh;
		if (sscanf(line + 7, "%d %d %d", &h, &pid, &sh) != 3) {
			snprintf(err, n, "source H PID H");
			return -1;
		}
		pthread_mutex_lock(&tab_mu);
		int ok = h >= 0 && h < nh && hs[h].live && hs[h].imported;
		if (ok) {
			hs[h].src_pid = pid;
			hs[h].src_h = sh;
		}
		pthread_mutex_unlock(&tab_mu);
		if (!ok) {
			snprintf(err, n, "source: %d is no imported handle", h);
			return -1;
		}
		return 0;
	}
	if (!strncmp(line, "import ", 7)) {
		if (*nfds != 1) {
			snprintf(err, n, "import H takes one descriptor");
			return -1;
		}
		return do_import(atoi(line + 7), fds[0], err, n);
	}
	if (!strcmp(line, "collrelease")) {
		collective_release();
		return 0;
	}
	if (!strcmp(line, "copyout") || !strcmp(line, "copyin"))
		return cmd_copy(line, fds, nfds, err, n, st);
	if (!strcmp(line, "peek"))
		return cmd_peek(fds, nfds, err, n, st);
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

/* answer is a command's answer line in out: err (rc < 0), its stats as
 * JSON (st), or what the command wrote there itself (st NULL). */
void answer(char *out, size_t n, int rc, const char *err, const struct stats *st)
{
	if (rc < 0) {
		char e[512];
		json_str(e, sizeof e, err);
		snprintf(out, n, "err %s\n", e);
		return;
	}
	if (!st)
		return;
	char se[sizeof st->w.scan_err];
	json_str(se, sizeof se, st->w.scan_err);
	snprintf(out, n,
		 "ok {\"bytes\":%lld,\"workers\":%d,\"setup_s\":%.6f,\"work_s\":%.6f,\"teardown_s\":%.6f,"
		 "\"wait_s\":%.6f,\"io_s\":%.6f,\"staged\":%d,\"collectives\":%lld,\"allocated\":%lld,"
		 "\"zero_bytes\":%lld,\"cached_bytes\":%lld,\"earlier_bytes\":%lld,\"scan_s\":%.6f,\"scan_error\":\"%s\"}\n",
		 st->bytes, st->workers, st->setup, st->work, st->teardown, st->wait, st->io, st->staged, st->collectives,
		 st->w.allocated, st->w.zero, st->w.cached, st->w.earlier, st->w.scan, se);
}

static void serve_conn(int c)
{
	static char out[16384];
	char line[1024], err[512];
	int fds[MAXFDS], nfds, owns = 0;
	long idle = idle_ms();
	set_timeout(c, SO_RCVTIMEO, idle);
	set_timeout(c, SO_SNDTIMEO, idle);
	while (recv_cmd(c, line, sizeof line, fds, &nfds) == 0) {
		err[0] = 0;
		struct stats st = {0};
		int rc = 0;
		int custom = 0;
		export_close();
		if (!strcmp(line, "report")) {
			cmd_report(out, sizeof out);
			custom = 1;
		} else if (!strcmp(line, "shared")) {
			cmd_shared(out, sizeof out);
			custom = 1;
		} else if (!strncmp(line, "export ", 7)) {
			rc = cmd_export(atoi(line + 7), out, sizeof out, err, sizeof err);
			custom = 1;
		} else if (!strcmp(line, "scan")) {
			rc = cmd_scan(out, sizeof out, err, sizeof err);
			custom = 1;
		} else if (!strncmp(line, "devhash ", 8)) {
			rc = cmd_devhash(line + 8, out, sizeof out, err, sizeof err);
			custom = 1;
		} else if (!strncmp(line, "hashes ", 7)) {
			rc = cmd_hashes(line + 7, fds, nfds, out, sizeof out, err, sizeof err);
			custom = 1;
		} else if (!strcmp(line, "skip")) {
			rc = cmd_skip(fds, nfds, out, sizeof out, err, sizeof err);
			custom = 1;
		} else if (!strncmp(line, "bases ", 6)) {
			rc = cmd_bases(line + 6, out, sizeof out, err, sizeof err);
			custom = 1;
		} else if (!strncmp(line, "based ", 6)) {
			rc = cmd_based(line + 6, err, sizeof err);
		} else if (!strcmp(line, "handles")) {
			rc = cmd_handles(fds, nfds, out, sizeof out, err, sizeof err);
			custom = 1;
		} else if (!strncmp(line, "adopt ", 6)) {
			rc = cmd_adopt(atoi(line + 6), fds, nfds, out, sizeof out, err, sizeof err);
			custom = 1;
		} else {
			rc = dispatch(line, fds, &nfds, err, sizeof err, &st, &owns);
		}
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
		answer(out, sizeof out, rc, err, custom ? NULL : &st);
		if (write_all(c, out, strlen(out)) < 0)
			break;
		set_timeout(c, SO_RCVTIMEO, owns ? 0 : idle);
	}
	export_close();
	unstage_all();
	if (owns && parked && !detached)
		on_orphan();
	if (!parked)
		collective_release(); /* held, and then left without a park */
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

void start_control(void)
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
