#!/usr/bin/env bash
# deploy/observability checked with Prometheus's own tools and against each other:
#   - `promtool check rules` on the rules, `promtool test rules` on their unit tests;
#   - the Grafana dashboard is well formed (ids, grid, queries, variables), and deploy/README.md
#     describes each of its panels;
#   - the PrometheusRule of the Kubernetes monitoring overlay carries exactly the rules' groups;
#   - the compose file's Prometheus configuration passes `promtool check config`.
#   usage: rules_check.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=SCRIPTDIR/../../scripts/lib/check.sh
source "$root/scripts/lib/check.sh"
command -v promtool >/dev/null || { echo "rules_check: promtool not found (scripts/install-deps.sh installs prometheus)"; exit 1; }
obs=$root/deploy/observability

check "promtool check rules" promtool check rules "$obs/gradwire-rules.yaml"
check "promtool test rules" bash -c "cd '$obs' && promtool test rules gradwire-rules.test.yaml"
check "every alert has a unit test" /usr/bin/python3 - "$obs" <<'PY'
import sys, yaml
obs = sys.argv[1]
alerts = {r["alert"] for g in yaml.safe_load(open(f"{obs}/gradwire-rules.yaml"))["groups"]
          for r in g["rules"] if "alert" in r}
tested = {t["alertname"] for case in yaml.safe_load(open(f"{obs}/gradwire-rules.test.yaml"))["tests"]
          for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
assert alerts <= tested, f"alerts never seen firing in a test: {sorted(alerts - tested)}"
PY
# The compose configuration names its rule file where compose mounts it; check a copy that
# points at the repository's.
sed "s#/etc/prometheus/gradwire-rules.yaml#$obs/gradwire-rules.yaml#" "$obs/prometheus.yml" >"$tmp/prometheus.yml"
check "promtool check config (compose's prometheus.yml)" promtool check config "$tmp/prometheus.yml"

check "the dashboard is well formed" /usr/bin/python3 - "$obs/gradwire-dashboard.json" <<'PY'
import json, re, sys
d = json.load(open(sys.argv[1]))
assert d["uid"] and d["title"] and d["schemaVersion"] >= 36, "uid, title, schemaVersion"
variables = {v["name"] for v in d["templating"]["list"]}
assert {"datasource", "job", "instance"} <= variables, variables
ids, cells = set(), set()
for p in d["panels"]:
    assert p["id"] not in ids, f"panel id {p['id']} twice"
    ids.add(p["id"])
    g = p["gridPos"]
    assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, (p["title"], g)
    for x in range(g["x"], g["x"] + g["w"]):
        for y in range(g["y"], g["y"] + g["h"]):
            assert (x, y) not in cells, f"panel '{p['title']}' overlaps another at {(x, y)}"
            cells.add((x, y))
    if p["type"] == "row":
        continue
    assert p["datasource"]["uid"] == "${datasource}", p["title"]
    assert p.get("description"), f"panel '{p['title']}' has no description"
    refs = [t["refId"] for t in p["targets"]]
    assert refs and len(refs) == len(set(refs)), (p["title"], refs)
    for t in p["targets"]:
        expr = t["expr"]
        used = set(re.findall(r"\$(\w+)", expr))
        assert used <= variables | {"__rate_interval"}, (p["title"], used)
        # Every gradwire selector is narrowed to the chosen job and servers.
        for sel in re.findall(r"gradwire_\w+\{([^}]*)\}", expr):
            assert 'job=~"$job"' in sel and 'instance=~"$instance"' in sel, (p["title"], expr)
        assert expr.count("(") == expr.count(")"), (p["title"], expr)
PY
check "deploy/README.md describes every panel" /usr/bin/python3 - "$obs/gradwire-dashboard.json" "$root/deploy/README.md" <<'PY'
import json, sys
readme = open(sys.argv[2]).read()
missing = [p["title"] for p in json.load(open(sys.argv[1]))["panels"]
           if p["type"] != "row" and f"**{p['title']}**" not in readme]
assert not missing, f"not described (as **TITLE**): {missing}"
PY
check "the k8s PrometheusRule carries exactly the rules' groups" /usr/bin/python3 - "$obs/gradwire-rules.yaml" "$root/deploy/k8s/overlays/monitoring/prometheusrule.yaml" <<'PY'
import sys, yaml
rules = yaml.safe_load(open(sys.argv[1]))
crd = yaml.safe_load(open(sys.argv[2]))
assert crd["kind"] == "PrometheusRule", crd["kind"]
assert crd["spec"]["groups"] == rules["groups"], "deploy/k8s/overlays/monitoring/prometheusrule.yaml differs from deploy/observability/gradwire-rules.yaml: regenerate it (see its header)"
PY
finish observability
