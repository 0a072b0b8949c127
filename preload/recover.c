/*
 * recover: the kept copy of the released memory, and recovery without
 * gpucr-stream.
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
#include "internal.h"

/* The copy gpucr-stream kept (the top of this file): descriptors until
 * `detach`, paths until the process runs again. */
static int keep_fds[64];
int nkeep;
char *keep_paths[64];     /* for messages, and their names in keep_dir */
static int keep_dir = -1; /* the directory they are in, from `keep` */
int driver_next, detached;

/* say writes a decision taken on our own to stderr and, replacing what was
 * there, to preload-PID.status next to the control socket. */
int said; /* say spoke since the last park: recover says how it ended */
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

void keep_close_fds(void)
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
void keep_clear(int rm)
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
	driver_next = detached = kept_delta = 0;
}

/* cmd_keep takes the descriptors of the kept copy, its directory first
 * then its files (the library owns them now), and learns their paths for
 * its messages. */
int cmd_keep(int *fds, int *nfds, char *err, size_t n)
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
	/* The copy out that wrote them left out what an earlier checkpoint
	 * holds (dedup.c): they refill nothing alone. */
	kept_delta = kept_scan.valid && kept_scan.w.earlier > 0;
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
	if (kept_delta) {
		snprintf(err, n, "the kept copy holds only the blocks that changed since an earlier checkpoint: gpucr-stream gpu resume --pid %d "
				 "refills the rest from it",
			 getpid());
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

/* run_again lets the parked program run: the gate and the collective
 * barrier open. */
void run_again(void)
{
	parked = 0;
	scan_free(&kept_scan);
	gate_open();
	collective_release();
}

/* do_recover brings the memory back and lets the program run: remap if
 * released, refill from fds (else the kept copy), unpark. On failure the
 * program stays parked. It owns fds. rm: remove the kept files after
 * (on our own only: `recover` leaves that to gpucr-stream). */
int do_recover(int *fds, int nfds, int rm, char *err, size_t n)
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
		if (run_job(0, 0, fds, nfds, err, n, &st) < 0)
			return -1;
		unfilled = 0;
	}
	/* Memory of another process comes back only through gpucr-stream
	 * (`import`, the exporter's new handle): parked until then. */
	if (parked && imports_pending())
		return 0;
	if (parked) {
		run_again();
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
void on_orphan(void)
{
	char err[512] = "";
	if (driver_next) {
		say("waiting", "gpucr-stream's connection ended (gpucr-stream died?) after it handed the process to the driver's checkpoint; the program stays "
			       "paused with its device memory %s: run `gpucr-stream gpu resume --pid %d` (it restores the driver's "
			       "state, then the memory from the kept copy%s%s)",
		    released ? "released" : "in place", getpid(), nkeep ? " " : "", nkeep ? keep_paths[0] : "");
		return;
	}
	if (kept_delta && released) {
		say("waiting", "gpucr-stream's connection ended (gpucr-stream died?) with the device memory released, and the kept copy holds "
			       "only the blocks that changed since an earlier checkpoint; the program stays paused: run `gpucr-stream gpu resume "
			       "--pid %d` (it refills the rest from that checkpoint)",
		    getpid());
		return;
	}
	int was = released;
	int rc = do_recover(NULL, 0, 1, err, sizeof err);
	if (rc == 0 && parked) {
		say("waiting", "gpucr-stream's connection ended (gpucr-stream died?) with the device memory released; the process's own is back, "
			       "but it maps memory of another process, which only gpucr-stream can map again: run `gpucr-stream gpu resume --pid %d`",
		    getpid());
		return;
	}
	if (rc < 0) {
		say("NOT RESUMED", "gpucr-stream's connection ended (gpucr-stream died?) with the device memory released, and the kept copy cannot refill it: "
				   "%s. The program stays paused: it never runs on wrong memory",
		    err);
		return;
	}
	say("resumed", "gpucr-stream's connection ended (gpucr-stream died?) before the driver's checkpoint; %s, the program runs on",
	    was ? "the device memory was mapped again and refilled from the kept copy" : "the device memory was never released");
}
