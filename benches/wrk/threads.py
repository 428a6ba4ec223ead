#!/usr/bin/env python3
"""Where a JVM's CPU goes, by thread: what run.sh reads around its loop.

    threads.py snapshot PID > FILE
    threads.py diff BEFORE AFTER REQUESTS

A snapshot is the process's CPU ticks (user + system) and each thread's id,
start time, name and ticks, from /proc/PID. The diff is the CPU each kind of
thread took between the two, in microseconds per request. The kind is the
thread's name with its number dropped: Linux keeps 15 bytes of a name, and
Cassandra's request stages share one pool whose threads rename themselves for
the stage they serve, so those are summed as one kind. A thread that ended
during the loop took its ticks with it (idle pool threads time out): what the
process used beyond its living threads is shown as "threads that ended".
"""
import os
import re
import sys

# Cassandra's shared pool (SEPWorker) names a thread for the stage it serves
# at the moment: its ticks cannot be told apart by stage from /proc.
REQUEST_STAGES = re.compile(
    r"^(Native-Transpor|MutationStage|ReadStage|CounterMutatio|ViewMutationSta|RequestResponse|SharedPool)"
)


def kind(name):
    if REQUEST_STAGES.match(name):
        return "request stages (shared pool)"
    return re.sub(r"[-#:_ ]*\d+$", "", name).strip() or name


def parse(stat):
    """(name, ticks, start time) from a stat line. The name sits in
    parentheses and may hold spaces, parentheses or any byte."""
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    # Fields 14, 15 and 22 of stat (utime, stime, starttime) are 12, 13 and
    # 20 after the name.
    return name, int(fields[11]) + int(fields[12]), fields[19]


def read_stat(path):
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def snapshot(pid):
    _, ticks, _ = parse(read_stat(f"/proc/{pid}/stat"))
    print(f"process\t{ticks}\t-\t-")
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        try:
            name, ticks, started = parse(read_stat(f"/proc/{pid}/task/{tid}/stat"))
        except OSError:  # the thread ended while it was read
            continue
        name = name.replace("\t", " ").replace("\n", " ")
        print(f"{tid}\t{ticks}\t{started}\t{name}")


def read(path):
    process, threads = 0, {}
    with open(path) as f:
        for line in f:
            tid, ticks, started, name = line.rstrip("\n").split("\t", 3)
            if tid == "process":
                process = int(ticks)
            else:
                # A thread id can be reused: the start time tells them apart.
                threads[(tid, started)] = (int(ticks), name)
    return process, threads


def diff(before, after, requests):
    if requests <= 0:
        sys.exit("threads.py: no requests to divide by")
    (p0, start), (p1, end) = read(before), read(after)
    per_tick = 1_000_000 / os.sysconf("SC_CLK_TCK") / requests
    by_kind = {}
    for key, (ticks, name) in end.items():
        # A thread born during the loop started from nothing.
        took = ticks - start.get(key, (0, name))[0]
        by_kind[kind(name)] = by_kind.get(kind(name), 0) + took
    ended = (p1 - p0) - sum(by_kind.values())
    if ended > 0:
        by_kind["threads that ended"] = ended
    # The threads are read after the process, so over a short loop their
    # sum can pass its total by a tick or two.
    total = max(p1 - p0, sum(by_kind.values()))
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
        diff(sys.argv[2], sys.argv[3], int(sys.argv[4] or 0))
    else:
        sys.exit(__doc__)
