#!/usr/bin/env bash
# End to end with the real binaries: `gradwire weights export|import` against a live server.
# Modules come from `gradwire demo --keep-modules` run with two seeds, which leaves two Linear
# 16->64 modules with different weights (demo.fc1) and two Linear 64->4 (demo.fc2). Checks that an
# export is a well-formed safetensors file, deterministic and byte-exact across a round trip,
# that import moves weights between modules of the same shape, and that a file which does not fit
# (other shapes, FP8, missing parameters, non-finite values, truncated, missing) is refused with
# exit 1 and leaves the module's weight version unchanged. No python: only coreutils.
#   usage: weights_e2e.sh PATH/gradwire-server PATH/gradwire
set -euo pipefail
server_bin=$1
cli_bin=$2
# shellcheck source=SCRIPTDIR/../../scripts/lib/check.sh
source "$(dirname "$0")/../../scripts/lib/check.sh"

# cli NAME ARGS...: runs the CLI against the server, stdout to $tmp/NAME.out, stderr to
# $tmp/NAME.err, exit status to $rc, without stopping the script when it fails.
cli() {
  local name=$1
  shift
  set +e
  "$cli_bin" "$@" >"$tmp/$name.out" 2>"$tmp/$name.err"
  rc=$?
  set -e
}
# json_num FILE FIELD: an unsigned integer field of a one-line JSON object.
json_num() { grep -o "\"$2\":[0-9]*" "$1" | head -1 | cut -d: -f2; }
# Module objects of `gradwire info --json`, one a line (the only innermost {...}).
modules() { "$cli_bin" info --server "$addr" --json | grep -o '{[^{}]*}'; }
ids_named() { modules | grep "\"name\":\"$1\"" | grep -o '"module_id":"[^"]*"' | cut -d'"' -f4; }
version_of() {
  modules | grep "\"module_id\":\"$1\"" | grep -o '"weight_version":[0-9]*' | cut -d: -f2
}

# Safetensors layout: 8-byte little-endian header length N, N bytes of JSON, then the data.
header_len() { od -A n -t u8 --endian=little -N 8 "$1" | tr -d ' '; }
header_of() { head -c $((8 + $(header_len "$1"))) "$1" | tail -c +9; }
data_of() { tail -c +$((8 + $(header_len "$1") + 1)) "$1"; }
# le64 N: N as 8 little-endian bytes.
le64() {
  local n=$1 i out=""
  for i in 0 1 2 3 4 5 6 7; do out+=$(printf '\\x%02x' $(((n >> (8 * i)) & 255))); done
  printf "$out"
}
# craft FILE HEADER-JSON DATA-FILE: a safetensors file from its parts (no padding needed).
craft() { { le64 ${#2}; printf '%s' "$2"; cat "$3"; } >"$1"; }
# repeat HEX-BYTES COUNT: the bytes (e.g. '\x80\x3f') COUNT times.
repeat() { local i; for ((i = 0; i < $2; i++)); do printf "$1"; done; }

start_server --listen 127.0.0.1:0
echo "server at $addr"

"$cli_bin" demo --server "$addr" --steps 5 --seed 7 --keep-modules --json >/dev/null 2>&1
"$cli_bin" demo --server "$addr" --steps 5 --seed 8 --keep-modules --json >/dev/null 2>&1
fc1_ids=$(ids_named demo.fc1)
fc2_ids=$(ids_named demo.fc2)
a=$(echo "$fc1_ids" | sed -n 1p)   # Linear 16 -> 64
a2=$(echo "$fc1_ids" | sed -n 2p)  # Linear 16 -> 64, other seed
b=$(echo "$fc2_ids" | sed -n 1p)   # Linear 64 -> 4
[ -n "$a" ] && [ -n "$a2" ] && [ -n "$b" ] || {
  echo "demo modules not found:"
  "$cli_bin" info --server "$addr" --json
  exit 1
}
echo "modules: a=$a a2=$a2 b=$b"

# --- export ---
va=$(version_of "$a")
cli export1 weights export --server "$addr" --module "$a" "$tmp/a.st"
check "export: exit 0" [ "$rc" = 0 ]
check "export: file exists" [ -s "$tmp/a.st" ]
check "export: summary names module, version and path" \
  grep -q "of module $a at weight version $va to $tmp/a.st" "$tmp/export1.out"
n=$(header_len "$tmp/a.st")
size=$(stat -c %s "$tmp/a.st")
data_bytes=$(((64 * 16 + 64) * 4))
check "export: header length $n is positive and keeps the data 8-byte aligned" \
  bash -c "[ $n -gt 1 ] && [ \$(($n % 8)) = 0 ]"
check "export: 8 + header + float32 data is the file size ($size)" \
  [ $((8 + n + data_bytes)) = "$size" ]
header_of "$tmp/a.st" >"$tmp/a.header"
check "export: header is a JSON object" bash -c "head -c 1 '$tmp/a.header' | grep -q '{'"
# entry NAME: the header's entry of tensor NAME, e.g. {"data_offsets":[0,4096],"dtype":...}.
entry() { grep -o "\"$1\":{[^}]*}" "$tmp/a.header"; }
check "export: weight is F32 [64, 16]" \
  bash -c "echo '$(entry weight)' | grep -q '\"dtype\":\"F32\"' &&
           echo '$(entry weight)' | grep -q '\"shape\":\[64,16\]'"
check "export: bias is F32 [64]" \
  bash -c "echo '$(entry bias)' | grep -q '\"dtype\":\"F32\"' &&
           echo '$(entry bias)' | grep -q '\"shape\":\[64\]'"
check "export: metadata" \
  bash -c "grep -q '\"format\":\"gradwire\"' '$tmp/a.header' &&
           grep -q '\"module_id\":\"$a\"' '$tmp/a.header' &&
           grep -q '\"weight_version\":\"$va\"' '$tmp/a.header' &&
           grep -q '\"kind\":\"LINEAR\"' '$tmp/a.header' &&
           grep -q '\"in_features\":\"16\"' '$tmp/a.header' &&
           grep -q '\"out_features\":\"64\"' '$tmp/a.header'"
check "export: no temporary file left" bash -c "! ls '$tmp' | grep -q '\.tmp\.'"

cli export2 weights export --server "$addr" --module "$a" "$tmp/a_again.st" --json
check "export twice: byte-identical" cmp -s "$tmp/a.st" "$tmp/a_again.st"
check "export --json: one line with parameters, bytes and version" \
  bash -c "[ \$(wc -l <'$tmp/export2.out') = 1 ] &&
           grep -q '\"parameters\":2' '$tmp/export2.out' &&
           grep -q '\"bytes\":$size' '$tmp/export2.out' &&
           [ '$(json_num "$tmp/export2.out" weight_version)' = $va ]"

# --- import into the same module: a no-op on the values, one version more ---
cli import_same weights import --server "$addr" --module "$a" "$tmp/a.st" --json
check "import into itself: exit 0" [ "$rc" = 0 ]
check "import into itself: version $va -> $((va + 1))" \
  bash -c "[ '$(json_num "$tmp/import_same.out" previous_weight_version)' = $va ] &&
           [ '$(json_num "$tmp/import_same.out" weight_version)' = $((va + 1)) ] &&
           [ '$(version_of "$a")' = $((va + 1)) ]"
cli export3 weights export --server "$addr" --module "$a" "$tmp/a_after.st"
data_of "$tmp/a.st" >"$tmp/a.data"
data_of "$tmp/a_after.st" >"$tmp/a_after.data"
check "re-export after import: same data bytes" cmp -s "$tmp/a.data" "$tmp/a_after.data"
header_of "$tmp/a_after.st" | tr -d ' ' |
  sed "s/\"weight_version\":\"$((va + 1))\"/\"weight_version\":\"$va\"/" >"$tmp/a_after.hdr"
tr -d ' ' <"$tmp/a.header" >"$tmp/a.hdr"
check "re-export after import: header differs only in weight_version" \
  cmp -s "$tmp/a.hdr" "$tmp/a_after.hdr"

# --- import into another module of the same shape: its weights become a's, bit for bit ---
cli export_a2 weights export --server "$addr" --module "$a2" "$tmp/a2_before.st"
data_of "$tmp/a2_before.st" >"$tmp/a2_before.data"
check "other seed: a2's weights differ from a's" bash -c "! cmp -s '$tmp/a.data' '$tmp/a2_before.data'"
va2=$(version_of "$a2")
cli import_a2 weights import --server "$addr" --module "$a2" "$tmp/a.st"
check "import a -> a2: exit 0" [ "$rc" = 0 ]
check "import a -> a2: prints the new weight version" \
  grep -q "weight version $va2 -> $((va2 + 1))" "$tmp/import_a2.out"
cli export_a2b weights export --server "$addr" --module "$a2" "$tmp/a2_after.st"
data_of "$tmp/a2_after.st" >"$tmp/a2_after.data"
check "import a -> a2: a2 now holds exactly a's float32 values" \
  cmp -s "$tmp/a.data" "$tmp/a2_after.data"

# --- refusals: exit 1, a clear message, the module untouched ---
vb=$(version_of "$b")
cli shape weights import --server "$addr" --module "$b" "$tmp/a.st"
check "other shapes: exit 1" [ "$rc" = 1 ]
check "other shapes: INVALID_ARGUMENT naming the tensor and both shapes" \
  bash -c "grep -q '^gradwire: INVALID_ARGUMENT: ' '$tmp/shape.err' &&
           grep -q 'tensor \"weight\" has shape \[64, 16\]' '$tmp/shape.err' &&
           grep -q 'parameter \"weight\" of module $b has shape \[4, 64\]' '$tmp/shape.err'"
check "other shapes: b's weight version unchanged" [ "$(version_of "$b")" = "$vb" ]

size=$(stat -c %s "$tmp/a.st")
head -c $((size - 10)) "$tmp/a.st" >"$tmp/trunc.st"
head -c 5 "$tmp/a.st" >"$tmp/trunc5.st"
va=$(version_of "$a")
cli trunc weights import --server "$addr" --module "$a" "$tmp/trunc.st"
check "truncated file: exit 1 with INVALID_ARGUMENT naming the file" \
  bash -c "[ $rc = 1 ] && grep -q '^gradwire: INVALID_ARGUMENT: .*trunc.st' '$tmp/trunc.err'"
cli trunc5 weights import --server "$addr" --module "$a" "$tmp/trunc5.st"
check "file shorter than the length prefix: exit 1 with INVALID_ARGUMENT" \
  bash -c "[ $rc = 1 ] && grep -q '^gradwire: INVALID_ARGUMENT: ' '$tmp/trunc5.err'"
cli missing weights import --server "$addr" --module "$a" "$tmp/no-such.st"
check "missing file: exit 1 with NOT_FOUND naming the file" \
  bash -c "[ $rc = 1 ] && grep -q '^gradwire: NOT_FOUND: .*no-such.st' '$tmp/missing.err'"
check "refused files: a's weight version unchanged" [ "$(version_of "$a")" = "$va" ]

# Hand-made files for b (weight [4, 64], bias [4]).
repeat '\x80\x3f' 260 >"$tmp/bf16_ones.bin"  # bf16 1.0, 256 + 4 elements
craft "$tmp/bf16.st" \
  '{"weight":{"dtype":"BF16","shape":[4,64],"data_offsets":[0,512]},"bias":{"dtype":"BF16","shape":[4],"data_offsets":[512,520]}}' \
  "$tmp/bf16_ones.bin"
cli bf16 weights import --server "$addr" --module "$b" "$tmp/bf16.st" --json
check "BF16 file: accepted, both tensors widened" \
  bash -c "[ $rc = 0 ] && grep -q '\"widened\":2' '$tmp/bf16.out' &&
           [ '$(json_num "$tmp/bf16.out" weight_version)' = $((vb + 1)) ]"
cli export_b weights export --server "$addr" --module "$b" "$tmp/b.st"
data_of "$tmp/b.st" | od -A n -t x4 -v | tr -s ' ' '\n' | sed '/^$/d' >"$tmp/b.words"
check "BF16 file: b now holds exactly float32 1.0, all 260 values" \
  bash -c "[ \$(wc -l <'$tmp/b.words') = 260 ] && [ \"\$(sort -u '$tmp/b.words')\" = 3f800000 ]"

vb=$(version_of "$b")
repeat '\x00' 272 >"$tmp/zeros272.bin"
craft "$tmp/fp8.st" \
  '{"weight":{"dtype":"F8_E4M3","shape":[4,64],"data_offsets":[0,256]},"bias":{"dtype":"F32","shape":[4],"data_offsets":[256,272]}}' \
  "$tmp/zeros272.bin"
cli fp8 weights import --server "$addr" --module "$b" "$tmp/fp8.st"
check "FP8 file: exit 1, INVALID_ARGUMENT naming the tensor and its dtype" \
  bash -c "[ $rc = 1 ] && grep -q '^gradwire: INVALID_ARGUMENT: .*tensor \"weight\" is F8_E4M3' '$tmp/fp8.err'"

repeat '\x00\x00\x00\x40' 4 >"$tmp/twos.bin"  # float32 2.0
craft "$tmp/bias_only.st" '{"bias":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}' \
  "$tmp/twos.bin"
cli partial_no weights import --server "$addr" --module "$b" "$tmp/bias_only.st"
check "file without weight: exit 1 naming the missing parameter" \
  bash -c "[ $rc = 1 ] && grep -q 'INVALID_ARGUMENT: .*lacks weight of module' '$tmp/partial_no.err'"

repeat '\x00\x00\xc0\x7f' 4 >"$tmp/nans.bin"  # float32 NaN
craft "$tmp/nan.st" '{"bias":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}' "$tmp/nans.bin"
cli nan weights import --server "$addr" --module "$b" "$tmp/nan.st" --partial
check "non-finite value: exit 1 naming the tensor" \
  bash -c "[ $rc = 1 ] && grep -q 'INVALID_ARGUMENT: .*tensor \"bias\" has the non-finite' '$tmp/nan.err'"

craft "$tmp/unknown.st" '{"bais":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}' \
  "$tmp/twos.bin"
cli unknown weights import --server "$addr" --module "$b" "$tmp/unknown.st" --partial
check "unknown tensor name: exit 1 naming it and listing the parameters" \
  bash -c "[ $rc = 1 ] && grep -q 'tensor \"bais\" is not a parameter of module .*weight, bias' '$tmp/unknown.err'"
check "refused hand-made files: b's weight version unchanged" [ "$(version_of "$b")" = "$vb" ]

cli partial_yes weights import --server "$addr" --module "$b" "$tmp/bias_only.st" --partial --json
check "--partial: bias alone accepted" \
  bash -c "[ $rc = 0 ] && grep -q '\"parameters\":1' '$tmp/partial_yes.out' &&
           [ '$(version_of "$b")' = $((vb + 1)) ]"

# --- other failures ---
cli nomod weights export --server "$addr" --module 0123456789abcdef0123456789abcdef "$tmp/x.st"
check "export of an unknown module: exit 1 with NOT_FOUND, no file" \
  bash -c "[ $rc = 1 ] && grep -q '^gradwire: NOT_FOUND: ' '$tmp/nomod.err' && [ ! -e '$tmp/x.st' ]"
cli nodir weights export --server "$addr" --module "$a" "$tmp/no/such/dir/a.st"
check "export into a missing directory: exit 1 naming the path" \
  bash -c "[ $rc = 1 ] && grep -q 'no/such/dir/a.st' '$tmp/nodir.err'"
cli nomodflag weights import --server "$addr" "$tmp/a.st"
check "import without --module: usage error" bash -c "[ $rc != 0 ] && grep -q -- '--module' '$tmp/nomodflag.err'"
cli help weights import --help
check "import --help documents --module, --partial and FILE" \
  bash -c "[ $rc = 0 ] && grep -q -- '--module' '$tmp/help.out' && grep -q -- '--partial' '$tmp/help.out' &&
           grep -q FILE '$tmp/help.out'"
cli help_export weights export --help
check "export --help documents --module, --json and FILE" \
  bash -c "[ $rc = 0 ] && grep -q -- '--module' '$tmp/help_export.out' &&
           grep -q -- '--json' '$tmp/help_export.out' && grep -q FILE '$tmp/help_export.out'"

stop_server

finish
