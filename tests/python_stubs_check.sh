#!/usr/bin/env bash
# The Python package's committed protocol stubs (client/python/gradwire/v1) must be exactly what
# protoc generates from proto/gradwire/v1 today. After changing a .proto, regenerate them with:
#   tests/python_stubs_check.sh --update
# Usage: tests/python_stubs_check.sh [--update] [repository root]
set -euo pipefail
update=0
if [ "${1:-}" = "--update" ]; then
  update=1
  shift
fi
root=$(cd "${1:-$(dirname "$0")/..}" && pwd)
plugin=$(command -v grpc_python_plugin) || {
  echo "python stubs: grpc_python_plugin not found (Debian: protobuf-compiler-grpc)" >&2
  exit 1
}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
protos=(gradwire/v1/tensor.proto gradwire/v1/module.proto gradwire/v1/service.proto)
(cd "$root/proto" && protoc --proto_path=. --python_out="$out" --grpc_python_out="$out" \
  --plugin=protoc-gen-grpc_python="$plugin" "${protos[@]}")
committed="$root/client/python/gradwire/v1"
if [ "$update" = 1 ]; then
  cp "$out"/gradwire/v1/*.py "$committed/"
  echo "python stubs: updated $committed"
  exit 0
fi
status=0
for f in "$out"/gradwire/v1/*.py; do
  name=$(basename "$f")
  if ! cmp -s "$f" "$committed/$name"; then
    echo "python stubs: $name differs from what protoc generates from proto/ (run $0 --update)" >&2
    status=1
  fi
done
for f in "$committed"/*_pb2*.py; do
  [ -e "$out/gradwire/v1/$(basename "$f")" ] || {
    echo "python stubs: $(basename "$f") has no .proto behind it" >&2
    status=1
  }
done
[ "$status" = 0 ] && echo "python stubs: client/python/gradwire/v1 matches proto/ ($(ls "$out"/gradwire/v1 | wc -l) files)"
exit "$status"
