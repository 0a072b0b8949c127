#!/usr/bin/env bash
# bench-migrate.sh -- live migration downtime between two network
# namespaces (veth pair, TLS, real CRIU on both sides) against the sum of
# `criu dump -D` to tmpfs and `criu restore -D` from tmpfs on one host.
# A fresh target for every measurement, the variants interleaved round by
# round, medians and ratios at the end (e2e/bench_migrate_test.go does the
# work with the e2e harness, which reaps the dumped target as an init does).
# Run as root (`make bench-migrate`). Tunables: BENCH_MB (target size,
# default 1024), BENCH_ROUNDS (default 3), BENCH_VARIANTS (default
# "plain s1 s2 s4 s2-none": plain = the criu baseline, sN = migrate
# --streams N, -none = --codec none, -nokeep = --keep-dir none, -hashes =
# --chunk-hashes, -before = the receiver run from BENCH_BEFORE, another
# build, e.g. main's before a change, -off = --precopy off: stop-and-copy),
# BENCH_SHAPE (shape the link with tc tbf, e.g. 10gbit), BENCH_REWRITE (the
# target rewrites this percentage of its pages a second), BENCH_OUT
# (markdown result file). Pre-copy against stop-and-copy:
#   BENCH_VARIANTS="s2 s2-off" BENCH_REWRITE=5 [BENCH_SHAPE=10gbit]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
	echo "bench-migrate: run as root (CRIU and network namespaces need it)" >&2
	exit 1
fi
GPUCR_CRIU=${GPUCR_CRIU:-$(bash scripts/install-criu.sh)}
OUT=${BENCH_OUT:-$(mktemp /tmp/gcs-bench-migrate-XXXX.md)}
export GPUCR_CRIU GPUCR_BENCH_MIGRATE=1 GPUCR_BENCH_OUT=$OUT
export GPUCR_BENCH_MB=${BENCH_MB:-1024} GPUCR_BENCH_ROUNDS=${BENCH_ROUNDS:-3}
export GPUCR_BENCH_VARIANTS=${BENCH_VARIANTS:-"plain s1 s2 s4 s2-none"}
export GPUCR_BENCH_SHAPE=${BENCH_SHAPE:-} GPUCR_BENCH_BEFORE=${BENCH_BEFORE:-}
export GPUCR_BENCH_REWRITE=${BENCH_REWRITE:-0}
go test -count=1 -timeout 60m -run '^TestBenchMigrate$' -v ./e2e >&2
cat "$OUT"
