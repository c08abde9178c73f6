# syntax=docker/dockerfile:1
# gradwire images. Two targets, same shape (builder stage, then a slim runtime stage that holds only
# the two binaries and the runtime libraries they link):
#   cpu   Debian 12 (bookworm-slim), the reference FP8 backend:   docker build --target cpu -t gradwire:cpu .
#   cuda  NVIDIA's CUDA 13 images (Ubuntu 24.04), libtorch from the PyTorch CUDA wheel:
#                                                                 docker build --target cuda -t gradwire:cuda .
# Layers go from what changes least (system packages) to what changes most (sources), so a code
# change rebuilds only the compile and copy layers. The server runs as an unprivileged user.
# Listening on 0.0.0.0 needs TLS and bearer tokens (or --insecure on a private network): pass them
# as flags, GRADWIRE_SERVER_* variables or a --config file. See deploy/README.md.

ARG DEBIAN_IMAGE=debian:bookworm-slim
ARG CUDA_DEVEL_IMAGE=nvidia/cuda:13.0.0-cudnn-devel-ubuntu24.04
ARG CUDA_RUNTIME_IMAGE=nvidia/cuda:13.0.0-cudnn-runtime-ubuntu24.04

# ---------------------------------------------------------------------------------------------
# The sources both builder stages compile, and scripts/container-build.sh, which compiles them there
# (configure with the stage's CMake arguments, build, install the three binaries to /out).
FROM scratch AS sources
COPY CMakeLists.txt /src/
COPY proto /src/proto
COPY kernels /src/kernels
COPY wire /src/wire
COPY storage /src/storage
COPY server /src/server
COPY client /src/client
COPY scripts/container-build.sh /src/scripts/

# ---------------------------------------------------------------------------------------------
FROM ${DEBIAN_IMAGE} AS cpu-builder
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      build-essential cmake ninja-build ccache pkg-config \
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
      libtorch-dev libspdlog-dev libcli11-dev nlohmann-json3-dev libcpp-httplib-dev \
      prometheus-cpp-dev libssl-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY --from=sources /src /src
ENV CCACHE_DIR=/root/.cache/ccache
RUN --mount=type=cache,target=/root/.cache/ccache \
    scripts/container-build.sh --strip -DGRADWIRE_CUDA=OFF

# ---------------------------------------------------------------------------------------------
FROM ${DEBIAN_IMAGE} AS cpu
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libtorch1.13 libopenblas0-pthread libgrpc++1.51 libprotobuf32 libspdlog1.10 libcpp-httplib0.11 libssl3 \
      libprometheus-cpp-core1.0 \
      ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/gradwire --create-home \
         --shell /usr/sbin/nologin gradwire
COPY --from=cpu-builder /out/gradwire-server /out/gradwire /out/gradwire-load /usr/local/bin/
USER 10001:10001
WORKDIR /var/lib/gradwire
VOLUME /var/lib/gradwire
# 50051: gRPC; 9464: Prometheus /metrics (with --metrics-listen 0.0.0.0:9464).
EXPOSE 50051 9464
ENV GRADWIRE_SERVER_LISTEN=0.0.0.0:50051
# The probe dials the port of GRADWIRE_SERVER_LISTEN on loopback; health needs no token.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD gradwire health --server "127.0.0.1:${GRADWIRE_SERVER_LISTEN##*:}" --timeout 3 \
      ${GRADWIRE_HEALTH_FLAGS:-} >/dev/null || exit 1
ENTRYPOINT ["gradwire-server"]

# ---------------------------------------------------------------------------------------------
FROM ${CUDA_DEVEL_IMAGE} AS cuda-builder
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      build-essential cmake ninja-build ccache pkg-config python3 python3-pip \
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
      libspdlog-dev libcli11-dev nlohmann-json3-dev libcpp-httplib-dev prometheus-cpp-dev libssl-dev \
    && rm -rf /var/lib/apt/lists/*
# libtorch with CUDA: the PyTorch wheel carries it (headers, CMake config, shared libraries).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
RUN pip3 install --no-cache-dir --break-system-packages --index-url "${TORCH_INDEX_URL}" torch \
    && ln -s "$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')" /opt/torch
WORKDIR /src
COPY --from=sources /src /src
ENV CCACHE_DIR=/root/.cache/ccache
RUN --mount=type=cache,target=/root/.cache/ccache \
    scripts/container-build.sh -DGRADWIRE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="90" \
      -DCMAKE_PREFIX_PATH=/opt/torch/share/cmake \
    && mkdir -p /out/torch-lib && cp -a /opt/torch/lib/*.so* /out/torch-lib/ \
    && cp -a /usr/lib/*-linux-gnu/libprometheus-cpp-core.so.* /out/torch-lib/
# (prometheus-cpp's core rides along with libtorch's libraries: its runtime package's name changes
# between Ubuntu releases, the builder's own copy does not.)

# ---------------------------------------------------------------------------------------------
FROM ${CUDA_RUNTIME_IMAGE} AS cuda
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51t64 libprotobuf32t64 libspdlog1.12 libcpp-httplib0.14 libssl3t64 libgomp1 \
      ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --home-dir /var/lib/gradwire --create-home \
         --shell /usr/sbin/nologin gradwire
COPY --from=cuda-builder /out/torch-lib/ /opt/libtorch/lib/
COPY --from=cuda-builder /out/gradwire-server /out/gradwire /out/gradwire-load /usr/local/bin/
ENV LD_LIBRARY_PATH=/opt/libtorch/lib:${LD_LIBRARY_PATH}
USER 10001:10001
WORKDIR /var/lib/gradwire
VOLUME /var/lib/gradwire
EXPOSE 50051 9464
ENV GRADWIRE_SERVER_LISTEN=0.0.0.0:50051 GRADWIRE_SERVER_DEVICE=auto
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD gradwire health --server "127.0.0.1:${GRADWIRE_SERVER_LISTEN##*:}" --timeout 3 \
      ${GRADWIRE_HEALTH_FLAGS:-} >/dev/null || exit 1
ENTRYPOINT ["gradwire-server"]
