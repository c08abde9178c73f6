#!/usr/bin/env bash
# Layering rules of the source tree (docs/backends.md, "The rpc boundary"), checked on every test
# run:
#   server/rpc          nothing from kernels/: tensors cross into the core as wire views and the
#                       backend converts them on its device (gradwire/wire/codec.h); and no
#                       libtorch, not even through the project's headers it includes (followed
#                       transitively by tests/include_closure.py): the core hands back encoded
#                       tensors (weights and gradients too), and what rpc includes of the core
#                       (module_host.h, host_types.h, kind_description.h, ...) is torch-free
#   server/ but core    no switch on the module kind: each kind declares its wire name and the
#                       spec fields it reads (core::ModuleKindOps), so a new kind needs no case
#                       outside server/core
#   wire codec          gradwire/wire/codec.h and its .cc: no libtorch, no protobuf, no gRPC
#   server/core         no gRPC and no generated protocol code: the core is transport-free; and
#                       nothing of server/rpc (the scheduling in server/rpc/scheduling is rpc's)
#   server/core/kinds   a kind and its FP8 math reach nothing of the host (server/core/host/,
#                       module_host.h, host_types.h, module_state.h, tensor_calls.h), of contexts
#                       or checkpoints, nor of server/rpc, not even through the headers they
#                       include: of the core they see only kinds/ and the spec (module_spec.h,
#                       optimizer_config.h)
#   server/core/contexts
#                       the context store holds what kinds save; nothing of the host, of
#                       checkpoints or of server/rpc, even through its headers
#   server/rpc/scheduling
#                       the executor and the batch former order and group jobs: nothing of
#                       server/core, server/device, kernels/, libtorch or gRPC, even through
#                       their headers
#   server/device       the device layer below the modules: nothing of server/core, server/rpc,
#                       gRPC or the generated messages
#   server/             nothing from client/: the server and the clients share only proto/,
#                       wire/ and storage/
#   storage/            no libtorch, no protobuf, no gRPC
#   client/             nothing from server/, but for the load tester's in-process baseline
#                       (client/load/inprocess.cc), which runs the server's core in the load
#                       tester's own process to measure what the service adds
# Usage: tests/layering_check.sh [repository root]
set -euo pipefail
root=${1:-$(dirname "$0")/..}
cd "$root"
status=0
violation() {
  echo "layering: $1" >&2
  shift
  printf '  %s\n' "$@" >&2
  status=1
}
check() {  # check DESCRIPTION PATTERN FILE...
  local what=$1 pattern=$2
  shift 2
  local hits
  hits=$(grep -nHE "$pattern" "$@" 2>/dev/null || true)
  if [ -n "$hits" ]; then
    mapfile -t lines <<<"$hits"
    violation "$what" "${lines[@]}"
  fi
}
mapfile -t rpc < <(find server/rpc -name '*.h' -o -name '*.cc')
check "server/rpc must not use kernels/ (convert through the backend and the wire codec)" \
  '#include "gradwire/kernels/|kernels::' "${rpc[@]}"
check "server/rpc must not use libtorch (the core hands back encoded tensors)" \
  '#include [<"](ATen|torch|c10)/|\bat::' "${rpc[@]}"
closure() {  # closure DESCRIPTION REGEX FILE...: what FILE includes, followed through the tree
  local what=$1 forbid=$2
  shift 2
  local hits
  if ! hits=$(python3 tests/include_closure.py --forbid "$forbid" "$@"); then
    mapfile -t lines <<<"$hits"
    violation "$what" "${lines[@]}"
  fi
}
closure "server/rpc must not reach libtorch through the headers it includes" \
  '^(ATen|torch|c10)/' "${rpc[@]}"
check "the wire codec must stay torch-, protobuf- and gRPC-free" \
  '#include [<"](ATen|torch|c10|google/protobuf|grpc|gradwire/v1)' \
  wire/include/gradwire/wire/codec.h wire/codec.cc
mapfile -t core < <(find server/core -name '*.h' -o -name '*.cc')
check "server/core must be transport-free (no gRPC, no generated messages)" \
  '#include [<"](grpc|grpcpp|gradwire/v1/|gradwire/wire/tensor.h|gradwire/wire/chunking.h)' \
  "${core[@]}"
check "server/core must not use server/rpc (scheduling included: it serves rpc)" \
  '#include "server/rpc/' "${core[@]}"
mapfile -t kinds < <(find server/core/kinds -name '*.h' -o -name '*.cc')
closure "server/core/kinds must not reach the host, contexts, checkpoints or server/rpc" \
  '^server/(core/(host|contexts|checkpoints)/|core/(module_host|host_types|module_state|tensor_calls|heap_trim)\.h|rpc/)' \
  "${kinds[@]}"
mapfile -t contexts < <(find server/core/contexts -name '*.h' -o -name '*.cc')
closure "server/core/contexts must not reach the host, checkpoints or server/rpc" \
  '^server/(core/(host|checkpoints)/|core/(module_host|host_types|module_state|tensor_calls)\.h|rpc/)' \
  "${contexts[@]}"
mapfile -t scheduling < <(find server/rpc/scheduling -name '*.h' -o -name '*.cc')
closure "server/rpc/scheduling must not reach server/core, server/device, kernels/, libtorch or gRPC" \
  '^(server/(core|device)/|gradwire/kernels/|ATen/|torch/|c10/|grpc|grpcpp/|gradwire/v1/)' \
  "${scheduling[@]}"
mapfile -t device < <(find server/device -name '*.h' -o -name '*.cc')
check "server/device is below the modules: nothing of server/core, server/rpc, gRPC or messages" \
  '#include [<"](grpc|grpcpp|gradwire/v1/|server/core/|server/rpc/)' "${device[@]}"
check "server/rpc must not use server/device (the core hands it encoded tensors)" \
  '#include "server/device/' "${rpc[@]}"
mapfile -t server < <(find server -name '*.h' -o -name '*.cc')
check "server/ must not use client/ (shared code lives in wire/ and storage/)" \
  '#include "gradwire/client/|#include "client/' "${server[@]}"
mapfile -t above_core < <(find server -path server/core -prune -o \( -name '*.h' -o -name '*.cc' \) -print)
check "no switch on the module kind outside server/core (kinds declare their name and fields)" \
  'ModuleKind::k[A-Z]|v1::(LINEAR|LAYERNORM_LINEAR|LAYERNORM_MLP)\b' "${above_core[@]}"
mapfile -t storage < <(find storage -name '*.h' -o -name '*.cc')
check "storage/ must stay torch-, protobuf- and gRPC-free" \
  '#include [<"](ATen|torch|c10|google/protobuf|grpc|gradwire/v1)' "${storage[@]}"
mapfile -t client < <(find client -name '*.h' -o -name '*.cc' | grep -v '^client/load/inprocess\.cc$')
check "client/ must not use server/ (only the load tester's in-process baseline may)" \
  '#include "server/' "${client[@]}"
[ "$status" -eq 0 ] && echo "layering: server, server/rpc (libtorch-free through every header it includes), server/rpc/scheduling, server/core (kinds below the host, contexts below the host), server/device, client, storage and the wire codec keep their rules; no kind switch outside server/core"
exit "$status"
