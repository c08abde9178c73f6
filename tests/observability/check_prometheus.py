#!/usr/bin/env python3
"""Evaluates every panel query of the Grafana dashboard and every recording rule through a real
Prometheus's HTTP API, at one instant while a gradwire-server was under load, and checks that
each returns series with sane values. Prints "ok   NAME" / "FAIL NAME" lines and a summary;
exits non-zero when a check failed.

    check_prometheus.py --url http://127.0.0.1:9090 --time UNIX_SECONDS --dashboard FILE
        --rules FILE --client "tenant alice" --error-code NOT_FOUND

Each panel has its expectations here, by title: a panel added to the dashboard without them
fails, so the test grows with the dashboard.
"""

import argparse
import json
import math
import sys
import urllib.parse
import urllib.request

import yaml

LOADED = ("Forward", "Backward")  # the methods gradwire-load --flow step runs
passed = failed = 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
        print(f"ok   {name}")
    else:
        failed += 1
        print(f"FAIL {name}{': ' + detail if detail else ''}")


class Prometheus:
    def __init__(self, url, at):
        self.url = url.rstrip("/")
        self.at = at

    def get(self, path, **params):
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"{path}: {body}")
        return body["data"]

    def query(self, expr):
        """Instant vector at the test's instant: a list of (labels, value)."""
        data = self.get("/api/v1/query", query=expr, time=f"{self.at:.3f}")
        if data["resultType"] != "vector":
            raise RuntimeError(f"{expr}: a {data['resultType']}, not a vector")
        return [(r["metric"], float(r["value"][1])) for r in data["result"]]


def dashboard_expr(expr):
    # What Grafana would send with every server selected and a rate window of four 1 s scrapes'
    # worth rounded up (its $__rate_interval is at least 4 scrape intervals).
    return (expr.replace("$__rate_interval", "15s").replace('"$job"', '".*"')
            .replace('"$instance"', '".*"'))


def by(series, label):
    return {s[0].get(label, ""): s[1] for s in series}


def finite(v):
    return not math.isnan(v) and not math.isinf(v)


# --- expectations -------------------------------------------------------------------------------
# Each takes the results of the panel's targets (a list, one per target, of (labels, value)) and
# returns an error string, or "" when the values are sane.

def all_values(results, pred, what):
    bad = [(s[0], s[1]) for r in results for s in r if not pred(s[1])]
    return f"{what}: {bad[:3]}" if bad else ""


def quantiles(results, label, must):
    """Latency quantiles: finite and > 0 for what the load ran; NaN only for a series with no
    calls in the window (histogram_quantile of zero rates)."""
    values = by(results[0], label)
    for key in must:
        if key not in values or not finite(values[key]) or values[key] <= 0:
            return f"{label}={key}: {values.get(key)} (want a finite value > 0)"
    return all_values(results, lambda v: math.isnan(v) or (finite(v) and v >= 0),
                      "negative or infinite quantiles")


def rates_positive(results, label, keys):
    values = by(results[0], label)
    missing = [k for k in keys if not values.get(k, 0) > 0]
    if missing:
        return f"no rate > 0 for {label} {missing}: {values}"
    return all_values(results, lambda v: finite(v) and v >= 0, "negative rates")


def ratio(results):
    return all_values(results, lambda v: finite(v) and 0 <= v <= 1, "ratio outside [0, 1]")


def memory_within_budget(results):
    held = {(s[0].get("instance"), s[0].get("memory")): s[1] for s in results[0]}
    budget = {(s[0].get("instance"), s[0].get("memory")): s[1] for s in results[1]}
    if not any(k[1] == "device" and v > 0 for k, v in budget.items()):
        return f"no device budget: {budget}"
    over = {k: (v, budget.get(k)) for k, v in held.items() if budget.get(k) is None or v > budget[k]}
    if over:
        return f"held over budget: {over}"
    return all_values(results, lambda v: finite(v) and v >= 0, "negative bytes")


def contexts(results):
    live = {s[0].get("instance"): s[1] for s in results[0]}
    off = {s[0].get("instance"): s[1] for s in results[1]}
    if any(off.get(i, 0) > n for i, n in live.items()):
        return f"more offloaded than live: {live} {off}"
    return all_values(results, lambda v: finite(v) and v >= 0 and v == int(v), "not a count")


def quota(results, client):
    params = by(results[0], "client")
    if not params.get(client, 0) > 0:
        return f"{client} holds no parameters: {params}"
    return all_values(results, lambda v: finite(v) and v >= 0, "negative bytes")


def panel_checks(client, error_code):
    nonneg = lambda results: all_values(results, lambda v: finite(v) and v >= 0, "negative")
    return {
        "Throughput by method": lambda r: rates_positive(r, "method", LOADED),
        "Errors by code": lambda r: rates_positive(r, "code", [error_code]),
        "Latency p50 by method": lambda r: quantiles(r, "method", LOADED),
        "Latency p99 by method": lambda r: quantiles(r, "method", LOADED),
        "Server error ratio": ratio,
        "Uptime": lambda r: all_values(r, lambda v: 0 < v < 3600, "not between 0 and 1 h"),
        "Restarts (24 h)": lambda r: all_values(r, lambda v: v == 0, "restarted"),
        "Context memory": memory_within_budget,
        "Live and offloaded contexts": contexts,
        "Evictions, offloads and restores": nonneg,
        "Pinned weight bytes": nonneg,
        "Queue depth": lambda r: all_values(r, lambda v: v >= 0 and v == int(v), "not a count"),
        "Queue wait p99 by method": lambda r: quantiles(r, "method", []) or all_values(
            [[s for s in r[0] if s[0].get("method") in LOADED]], finite, "no wait for the load"),
        "Workspace cache hit ratio": lambda r: ratio(r) or all_values(
            r, lambda v: v > 0.5, "a steady load should mostly hit the cache"),
        "GEMM FLOP/s": lambda r: all_values(r, lambda v: finite(v) and v > 0, "no GEMM work"),
        "Requests by client": lambda r: rates_positive(r, "client", [client]),
        "Latency p99 by client": lambda r: quantiles(r, "client", [client]),
        "Quota use by client": lambda r: quota(r, client),
    }


def rule_checks(client, error_code):
    return {
        "gradwire:rpc:rate1m": lambda s: rates_positive([s], "method", LOADED),
        "gradwire:rpc_errors:rate1m": lambda s: rates_positive([s], "code", [error_code]),
        "gradwire:rpc_server_errors:ratio_rate5m": lambda s: ratio([s]),
        "gradwire:rpc_duration_seconds:p50_5m": lambda s: quantiles([s], "method", LOADED),
        "gradwire:rpc_duration_seconds:p99_5m": lambda s: quantiles([s], "method", LOADED),
        "gradwire:queue_wait_seconds:p99_5m": lambda s: quantiles([s], "method", []),
        "gradwire:client_rpc:rate1m": lambda s: rates_positive([s], "client", [client]),
        "gradwire:context_budget:ratio": lambda s: ratio([s]),
        "gradwire:context_evictions:rate5m": lambda s: all_values(
            [s], lambda v: finite(v) and v >= 0, "negative"),
        "gradwire:gemm_flops:rate1m": lambda s: all_values(
            [s], lambda v: finite(v) and v > 0, "no GEMM work"),
        "gradwire:gemm_achieved_flops_per_second:1m": lambda s: all_values(
            [s], lambda v: finite(v) and v > 0, "no GEMM work"),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--time", type=float, required=True)
    ap.add_argument("--dashboard", required=True)
    ap.add_argument("--rules", required=True)
    ap.add_argument("--client", required=True, help="the client label of the loaded tenant")
    ap.add_argument("--error-code", required=True, help="a code the test kept causing")
    a = ap.parse_args()
    prom = Prometheus(a.url, a.time)

    targets = prom.get("/api/v1/targets")["activeTargets"]
    check("prometheus scraped the server (bearer token accepted)",
          bool(targets) and all(t["health"] == "up" for t in targets),
          str([(t["scrapeUrl"], t["health"], t.get("lastError")) for t in targets]))

    dash = json.load(open(a.dashboard))
    checks = panel_checks(a.client, a.error_code)
    results = {}
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        title = panel["title"]
        try:
            got = [prom.query(dashboard_expr(t["expr"])) for t in panel["targets"]]
        except Exception as e:  # a query Prometheus refuses: the panel is broken
            check(f"panel '{title}': its queries evaluate", False, str(e))
            continue
        results[title] = got
        empty = [t["refId"] for t, r in zip(panel["targets"], got) if not r]
        check(f"panel '{title}': every query returns series", not empty,
              f"no series for {empty}")
        if title not in checks:
            check(f"panel '{title}': has expectations in this test", False)
            continue
        if empty:
            continue
        problem = checks[title](got)
        check(f"panel '{title}': sane values", not problem, problem)
    missing = set(checks) - {p["title"] for p in dash["panels"]}
    check("every expected panel is on the dashboard", not missing, str(missing))
    if "Latency p50 by method" in results and "Latency p99 by method" in results:
        p50 = by(results["Latency p50 by method"][0], "method")
        p99 = by(results["Latency p99 by method"][0], "method")
        bad = {m: (p50[m], p99.get(m)) for m in LOADED if not p50.get(m, 0) <= p99.get(m, -1)}
        check("p50 <= p99 for every loaded method", not bad, str(bad))

    rules = yaml.safe_load(open(a.rules))
    rchecks = rule_checks(a.client, a.error_code)
    recorded = {}
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "record" not in rule:
                continue
            name = rule["record"]
            # The expression itself, and the series Prometheus recorded from it by then.
            direct = prom.query(rule["expr"])
            stored = prom.query(name)
            recorded[name] = stored
            check(f"rule {name}: evaluates to series", bool(direct), "no series")
            check(f"rule {name}: recorded by Prometheus", bool(stored), "no series")
            if name not in rchecks:
                check(f"rule {name}: has expectations in this test", False)
            elif stored:
                problem = rchecks[name](stored)
                check(f"rule {name}: sane values", not problem, problem)
    p50 = by(recorded.get("gradwire:rpc_duration_seconds:p50_5m", []), "method")
    p99 = by(recorded.get("gradwire:rpc_duration_seconds:p99_5m", []), "method")
    bad = {m: (p50.get(m), p99.get(m)) for m in LOADED if not p50.get(m, 0) <= p99.get(m, -1)}
    check("recorded p50 <= p99 for every loaded method", not bad, str(bad))

    groups = prom.get("/api/v1/rules")["groups"]
    loaded = [r for g in groups for r in g["rules"]]
    defined = sum(len(g["rules"]) for g in rules["groups"])
    check(f"Prometheus loaded all {defined} rules", len(loaded) == defined, f"{len(loaded)}")
    broken = [(r["name"], r.get("lastError")) for r in loaded if r.get("health") != "ok"]
    check("every rule evaluates without error", not broken, str(broken))

    print(f"queries: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
