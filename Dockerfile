# Image of the manager (cairn-manager): a static binary. Build it first
# (`make build`, CGO_ENABLED=0); `make docker-build` builds all three images
# (this one, Dockerfile.data and Dockerfile.csi). BASE_IMAGE defaults to
# distroless; on machines that cannot pull, scratch works as well.
ARG BASE_IMAGE=gcr.io/distroless/static:nonroot
FROM ${BASE_IMAGE}
COPY bin/cairn-manager /cairn-manager
USER 65532:65532
ENTRYPOINT ["/cairn-manager"]
