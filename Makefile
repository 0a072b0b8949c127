# gpucr-stream: `make demo` runs a checkpoint and restore through a local
# archive; `make test` runs everything CI runs. Both install what they need.
GO        ?= go
BIN       := bin/gpucr-stream
VERSION   ?= $(shell git describe --always --dirty 2>/dev/null || echo dev)
LDFLAGS   := -s -w -X main.version=$(VERSION)
FUZZTIME  ?= 10s
CRIU_PREFIX ?= /opt/gpucr-criu

.PHONY: build preload deps test unit e2e fuzz lint demo bench bench-migrate gpu-e2e clean

build: preload
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) ./cmd/gpucr-stream

# The library GPU processes load for the fast path (docs/PRODUCERS.md,
# section 3): C, no CUDA headers, built with the system compiler.
CC ?= cc
PRELOAD := bin/libgpucr-preload.so
preload: $(PRELOAD)
$(PRELOAD): preload/gpucr_preload.c
	@mkdir -p bin
	$(CC) -O2 -g -Wall -Wextra -fPIC -shared -fvisibility=default -o $@ $< -ldl -lpthread

# deps installs the real components the tests and the demo use.
deps:
	bash scripts/install-deps.sh

# staticcheck, pinned: the one on PATH if there is one, else installed
# into bin/tools. Its default checks, U1000 (unused code) included.
STATICCHECK_VERSION := v0.8.2
STATICCHECK ?= $(or $(shell command -v staticcheck 2>/dev/null),$(CURDIR)/bin/tools/staticcheck)

$(CURDIR)/bin/tools/staticcheck:
	GOBIN=$(CURDIR)/bin/tools $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)

lint: $(STATICCHECK)
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || { gofmt -l $$(git ls-files '*.go'); echo "gofmt needed"; exit 1; }
	$(GO) vet ./...
	$(STATICCHECK) ./...

unit:
	$(GO) test -race -short -count=1 $$($(GO) list ./... | grep -v /e2e)

# The end-to-end tests need root and real CRIU (and MinIO for S3 tests).
e2e: build
	PATH=$(CRIU_PREFIX)/bin:$$PATH $(GO) test -count=1 -timeout 40m ./e2e/...

# A short run of every fuzz target.
fuzz:
	bash scripts/fuzz.sh $(FUZZTIME)

test: deps lint unit fuzz e2e

demo: deps build
	bash scripts/demo.sh

# On a machine with an NVIDIA GPU (driver >= 570), PyTorch and CRIU >= 4.0
# (docs/BENCHMARKS.md#gpu): checkpoint and restore a PyTorch process with
# 10 GiB of checksummed tensors, against plain cuCheckpoint + criu -D.
gpu-e2e: build
	bash e2e/gpu/run.sh

bench: deps build
	bash scripts/bench.sh

# Live migration downtime between two network namespaces (docs/BENCHMARKS.md, Migration).
bench-migrate: deps
	bash scripts/bench-migrate.sh

clean:
	rm -rf bin
