# kvselect developer targets. `make ci` is what .ci/run executes.
GO ?= go
PKGS ?= ./... ./examples/... ./replica/natsbus/...
FUZZTIME ?= 10s
BENCHCOUNT ?= 6
SOAKTIME ?= 1m
DOCKER ?= docker
IMAGE_PREFIX ?= kvselect-
IMAGE_TAG ?= dev
BASE_IMAGE ?= scratch

.PHONY: test race lint fuzz-smoke bench soak ci e2e-kube image

test: ## unit tests, the README's test command
	$(GO) test $(PKGS)

race: ## unit tests under the race detector
	$(GO) test -race $(PKGS)

lint: ## formatting and vet
	@out="$$(gofmt -l .)"; if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)

fuzz-smoke: ## run every fuzz target briefly
	./scripts/fuzz-smoke.sh $(FUZZTIME)

bench: ## run the benchmarks and regenerate docs/BENCHMARKS.md
	$(GO) run ./internal/benchreport -count $(BENCHCOUNT)

soak: ## churn soak of the KV index (workers leaving and joining, events flowing): its heap must stay flat
	$(GO) test -tags soak -run TestChurnSoak -v ./kvindex/ -args -soak $(SOAKTIME)

e2e-kube: ## end-to-end tests against a real kube-apiserver and etcd (docs/E2E.md)
	./scripts/kube-e2e.sh

image: ## build the images of the three binaries with Docker (docs/DEPLOY.md; not run in CI, which runs their go build)
	@for b in epp gateway pdsidecar; do \
		echo "== $(IMAGE_PREFIX)$$b:$(IMAGE_TAG)"; \
		$(DOCKER) build -f examples/$$b/Dockerfile --build-arg BASE_IMAGE=$(BASE_IMAGE) -t $(IMAGE_PREFIX)$$b:$(IMAGE_TAG) . || exit 1; \
	done

ci: lint race fuzz-smoke
