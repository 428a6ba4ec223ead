//! The cluster run: two `tally vote` instances and two `tally consumer`s in
//! one group, sharing nothing but the stores, on a three-node Cassandra
//! (RF 3, LOCAL_QUORUM / LOCAL_SERIAL) and three Kafka brokers (RF 3,
//! min.insync.replicas 2), under load, while nodes are killed, paused and
//! cut off. Every request is recorded with its invocation and answer time;
//! afterwards each (user, target) history must be linearizable, no
//! acknowledged vote lost, and the durable and served totals equal to the
//! recount of `reactions` once the pipeline drains, with no reconcile.
//!
//!   scripts/stack.sh up --cluster
//!   cargo test --test cluster -- --nocapture                 # the short run (CI)
//!   TALLY_CLUSTER_SECS=900 cargo test --test cluster -- --nocapture
//!
//! The faults are placed at shares of TALLY_CLUSTER_SECS; the load runs
//! until the last one has healed (a restart can take longer than its
//! share), and a tail after it.
//!
//! It needs the cluster (`scripts/test.sh` starts it for this test alone)
//! and root for the iptables partition.

#[path = "it/support/mod.rs"]
mod support;

use std::collections::{BTreeMap, HashMap};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::history::{self, Kind};
use support::stack::{env_num, root, signal_server, stack};
use support::{CLUSTER_HOSTS, JWT_SECRET, Proc, TestEnv, Zipf, eventually, free_port, token};

/// Loopback iptables rules that cut Cassandra's internode traffic between
/// two addresses both ways; removed when dropped, also on a panic.
struct Partition(Vec<Vec<String>>);

impl Partition {
    fn cut(a: &str, b: &str) -> Partition {
        let rules: Vec<Vec<String>> = [(a, b), (b, a)]
            .iter()
            .map(|(s, d)| {
                [
                    "INPUT", "-i", "lo", "-s", s, "-d", d, "-p", "tcp", "--dport", "7000", "-j",
                    "DROP",
                ]
                .map(String::from)
                .to_vec()
            })
            .collect();
        for rule in &rules {
            let ok = Command::new("iptables")
                .arg("-A")
                .args(rule)
                .status()
                .is_ok_and(|s| s.success());
            assert!(
                ok,
                "iptables -A {rule:?} (root and the iptables package are needed)"
            );
        }
        Partition(rules)
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        for rule in &self.0 {
            let _ = Command::new("iptables").arg("-D").args(rule).status();
        }
    }
}

/// Servers stopped with SIGSTOP, continued when dropped (also on a panic).
struct Paused(Vec<u32>);

impl Paused {
    /// Stops every one of `nodes` with one signal, so they stop together.
    fn stop(nodes: &[&str]) -> Paused {
        let pids: Vec<u32> = nodes
            .iter()
            .map(|n| {
                stack(&["pid", n])
                    .parse()
                    .unwrap_or_else(|e| panic!("pid of {n}: {e}"))
            })
            .collect();
        let paused = Paused(pids);
        paused.signal("-STOP");
        paused
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(sig)
            .args(self.0.iter().map(u32::to_string))
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {sig} {:?}", self.0);
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        self.signal("-CONT");
    }
}

/// SIGSTOPs Cassandra `nodes` for `how_long`, then lets them go on.
async fn pause(nodes: &[&str], how_long: Duration) {
    eprintln!("cluster: SIGSTOP {nodes:?} for {how_long:?}");
    let paused = tokio::task::block_in_place(|| Paused::stop(nodes));
    tokio::time::sleep(how_long).await;
    drop(paused);
}

#[derive(Debug, Clone, PartialEq)]
enum Answer {
    Ok,
    /// Refused before anything changed (4xx other than a timeout).
    Refused(u16),
    /// No answer, or a 503: the vote may or may not have happened.
    Unknown,
    /// A 503 `outcome_unknown`: a conditional write timed out and the
    /// SERIAL read that would tell failed until the deadline.
    OutcomeUnknown,
}

impl Answer {
    fn unknown(&self) -> bool {
        matches!(self, Answer::Unknown | Answer::OutcomeUnknown)
    }
}

#[derive(Debug, Clone)]
struct Rec {
    user: String,
    target: String,
    /// The vote's Idempotency-Key, or None for a summary read.
    key: Option<String>,
    /// A vote's action, or the state a summary read returned.
    state: String,
    invoked: u64,
    answered: u64,
    answer: Answer,
}

struct Clock(Instant);

impl Clock {
    fn now(&self) -> u64 {
        self.0.elapsed().as_micros() as u64
    }
}

async fn vote(
    client: &reqwest::Client,
    base: &str,
    user: &str,
    key: &str,
    target: &str,
    action: &str,
    timeout: Duration,
) -> Answer {
    match support::post_vote(client, base, user, key, target, action, timeout).await {
        Ok(r) if r.status().is_success() => match r.bytes().await {
            Ok(_) => Answer::Ok,
            Err(_) => Answer::Unknown,
        },
        Ok(r) if r.status().as_u16() == 503 => match r.text().await {
            Ok(body) if body.contains("outcome_unknown") => Answer::OutcomeUnknown,
            _ => Answer::Unknown,
        },
        Ok(r) if r.status().is_server_error() => Answer::Unknown,
        Ok(r) => Answer::Refused(r.status().as_u16()),
        Err(_) => Answer::Unknown,
    }
}

async fn read_state(
    client: &reqwest::Client,
    base: &str,
    user: &str,
    target: &str,
) -> Option<String> {
    let res = client
        .get(format!("{base}/v1/votes/summary?target_ids={target}"))
        .bearer_auth(token(user))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?;
    if !res.status().is_success() {
        return None;
    }
    let body: serde_json::Value = res.json().await.ok()?;
    body["items"][target]["user_state"]
        .as_str()
        .map(str::to_owned)
}

/// The sum of one metric's samples whose labels contain every `labels` pair,
/// from a Prometheus text page.
fn metric(page: &str, name: &str, labels: &[&str]) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|x| l.contains(x)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

/// Every vote instance's metrics page (on its operator address), concatenated.
async fn scrape(client: &reqwest::Client, bases: &[String]) -> String {
    let mut pages = String::new();
    for base in bases {
        if let Ok(r) = client.get(format!("{base}/metrics")).send().await {
            pages.push_str(&r.text().await.unwrap_or_default());
            pages.push('\n');
        }
    }
    pages
}

/// CAS timeouts of votes, and how they ended: applied, not applied, or
/// unresolved (the SERIAL read failed until the deadline).
fn cas_outcomes(pages: &str) -> [f64; 4] {
    [
        metric(
            pages,
            "tally_cas_total",
            &["statement=\"vote\"", "outcome=\"unknown\""],
        ),
        metric(
            pages,
            "tally_unknown_outcomes_total",
            &["resolved=\"applied\""],
        ),
        metric(
            pages,
            "tally_unknown_outcomes_total",
            &["resolved=\"not_applied\""],
        ),
        metric(
            pages,
            "tally_unknown_outcomes_total",
            &["resolved=\"unresolved\""],
        ),
    ]
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

/// A fault and the window it lasted, for the per-phase report.
#[derive(Debug, Clone, serde::Serialize)]
struct Window {
    fault: &'static str,
    from_s: f64,
    to_s: f64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_under_node_kills_pauses_and_partitions_stays_linearizable_and_converges() {
    let secs = env_num("TALLY_CLUSTER_SECS", 150);
    let seed = env_num("TALLY_CLUSTER_SEED", 1);
    let (n_users, n_targets, n_workers) = (48u64, 30usize, 12u64);
    eprintln!("cluster: {secs}s, seed {seed}, {n_users} users over {n_targets} targets");
    assert_eq!(
        stack(&["status"]).lines().next(),
        Some("mode: cluster"),
        "this test needs `scripts/stack.sh up --cluster`"
    );

    let env = TestEnv::on_cluster().await;
    let ports = [free_port(), free_port()];
    let ops_ports = [free_port(), free_port()];
    // Each process's warnings and errors go to a file of its own, read back
    // only if the totals do not converge: the run's own account of why.
    let logs = std::env::temp_dir().join(format!("tally-cluster-{}", std::process::id()));
    std::fs::create_dir_all(&logs).unwrap_or_else(|e| panic!("{}: {e}", logs.display()));
    let spawned = std::sync::atomic::AtomicUsize::new(0);
    let spawn = |sub: &str, port: Option<(u16, u16)>| {
        let n = spawned.fetch_add(1, Ordering::Relaxed);
        let log = logs.join(format!("{sub}-{n}.log"));
        let log = std::fs::File::create(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let mut cmd = env.tally();
        cmd.arg(sub)
            .env("TALLY_JWT_SECRET", JWT_SECRET)
            .env("TALLY_CASSANDRA_LOCAL_DC", "dc1")
            .env("TALLY_CASSANDRA_TIMEOUT_MS", "3000")
            .env("TALLY_CACHE_TTL_MIN", "3s")
            .env("TALLY_CACHE_TTL_MAX", "5s")
            .env("TALLY_LOG_FORMAT", "json")
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        if let Some((port, ops)) = port {
            cmd.env("TALLY_LISTEN", format!("127.0.0.1:{port}"))
                .env("TALLY_OPS_LISTEN", format!("127.0.0.1:{ops}"));
        }
        Proc(cmd.spawn().unwrap_or_else(|e| panic!("{e}")))
    };
    let _votes: Vec<Proc> = ports
        .iter()
        .zip(ops_ports)
        .map(|(p, o)| spawn("vote", Some((*p, o))))
        .collect();
    let mut consumers = vec![spawn("consumer", None), spawn("consumer", None)];
    let bases: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let ops_bases: Vec<String> = ops_ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let client = reqwest::Client::new();
    for base in &bases {
        support::wait_until_healthy(&client, base, Duration::from_secs(90)).await;
    }

    let clock = Arc::new(Clock(Instant::now()));
    let log: Arc<Mutex<Vec<Rec>>> = Arc::default();
    // The load runs until the last fault has healed, and a tail after it.
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..n_workers {
        let (client, bases, log, clock, stop) = (
            client.clone(),
            bases.clone(),
            log.clone(),
            clock.clone(),
            stop.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut zipf = Zipf::new(n_targets, 0.8, seed * 1000 + w);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let user = format!("u{}", zipf.below(n_users / n_workers) * n_workers + w);
                let target = format!("t{}", zipf.sample());
                let base = &bases[zipf.below(2) as usize];
                let action = ["like", "dislike", "none"][zipf.below(3) as usize];
                let key = format!("{user}-{w}-{n}-{seed}");
                n += 1;
                let rec = |key: Option<&str>, state: &str, invoked, answer| Rec {
                    user: user.clone(),
                    target: target.clone(),
                    key: key.map(str::to_owned),
                    state: state.to_owned(),
                    invoked,
                    answered: clock.now(),
                    answer,
                };
                let mut recs = Vec::new();
                match zipf.below(10) {
                    // A summary read: the user's own state.
                    0..=2 => {
                        let invoked = clock.now();
                        if let Some(state) = read_state(&client, base, &user, &target).await {
                            recs.push(rec(None, &state, invoked, Answer::Ok));
                        }
                    }
                    // A double click: two keys at once, one on each instance.
                    3 => {
                        let key2 = format!("{key}-b");
                        let invoked = clock.now();
                        let (a, b) = tokio::join!(
                            vote(
                                &client,
                                &bases[0],
                                &user,
                                &key,
                                &target,
                                action,
                                Duration::from_secs(10)
                            ),
                            vote(
                                &client,
                                &bases[1],
                                &user,
                                &key2,
                                &target,
                                action,
                                Duration::from_secs(10)
                            )
                        );
                        recs.push(rec(Some(&key), action, invoked, a));
                        recs.push(rec(Some(&key2), action, invoked, b));
                    }
                    // A lost response, then retries with the same key on
                    // either instance until one answers.
                    4 => {
                        let invoked = clock.now();
                        let lost = Duration::from_millis(1 + zipf.below(20));
                        let first = vote(&client, base, &user, &key, &target, action, lost).await;
                        recs.push(rec(Some(&key), action, invoked, first));
                        for _ in 0..20 {
                            let other = &bases[zipf.below(2) as usize];
                            let invoked = clock.now();
                            let answer = vote(
                                &client,
                                other,
                                &user,
                                &key,
                                &target,
                                action,
                                Duration::from_secs(10),
                            )
                            .await;
                            let done = !answer.unknown();
                            recs.push(rec(Some(&key), action, invoked, answer));
                            if done {
                                break;
                            }
                            tokio::time::sleep(Duration::from_millis(300)).await;
                        }
                    }
                    _ => {
                        let invoked = clock.now();
                        let answer = vote(
                            &client,
                            base,
                            &user,
                            &key,
                            &target,
                            action,
                            Duration::from_secs(10),
                        )
                        .await;
                        recs.push(rec(Some(&key), action, invoked, answer));
                    }
                }
                if let Ok(mut l) = log.lock() {
                    l.extend(recs);
                }
            }
        }));
    }

    // The faults, in order, each at its share of the run.
    let at = |f: f64| Duration::from_secs_f64(secs as f64 * f);
    let one_paused = Duration::from_secs_f64((secs as f64 * 0.05).clamp(4.0, 20.0));
    let started = Instant::now();
    let wait_until = |when: Duration| async move {
        if let Some(d) = when.checked_sub(started.elapsed()) {
            tokio::time::sleep(d).await;
        }
    };
    let mut windows: Vec<Window> = Vec::new();
    let now_s = || clock.now() as f64 / 1e6;
    // A fault's window, from when it began until now.
    let window = |fault: &'static str, from_s: f64| Window {
        fault,
        from_s,
        to_s: now_s(),
    };
    // kill -9 of one server, and its start again at `restart_at` of the run.
    let kill_then_start = |name: &'static str, restart_at: Duration| async move {
        eprintln!(
            "cluster: kill -9 {name} at {:.1}s",
            started.elapsed().as_secs_f64()
        );
        signal_server(name, "-KILL");
        wait_until(restart_at).await;
        tokio::task::block_in_place(|| stack(&["start", name]));
    };

    wait_until(at(0.08)).await;
    let from = now_s();
    kill_then_start("cassandra3", at(0.20)).await;
    windows.push(window(
        "kill -9 of one Cassandra node until it answers again",
        from,
    ));

    wait_until(at(0.38)).await;
    let from = now_s();
    pause(&["cassandra2"], one_paused).await;
    windows.push(window("SIGSTOP of one Cassandra replica", from));

    // A quorum lost for less than a vote's deadline: every CAS timeout
    // must be resolved by the vote's own SERIAL read once it returns. It
    // starts at least 12 s (a vote's deadline and one request timeout)
    // after the last fault, so no earlier vote ends inside its window.
    wait_until(at(0.46).max(started.elapsed() + Duration::from_secs(12))).await;
    let before = cas_outcomes(&scrape(&client, &ops_bases).await);
    let from = now_s();
    pause(&["cassandra2", "cassandra3"], Duration::from_secs(3)).await;
    windows.push(window(
        "SIGSTOP of two of three replicas (no quorum), 3 s",
        from,
    ));
    // Once the quorum is back and every request sent during the pause has
    // returned (one Cassandra request timeout, 3 s), every CAS timeout so
    // far ends, within a vote's deadline, with a count of how it ended.
    let resumed = Instant::now();
    let after = eventually(
        "every CAS timeout of the 3 s quorum loss to end",
        Duration::from_secs(30),
        || async {
            let [timeouts, applied, not_applied, unresolved] =
                cas_outcomes(&scrape(&client, &ops_bases).await);
            (resumed.elapsed() >= Duration::from_secs(3)
                && applied + not_applied + unresolved == timeouts)
                .then_some([timeouts, applied, not_applied, unresolved])
        },
    )
    .await;
    let short_loss: Vec<f64> = (0..4).map(|i| after[i] - before[i]).collect();

    // Lost for longer than the deadline: a CAS timeout whose SERIAL read
    // fails too, answered 503 outcome_unknown. The client's retry with its
    // key, or the relay, settles each; the checks below show that nothing
    // was lost or counted twice.
    wait_until(at(0.52)).await;
    let from = now_s();
    pause(&["cassandra2", "cassandra3"], Duration::from_secs(12)).await;
    windows.push(window(
        "SIGSTOP of two of three replicas (no quorum), 12 s",
        from,
    ));

    wait_until(at(0.56)).await;
    let from = now_s();
    eprintln!("cluster: partition 127.0.0.2 <-> 127.0.0.3 at {from:.1}s for {one_paused:?}");
    let cut = Partition::cut(CLUSTER_HOSTS[1], CLUSTER_HOSTS[2]);
    tokio::time::sleep(one_paused).await;
    drop(cut);
    windows.push(window(
        "loopback partition between two Cassandra nodes",
        from,
    ));

    wait_until(at(0.64)).await;
    let from = now_s();
    kill_then_start("kafka2", at(0.72)).await;
    windows.push(window(
        "kill -9 of one Kafka broker until it answers again",
        from,
    ));

    wait_until(at(0.78)).await;
    let leaders = {
        let kafka = env.kafka.clone();
        tokio::task::spawn_blocking(move || tally::bus::admin::partition_leaders(&kafka))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|e| panic!("{e:#}"))
    };
    let leader = leaders.first().map_or(1, |(_, leader, _)| *leader);
    let from = now_s();
    eprintln!("cluster: restart of kafka{leader}, leader of partition 0, at {from:.1}s");
    let name = format!("kafka{leader}");
    tokio::task::block_in_place(|| stack(&["restart", &name]));
    windows.push(window("restart of a partition leader's broker", from));

    wait_until(at(0.86)).await;
    let from = now_s();
    eprintln!("cluster: kill -9 of one consumer at {from:.1}s");
    consumers[0].kill9();
    tokio::time::sleep(Duration::from_secs(2)).await;
    consumers[0] = spawn("consumer", None);
    windows.push(window("kill -9 of one consumer (a rebalance)", from));

    tokio::time::sleep(at(0.12).max(Duration::from_secs(10))).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap_or_else(|e| panic!("{e}"));
    }
    let load_end_s = now_s();
    let recs = log.lock().map(|l| l.clone()).unwrap_or_default();
    eprintln!("cluster: load done, {} requests; draining", recs.len());

    // --- drain, then the durable totals with no reconcile --------------
    eventually(
        "the consumer group to drain",
        Duration::from_secs(180),
        || async {
            let (k, g) = (env.kafka.clone(), env.group.clone());
            let lag = tokio::task::spawn_blocking(move || tally::bus::lag::group_lag(&k, &g))
                .await
                .ok()?
                .ok()?;
            lag.iter().all(|l| l.messages == 0).then_some(())
        },
    )
    .await;
    let drained = Instant::now();
    // Totals the first look finds equal converged at the drain (0 s), not
    // after the length of the look.
    let mut first_look = true;
    let truth = loop {
        let (truth, stats) = (env.recount().await, env.stats().await);
        if truth == stats {
            break truth;
        }
        first_look = false;
        if drained.elapsed() > Duration::from_secs(90) {
            panic!(
                "timed out after 90s waiting for target_stats to equal the recount of reactions, \
                 with no reconcile\n{}",
                why_not_converged(&truth, &stats, &logs)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let durable_converged_s = if first_look {
        0.0
    } else {
        drained.elapsed().as_secs_f64()
    };

    // --- what users see: the summary, cache included -------------------
    let served_since = Instant::now();
    eventually(
        "served totals to equal the recount",
        Duration::from_secs(30),
        || async {
            let mismatches = support::served_mismatches(&client, &bases[0], &truth)
                .await
                .ok()?;
            mismatches.is_empty().then_some(())
        },
    )
    .await;
    let served_converged_s = durable_converged_s + served_since.elapsed().as_secs_f64();

    // --- every (user, target) history is linearizable -----------------
    let end = clock.now();
    let mut registers: BTreeMap<(String, String), Vec<&Rec>> = BTreeMap::new();
    for r in &recs {
        registers
            .entry((r.user.clone(), r.target.clone()))
            .or_default()
            .push(r);
    }
    let (mut acknowledged, mut unknown_to_client, mut resolved_on_retry) = (0usize, 0usize, 0usize);
    let mut checked = 0usize;
    for ((user, target), recs) in &registers {
        let mut ops = Vec::new();
        let mut by_key: HashMap<&str, Vec<&Rec>> = HashMap::new();
        for r in recs {
            match &r.key {
                None => ops.push(history::Op {
                    kind: Kind::Read(r.state.clone()),
                    invoked: r.invoked,
                    answered: Some(r.answered),
                }),
                Some(k) => by_key.entry(k.as_str()).or_default().push(r),
            }
        }
        // All attempts of one key are one vote: it happened at most once,
        // after its first invocation and, if acknowledged, before its
        // first acknowledgement.
        for attempts in by_key.values() {
            let invoked = attempts.iter().map(|a| a.invoked).min().unwrap_or(0);
            let ok = attempts
                .iter()
                .filter(|a| a.answer == Answer::Ok)
                .map(|a| a.answered)
                .min();
            let unknown = attempts.iter().any(|a| a.answer.unknown());
            if ok.is_none() && !unknown {
                continue;
            }
            if ok.is_some() {
                acknowledged += 1;
                if unknown {
                    unknown_to_client += 1;
                    resolved_on_retry += 1;
                }
            } else {
                unknown_to_client += 1;
            }
            ops.push(history::Op {
                kind: Kind::Write(attempts[0].state.clone()),
                invoked,
                answered: ok,
            });
        }
        // The row as it ends: a read after everything else.
        let row = truth
            .get(target)
            .and_then(|t| t.users.get(user))
            .map_or("none".to_owned(), |(_, state)| state.clone());
        ops.push(history::Op {
            kind: Kind::Read(row),
            invoked: end,
            answered: Some(end + 1),
        });
        if let Err(e) = history::check(&ops, "none") {
            panic!("{user} on {target}: {e}");
        }
        checked += 1;
    }

    // --- CAS timeouts, and how each was resolved -----------------------
    let [cas_unknown, resolved_applied, resolved_not, unresolved] =
        cas_outcomes(&scrape(&client, &ops_bases).await);

    // --- the report -----------------------------------------------------
    let phase = |from: f64, to: f64| {
        let mut lat: Vec<u64> = recs
            .iter()
            .filter(|r| r.key.is_some() && r.answer == Answer::Ok)
            .filter(|r| (r.invoked as f64 / 1e6) >= from && (r.invoked as f64 / 1e6) < to)
            .map(|r| r.answered - r.invoked)
            .collect();
        lat.sort_unstable();
        serde_json::json!({
            "from_s": from, "to_s": to,
            "ok_votes_per_s": lat.len() as f64 / (to - from).max(0.001),
            "p95_ms": percentile(&lat, 0.95), "p99_ms": percentile(&lat, 0.99),
        })
    };
    let first = windows.first().map_or(load_end_s, |w| w.from_s);
    let last = windows.last().map_or(0.0, |w| w.to_s);
    let mut phases =
        vec![serde_json::json!({"phase": "before any fault", "stats": phase(0.0, first)})];
    for w in &windows {
        phases.push(serde_json::json!({"phase": w.fault, "stats": phase(w.from_s, w.to_s)}));
    }
    phases.push(
        serde_json::json!({"phase": "after the last fault", "stats": phase(last, load_end_s)}),
    );
    let count = |f: &dyn Fn(&Rec) -> bool| recs.iter().filter(|r| f(r)).count();
    let report = serde_json::json!({
        "seconds": secs,
        "seed": seed,
        "requests": recs.len(),
        "votes_ok": count(&|r| r.key.is_some() && r.answer == Answer::Ok),
        "votes_unknown": count(&|r| r.key.is_some() && r.answer.unknown()),
        "answered_outcome_unknown": count(&|r| r.answer == Answer::OutcomeUnknown),
        "votes_refused": count(&|r| matches!(r.answer, Answer::Refused(_))),
        "reads": count(&|r| r.key.is_none()),
        "registers_checked_linearizable": checked,
        "acknowledged_votes": acknowledged,
        "acknowledged_votes_lost": 0,
        "outcomes_unknown_to_the_client": unknown_to_client,
        "of_which_resolved_on_retry": resolved_on_retry,
        "cas_timeouts": cas_unknown,
        "resolved_by_serial_read": {"applied": resolved_applied, "not_applied": resolved_not, "unresolved": unresolved},
        "quorum_lost_3s": {"cas_timeouts": short_loss[0], "applied": short_loss[1], "not_applied": short_loss[2], "unresolved": short_loss[3]},
        "durable_equal_recount_s_after_drain": durable_converged_s,
        "served_equal_recount_s_after_drain": served_converged_s,
        "targets": truth.len(),
        "phases": phases,
    });
    eprintln!(
        "cluster report: {}",
        serde_json::to_string_pretty(&report).unwrap_or_default()
    );
    let dir = root().join("target/tally-cluster");
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(
        dir.join(format!("report-{secs}s-seed{seed}.json")),
        report.to_string(),
    );

    assert!(checked > 0 && acknowledged > 0, "the run voted: {report}");
    assert!(
        cas_unknown >= 1.0,
        "the quorum losses produced no CAS timeout: {report}"
    );
    assert_eq!(
        resolved_applied + resolved_not + unresolved,
        cas_unknown,
        "every CAS timeout was followed by the SERIAL read that resolves it: {report}"
    );
    assert_eq!(
        short_loss[3], 0.0,
        "a quorum back within the deadline: every CAS timeout resolved by the SERIAL read: {report}"
    );
    drop(consumers);
    // The processes' logs are kept only for a run that failed: its account
    // of why. A passing run's would pile up in /tmp, one folder a run.
    let _ = std::fs::remove_dir_all(&logs);
}

/// What differs between the recount and `target_stats`, target by target,
/// and the last warnings and errors the run's processes wrote (dead letters,
/// parked buckets, the relay's failures): enough to tell a lost publish from
/// a parked bucket or a double count without running it again.
fn why_not_converged(
    truth: &std::collections::BTreeMap<String, support::Tally>,
    stats: &std::collections::BTreeMap<String, support::Tally>,
    logs: &std::path::Path,
) -> String {
    let mut out = String::from("targets whose totals differ (recount, then target_stats):\n");
    let targets: std::collections::BTreeSet<&String> = truth.keys().chain(stats.keys()).collect();
    for t in targets {
        let (r, s) = (truth.get(t), stats.get(t));
        if r != s {
            out.push_str(&format!("  {t}: {r:?} against {s:?}\n"));
        }
    }
    let mut lines: Vec<String> = std::fs::read_dir(logs)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|f| {
            let name = f.file_name().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(f.path()).ok()?;
            Some((name, text))
        })
        .flat_map(|(name, text)| {
            text.lines()
                .filter(|l| l.contains("\"WARN\"") || l.contains("\"ERROR\""))
                .filter(|l| !l.contains("tally::access"))
                .map(|l| format!("  {name}: {l}"))
                .collect::<Vec<_>>()
        })
        .collect();
    lines.sort_by(|a, b| {
        let at = |l: &str| {
            l.split("\"timestamp\":\"")
                .nth(1)
                .map(|t| t[..t.len().min(30)].to_owned())
        };
        at(a).cmp(&at(b))
    });
    let shown = lines.len().saturating_sub(60);
    out.push_str(&format!(
        "the processes' last warnings and errors ({} of {}; all in {}):\n",
        lines.len() - shown,
        lines.len(),
        logs.display()
    ));
    for l in &lines[shown..] {
        out.push_str(&l.chars().take(400).collect::<String>());
        out.push('\n');
    }
    out
}
