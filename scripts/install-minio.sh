#!/usr/bin/env bash
# install-minio.sh [--check] [DIR] -- make the pinned MinIO server the S3
# tests use available as DIR/minio (default /usr/local/bin/minio); --check
# only says whether it is.
#
# MinIO's upstream repository is archived; the tests (store/s3, e2e) run against
# one pinned build, made with `go install` from the Go module proxy. An
# existing DIR/minio built from that version is kept, so running this again
# does nothing. Needs Go; takes a few minutes the first time.
#
# Prints the path of the minio binary on stdout; progress goes to stderr.
set -euo pipefail

VERSION=v0.0.0-20260212201848-7aac2a2c5b7c # keep in step with store/miniotest.Version
CHECK=0
if [ "${1:-}" = --check ]; then
	CHECK=1
	shift
fi
DIR=${1:-/usr/local/bin}
BIN=$DIR/minio

log() { printf 'install-minio: %s\n' "$*" >&2; }

installed_version() {
	# go version -m prints "mod <path> <version> <sum>" for the main module.
	go version -m "$1" 2>/dev/null | awk '$1 == "mod" && $2 == "github.com/minio/minio" { print $3 }'
}

if [ -x "$BIN" ]; then
	have=$(installed_version "$BIN" || true)
	if [ "$have" = "$VERSION" ]; then
		echo "$BIN"
		exit 0
	fi
	[ $CHECK = 1 ] || log "$BIN is version '${have:-unknown}', want $VERSION; reinstalling"
fi
[ $CHECK = 0 ] || exit 1

command -v go >/dev/null || { log "go is required (go install github.com/minio/minio@$VERSION)"; exit 1; }
mkdir -p "$DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
log "building github.com/minio/minio@$VERSION (a few minutes)"
# Outside any module, so that this repository's go.mod plays no part.
(cd "$tmp" && GOBIN="$tmp/bin" CGO_ENABLED=0 go install "github.com/minio/minio@$VERSION")
install -m 0755 "$tmp/bin/minio" "$BIN.tmp.$$"
mv -f "$BIN.tmp.$$" "$BIN"
echo "$BIN"
