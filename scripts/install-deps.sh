#!/usr/bin/env bash
# Installs the Debian 12 packages gradwire needs to build and test. Idempotent: installs only
# what is missing, and touches apt not at all when nothing is.
#   scripts/install-deps.sh [build|all]
# build: what building the server and the clients needs (scripts/demo.sh); all (the default,
# scripts/test.sh): that and the tools the test suites, fuzzers and benchmarks run.
set -euo pipefail
which=${1:-all}
case "$which" in
  build | all) ;;
  *) echo "usage: scripts/install-deps.sh [build|all]" >&2; exit 2 ;;
esac
packages=(
  build-essential cmake ninja-build ccache pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libtorch-dev libopenblas0-pthread libspdlog-dev libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev
  libcpp-httplib-dev libssl-dev openssl
  # Metrics (prometheus-cpp: core and pull).
  prometheus-cpp-dev
)
if [ "$which" = all ]; then
  packages+=(
  # Prometheus itself, with promtool, for the observability tests (tests/observability). On a
  # machine with systemd the package also enables its own service on :9090; the tests run a
  # Prometheus of their own.
  prometheus
  python3-torch python3-grpcio python3-protobuf python3-numpy python3-sklearn python3-matplotlib
  python3-pytest python3-venv python3-pip python3-setuptools
  yamllint python3-yaml docker-compose gnuplot-nox
  # The proxy tests (tests/deploy/haproxy_check.sh, tests/e2e/proxy_e2e.sh): HAProxy 2.6.
  haproxy
  # Fuzzing (scripts/fuzz.sh): clang and its runtimes, libFuzzer among them.
  clang libclang-rt-14-dev
  )
  command -v kubectl >/dev/null || packages+=(kubernetes-client)
fi
missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present ($which)"
  exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root (or sudo) for: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "install-deps: installing ${missing[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
  --no-install-recommends "${missing[@]}"
echo "install-deps: done"
