#!/usr/bin/env python3
"""Where a JVM's CPU goes, by thread: what run.sh reads around its loop.

    threads.py snapshot PID > FILE
    threads.py diff BEFORE AFTER REQUESTS

A snapshot is each thread's id, name and CPU ticks (user + system) from
/proc/PID/task. The diff is the CPU each kind of thread took between the two,
in microseconds per request. The kind is the thread's name with its number
dropped: Linux keeps 15 characters of a name, and Cassandra's request stages
share one pool whose threads rename themselves for the stage they serve, so
those are summed as one kind.
"""
import os
import re
import sys

# Cassandra's shared pool (SEPWorker) names a thread for the stage it serves
# at the moment: its ticks cannot be told apart by stage from /proc.
REQUEST_STAGES = re.compile(
    r"^(Native-Transpor|MutationStage|ReadStage|CounterMutatio|ViewMutationSta|"
    r"RequestResponse|Paxos|PaxosRepair|AntiEntropy|Read-Repair|GossipStage|"
    r"InternalRespons|MigrationStage|SharedPool)"
)


def kind(name):
    if REQUEST_STAGES.match(name):
        return "request stages (shared pool)"
    return re.sub(r"[-#:_ ]*\d+$", "", name).strip() or name


def snapshot(pid):
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended while we read
            continue
        # The name sits in parentheses and may hold spaces or parentheses.
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        # utime and stime are fields 14 and 15 of stat, 12 and 13 after the name.
        print(f"{tid}\t{int(fields[11]) + int(fields[12])}\t{name}")


def read(path):
    out = {}
    with open(path) as f:
        for line in f:
            tid, ticks, name = line.rstrip("\n").split("\t", 2)
            out[tid] = (int(ticks), name)
    return out


def diff(before, after, requests):
    start, end = read(before), read(after)
    per_tick = 1_000_000 / os.sysconf("SC_CLK_TCK") / requests
    by_kind = {}
    for tid, (ticks, name) in end.items():
        # A thread born during the loop started from nothing; one that died
        # took its ticks with it (a JVM keeps its pools' threads).
        took = ticks - start.get(tid, (0, name))[0]
        by_kind[kind(name)] = by_kind.get(kind(name), 0) + took
    total = sum(by_kind.values())
    print(f"{'thread kind':<32} {'us/request':>10} {'share':>6}")
    for k, ticks in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        if ticks * per_tick < 1:
            continue
        print(f"{k:<32} {ticks * per_tick:>10.0f} {100 * ticks / max(total, 1):>5.1f}%")
    print(f"{'all':<32} {total * per_tick:>10.0f}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "snapshot":
        snapshot(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "diff":
        diff(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(__doc__)
