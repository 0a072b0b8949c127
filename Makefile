# gpucr-stream: `make demo` runs a checkpoint and restore through a local
# archive; `make test` runs everything CI runs. Both install what they need
# (the demo only CRIU; the tests also Debian tools and MinIO). `make install`
# puts gpucr-stream (with gpucr-stream-swrk) and a criu wrapper in $(PREFIX)/bin.
GO        ?= go
BIN       := bin/gpucr-stream
VERSION   ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -s -w -X main.version=$(VERSION)
FUZZTIME  ?= 10s
CRIU_PREFIX ?= /opt/gpucr-criu
PREFIX    ?= /usr/local
export CRIU_PREFIX

.PHONY: build binary build-testhooks preload deps deps-demo install uninstall test unit e2e fuzz lint demo minio bench bench-migrate bench-restore bench-stream-restore bench-containers gpu-e2e clean

build: preload binary

# binary is gpucr-stream and, beside it, gpucr-stream-swrk, its swrk alone
# for container runtimes (docs/CONTAINERS.md): what the demo and install
# need, no C compiler. `go mod download` fetches the modules silently, so
# the build prints no download lines.
binary:
	@$(GO) mod download
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/gpucr-stream
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '-s -w' -o $(BIN)-swrk ./cmd/gpucr-stream-swrk

# build-testhooks is gpucr-stream with its test hooks (GPUCR_TEST_FAULT,
# GPUCR_TEST_PAUSE: package testhook), for the GPU machine's fault rounds
# (e2e/gpu/run.sh); the e2e tests build their own. Never installed: build
# and install leave the hooks out.
build-testhooks:
	@$(GO) mod download
	CGO_ENABLED=0 $(GO) build -trimpath -tags gpucr_testhooks -ldflags '$(LDFLAGS)' -o $(BIN)-testhooks ./cmd/gpucr-stream

# The library GPU processes load for the fast path (docs/PRODUCERS.md,
# section 3): C, no CUDA headers, built with the system compiler.
CC ?= cc
PRELOAD := bin/libgpucr-preload.so
preload: $(PRELOAD)
PRELOAD_SRC := $(wildcard preload/*.c)
$(PRELOAD): $(PRELOAD_SRC) preload/internal.h preload/devhash.h
	@mkdir -p bin
	$(CC) -O2 -g -Wall -Wextra -fPIC -shared -fvisibility=default -o $@ $(PRELOAD_SRC) -ldl -lpthread

# deps installs the real components the tests use; deps-demo only CRIU.
deps:
	@bash scripts/install-deps.sh test

deps-demo:
	@bash scripts/install-deps.sh demo

# install puts the binaries in $(PREFIX)/bin, the fast path's library (where
# a C compiler builds it) in $(PREFIX)/lib/gpucr-stream, where `gpucr-stream
# run` looks for it, and, where CRIU was installed into $(CRIU_PREFIX) (not
# the system's), a link to its loader wrapper as $(PREFIX)/bin/criu: the
# wrapper finds its prefix through the link.
PRELOAD_DIR := $(PREFIX)/lib/gpucr-stream
install: binary
	install -d $(DESTDIR)$(PREFIX)/bin
	install -m 0755 $(BIN) $(DESTDIR)$(PREFIX)/bin/gpucr-stream
	install -m 0755 $(BIN)-swrk $(DESTDIR)$(PREFIX)/bin/gpucr-stream-swrk
	@if command -v $(CC) >/dev/null; then \
		$(MAKE) --no-print-directory preload && \
		install -d $(DESTDIR)$(PRELOAD_DIR) && \
		install -m 0755 $(PRELOAD) $(DESTDIR)$(PRELOAD_DIR)/libgpucr-preload.so && \
		echo "installed $(DESTDIR)$(PRELOAD_DIR)/libgpucr-preload.so (gpucr-stream run)"; \
	else \
		echo "no C compiler ($(CC)): libgpucr-preload.so not built; gpucr-stream run needs it (apt-get install gcc, then make install again)"; \
	fi
	@if [ -x $(CRIU_PREFIX)/bin/criu ]; then \
		ln -sfn $(CRIU_PREFIX)/bin/criu $(DESTDIR)$(PREFIX)/bin/criu && \
		echo "installed $(DESTDIR)$(PREFIX)/bin/criu -> $(CRIU_PREFIX)/bin/criu"; \
	else \
		echo "no CRIU in $(CRIU_PREFIX) (make deps-demo installs one); using the system's: $$(command -v criu || echo none)"; \
	fi
	@echo "installed $(DESTDIR)$(PREFIX)/bin/gpucr-stream ($(VERSION))"

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/gpucr-stream $(DESTDIR)$(PREFIX)/bin/gpucr-stream-swrk $(DESTDIR)$(PRELOAD_DIR)/libgpucr-preload.so
	-rmdir $(DESTDIR)$(PRELOAD_DIR) 2>/dev/null
	@if [ -L $(DESTDIR)$(PREFIX)/bin/criu ] && [ "$$(readlink $(DESTDIR)$(PREFIX)/bin/criu)" = $(CRIU_PREFIX)/bin/criu ]; then \
		rm -f $(DESTDIR)$(PREFIX)/bin/criu; fi

# staticcheck, pinned: the one on PATH if there is one, else installed
# into bin/tools. Its default checks, U1000 (unused code) included.
STATICCHECK_VERSION := v0.8.2
STATICCHECK ?= $(or $(shell command -v staticcheck 2>/dev/null),$(CURDIR)/bin/tools/staticcheck)

$(CURDIR)/bin/tools/staticcheck:
	GOBIN=$(CURDIR)/bin/tools $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

# The build with test hooks (gpucr_testhooks) is vetted and checked too;
# its own tests are in the packages that have a test file of that tag.
TESTHOOKS_PKGS = $$(grep -rl --include='*_test.go' '^//go:build gpucr_testhooks' . | xargs -n1 dirname | sort -u)

lint: $(STATICCHECK)
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt needed"; exit 1; }
	$(GO) vet ./...
	$(GO) vet -tags gpucr_testhooks ./...
	$(STATICCHECK) ./...
	$(STATICCHECK) -tags gpucr_testhooks ./...

# go test's own deadline (10m a package by default) guards against a hang,
# not a loaded machine: under a load average of 20 on 2 cores, source's
# tests ran past it (docs/bench-log/2026-12.md, "The first day").
UNIT_TIMEOUT ?= 30m
unit:
	$(GO) test -race -short -count=1 -timeout $(UNIT_TIMEOUT) $$($(GO) list ./... | grep -v /e2e)
	$(GO) test -race -short -count=1 -timeout $(UNIT_TIMEOUT) -tags gpucr_testhooks $(TESTHOOKS_PKGS)

# The end-to-end tests need root and real CRIU (and MinIO for S3 tests).
# Each test is named as it starts and ends (scripts/testsum); a failed
# test's whole log is printed (E2E_VERBOSE=1: every test's).
e2e: build
	PATH=$(CRIU_PREFIX)/bin:$$PATH $(GO) run ./scripts/testsum $(if $(E2E_VERBOSE),-v) -- -count=1 -timeout 40m ./e2e/...

# A short run of every fuzz target.
fuzz:
	bash scripts/fuzz.sh $(FUZZTIME)

# Every stage runs to its end, whatever the others did; the failures are
# listed at the end, with each stage's time (scripts/test.sh).
test:
	@MAKE="$(MAKE)" bash scripts/test.sh deps lint unit fuzz e2e

# A local S3 to try gpucr-stream with: MinIO on 127.0.0.1, random
# credentials, a new data directory; prints what to export and how to
# stop it (scripts/minio.sh).
minio:
	@bash scripts/minio.sh

# CRIU's install (mostly network waits, each step printed as it goes)
# runs beside the build (mostly CPU). Times measured: docs/PERFORMANCE.md#demo.
demo:
	@echo "demo: installing CRIU (unless there) and building gpucr-stream side by side; a first build compiles every dependency (minutes on 2 cores)"
	@$(MAKE) --no-print-directory -j2 deps-demo binary
	@bash scripts/demo.sh

# On a machine with an NVIDIA GPU (driver >= 570), PyTorch and CRIU >= 4.0
# (docs/PERFORMANCE.md, GPU processes): checkpoint and restore a PyTorch process with
# 10 GiB of checksummed tensors, against plain cuCheckpoint + criu -D.
gpu-e2e: build build-testhooks
	bash e2e/gpu/run.sh

bench: deps build
	bash scripts/bench.sh

# Live migration downtime between two network namespaces (docs/PERFORMANCE.md#migrate).
bench-migrate: deps
	bash scripts/bench-migrate.sh

# A restore through serve split into serve's start, CRIU and serve's exit,
# beside criu restore -D (docs/bench-log/2026-11.md, "Restore: inside CRIU or around it").
bench-restore: deps build
	bash scripts/bench-restore.sh

# Restore from a stream (cat STREAM | serve, serve --early, restore --from -)
# beside criu restore -D (docs/PERFORMANCE.md#pages-last; docs/bench-log/2026-11.md, "Restore from a stream while it is read").
bench-stream-restore: deps build
	bash scripts/bench-stream-restore.sh

# A runc container through gpucr-stream against plain runc checkpoint and
# restore into tmpfs, and a second --dedup checkpoint of it unchanged
# (docs/CONTAINERS.md, "Measured").
bench-containers: deps build
	bash scripts/bench-containers.sh

clean:
	rm -rf bin
