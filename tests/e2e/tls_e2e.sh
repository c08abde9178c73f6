#!/usr/bin/env bash
# TLS and mutual TLS with the real binaries. The certificates are made here with openssl (a CA,
# a server certificate for 127.0.0.1, a client certificate, and a second CA nobody trusts); none
# is committed.
#   usage: tls_e2e.sh PATH/gradwire-server PATH/gradwire
set -euo pipefail
server_bin=$1
cli_bin=$2
# shellcheck source=SCRIPTDIR/../../scripts/lib/check.sh
source "$(dirname "$0")/../../scripts/lib/check.sh"

pki="$tmp/pki"
mkdir -p "$pki"
make_ca() {  # make_ca NAME
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 2 \
    -subj "/CN=gradwire test $1" -keyout "$pki/$1.key" -out "$pki/$1.crt" 2>/dev/null
}
make_cert() {  # make_cert NAME CA EXTENSIONS
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "/CN=$1" \
    -keyout "$pki/$1.key" -out "$pki/$1.csr" 2>/dev/null
  printf '%s\n' "$3" >"$pki/$1.ext"
  openssl x509 -req -in "$pki/$1.csr" -CA "$pki/$2.crt" -CAkey "$pki/$2.key" -CAcreateserial \
    -days 2 -extfile "$pki/$1.ext" -out "$pki/$1.crt" 2>/dev/null
}
make_ca ca
make_ca stranger
make_cert server ca "subjectAltName=IP:127.0.0.1,DNS:gradwire.test
extendedKeyUsage=serverAuth"
make_cert client ca "extendedKeyUsage=clientAuth"
make_cert impostor stranger "extendedKeyUsage=clientAuth"

health() { "$cli_bin" health --server "$addr" --timeout 3 "$@" >/dev/null 2>&1; }

# TLS: the server proves itself; clients need the CA.
start_server --listen 127.0.0.1:0 --tls-cert "$pki/server.crt" --tls-key "$pki/server.key"
check "tls: logged" grep -q "TLS on" "$tmp/server.log"
check "tls: client with the CA is served" health --tls-ca "$pki/ca.crt"
check "tls: plaintext client is refused" \
  bash -c "! '$cli_bin' health --server '$addr' --timeout 3 >/dev/null 2>&1"
check "tls: client trusting another CA is refused" \
  bash -c "! '$cli_bin' health --server '$addr' --timeout 3 --tls-ca '$pki/stranger.crt' >/dev/null 2>&1"
check "tls: --tls-server-name verifies another name of the certificate" \
  health --tls-ca "$pki/ca.crt" --tls-server-name gradwire.test
check "tls: --tls-server-name the certificate lacks is refused" \
  bash -c "! '$cli_bin' health --server '$addr' --timeout 3 --tls-ca '$pki/ca.crt' --tls-server-name other.test >/dev/null 2>&1"
check "tls: demo trains over TLS" \
  bash -c "'$cli_bin' demo --server '$addr' --steps 20 --json --tls-ca '$pki/ca.crt' 2>/dev/null | grep -q final_loss"
stop_server

# Mutual TLS: the client proves itself too.
start_server --listen 127.0.0.1:0 --tls-cert "$pki/server.crt" --tls-key "$pki/server.key" \
  --tls-client-ca "$pki/ca.crt"
check "mtls: logged" grep -q "mutual TLS" "$tmp/server.log"
check "mtls: client with a certificate from the CA is served" \
  health --tls-ca "$pki/ca.crt" --tls-cert "$pki/client.crt" --tls-key "$pki/client.key"
check "mtls: client without a certificate is refused" \
  bash -c "! '$cli_bin' health --server '$addr' --timeout 3 --tls-ca '$pki/ca.crt' >/dev/null 2>&1"
check "mtls: certificate from another CA is refused" \
  bash -c "! '$cli_bin' health --server '$addr' --timeout 3 --tls-ca '$pki/ca.crt' --tls-cert '$pki/impostor.crt' --tls-key '$pki/impostor.key' >/dev/null 2>&1"
stop_server

# Bad flags: half a key pair.
set +e
"$server_bin" --listen 127.0.0.1:0 --tls-cert "$pki/server.crt" >"$tmp/half.log" 2>&1
rc=$?
set -e
check "tls: --tls-cert without --tls-key is refused" \
  bash -c "[ $rc = 2 ] && grep -q 'both --tls-cert and --tls-key' '$tmp/half.log'"

# Secure by default: a non-loopback address needs TLS and bearer tokens, unless --insecure.
echo "tenant-a tenant-a-0123456789abcdef" >"$tmp/tokens"
refused() {  # refused WHAT FLAGS...: the server exits 2 naming WHAT it lacks
  local what=$1
  shift
  local rc=0
  "$server_bin" --listen 0.0.0.0:0 "$@" >"$tmp/open.log" 2>&1 || rc=$?
  [ "$rc" = 2 ] && grep -q "refusing to serve on 0.0.0.0:0 without $what" "$tmp/open.log"
}
check "non-loopback without TLS or tokens is refused" refused "TLS and bearer tokens"
check "non-loopback with TLS but no tokens is refused" refused "bearer tokens" \
  --tls-cert "$pki/server.crt" --tls-key "$pki/server.key"
check "non-loopback with tokens but no TLS is refused" refused "TLS" --tokens-file "$tmp/tokens"
start_server --listen 0.0.0.0:0 --tls-cert "$pki/server.crt" --tls-key "$pki/server.key" \
  --tokens-file "$tmp/tokens"
check "non-loopback with TLS and tokens serves" grep -q "listening on 0.0.0.0:" "$tmp/server.log"
stop_server
start_server --listen 0.0.0.0:0 --insecure
check "non-loopback plaintext with --insecure serves" grep -q "listening on 0.0.0.0:" "$tmp/server.log"
stop_server

finish
