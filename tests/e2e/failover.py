"""Servers on one shared checkpoint directory behind HAProxy: one is killed under load, then comes
back (tests/e2e/proxy_e2e.sh runs both phases, scripts/bench-failover.sh measures the first).

  failover.py kill   PROXY ADMIN VICTIM_PID STATE_JSON SERVER1 SERVER2 SERVER3
  failover.py return PROXY STATE_JSON SERVER1 SERVER2 SERVER3

kill: 24 durable modules through the proxy, each trained three steps (the servers checkpoint
every 2, so the third is not saved) with a training context left open. While worker threads step
the other servers' modules without pause, the victim (server 2) is killed with SIGKILL. Then:
  - the other servers' modules see no error at any time, and their weights, versions and
    contexts are as they were;
  - each of the victim's modules serves again (measured from HAProxy marking it DOWN) on another
    server, with the weights and version of its last checkpoint (one step back);
  - a backward on a context the victim made raises ContextLostError naming why.
The victim's modules then train three more steps there (the third not saved), and STATE_JSON
records it all.

return: with server 2 back on its address, the victim's modules go back to it with every step the
servers that held them meanwhile took, the unsaved ones too (those servers are alive, so they hand
each module over: save it, drop it, release it); no version goes back, and the other modules are
untouched.
"""
import csv
import io
import json
import os
import signal
import sys
import threading
import time
import urllib.request

import torch

import gradwire
from gradwire.v1 import module_pb2

MODULES = 24


def states(admin):
    text = urllib.request.urlopen("http://%s/stats;csv" % admin, timeout=3).read().decode()
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    return {r["svname"]: r["status"] for r in rows if r["pxname"] == "gradwire"}


def homes_of(ids, servers):
    homes = {}
    for n, server in enumerate(servers, 1):
        with gradwire.Client(server) as d:
            for m in d.list_modules():
                if m.module_id in ids:
                    homes[m.module_id] = n
    return homes


def step(c, module_id):
    _, ctx, _ = c.forward(module_id, torch.randn(3, 16), True)
    c.backward(ctx, torch.randn(3, 8))
    return c.apply_gradients(module_id)


def same(a, b):
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def kill(proxy, admin, victim_pid, state_path, servers):
    spec = module_pb2.ModuleSpec(kind=module_pb2.LINEAR, in_features=16, out_features=8, seed=5)
    spec.optimizer.sgd.learning_rate = 0.1
    c = gradwire.Client(proxy)
    ids = [c.create_module(spec).module_id for _ in range(MODULES)]
    homes = homes_of(set(ids), servers)
    assert set(homes.values()) == {1, 2, 3}, homes
    saved, latest = {}, {}
    for mid in ids:
        step(c, mid)
        step(c, mid)  # checkpointed (--checkpoint-every 2)
        saved[mid] = c.get_weights_versioned(mid)
        step(c, mid)  # not checkpointed: lost with the victim
        latest[mid] = c.get_weights_versioned(mid)
    pending = {mid: c.forward(mid, torch.randn(3, 16), True)[1] for mid in ids}
    victims = [m for m in ids if homes[m] == 2]
    others = [m for m in ids if homes[m] != 2]

    # Load on the other servers' modules (their own modules, so no pending context is touched)
    # from before the kill until the victims serve again: every error is counted by code.
    errors, steps, stop = {}, [0], threading.Event()

    def worker(n):
        w = gradwire.Client(proxy)
        mine = []
        while len(mine) < 2:  # two modules on the servers that stay
            m = w.create_module(spec).module_id
            if homes_of({m}, [servers[0], servers[2]]):
                mine.append(m)
            else:
                w.delete_module(m)
        while not stop.is_set():
            for mid in mine:
                try:
                    step(w, mid)
                    steps[0] += 1
                except gradwire.GradwireError as e:
                    errors[e.code] = errors.get(e.code, 0) + 1
        for mid in mine:
            w.delete_module(mid)
        w.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    os.kill(victim_pid, signal.SIGKILL)
    killed = time.monotonic()
    while states(admin).get("gradwire-2") != "DOWN":
        assert time.monotonic() - killed < 15, states(admin)
        time.sleep(0.02)
    down = time.monotonic()
    # Each victim's first call, in turn: the first is taken over at once, the last after all the
    # others (the figure the 2 s target is about).
    served, first_errors = {}, {}
    for mid in victims:
        while True:
            try:
                c.forward(mid, torch.randn(3, 16), False)
                served[mid] = time.monotonic() - down
                break
            except gradwire.GradwireError as e:
                first_errors[e.code] = first_errors.get(e.code, 0) + 1
                assert time.monotonic() - down < 10, e
                time.sleep(0.01)
    time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join()
    assert steps[0] > 0
    assert errors == {}, errors

    for mid in others:  # untouched: context, weights, version
        w, v = c.get_weights_versioned(mid)
        assert v == latest[mid][1] and same(w, latest[mid][0]), mid
        c.backward(pending[mid], torch.randn(3, 8))
    lost_reasons = {}
    for mid in victims:  # back one step, to the checkpoint; the context is lost, and why
        w, v = c.get_weights_versioned(mid)
        assert v == saved[mid][1] == latest[mid][1] - 1, (v, saved[mid][1], latest[mid][1])
        assert same(w, saved[mid][0]), mid
        try:
            c.backward(pending[mid], torch.randn(3, 8))
            raise AssertionError("a context of the killed server answered")
        except gradwire.ContextLostError as e:
            lost_reasons[e.reason] = lost_reasons.get(e.reason, 0) + 1
        step(c, mid)
        step(c, mid)  # saved on the server that holds it now
        step(c, mid)  # not saved: only a hand-over brings it back
    assert lost_reasons == {"server_restarted": len(victims)}, lost_reasons
    after = {mid: c.get_weights_versioned(mid) for mid in ids}
    holders = homes_of(set(victims), [servers[0], servers[2]])
    assert set(holders) == set(victims), holders
    c.close(keep=True)
    result = {
        "modules": len(ids), "victims": len(victims),
        "down_after_kill_s": round(down - killed, 3),
        "first_served_s": round(min(served.values()), 3),
        "all_served_s": round(max(served.values()), 3),
        "first_call_errors": first_errors, "load_steps": steps[0], "load_errors": errors,
        "lost_context_reasons": lost_reasons,
    }
    print("  killed server's %d modules: first served %.3f s, all %.3f s after DOWN (%.3f s after "
          "the kill); %d load steps on the others, errors %s"
          % (len(victims), result["first_served_s"], result["all_served_s"],
             result["down_after_kill_s"], steps[0], errors))
    state = {"ids": ids, "victims": victims, "holders": {m: holders[m] for m in victims},
             "versions": {m: after[m][1] for m in ids}, "result": result}
    with open(state_path, "w") as f:
        json.dump(state, f)


def come_back(proxy, state_path, servers):
    state = json.load(open(state_path))
    ids, victims, versions = state["ids"], state["victims"], state["versions"]
    c = gradwire.Client(proxy)
    for mid in ids:  # no version goes back (not even an unsaved step), and every module trains on
        _, v = c.get_weights_versioned(mid)
        assert v == versions[mid], (mid, v, versions[mid])
        assert step(c, mid) == v + 1
    back = homes_of(set(victims), [servers[1]])
    assert set(back) == set(victims), "not every module went back to the returning server"
    # The servers that held them meanwhile handed them over.
    deadline = time.time() + 10
    while homes_of(set(victims), [servers[0], servers[2]]):
        assert time.time() < deadline, "a server kept a module another server took over"
        time.sleep(0.2)
    c.close(keep=True)
    print("  %d modules went back to the returning server at their newest versions, unsaved steps "
          "included: the servers that held them handed them over" % len(victims))


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        kill(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6:9])
    else:
        come_back(sys.argv[2], sys.argv[3], sys.argv[4:7])
