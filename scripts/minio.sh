#!/usr/bin/env bash
# minio.sh -- a local S3 for trying gpucr-stream (and for the benchmarks):
# starts MinIO (the pinned build of scripts/install-minio.sh, or
# $MINIO_BINARY) on 127.0.0.1 with random credentials and a new directory
# in $TMPDIR (default /tmp), and prints, on stdout, the variables to export
# (GPUCR_MINIO_DIR: that directory) and how to stop it:
#   eval "$(bash scripts/minio.sh)"    # or: make minio, then paste
# Its data and log are in that directory, which `minio.sh stop DIR` removes
# once the server is gone.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf 'minio: %s\n' "$*" >&2; }

if [ "${1:-}" = stop ]; then
	dir=${2:?usage: minio.sh stop DIR}
	[ -f "$dir/minio.pid" ] || { say "$dir is no directory of minio.sh's (no minio.pid)"; exit 1; }
	pid=$(cat "$dir/minio.pid")
	kill "$pid" 2>/dev/null || true
	for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
	kill -9 "$pid" 2>/dev/null || true
	rm -rf "$dir"
	say "stopped minio (pid $pid) and removed $dir"
	exit 0
fi

bin=${MINIO_BINARY:-}
if [ -z "$bin" ]; then
	bash scripts/install-minio.sh --check >/dev/null 2>&1 ||
		say "building the pinned MinIO server into /usr/local/bin/minio first (a few minutes, once)"
	bin=$(bash scripts/install-minio.sh)
fi

# A free port: nothing answers on it.
free_port() {
	local p
	for _ in $(seq 100); do
		p=$((20000 + RANDOM % 30000))
		if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
			echo "$p"
			return
		fi
	done
	say "no free port found on 127.0.0.1"
	exit 1
}
random() { od -An -N"$1" -tx1 /dev/urandom | tr -d ' \n'; }

dir=$(mktemp -d "${TMPDIR:-/tmp}/gpucr-minio-XXXXXX")
port=$(free_port)
console=$(free_port)
user=gpucr-$(random 6)
pass=$(random 20)
mkdir "$dir/data"
# Its own session, so that it outlives this script and the terminal's
# Ctrl-C; MINIO_* of the caller's environment play no part.
env $(env | sed -n 's/^\(MINIO_[^=]*\)=.*/-u \1/p') \
	MINIO_ROOT_USER="$user" MINIO_ROOT_PASSWORD="$pass" MINIO_BROWSER=off MINIO_UPDATE=off \
	setsid "$bin" server "$dir/data" --address "127.0.0.1:$port" --console-address "127.0.0.1:$console" --quiet \
	</dev/null >"$dir/minio.log" 2>&1 &
pid=$!
echo "$pid" >"$dir/minio.pid"

live() {
	local line
	exec 3<>"/dev/tcp/127.0.0.1/$port" || return 1
	printf 'GET /minio/health/live HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
	read -r line <&3 || true
	exec 3<&-
	[[ $line == *" 200 "* ]]
}
for _ in $(seq 600); do
	live 2>/dev/null && break
	if ! kill -0 "$pid" 2>/dev/null; then
		say "minio exited; its log:"
		cat "$dir/minio.log" >&2
		rm -rf "$dir"
		exit 1
	fi
	sleep 0.1
done
live 2>/dev/null || {
	say "minio on 127.0.0.1:$port not live after 60 s (log: $dir/minio.log); stopped it"
	kill -9 "$pid" 2>/dev/null || true
	exit 1
}

exports="export AWS_ACCESS_KEY_ID=$user AWS_SECRET_ACCESS_KEY=$pass AWS_ENDPOINT_URL=http://127.0.0.1:$port AWS_REGION=us-east-1 GPUCR_MINIO_DIR=$(printf %q "$dir")"
echo "$exports" >"$dir/env"
chmod 0600 "$dir/env"
cat <<MSG
# MinIO (pid $pid) on http://127.0.0.1:$port, data and log in $dir; for this shell:
$exports
# then e.g.: gpucr-stream checkpoint --pid \$PID --to s3://ckpt/job1 --create-bucket
# another shell: . $dir/env
# stop it and remove its data: bash $PWD/scripts/minio.sh stop $dir
MSG
