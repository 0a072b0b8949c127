#!/usr/bin/env bash
# install-deps.sh [demo|test] -- install what the demo or the tests use on a
# fresh Debian machine, saying what, one line each; nothing else is printed
# unless it fails.
#   demo: CRIU >= 4 (scripts/install-criu.sh): all the demo runs besides Go.
#   test: the same, Debian tools (iproute2 for network namespaces, openssh
#         for the ssh form, lz4 and zstd for the pipe examples, nftables and
#         iptables for CRIU to dump a network namespace's rules, runc and
#         podman for the container tests, jq for their benchmark) and the
#         pinned MinIO server for the S3 tests (built with Go: minutes, once).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-test}
case $what in demo | test) ;; *) echo "usage: install-deps.sh [demo|test]" >&2; exit 2 ;; esac
if [ "$(id -u)" != 0 ]; then
	echo "install-deps: run as root (CRIU needs it)" >&2
	exit 1
fi
say() { printf 'install-deps: %s\n' "$*" >&2; }

# quiet CMD... runs CMD with its output kept aside, shown only if it fails.
quiet() {
	local log rc=0
	log=$(mktemp)
	"$@" >"$log" 2>&1 || rc=$?
	[ $rc = 0 ] || { cat "$log" >&2; say "failed: $*"; }
	rm -f "$log"
	return $rc
}

if [ "$what" = test ]; then
	need=()
	for tool in ip:iproute2 sshd:openssh-server ssh:openssh-client lz4:lz4 zstd:zstd nft:nftables iptables-restore:iptables jq:jq; do
		command -v "${tool%%:*}" >/dev/null 2>&1 || [ -x "/usr/sbin/${tool%%:*}" ] || need+=("${tool##*:}")
	done
	# The container runtimes without their recommends: runc's would
	# install Debian's criu (bookworm's 3.17 cannot start on these kernels)
	# on PATH beside the one installed below. Podman runs as root here
	# (no uidmap, slirp4netns or fuse-overlayfs); netavark is the network
	# backend it looks for first.
	runtimes=()
	for tool in runc:runc podman:podman conmon:conmon netavark:netavark; do
		command -v "${tool%%:*}" >/dev/null 2>&1 || [ -x "/usr/lib/podman/${tool%%:*}" ] || runtimes+=("${tool##*:}")
	done
	if [ ${#need[@]} -gt 0 ] || [ ${#runtimes[@]} -gt 0 ]; then
		say "apt-get install ${need[*]} ${runtimes[*]} (for the network, pipe and container tests)"
		quiet apt-get update -qq
	fi
	if [ ${#need[@]} -gt 0 ]; then
		DEBIAN_FRONTEND=noninteractive quiet apt-get install -y -qq "${need[@]}"
	fi
	if [ ${#runtimes[@]} -gt 0 ]; then
		DEBIAN_FRONTEND=noninteractive quiet apt-get install -y -qq --no-install-recommends "${runtimes[@]}"
	fi
fi

prefix=${CRIU_PREFIX:-/opt/gpucr-criu}
if criu=$(bash scripts/install-criu.sh --check "$prefix" 2>/dev/null); then
	say "criu: $criu"
else
	say "installing CRIU 4.2 (Debian forky's criu and the libraries it links) into $prefix: about 17 MB to download (forky's package list, 24 packages)"
	# Its lines are the progress (apt's one per package); stdout is the path.
	bash scripts/install-criu.sh "$prefix" >/dev/null
	say "criu: $prefix/bin/criu"
fi

if [ "$what" = test ]; then
	if ! bash scripts/install-minio.sh --check >/dev/null 2>&1; then
		say "building the pinned MinIO server for the S3 tests into /usr/local/bin/minio (a few minutes, once)"
	fi
	quiet bash scripts/install-minio.sh
fi
