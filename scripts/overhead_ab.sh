#!/usr/bin/env bash
# Side-by-side planner overhead of two commits (the `overhead` suite's k=5 loop: plan+commit of
# CraftPlanner over the suite's own request generator, 5,000 warm-up requests then 20,000 timed),
# interleaved: each round runs old and new (order flipped every round) under the same
# PYTHONHASHSEED, for the tree and frequency policies. Prints the medians over rounds and the
# new/old ratios of wall and thread-CPU p50/p99 (µs).
#   scripts/overhead_ab.sh OLD_REV NEW_REV [ROUNDS]   (default ROUNDS=8; ~10 s a run)
set -euo pipefail
old_rev=${1:?old commit}; new_rev=${2:?new commit}; rounds=${3:-8}
repo=$(cd "$(dirname "$0")/.." && pwd)
py="$repo/.venv/bin/python"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
for v in old new; do
  rev=$old_rev; [ "$v" = new ] && rev=$new_rev
  mkdir -p "$work/$v" && git -C "$repo" archive "$rev" src benchmarks | tar -x -C "$work/$v"
done
cat > "$work/loop.py" <<'PY'
import gc, json, sys, time
from craft_rag_bench.bench.overhead import _requests
from craft_rag.planner import CraftPlanner, PlannerConfig
policy = sys.argv[1]
reqs = _requests(50000, 5, 0)
planner = CraftPlanner(PlannerConfig(policy=policy, window=1000))
for r in reqs[:5000]:
    planner.commit(planner.plan(r), prefix_tokens=40)
gc.collect(); gc.freeze()
cpu, wall = [], []
tt, pc = time.thread_time_ns, time.perf_counter_ns
for r in reqs[5000:25000]:
    c0, w0 = tt(), pc()
    planner.commit(planner.plan(r), prefix_tokens=40)
    w1, c1 = pc(), tt()
    cpu.append(c1 - c0); wall.append(w1 - w0)
def q(x, f):
    x = sorted(x); return x[min(len(x) - 1, int(f * len(x)))] / 1000
print(json.dumps({"wall_p50": q(wall, .5), "wall_p99": q(wall, .99),
                  "cpu_p50": q(cpu, .5), "cpu_p99": q(cpu, .99)}))
PY
: > "$work/rows"
for i in $(seq 1 "$rounds"); do
  order="old new"; [ $((i % 2)) -eq 0 ] && order="new old"
  for policy in tree frequency; do
    for v in $order; do
      line=$(PYTHONHASHSEED=$i PYTHONPATH="$work/$v/src:$work/$v/benchmarks/craft-rag-bench/src" \
        "$py" "$work/loop.py" "$policy")
      echo "$v $policy $line" >> "$work/rows"
    done
  done
done
"$py" - "$work/rows" <<'PY'
import json, statistics, sys
rows = [line.split(" ", 2) for line in open(sys.argv[1])]
for policy in ("tree", "frequency"):
    for metric in ("wall_p50", "wall_p99", "cpu_p50", "cpu_p99"):
        med = {v: statistics.median(json.loads(r)[metric] for w, p, r in rows
                                    if w == v and p == policy) for v in ("old", "new")}
        print(f"{policy:9} {metric:8} old {med['old']:8.1f}  new {med['new']:8.1f}  "
              f"new/old {med['new'] / med['old']:.3f}")
PY
