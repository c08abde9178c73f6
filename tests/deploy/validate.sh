#!/usr/bin/env bash
# Checks deploy/: yamllint (strict) on every YAML file; `kubectl kustomize` builds the base and
# each overlay (with throwaway Secret files) into the objects an operator expects; the ConfigMap's
# server.toml is a configuration the real server accepts; the compose files are valid.
# (tests/deploy/haproxy_check.sh checks the HAProxy configurations themselves.)
#   usage: validate.sh PATH/gradwire-server
set -euo pipefail
server_bin=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=SCRIPTDIR/../../scripts/lib/check.sh
source "$root/scripts/lib/check.sh"
need() { command -v "$1" >/dev/null || { echo "validate: $1 not found (scripts/install-deps.sh installs it)"; exit 1; }; }
need yamllint
kubectl=${KUBECTL:-kubectl}  # KUBECTL=... checks another release (e.g. Debian's 1.20)
need "$kubectl"

mapfile -t yamls < <(find "$root/deploy" -name '*.yaml' -o -name '*.yml' | sort)
check "yamllint --strict on ${#yamls[@]} files" \
  yamllint --strict -c "$root/deploy/.yamllint" "${yamls[@]}"

cp -r "$root/deploy/k8s" "$tmp/k8s"
for f in tls.crt tls.key ca.crt tokens.txt; do echo "placeholder" >"$tmp/k8s/overlays/example/$f"; done
build() { "$kubectl" kustomize "$tmp/k8s/$1" 2>"$tmp/kustomize.err"; }
for overlay in base overlays/example overlays/cpu overlays/monitoring overlays/haproxy; do
  check "kustomize builds $overlay" bash -c "$(declare -f build); tmp='$tmp' kubectl='$kubectl'; build $overlay >'$tmp/${overlay//\//_}.yaml'"
done
out="$tmp/overlays_example.yaml"
has() { grep -qE "$1" "$2"; }
check "example: a StatefulSet" has '^kind: StatefulSet$' "$out"
check "example: a headless Service" has '^  clusterIP: None$' "$out"
check "example: a PodDisruptionBudget" has '^kind: PodDisruptionBudget$' "$out"
check "example: a ConfigMap with server.toml" has '^  server.toml: \|$' "$out"
check "example: a Secret with TLS and tokens" \
  bash -c "grep -q '^kind: Secret$' '$out' && grep -q 'tokens.txt:' '$out' && grep -q 'tls.key:' '$out'"
check "example: the pods mount the generated Secret and ConfigMap by their hashed names" \
  bash -c "grep -qE 'secretName: gradwire-secret-[a-z0-9]+$' '$out' && grep -qE '^ +name: gradwire-config-[a-z0-9]+$' '$out'"
check "example: one GPU per server" has 'nvidia.com/gpu: 1$' "$out"
check "example: resource requests" has '^ +memory: 32Gi$' "$out"
check "example: readiness, liveness and startup probes" \
  bash -c "grep -q readinessProbe: '$out' && grep -q livenessProbe: '$out' && grep -q startupProbe: '$out'"
check "example: a volume claim for checkpoints" has '^  volumeClaimTemplates:$' "$out"
check "example: the image is set by the overlay" has 'image: registry.example.com/gradwire:0.1.0-cuda$' "$out"
check "example: everything in namespace gradwire" \
  bash -c "[ \$(grep -c '^  namespace: gradwire$' '$out') -ge 5 ]"
check "cpu: no GPU, the cpu image" \
  bash -c "! grep -q nvidia.com/gpu '$tmp/overlays_cpu.yaml' && grep -q 'gradwire:0.1.0-cpu$' '$tmp/overlays_cpu.yaml'"
mon="$tmp/overlays_monitoring.yaml"
check "monitoring: the example plus a PodMonitor of the metrics port" \
  bash -c "grep -q '^kind: StatefulSet$' '$mon' && grep -q '^kind: PodMonitor$' '$mon' && grep -qE '^ +(- )?port: metrics$' '$mon'"
check "monitoring: the rules as a PrometheusRule" \
  bash -c "grep -q '^kind: PrometheusRule$' '$mon' && grep -q 'alert: GradwireHighErrorRatio' '$mon'"
check "monitoring: the PodMonitor selects the StatefulSet's pods" /usr/bin/python3 - "$mon" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
pods = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["metadata"]["labels"]
monitor = next(d for d in docs if d["kind"] == "PodMonitor")
want = monitor["spec"]["selector"]["matchLabels"]
assert all(pods.get(k) == v for k, v in want.items()), (want, pods)
ports = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"][0]["ports"]
assert any(p["name"] == "metrics" for p in ports), ports
for d in docs:
    if d["kind"] != "Namespace":
        assert d["metadata"].get("namespace") == "gradwire", d["metadata"]
PY
hap="$tmp/overlays_haproxy.yaml"
check "haproxy: the example plus a Deployment, its Service and PodDisruptionBudget" \
  bash -c "grep -q '^kind: StatefulSet$' '$hap' && grep -q '^kind: Deployment$' '$hap' && grep -q '^  name: gradwire-proxy$' '$hap'"
check "haproxy: the proxy's objects fit the example's" /usr/bin/python3 - "$hap" "$root/deploy/k8s/overlays/haproxy/haproxy.cfg" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
def one(kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]
matches = lambda selector, labels: all(labels.get(k) == v for k, v in selector.items())
dep = one("Deployment")
pods = dep["spec"]["template"]["metadata"]["labels"]
spec = dep["spec"]["template"]["spec"]
# The proxy Service selects the HAProxy pods; the servers' headless Service does not.
assert matches(one("Service", "gradwire-proxy")["spec"]["selector"], pods), pods
assert not matches(one("Service", "gradwire")["spec"]["selector"], pods), pods
assert any(matches(d["spec"]["selector"]["matchLabels"], pods)
           for d in docs if d["kind"] == "PodDisruptionBudget")
# It mounts the generated ConfigMap and Secret by their hashed names, and the ConfigMap holds
# haproxy.cfg as written.
volumes = {v["name"]: v for v in spec["volumes"]}
cm = one("ConfigMap", volumes["config"]["configMap"]["name"])
assert cm["metadata"]["name"].startswith("gradwire-haproxy-config-"), cm["metadata"]["name"]
assert cm["data"]["haproxy.cfg"] == open(sys.argv[2]).read()
secret = one("Secret", volumes["tls"]["secret"]["secretName"])
items = {i["key"]: i["path"] for i in volumes["tls"]["secret"]["items"]}
assert items == {"tls.crt": "tls.crt", "tls.key": "tls.crt.key", "ca.crt": "ca.crt"}, items
assert all(k in secret["data"] for k in items), secret["data"].keys()
container = spec["containers"][0]
assert container["args"][-1] == "/etc/gradwire/haproxy/haproxy.cfg", container["args"]
assert any(e["name"] == "POD_NAMESPACE" for e in container["env"])
# The config names the servers by the StatefulSet's headless Service.
sts = one("StatefulSet")
cfg = cm["data"]["haproxy.cfg"]
assert "." + sts["spec"]["serviceName"] + ".${POD_NAMESPACE}.svc." in cfg
assert sts["metadata"]["name"] + "-0." in cfg
# The servers share one checkpoint directory on a ReadWriteMany claim, with --checkpoint-shared
# (docs/scaling-out.md).
claims = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
assert [c["metadata"]["name"] for c in claims] == ["gradwire-checkpoints"], claims
assert claims[0]["spec"]["accessModes"] == ["ReadWriteMany"], claims[0]
server = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "server"][0]
args = server["args"]
assert args[:2] == ["--config", "/etc/gradwire/config/server.toml"], args
assert "--checkpoint-shared" in args, args
shared_dir = args[args.index("--checkpoint-dir") + 1]
mounts = {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
assert shared_dir.startswith(mounts["shared-checkpoints"] + "/"), (shared_dir, mounts)
volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
assert volumes["shared-checkpoints"]["persistentVolumeClaim"]["claimName"] == "gradwire-checkpoints"
assert {"config", "secret"} <= set(volumes), volumes
for d in docs:
    if d["kind"] != "Namespace":
        assert d["metadata"].get("namespace") == "gradwire", d["metadata"]
PY

# The ConfigMap's configuration is one the server accepts (secret paths pointed at real files).
sed -e "s#/etc/gradwire/secret/#$tmp/k8s/overlays/example/#" "$root/deploy/k8s/base/server.toml" >"$tmp/server.toml"
check "server.toml: gradwire-server accepts it" \
  bash -c "'$server_bin' --config '$tmp/server.toml' --print-config >'$tmp/printed.toml'"
check "server.toml: the context budgets are set (16 GiB each)" \
  bash -c "grep -q '^context-memory = 17179869184$' '$tmp/printed.toml' && grep -q '^host-offload-memory = 17179869184$' '$tmp/printed.toml'"
check "server.toml: TLS and tokens on" \
  bash -c "grep -q '^tokens-file = \"$tmp' '$tmp/printed.toml' && grep -q '^tls-cert = \"$tmp' '$tmp/printed.toml'"

if command -v docker-compose >/dev/null; then
  check "compose file is valid" docker-compose -f "$root/deploy/compose.yaml" config -q
  check "haproxy compose file is valid" docker-compose -f "$root/deploy/haproxy/compose.yaml" config -q
else
  echo "skip compose file check: docker-compose not installed"
fi
check "Dockerfile has the cpu and cuda targets" \
  bash -c "grep -qE '^FROM .* AS cpu$' '$root/Dockerfile' && grep -qE '^FROM .* AS cuda$' '$root/Dockerfile'"
check ".dockerignore keeps build trees and .git out" \
  bash -c "grep -qx '.git' '$root/.dockerignore' && grep -qx 'build\*' '$root/.dockerignore'"

finish deploy
