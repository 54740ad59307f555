# Image with cairn-manager, cairn-csi and cairn-data. Build the binaries first
# (`make build`, static, CGO_ENABLED=0); `make docker-build` does both.
# BASE_IMAGE defaults to distroless; on machines that cannot pull, pass
# --build-arg BASE_IMAGE=scratch or a locally imported image.
ARG BASE_IMAGE=gcr.io/distroless/static:nonroot
FROM ${BASE_IMAGE}
COPY bin/cairn-manager /cairn-manager
COPY bin/cairn-csi /cairn-csi
COPY bin/cairn-data /cairn-data
USER 65532:65532
ENTRYPOINT ["/cairn-manager"]
