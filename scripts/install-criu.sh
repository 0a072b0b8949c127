#!/usr/bin/env bash
# install-criu.sh [--check] [PREFIX] -- make a working CRIU >= 4.0 available
# (--check: only say whether one is, installing nothing).
#
# Debian bookworm's criu 3.17 fails on recent kernels ("vdso: Unexpected rt
# vDSO area bounds"), and trixie's 4.1.1 hangs on 6.18 kernels at the end of
# every dump (waiting for the parasite's rt_sigreturn to trap: the process
# runs on, CRIU waits forever), so unless a usable criu is already on PATH
# this unpacks Debian forky's criu (4.2) and the libraries it links into PREFIX
# (default /opt/gpucr-criu) without touching the system's apt state or libc.
# The result is run through the prefix's own dynamic loader by the wrapper
# PREFIX/bin/criu, which finds the prefix from its own location, so the whole
# directory can be copied to another machine (e.g. the GPU machine) and used
# from any path.
#
# Prints the path of a usable criu on stdout; progress goes to stderr.
set -euo pipefail

CHECK=0
if [ "${1:-}" = --check ]; then
	CHECK=1
	shift
fi
PREFIX=${1:-/opt/gpucr-criu}
SUITE=${GPUCR_CRIU_SUITE:-forky}
SYSTEM_SOURCES=/etc/apt/sources.list.d/debian.sources

# criu itself, libcompel1, trixie's libc (the loader must match the libc it
# loads), and the run-time libraries criu links transitively.
PACKAGES=(
	criu libcompel1 libc6
	libbsd0 libgnutls30t64 libnftables1 libprotobuf-c1 libnl-3-200 LIBNET
	libuuid1 libxtables12 libnftnl11 libjansson4 libmnl0 libmd0 libp11-kit0
	libidn2-0 libunistring5 libtasn1-6 libnettle8t64 libhogweed6t64 libgmp10
	libffi8 libgcc-s1
)

# Each line says how long the install has run: it is minutes of network
# waits on a fresh machine, and says so as it goes.
log() { printf 'install-criu: [%3ds] %s\n' "$SECONDS" "$*" >&2; }

# usable CRIU: reports a major version >= 4, passes `criu check` and, as
# root, really dumps a throwaway process within 20 s (`criu check` passes
# where a dump hangs).
usable() {
	local bin=$1 ver major
	[ -x "$bin" ] || return 1
	ver=$("$bin" --version 2>/dev/null | awk '/^Version:/ {print $2; exit}') || return 1
	major=${ver%%.*}
	[[ $major =~ ^[0-9]+$ ]] && [ "$major" -ge 4 ] || return 1
	"$bin" check >/dev/null 2>&1 || return 1
	[ "$(id -u)" -eq 0 ] || return 0
	local dir pid ok=1
	dir=$(mktemp -d /tmp/gpucr-criu-try.XXXXXX)
	# Not a job of this shell, whose "Killed" notice would only confuse.
	pid=$(setsid sh -c 'echo $$; exec sleep 120 >/dev/null 2>&1' </dev/null &)
	if timeout 20 "$bin" dump -D "$dir" -t "$pid" -o dump.log >/dev/null 2>&1; then
		ok=0
	else
		log "$bin ($ver) could not dump a test process: $(tail -2 "$dir/dump.log" 2>/dev/null | tr '\n' ' ')"
	fi
	kill -9 "$pid" 2>/dev/null
	rm -rf "$dir"
	return $ok
}

if sys=$(command -v criu 2>/dev/null) && usable "$sys"; then
	log "using system criu: $($sys --version | head -1)"
	echo "$sys"
	exit 0
fi

WRAPPER=$PREFIX/bin/criu
if usable "$WRAPPER"; then
	log "already installed: $($WRAPPER --version | head -1)"
	echo "$WRAPPER"
	exit 0
fi
[ $CHECK = 0 ] || exit 1

[ "$(id -u)" -eq 0 ] || { log "must run as root (apt-get download, criu check)"; exit 1; }
[ -r "$SYSTEM_SOURCES" ] || { log "$SYSTEM_SOURCES not found; need a Debian deb822 apt source"; exit 1; }
for tool in apt-get dpkg awk; do
	command -v "$tool" >/dev/null || { log "$tool not found"; exit 1; }
done

# apt's lists and .debs live in a temporary dir, so the prefix stays small
# enough to carry to another machine.
STATE=$(mktemp -d /tmp/gpucr-criu-apt.XXXXXX)
trap 'rm -rf "$STATE"' EXIT
mkdir -p "$STATE/lists/partial" "$STATE/cache/archives/partial" "$STATE/debs" "$PREFIX/bin"

# Copy the machine's own main Debian stanza (not -security/-updates) so the
# mirror host is never hard-coded, only with Suites replaced. Signed-By stays:
# bookworm's debian-archive-keyring already carries trixie's keys.
SOURCES=$STATE/gpucr-criu.sources
awk -v suite="$SUITE" '
	function flush() {
		if (n > 0 && uris != "" && uris !~ /-security/ && suites ~ /(^| )[a-z]+( |$)/ && !done) {
			for (i = 1; i <= n; i++) print lines[i]
			done = 1
		}
		n = 0; uris = ""; suites = ""
	}
	/^[[:space:]]*$/ { flush(); next }
	/^#/ { next }
	{
		key = $1
		if (key == "URIs:") uris = $0
		if (key == "Suites:") { suites = substr($0, 8); $0 = "Suites: " suite }
		lines[++n] = $0
	}
	END { flush(); if (!done) exit 1 }
' "$SYSTEM_SOURCES" >"$SOURCES" || { log "no main Debian stanza found in $SYSTEM_SOURCES"; exit 1; }
log "private apt source: $(grep -E '^(URIs|Suites):' "$SOURCES" | tr '\n' ' ')"

# Everything apt writes goes under $STATE, so the system's lists and package
# cache stay bookworm-only.
APT_OPTS=(
	-o "Dir::Etc::SourceList=$SOURCES"
	-o "Dir::Etc::SourceParts=/dev/null"
	-o "Dir::State::Lists=$STATE/lists"
	-o "Dir::Cache=$STATE/cache"
	-o "Dir::Cache::archives=$STATE/cache/archives"
	-o "APT::Sandbox::User=root"
	# Only the package lists: no translations, no AppStream metadata (a
	# third of the download).
	-o "Acquire::Languages=none"
	-o "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false"
	-o "Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false"
	-o "Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false"
)
# apt-get's own lines ("Get:N ... [size]") are the progress of the two
# download steps.
apt_lines() { sed -u 's/^/install-criu:        /' >&2; }
log "apt-get update ($SUITE): its package list, about 10 MB"
apt-get "${APT_OPTS[@]}" -q update 2>&1 | apt_lines

# libnet's package name follows its soname (libnet1 in trixie, libnet9 later).
LIBNET=$(apt-cache "${APT_OPTS[@]}" depends criu 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^libnet[0-9]+$/ {print $2; exit}')
[ -n "$LIBNET" ] || { log "criu in $SUITE depends on no libnetN package?"; exit 1; }
PACKAGES=("${PACKAGES[@]/LIBNET/$LIBNET}")
# A prefix that failed the checks above is replaced, not unpacked over.
rm -rf "${PREFIX:?}/usr" "$WRAPPER"

log "apt-get download: ${#PACKAGES[@]} packages (${PACKAGES[*]})"
(cd "$STATE/debs" && apt-get "${APT_OPTS[@]}" -q download "${PACKAGES[@]}" 2>&1 | apt_lines)

log "unpacking into $PREFIX"
for deb in "$STATE"/debs/*.deb; do
	dpkg -x "$deb" "$PREFIX"
done

rm -rf "$PREFIX"/usr/share/{doc,man,info,locale,lintian}

LIBDIR=$PREFIX/usr/lib/x86_64-linux-gnu
LOADER=$LIBDIR/ld-linux-x86-64.so.2
[ -e "$LOADER" ] || { log "loader $LOADER missing after unpack"; exit 1; }
[ -x "$PREFIX/usr/sbin/criu" ] || { log "$PREFIX/usr/sbin/criu missing after unpack"; exit 1; }

# Fail loudly on a library the package list misses, naming the soname, rather
# than letting criu die later with a loader error.
missing=$("$LOADER" --list --library-path "$LIBDIR" "$PREFIX/usr/sbin/criu" 2>&1 | awk '/not found/ {print $1}' || true)
if [ -n "$missing" ]; then
	log "libraries still missing (add their packages to PACKAGES): $missing"
	exit 1
fi

# --library-path (not LD_LIBRARY_PATH) so that programs criu execs (action
# scripts, iptables, ip) keep using the system's own libraries.
cat >"$WRAPPER" <<'EOF'
#!/bin/sh
# Runs Debian's criu through the loader and libraries unpacked next to it.
# Generated by scripts/install-criu.sh; the prefix is found from this file's
# location so the directory can be moved or copied.
here=$(dirname -- "$(readlink -f -- "$0")")
prefix=$(dirname -- "$here")
lib=$prefix/usr/lib/x86_64-linux-gnu
exec "$lib/ld-linux-x86-64.so.2" --library-path "$lib" "$prefix/usr/sbin/criu" "$@"
EOF
chmod 0755 "$WRAPPER"

if ! usable "$WRAPPER"; then
	log "installed criu does not work:"
	"$WRAPPER" --version >&2 || true
	"$WRAPPER" check >&2 || true
	exit 1
fi
log "installed: $($WRAPPER --version | head -1)"
echo "$WRAPPER"
