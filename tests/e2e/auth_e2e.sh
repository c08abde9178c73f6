#!/usr/bin/env bash
# Bearer tokens, tenants and the configuration file, with the real binaries.
#   usage: auth_e2e.sh PATH/gradwire-server PATH/gradwire
set -euo pipefail
server_bin=$1
cli_bin=$2
# shellcheck source=SCRIPTDIR/../../scripts/lib/check.sh
source "$(dirname "$0")/../../scripts/lib/check.sh"

alice_token=alice-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
bob_token=bob-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
printf '# tenants of this test\nalice %s\nbob %s\n' "$alice_token" "$bob_token" >"$tmp/tokens"
echo "$alice_token" >"$tmp/alice.token"
echo "$bob_token" >"$tmp/bob.token"

# --- configuration: file < environment < flags; unknown keys are errors; tokens masked ---
cat >"$tmp/server.toml" <<TOML
# gradwire-server configuration
listen = "127.0.0.1:0"
log-level = "debug"
max-message-mib = 32
checkpoint_every = 7
tokens = ["carol:carol-0123456789abcdef"]
TOML
cfg() { "$server_bin" --config "$tmp/server.toml" --print-config "$@"; }
check "config: file values apply" bash -c "'$server_bin' --config '$tmp/server.toml' --print-config | grep -qx 'max-message-mib = 32'"
check "config: underscores name the same key" bash -c "'$server_bin' --config '$tmp/server.toml' --print-config | grep -qx 'checkpoint-every = 7'"
check "config: environment beats file" bash -c "GRADWIRE_SERVER_MAX_MESSAGE_MIB=48 '$server_bin' --config '$tmp/server.toml' --print-config | grep -qx 'max-message-mib = 48'"
check "config: flag beats environment" bash -c "GRADWIRE_SERVER_MAX_MESSAGE_MIB=48 '$server_bin' --config '$tmp/server.toml' --max-message-mib 16 --print-config | grep -qx 'max-message-mib = 16'"
# --help, --config's own flag and --print-config are not configuration: no variable sets them.
check "config: GRADWIRE_SERVER_HELP is not --help" bash -c "GRADWIRE_SERVER_HELP=1 '$server_bin' --print-config | grep -qx 'max-message-mib = 64'"
check "config: --help names no variable for itself" bash -c "! '$server_bin' --help | grep -q GRADWIRE_SERVER_HELP"
check "config: the file may come from the environment" bash -c "GRADWIRE_SERVER_CONFIG='$tmp/server.toml' '$server_bin' --print-config | grep -qx 'max-message-mib = 32'"
check "config: tokens are masked" bash -c "'$server_bin' --config '$tmp/server.toml' --print-config | grep -qx 'tokens = \[\"carol:\*\*\*\*\"\]'"
check "config: no token in the output" bash -c "! '$server_bin' --config '$tmp/server.toml' --print-config | grep -q 0123456789abcdef"
# Sizes take units (KiB = 1024, KB = 1000) from flags, the environment and the file.
check "config: size flag with a unit" bash -c "'$server_bin' --context-memory 512MiB --print-config | grep -qx 'context-memory = 536870912'"
check "config: size from the environment" bash -c "GRADWIRE_SERVER_HOST_OFFLOAD_MEMORY=1GB '$server_bin' --print-config | grep -qx 'host-offload-memory = 1000000000'"
printf 'max-request-bytes = "2MiB"\ncontext-ttl = 30\n' >"$tmp/sizes.toml"
check "config: size from the file" bash -c "'$server_bin' --config '$tmp/sizes.toml' --print-config | grep -qx 'max-request-bytes = 2097152'"
check "config: a bad size is refused" bash -c "! '$server_bin' --context-memory 12parsecs --print-config 2>/dev/null"
# Every flag in --help has a key in --print-config (the config mirrors every flag).
missing=""
for flag in $("$server_bin" --help | grep -o -- '^  --[a-z-]*' | sed 's/^  --//'); do
  case $flag in help | config | print-config) continue ;; esac
  cfg | grep -q "^$flag = " || missing="$missing $flag"
done
check "config: every flag is a key of --print-config${missing:+ (missing:$missing)}" [ -z "$missing" ]
# The printed configuration reads back unchanged.
cfg >"$tmp/printed.toml"
sed -i 's/^tokens = .*/tokens = []/' "$tmp/printed.toml"
check "config: --print-config output is a valid config file" \
  bash -c "'$server_bin' --config '$tmp/printed.toml' --print-config | grep -qx 'max-message-mib = 32'"
bad_config() {  # bad_config TEXT EXPECTED-MESSAGE
  printf '%s\n' "$1" >"$tmp/bad.toml"
  local rc=0
  "$server_bin" --config "$tmp/bad.toml" >"$tmp/bad.log" 2>&1 || rc=$?
  [ "$rc" != 0 ] && grep -qF "$2" "$tmp/bad.log"
}
check "config: unknown key is an error naming it" bad_config 'listne = "127.0.0.1:0"' "unknown key 'listne'"
check "config: sections are refused" bad_config $'[server]\nlisten = "x"' "unknown key 'server.listen'"
check "config: a bad value is checked like the flag" bad_config 'device = "tpu"' "device"
check "config: --config itself is not a key" bad_config 'config = "x.toml"' "unknown key 'config'"
check "config: a missing file is an error" \
  bash -c "! '$server_bin' --config '$tmp/nonexistent.toml' >/dev/null 2>&1"

# --- tokens ---
bad_tokens() {  # bad_tokens FILE-TEXT EXPECTED
  printf '%s\n' "$1" >"$tmp/bad.tokens"
  local rc=0
  "$server_bin" --listen 127.0.0.1:0 --tokens-file "$tmp/bad.tokens" >"$tmp/bad.log" 2>&1 || rc=$?
  [ "$rc" = 2 ] && grep -qF "$2" "$tmp/bad.log" && ! grep -q "tooshort" "$tmp/bad.log"
}
check "tokens: a short token is refused, and not logged" bad_tokens "alice tooshort" "at least 16"
check "tokens: a line without a token is refused" bad_tokens "alice" "the token is missing"

start_server --listen 127.0.0.1:0 --tokens-file "$tmp/tokens" --log-level debug --log-format json
check "tokens: startup names the tenants" grep -q "2 tokens for 2 tenants (alice, bob)" "$tmp/server.log"
gw() { "$cli_bin" "$@" --server "$addr" --timeout 5; }
set +e
gw info >"$tmp/anon.out" 2>&1
anon_rc=$?
set -e
check "tokens: a call without a token is refused" \
  bash -c "[ $anon_rc != 0 ] && grep -q UNAUTHENTICATED '$tmp/anon.out'"
check "tokens: health needs no token (probes)" gw health
check "tokens: --token-file is accepted" bash -c "'$cli_bin' info --server '$addr' --token-file '$tmp/alice.token' >/dev/null"
check "tokens: GRADWIRE_TOKEN is accepted" bash -c "GRADWIRE_TOKEN='$bob_token' '$cli_bin' info --server '$addr' >/dev/null"
check "tokens: a wrong token is refused" \
  bash -c "! GRADWIRE_TOKEN='${alice_token}x' '$cli_bin' info --server '$addr' >/dev/null 2>&1"
check "tokens: alice trains a model" bash -c "'$cli_bin' demo --server '$addr' --token-file '$tmp/alice.token' --steps 10 --keep-modules --json | grep -q final_loss"
alice_modules=$("$cli_bin" info --server "$addr" --token-file "$tmp/alice.token" --json)
bob_modules=$("$cli_bin" info --server "$addr" --token-file "$tmp/bob.token" --json)
module=$(echo "$alice_modules" | grep -o '"module_id":"[0-9a-f]*"' | head -1 | cut -d'"' -f4)
check "tokens: alice sees her modules" [ -n "$module" ]
check "tokens: bob does not see them" bash -c "! echo '$bob_modules' | grep -q '$module'"
set +e
"$cli_bin" weights export --server "$addr" --token-file "$tmp/bob.token" --module "$module" \
  "$tmp/stolen.safetensors" >"$tmp/bob.out" 2>&1
bob_rc=$?
set -e
check "tokens: bob's export of alice's module is NOT_FOUND" \
  bash -c "[ $bob_rc != 0 ] && grep -q NOT_FOUND '$tmp/bob.out' && [ ! -e '$tmp/stolen.safetensors' ]"
check "tokens: alice can export it" bash -c "'$cli_bin' weights export --server '$addr' --token-file '$tmp/alice.token' --module '$module' '$tmp/mine.safetensors' >/dev/null"
check "logs: RPC lines carry the tenant" grep -q '"tenant":"alice"' "$tmp/server.log"
check "logs: no token appears in the log" \
  bash -c "! grep -qF -e '$alice_token' -e '$bob_token' '$tmp/server.log'"
stop_server

finish
