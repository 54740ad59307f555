# Cairn Makefile. `make help` lists the targets.
#
# Parsing this file never touches the network: tools are installed by the
# targets that need them, pinned below, into ./bin. Heavy builds (envtest's
# kube-apiserver and etcd) are cached in $(CAIRN_CACHE) so a fresh clone on
# the same machine reuses them.

SHELL := /usr/bin/env bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

# Images: the manager, the data plane (instance manager, engine, replica)
# and the CSI driver.
IMG ?= cairn-manager:dev
DATA_IMG ?= cairn-data:dev
CSI_IMG ?= cairn-csi:dev
# Bases the images are built FROM (build arguments): the manager's
# (distroless by default) and the node-side images' (Debian bookworm).
# Empty picks the public default, or kind-offline's local Debian where it
# has been built (hack/docker-build.sh).
BASE_IMAGE ?=
NODE_BASE_IMAGE ?=
CONTAINER_TOOL ?= docker
KUBECTL ?= kubectl

LOCALBIN ?= $(CURDIR)/bin
CAIRN_CACHE ?= $(HOME)/.cache/cairn
GO ?= go
GOTESTFLAGS ?= -race -count=1 -timeout 45m

## Tool versions (pinned).
CONTROLLER_TOOLS_VERSION ?= v0.23.0
KUSTOMIZE_VERSION ?= v5.7.1
ENVTEST_K8S_VERSION ?= 1.37.1
ENVTEST_ETCD_VERSION ?= 3.7.3

PROTOC_GEN_GO_VERSION ?= v1.36.11
PROTOC_GEN_GO_GRPC_VERSION ?= v1.6.2
GOLANGCI_LINT_VERSION ?= v2.15.0

CONTROLLER_GEN ?= $(LOCALBIN)/controller-gen-$(CONTROLLER_TOOLS_VERSION)
KUSTOMIZE ?= $(LOCALBIN)/kustomize-$(KUSTOMIZE_VERSION)
PROTOC_GEN_GO ?= $(LOCALBIN)/protoc-gen-go-$(PROTOC_GEN_GO_VERSION)
PROTOC_GEN_GO_GRPC ?= $(LOCALBIN)/protoc-gen-go-grpc-$(PROTOC_GEN_GO_GRPC_VERSION)
GOLANGCI_LINT ?= $(LOCALBIN)/golangci-lint-$(GOLANGCI_LINT_VERSION)
PROTOS := $(shell find dataplane/api -name '*.proto' 2>/dev/null)

##@ General

.PHONY: help
help: ## Show this help.
	@awk 'BEGIN {FS = ":.*##"; printf "Usage: make <target>\n"} \
	  /^[a-zA-Z0-9_-]+:.*?##/ { printf "  \033[36m%-16s\033[0m %s\n", $$1, $$2 } \
	  /^##@/ { printf "\n\033[1m%s\033[0m\n", substr($$0, 5) }' $(MAKEFILE_LIST)

##@ Development

.PHONY: manifests
manifests: $(CONTROLLER_GEN) ## Generate CRDs (config/crd/bases) and RBAC (config/rbac/role.yaml) from markers.
	$(CONTROLLER_GEN) rbac:roleName=manager-role crd paths="./api/..." paths="./controllers/..." \
	  output:crd:artifacts:config=config/crd/bases output:rbac:artifacts:config=config/rbac

.PHONY: generate
generate: $(CONTROLLER_GEN) proto ## Generate DeepCopy methods (api/v1alpha1/zz_generated.deepcopy.go) and gRPC code.
	$(CONTROLLER_GEN) object:headerFile="hack/boilerplate.go.txt" paths="./api/..."

.PHONY: proto
proto: $(PROTOC_GEN_GO) $(PROTOC_GEN_GO_GRPC) ## Generate Go code from dataplane/api/**/*.proto (protoc from Debian's protobuf-compiler).
	hack/install-protoc.sh
	cd dataplane/api && protoc --proto_path=. \
	  --plugin=protoc-gen-go=$(PROTOC_GEN_GO) --go_out=. --go_opt=paths=source_relative \
	  --plugin=protoc-gen-go-grpc=$(PROTOC_GEN_GO_GRPC) --go-grpc_out=. --go-grpc_opt=paths=source_relative \
	  $(patsubst dataplane/api/%,%,$(PROTOS))

.PHONY: fmt
fmt: ## Run gofmt -w on both modules.
	gofmt -s -w $$(git ls-files --cached --others --exclude-standard '*.go')

.PHONY: vet
vet: ## Run go vet on both modules.
	$(GO) vet ./... ./dataplane/...

.PHONY: lint
lint: vet $(GOLANGCI_LINT) ## go vet, a gofmt check (fails on unformatted files) and golangci-lint (.golangci.yml) over both modules.
	@unformatted=$$(gofmt -s -l $$(git ls-files --cached --others --exclude-standard '*.go')); \
	if [[ -n "$$unformatted" ]]; then echo "not gofmt -s formatted (run 'make fmt'):"; echo "$$unformatted"; exit 1; fi
	$(GOLANGCI_LINT) run --build-tags e2e,chaoscluster ./... ./dataplane/...

.PHONY: verify
verify: $(CONTROLLER_GEN) $(KUSTOMIZE) $(PROTOC_GEN_GO) $(PROTOC_GEN_GO_GRPC) ## Regenerate code and manifests and fail if that changes anything; build kustomizations.
	CONTROLLER_GEN=$(CONTROLLER_GEN) hack/verify-generated.sh
	@for k in config/crd config/rbac config/samples config/default config/storage config/csi config/instance-manager config/snapshot-controller config/monitoring; do \
	  $(KUSTOMIZE) build $$k >/dev/null || { echo "kustomize build $$k failed"; exit 1; }; done
	@echo "kustomize: config/{crd,rbac,samples,default,storage,csi,instance-manager,snapshot-controller,monitoring} build"
	@for m in . dataplane; do (cd $$m && GOWORK=off $(GO) mod tidy -diff >/dev/null) || { \
	  echo "go.mod/go.sum in $$m are not tidy: run 'cd $$m && GOWORK=off go mod tidy' and commit"; exit 1; }; done
	@echo "go mod tidy: both modules tidy"

.PHONY: envtest
envtest: ## Get kube-apiserver, etcd and kubectl for envtest into bin/k8s (built offline when ../shared/tools is present).
	@LOCALBIN=$(LOCALBIN) CAIRN_CACHE=$(CAIRN_CACHE) ENVTEST_K8S_VERSION=$(ENVTEST_K8S_VERSION) \
	  ENVTEST_ETCD_VERSION=$(ENVTEST_ETCD_VERSION) hack/envtest.sh >/dev/null

.PHONY: test-tools
test-tools: ## Install the real clients the tests drive (qemu-utils, libnbd-bin, fio, e2fsprogs, iptables, user-mode-linux) if missing.
	hack/install-test-tools.sh
	CAIRN_CACHE=$(CAIRN_CACHE) hack/install-versitygw.sh >/dev/null

.PHONY: test
test: verify lint envtest test-tools ## Verify generated code, lint, run every test of both modules (envtest included), build each module alone.
	export KUBEBUILDER_ASSETS="$$(LOCALBIN=$(LOCALBIN) CAIRN_CACHE=$(CAIRN_CACHE) ENVTEST_K8S_VERSION=$(ENVTEST_K8S_VERSION) ENVTEST_ETCD_VERSION=$(ENVTEST_ETCD_VERSION) hack/envtest.sh)"; \
	  CAIRN_REQUIRE_UML=1 $(GO) test $(GOTESTFLAGS) ./... ./dataplane/...
	GOWORK=off $(GO) build ./...
	cd dataplane && GOWORK=off $(GO) build ./...

FUZZTIME ?= 60s

.PHONY: bench
bench: build ## fio: raw file vs qemu-nbd vs the engine with 1 and 3 replicas (tables with ratios; one on an emulated device-bound disk; encryption at rest; data-port key and TLS), and a 1 GiB rebuild.
	hack/install-test-tools.sh
	cd dataplane && $(GO) run ./test/bench --bin $(LOCALBIN)/cairn-data $(BENCHFLAGS)

.PHONY: bench-footprint
VOLUMES ?= 50
bench-footprint: build ## Memory (RSS split, PSS), threads, descriptors, idle CPU and wake-ups per attached three-replica volume (with IM=1 each engine's status stream held open, as the engine controller does): make bench-footprint [VOLUMES=50] [IM=1: started by one instance manager, whose own footprint and limits are reported] (qemu-nbd as the yardstick).
	hack/install-test-tools.sh
	cd dataplane && $(GO) run ./test/bench --bin $(LOCALBIN)/cairn-data --footprint $(VOLUMES) $(if $(IM),--footprint-im) $(BENCHFLAGS)

.PHONY: bench-backup
bench-backup: build ## Backups against versitygw on 127.0.0.1: full backup and restore of a 1 GiB random volume from a real replica vs a plain S3 client (ratios), incremental after changing 1 %: make bench-backup [BENCHFLAGS=--size=256M]
	CAIRN_CACHE=$(CAIRN_CACHE) hack/install-versitygw.sh >/dev/null
	cd dataplane && CAIRN_CACHE=$(CAIRN_CACHE) $(GO) run ./test/benchbackup --bin $(LOCALBIN)/cairn-data $(BENCHFLAGS)

.PHONY: bench-cluster
bench-cluster: build ## fio in pods on the e2e kind cluster: Cairn claims (ext4, block; 1 and 3 replicas) vs a hostPath directory of the same node, and the same engine with one replica at its NBD socket on this machine, medians and ratios; PVC -> pod Running for 1 and 20 claims; on kind, where each job's CPU goes per I/O (brings up or reuses the cluster cairn-e2e and keeps it).
	hack/install-test-tools.sh
	CAIRN_DATA_BIN=$(LOCALBIN)/cairn-data hack/bench-cluster.sh

.PHONY: chaos
SCHEDULES ?= 100
SEED ?= 0
chaos: ## Randomized fault schedules against real processes: make chaos SCHEDULES=N SEED=S [FAULTS=a,b] [UNSAFE=1] (root).
	hack/install-test-tools.sh
	cd dataplane && $(GO) test -v -count=1 -timeout 0 -run '^TestChaos$$' ./test/chaos -args \
	  -chaos.schedules=$(SCHEDULES) -chaos.seed=$(SEED) $(if $(FAULTS),-chaos.faults=$(FAULTS)) $(if $(UNSAFE),-chaos.unsafe-engine)

.PHONY: chaos-cluster
chaos-cluster: ## Whole-stack fault schedules on the e2e kind cluster (Cairn deployed): make chaos-cluster SCHEDULES=N SEED=S [STEPS=k] [FAULTS=a,b] (default 1 schedule).
	$(GO) test -v -count=1 -timeout 0 -tags chaoscluster -run '^TestChaosCluster$$' ./test/chaoscluster -args \
	  -chaoscluster.schedules=$(if $(filter command line environment,$(origin SCHEDULES)),$(SCHEDULES),1) -chaoscluster.seed=$(SEED) \
	  $(if $(STEPS),-chaoscluster.steps=$(STEPS)) $(if $(FAULTS),-chaoscluster.faults=$(FAULTS))

.PHONY: test-e2e
test-e2e: build ## The e2e suite (test/e2e) on a three-node kind cluster with Cairn deployed from this tree; KEEP=1 keeps the cluster.
	hack/test-e2e.sh

.PHONY: test-conformance
test-conformance: ## Kubernetes' CSI driver suites (External Storage) against Cairn on the e2e kind cluster: test/driver.yaml, a skip list with reasons, a summary (hack/test-conformance.sh; long, see docs/csi.md#conformance).
	hack/test-conformance.sh

.PHONY: demo demo-kind
demo: build ## See it work on Kubernetes: a three-node kind cluster (node image built offline the first time: minutes), Cairn deployed, a PVC written by a pod, a replica's node stopped and back, the repair shown live, the data verified, the instance manager restarted under a writer, a backup to an in-cluster S3 server restored into a larger claim.
	hack/demo-kind.sh

demo-kind: demo ## The same as demo (its former name).

.PHONY: demo-dataplane
demo-dataplane: build ## The data plane alone, no Kubernetes: 3 replicas + engine on loopback, snapshot, kill one, rebuild, verify every byte, revert.
	hack/install-test-tools.sh
	hack/demo.sh

.PHONY: bench-replica
bench-replica: ## 4 KiB random I/O through dataconn to one replica vs the raw file (ratio), index memory per TiB, and direct I/O through io_uring vs pread/pwrite (CPU per I/O).
	cd dataplane && $(GO) test -run '^$$' -bench . -benchtime 1x ./replica/...
	cd dataplane && $(GO) test -run '^$$' -bench Direct4K -benchtime 3s ./internal/uring/

.PHONY: bench-control
bench-control: envtest ## Control plane: create -> attached latency (1 and 20 volumes, ratio to starting the processes directly), reconciles/s, heap at 1,000 volumes.
	hack/install-test-tools.sh
	export KUBEBUILDER_ASSETS="$$(LOCALBIN=$(LOCALBIN) CAIRN_CACHE=$(CAIRN_CACHE) ENVTEST_K8S_VERSION=$(ENVTEST_K8S_VERSION) ENVTEST_ETCD_VERSION=$(ENVTEST_ETCD_VERSION) hack/envtest.sh)"; \
	  CAIRN_BENCH_CONTROL=1 $(GO) test -v -count=1 -timeout 30m -run '^TestBenchControl$$' ./controllers/volume/

.PHONY: fuzz
fuzz: ## Fuzz the dataconn decoder, a live dataconn server and the authentication handshake, $(FUZZTIME) each (new crashers land in dataplane/dataconn/testdata/fuzz).
	cd dataplane && $(GO) test -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME) ./dataconn
	cd dataplane && $(GO) test -run '^$$' -fuzz '^FuzzServer$$' -fuzztime $(FUZZTIME) -fuzzminimizetime 200x ./dataconn
	cd dataplane && $(GO) test -run '^$$' -fuzz '^FuzzServerHandshake$$' -fuzztime $(FUZZTIME) ./dataconn
	cd dataplane && $(GO) test -run '^$$' -fuzz '^FuzzAuthDecode$$' -fuzztime $(FUZZTIME) ./dataconn

##@ Build

.PHONY: build
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)

build: ## Build bin/cairn-manager, bin/cairn-csi, bin/cairn-data and bin/kubectl-cairn (static, stripped: -s -w keeps function names in stack traces, drops the symbol table and DWARF).
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w" -o $(LOCALBIN)/cairn-manager ./cmd/manager
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w -X main.version=$(VERSION)" -o $(LOCALBIN)/cairn-csi ./cmd/cairn-csi
	cd dataplane && CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w -X github.com/cairn-io/cairn/dataplane.Version=$(VERSION)" -o $(LOCALBIN)/cairn-data ./cmd/cairn-data
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w" -o $(LOCALBIN)/kubectl-cairn ./cmd/kubectl-cairn

.PHONY: run
run: manifests generate fmt vet ## Run the manager on this machine against the cluster in KUBECONFIG.
	$(GO) run ./cmd/manager

.PHONY: docker-build
docker-build: build ## Build the images $(IMG), $(DATA_IMG) and $(CSI_IMG) with the binaries from `make build`.
	CONTAINER_TOOL=$(CONTAINER_TOOL) IMG=$(IMG) DATA_IMG=$(DATA_IMG) CSI_IMG=$(CSI_IMG) \
	  BASE_IMAGE=$(BASE_IMAGE) NODE_BASE_IMAGE=$(NODE_BASE_IMAGE) hack/docker-build.sh

.PHONY: docker-push
docker-push: ## Push the images.
	for i in $(IMG) $(DATA_IMG) $(CSI_IMG); do $(CONTAINER_TOOL) push $$i; done

##@ Deployment

.PHONY: install
install: manifests $(KUSTOMIZE) ## Install the CRDs into the cluster in KUBECONFIG.
	$(KUSTOMIZE) build config/crd | $(KUBECTL) apply --server-side -f -

.PHONY: uninstall
uninstall: manifests $(KUSTOMIZE) ## Remove the CRDs (and every Cairn object) from the cluster.
	$(KUSTOMIZE) build config/crd | $(KUBECTL) delete --ignore-not-found -f -

.PHONY: deploy
deploy: manifests $(KUSTOMIZE) ## Deploy or upgrade Cairn with images $(IMG), $(DATA_IMG), $(CSI_IMG) in the cluster in KUBECONFIG: CRDs and RBAC, then the manager, the CSI controller, the CSI node plugin and the instance managers, each rolled out before the next (hack/deploy.sh; docs/install.md#upgrade).
	cd config/manager && $(KUSTOMIZE) edit set image controller=$(IMG)
	cd config/instance-manager && $(KUSTOMIZE) edit set image cairn-data=$(DATA_IMG)
	cd config/csi && $(KUSTOMIZE) edit set image cairn-csi=$(CSI_IMG) cairn-data=$(DATA_IMG)
	KUSTOMIZE=$(KUSTOMIZE) KUBECTL=$(KUBECTL) hack/deploy.sh

SNAPSHOTTER_VERSION ?= v8.7.0

.PHONY: deploy-snapshot-controller
deploy-snapshot-controller: $(KUSTOMIZE) ## For clusters without VolumeSnapshot support (kind): the snapshot CRDs (from the external-snapshotter client module) and snapshot-controller.
	crds="$$($(GO) mod download -json github.com/kubernetes-csi/external-snapshotter/client/v8@$(SNAPSHOTTER_VERSION) | sed -n 's/^\t"Dir": "\(.*\)",$$/\1/p')/config/crd"; \
	  $(KUBECTL) apply --server-side -k "$$crds"
	$(KUSTOMIZE) build config/snapshot-controller | $(KUBECTL) apply --server-side -f -

.PHONY: undeploy
undeploy: $(KUSTOMIZE) ## Remove what `make deploy` created (delete your PVCs first: their volumes' data goes with the CRDs).
	-$(KUBECTL) delete --ignore-not-found -f config/storage/volumesnapshotclass.yaml
	$(KUSTOMIZE) build config/storage | $(KUBECTL) delete --ignore-not-found -f -
	$(KUSTOMIZE) build config/default | $(KUBECTL) delete --ignore-not-found -f -

##@ Tools

$(LOCALBIN):
	mkdir -p $(LOCALBIN)

$(CONTROLLER_GEN): | $(LOCALBIN)
	hack/go-install-tool.sh $@ sigs.k8s.io/controller-tools/cmd/controller-gen $(CONTROLLER_TOOLS_VERSION)

$(KUSTOMIZE): | $(LOCALBIN)
	hack/go-install-tool.sh $@ sigs.k8s.io/kustomize/kustomize/v5 $(KUSTOMIZE_VERSION)

$(PROTOC_GEN_GO): | $(LOCALBIN)
	hack/go-install-tool.sh $@ google.golang.org/protobuf/cmd/protoc-gen-go $(PROTOC_GEN_GO_VERSION)

$(PROTOC_GEN_GO_GRPC): | $(LOCALBIN)
	hack/go-install-tool.sh $@ google.golang.org/grpc/cmd/protoc-gen-go-grpc $(PROTOC_GEN_GO_GRPC_VERSION)

$(GOLANGCI_LINT): | $(LOCALBIN)
	hack/go-install-tool.sh $@ github.com/golangci/golangci-lint/v2/cmd/golangci-lint $(GOLANGCI_LINT_VERSION)

.PHONY: tools
tools: $(CONTROLLER_GEN) $(KUSTOMIZE) $(PROTOC_GEN_GO) $(PROTOC_GEN_GO_GRPC) $(GOLANGCI_LINT) envtest ## Install every pinned tool.
