//! `tally consumer`: counts each published transition exactly once into
//! `target_stats`, however often Kafka delivers it.
//!
//! A batch is up to `batch_max` messages or `batch_wait` of time. Its events
//! are grouped by bucket of a target, and each bucket gets one fenced write
//! (see `fence`); buckets are written in parallel, so a target that gets
//! most of the traffic is written by as many writers as it has buckets. Offsets are stored only after every write of the batch has
//! landed, and the cache drops those writes owe are sent (see `held`);
//! auto-commit then commits them. A crash anywhere replays from the last
//! commit, and the replayed versions are dropped by the apply rule.
//!
//! Between batches the consumer remembers the seq and totals it last left
//! each bucket at. When a bucket's events arrive in order, as they do
//! unless something was lost or replayed, it writes them without reading
//! anything: the write is conditioned on that seq, and each user's row on
//! the version and state their first event says it holds. Anything else
//! (another writer moved the fence, a replay, a gap) refuses the write, and
//! the bucket takes the reading path of `fence`. A bucket the consumer has
//! not written yet is learnt before the batch's writes: the heads of all of
//! a target's unknown buckets in one read.

mod held;
mod lag;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;

use crate::bus::dead_letter::DeadLetters;
use crate::bus::lag::Positions;
use crate::bus::signature::EventKey;
use crate::bus::source::{Next, Received, Source};
use crate::cache::{Cache, TtlPolicy};
use crate::domain::{Applied, Bucket, Ledger, TargetId, TargetType, Transition, UserId};
use crate::fence::{self, Ending, Fold, Left, MAX_USERS_PER_WRITE, Read, Step};
use crate::ops::Stores;
use crate::store::Cas;
use crate::store::reactions::{Reactions, Seen};
use crate::store::stats::FencedWrite;
use crate::store::stats::Stats;
use crate::store::targets::Targets;
use crate::store::{Store, StoreError};

/// How the consumer writes: `batched` (one fenced write per bucket of a
/// target per batch) or `per-event` (one per event, the baseline the benches compare).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    Batched,
    PerEvent,
}

/// Settings of `tally consumer`.
#[derive(clap::Args, Debug, Clone)]
pub struct ConsumerConfig {
    /// Consumer group; run several processes in one group to share partitions.
    #[arg(long, env = "TALLY_CONSUMER_GROUP", default_value = "tally-consumer")]
    pub group: String,

    /// Most messages in one batch.
    #[arg(long = "batch-max", env = "TALLY_BATCH_MAX", default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub batch_max: u64,

    /// Longest a batch waits to fill after its first message.
    #[arg(long = "batch-wait", env = "TALLY_BATCH_WAIT", default_value = "50ms", value_parser = crate::cli::values::duration)]
    pub batch_wait: Duration,

    /// Buckets written concurrently within one batch. Each write is a
    /// Paxos round of tens of milliseconds under load, so this, not CPU,
    /// bounds what one consumer counts a second: with 16 it fell some 300
    /// transitions a second behind 64 connections of votes on 2 cores.
    #[arg(long = "write-parallelism", env = "TALLY_WRITE_PARALLELISM", default_value_t = 64, value_parser = crate::cli::values::count(4_096))]
    pub parallelism: usize,

    /// How long a stop (SIGTERM) waits for the batch in hand to be written.
    #[arg(long = "drain-timeout", env = "TALLY_DRAIN_TIMEOUT", default_value = "20s", value_parser = crate::cli::values::duration)]
    pub drain_timeout: Duration,

    #[arg(long = "write-mode", env = "TALLY_WRITE_MODE", value_enum, default_value_t = WriteMode::Batched)]
    pub mode: WriteMode,

    /// Failed writes of one bucket of a target after which its events go to
    /// the dead-letter topic, if Cassandra still takes a conditional write
    /// elsewhere (a store that takes none is waited for, never parked).
    #[arg(long = "park-after", env = "TALLY_PARK_AFTER", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1_000))]
    pub park_after: u32,

    /// Count events without checking them against the users' rows (one
    /// read per chunk of a target's events). Without it, an event whose
    /// user has no row for the target, or whose version is ahead of the
    /// row's, is dead-lettered: someone other than the vote API produced
    /// it. Only for topics nothing else can write (and for benches of
    /// synthetic events).
    #[arg(long = "trust-events", env = "TALLY_TRUST_EVENTS")]
    pub trust_events: bool,

    /// Address of the consumer's /metrics, /healthz and /readyz (port 0 picks one).
    #[arg(long = "listen", env = "TALLY_CONSUMER_LISTEN", default_value = "127.0.0.1:9091", value_parser = crate::cli::values::listen_address)]
    pub listen: String,

    /// The TTL of cache entries it writes through; it follows the group's
    /// lag, as the vote API's does.
    #[command(flatten)]
    pub cache_ttl: TtlPolicy,
    #[command(flatten)]
    pub stores: Stores,
}

/// Running counts, shared with tests, metrics and the lag reporter.
#[derive(Debug, Default)]
pub struct Progress {
    /// Messages written (applied, replayed or dead-lettered); their offsets
    /// are stored then, or once the cache drops their writes owe are sent.
    pub processed: AtomicU64,
    pub dead_lettered: AtomicU64,
    /// Events dead-lettered because their bucket's writes kept failing.
    pub parked: AtomicU64,
    pub replays: AtomicU64,
    pub gaps: AtomicU64,
    /// Fenced writes that landed.
    pub writes: AtomicU64,
    /// Fenced writes that lost to another writer and were redone.
    pub fence_conflicts: AtomicU64,
    pub batches: AtomicU64,
    /// CQL requests made to count: every read and every batch, and every
    /// registration.
    pub requests: AtomicU64,
    /// Targets registered before their events were counted (with
    /// `--trust-events`), once per target and process.
    pub registrations: AtomicU64,
    /// Reads of the users' rows behind events (one per chunk of a
    /// target's unsigned events).
    pub row_reads: AtomicU64,
    /// Events kept without a read because their signature verified.
    pub signed: AtomicU64,
    /// Events signed, but not with this consumer's key (or altered since),
    /// which were read against the rows instead.
    pub bad_signatures: AtomicU64,
    /// Events without a signature, though this consumer has a key.
    pub unsigned: AtomicU64,
    /// Signed events, though this consumer has no key to verify them.
    pub unverified: AtomicU64,
    /// The port /metrics, /healthz and /readyz are served on.
    pub ops_port: AtomicU64,
}

impl ConsumerConfig {
    /// The settings that contradict each other, refused before anything
    /// connects.
    pub fn check(&self) -> Result<(), String> {
        self.stores.redis.check()?;
        let key = self.stores.kafka.event_key()?;
        if key.is_some() && self.trust_events {
            return Err(
                "--event-signing-key has no use with --trust-events, which checks no event".into(),
            );
        }
        Ok(())
    }
}

/// Runs until `stop` turns true, then finishes the batch in hand (up to
/// `drain_timeout`), commits what was written, and leaves the group.
pub async fn run(
    config: ConsumerConfig,
    mut stop: watch::Receiver<bool>,
    progress: Arc<Progress>,
) -> anyhow::Result<()> {
    let store =
        Arc::new(Store::open_waiting(&config.stores.cassandra, Duration::from_secs(1)).await?);
    let source = Source::join(&config.stores.kafka, &config.group, config.batch_wait)?;
    let dead_letters = DeadLetters::new(&config.stores.kafka)?;
    let cache = Cache::new(&config.stores.redis, config.cache_ttl.min)?;
    // A wrong password or CA is a setting to fix, not an outage to ride out.
    cache.check_login().await?;
    config.stores.kafka.check_login().await?;
    let ttl_task = tokio::spawn(config.cache_ttl.clone().follow_consumer_lag(
        cache.clone(),
        config.stores.kafka.clone(),
        config.group.clone(),
    ));
    let readiness =
        crate::ops::Readiness::for_consumer(store.clone(), &config.stores.kafka, cache.clone())?;
    let (port, ops_server) =
        crate::ops::serve(&config.listen, readiness.clone(), crate::metrics::install())?;
    progress.ops_port.store(u64::from(port), Ordering::Relaxed);
    let ops_handle = ops_server.handle();
    tokio::spawn(ops_server);
    let positions = Positions::default();
    let lag_task = tokio::spawn(lag::report(source.clone(), positions.clone(), stop.clone()));
    let drops_task = tokio::spawn(cache.clone().keep_dropping_owed());
    let runs_task = tokio::spawn(cache.clone().keep_checking_runs());
    let held = Arc::new(held::Held::default());
    let release_task = tokio::spawn(held.clone().keep_releasing(cache.clone(), source.clone()));
    tracing::info!(group = %config.group, topic = %config.stores.kafka.topic, mode = ?config.mode, "tally consumer started");

    let known = Known::default();
    let parked = Parked::default();
    let event_key = config
        .stores
        .kafka
        .event_key()
        .map_err(anyhow::Error::msg)?;
    let worker = Worker {
        config: &config,
        event_key: event_key.as_ref(),
        stats: &store.stats,
        provenance: if config.trust_events {
            Provenance::Trusted(&store.targets)
        } else {
            Provenance::Rows(&store.reactions)
        },
        dead_letters: &dead_letters,
        cache: &cache,
        progress: &progress,
        known: &known,
        parked: &parked,
        readiness: &readiness,
    };
    let result = loop {
        if *stop.borrow() {
            break Ok(());
        }
        let batch = tokio::select! {
            b = source.gather(config.batch_max, config.batch_wait) => b,
            _ = stop.changed() => continue,
        };
        if batch.is_empty() {
            continue;
        }
        // Finish the batch in hand even after a stop, within the drain timeout.
        let written = tokio::select! {
            r = worker.process(&batch, &stop) => r,
            () = drain_deadline(stop.clone(), config.drain_timeout) => Err(anyhow::anyhow!("drain timeout: batch abandoned, it will be replayed")),
        };
        match written {
            Ok(()) => {
                held.written(cache.owed_mark(), Next::after(&batch));
                held.release_paid(&cache, &source);
                positions.advance(&batch);
                // Batches first: whoever sees the messages processed sees
                // their batch counted.
                progress.batches.fetch_add(1, Ordering::Relaxed);
                progress
                    .processed
                    .fetch_add(batch.len() as u64, Ordering::Relaxed);
            }
            Err(e) => break Err(e),
        }
    };

    lag_task.abort();
    ttl_task.abort();
    drops_task.abort();
    runs_task.abort();
    release_task.abort();
    // The drops first: the batches they hold are stored once they are sent,
    // and committed by the leave.
    cache.drop_owed_before_exit(LEAVE_BOUND).await;
    held.release_paid(&cache, &source);
    source.leave(LEAVE_BOUND).await;
    ops_handle.stop(true).await;
    tracing::info!(
        processed = progress.processed.load(Ordering::Relaxed),
        "tally consumer stopped"
    );
    result
}

/// Longest a stop waits for Kafka to take the final commit and the leave.
/// The group's session timeout (10 s) reassigns the partitions of a member
/// that never said goodbye, so waiting longer buys nothing.
const LEAVE_BOUND: Duration = Duration::from_secs(10);

/// A Cassandra request for `target`, retried with backoff until it
/// succeeds: its events cannot be counted without it. Given up only while
/// stopping, once Cassandra has failed it for a while.
async fn until_done<T, F, Fut>(
    target: &TargetId,
    what: &str,
    stop: &watch::Receiver<bool>,
    mut request: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut backoff = Duration::from_millis(50);
    loop {
        match request().await {
            Ok(done) => return Ok(done),
            Err(e) => {
                let e = anyhow::Error::new(e);
                if *stop.borrow() && backoff >= Duration::from_secs(2) {
                    anyhow::bail!("stopping while Cassandra is failing: {e:#}");
                }
                tracing::warn!(target_id = %target, error = format!("{e:#}"), "{what} failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

async fn drain_deadline(mut stop: watch::Receiver<bool>, timeout: Duration) {
    let _ = stop.wait_for(|s| *s).await;
    tokio::time::sleep(timeout).await;
}

/// A batch's events by bucket of a target, with where in the batch each came.
type ByBucket = HashMap<(TargetId, Bucket), (Vec<Transition>, Vec<usize>)>;

/// What stands behind an event.
#[derive(Clone, Copy)]
enum Provenance<'a> {
    /// The user's row, which each event is checked against, unless its
    /// signature verifies (`--event-signing-key`): the vote API publishes
    /// only committed transitions. A row commits only after its target is
    /// in the registry, so neither needs the consumer to register it.
    Rows(&'a Reactions),
    /// Nothing (`--trust-events`): the consumer registers each target
    /// before counting it, since a read's miss serves a target with no
    /// registry row as zeros.
    Trusted(&'a Targets),
}

struct Worker<'a> {
    config: &'a ConsumerConfig,
    /// `--event-signing-key`: events it verifies are kept without a read.
    event_key: Option<&'a EventKey>,
    stats: &'a Stats,
    provenance: Provenance<'a>,
    dead_letters: &'a DeadLetters,
    cache: &'a Cache,
    progress: &'a Progress,
    known: &'a Known,
    parked: &'a Parked,
    readiness: &'a crate::ops::Readiness,
}

/// Buckets whose events were parked lately. While one stays here, a
/// single failed write parks its next events, rather than `park_after`:
/// a target that is broken costs each batch one attempt, not a minute.
#[derive(Default)]
struct Parked(Mutex<HashMap<(TargetId, Bucket), std::time::Instant>>);

/// How long a parked bucket is remembered as broken.
const PARKED_FOR: Duration = Duration::from_secs(300);

impl Parked {
    fn recently(&self, target: &TargetId, bucket: Bucket) -> bool {
        self.0.lock().is_ok_and(|p| {
            p.get(&(target.clone(), bucket))
                .is_some_and(|at| at.elapsed() < PARKED_FOR)
        })
    }

    fn set(&self, target: &TargetId, bucket: Bucket, parked: bool) {
        if let Ok(mut p) = self.0.lock() {
            p.retain(|_, at| at.elapsed() < PARKED_FOR);
            if parked {
                p.insert((target.clone(), bucket), std::time::Instant::now());
            } else {
                p.remove(&(target.clone(), bucket));
            }
        }
    }
}

/// The seq and totals this consumer last left each bucket at, as far as it
/// knows: right until another writer (a consumer after a rebalance,
/// reconcile) writes the bucket, which the next write's fence then tells.
#[derive(Default)]
struct Known(Mutex<HashMap<(TargetId, Bucket), Left>>);

/// Buckets remembered at most; past it the memory starts again empty, which
/// costs one read per bucket.
const KNOWN_MAX: usize = 100_000;

impl Known {
    fn get(&self, target: &TargetId, bucket: Bucket) -> Option<Left> {
        self.0.lock().ok()?.get(&(target.clone(), bucket)).copied()
    }

    fn set(&self, target: &TargetId, bucket: Bucket, left: Option<Left>) {
        if let Ok(mut known) = self.0.lock() {
            match left {
                Some(left) => {
                    if known.len() >= KNOWN_MAX {
                        known.clear();
                    }
                    known.insert((target.clone(), bucket), left);
                }
                None => {
                    known.remove(&(target.clone(), bucket));
                }
            }
        }
    }
}

impl Worker<'_> {
    /// Writes everything a batch means. Returns only when all of it landed
    /// (or the consumer is stopping and gave up, in which case no offset of
    /// this batch may be stored).
    async fn process(
        &self,
        batch: &[Received],
        stop: &watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        // Each bucket's events, and where in the batch each came.
        let mut by_bucket: ByBucket = HashMap::new();
        for (i, m) in batch.iter().enumerate() {
            match Transition::from_json(&m.payload) {
                Ok(t) => {
                    let bucket = self.stats.bucket_of(&t.user_id);
                    let (events, sources) =
                        by_bucket.entry((t.target_id.clone(), bucket)).or_default();
                    events.push(t);
                    sources.push(i);
                }
                Err(reason) => {
                    self.dead_letter(m, &reason.to_string(), "invalid", stop)
                        .await?;
                }
            }
        }
        if self.config.mode == WriteMode::Batched {
            let mut unknown: HashMap<TargetId, Vec<Bucket>> = HashMap::new();
            for (target, bucket) in by_bucket.keys() {
                if self.known.get(target, *bucket).is_none() {
                    unknown.entry(target.clone()).or_default().push(*bucket);
                }
            }
            self.learn_heads(unknown).await;
        }
        if let Provenance::Trusted(targets) = self.provenance {
            self.register_new(targets, &by_bucket, stop).await?;
        }
        let writes =
            by_bucket
                .into_iter()
                .map(|((target, bucket), (events, sources))| async move {
                    let sources: Vec<&Received> = sources.iter().map(|&i| &batch[i]).collect();
                    let (events, sources) = match self.provenance {
                        Provenance::Rows(rows) => {
                            self.checked(rows, &target, (events, sources), stop).await?
                        }
                        Provenance::Trusted(_) => (events, sources),
                    };
                    self.count_bucket((&target, bucket), (&events, &sources), stop)
                        .await
                });
        let results: Vec<anyhow::Result<()>> = futures::stream::iter(writes)
            .buffer_unordered(self.config.parallelism.max(1))
            .collect()
            .await;
        results.into_iter().collect()
    }

    /// Reads the heads of the buckets of a batch this consumer does not
    /// know yet (`unknown`, by target), one request per target, so that their in-order
    /// events are written unread too: a bucket's first write then costs a
    /// share of one read instead of two reads of its own. What is read is
    /// only a belief, like everything in `Known`; the write's fence checks
    /// it. A read that fails leaves its buckets to the reading path.
    async fn learn_heads(&self, unknown: HashMap<TargetId, Vec<Bucket>>) {
        let reads = unknown.into_iter().map(|(target, buckets)| async move {
            let heads = self.stats.heads_of(&target, &buckets).await;
            (target, heads)
        });
        let mut reads =
            futures::stream::iter(reads).buffer_unordered(self.config.parallelism.max(1));
        while let Some((target, heads)) = reads.next().await {
            self.progress.requests.fetch_add(1, Ordering::Relaxed);
            match heads {
                Ok(heads) => {
                    for (bucket, head) in heads {
                        self.known
                            .set(&target, bucket, Some((head.seq, head.totals)));
                    }
                }
                Err(e) => {
                    tracing::debug!(target_id = %target, error = format!("{:#}", anyhow::Error::new(e)), "heads not read; those buckets read their own");
                }
            }
        }
    }

    /// Counts the events of one bucket of a target, in chunks of at most
    /// `MAX_USERS_PER_WRITE` users (one event per chunk in per-event mode),
    /// each through the fence. Retries a chunk until it lands, or parks it
    /// (see `park`) when the bucket keeps failing while the store does not.
    async fn count_bucket(
        &self,
        (target, bucket): (&TargetId, Bucket),
        (events, sources): (&[Transition], &[&Received]),
        stop: &watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        let per_chunk = match self.config.mode {
            WriteMode::Batched => MAX_USERS_PER_WRITE,
            WriteMode::PerEvent => 1,
        };
        for range in chunks_by_users(events, per_chunk) {
            let chunk = &events[range.clone()];
            if self.config.mode == WriteMode::Batched
                && self.count_unread((target, bucket), chunk).await
            {
                continue;
            }
            let mut users: Vec<&UserId> = chunk.iter().map(|t| &t.user_id).collect();
            users.sort_unstable();
            users.dedup();
            let mut backoff = Duration::from_millis(50);
            let mut failures = 0;
            let park_after = if self.parked.recently(target, bucket) {
                1
            } else {
                self.config.park_after
            };
            loop {
                let mut counting = Counting {
                    events: chunk,
                    ledger: Ledger::default(),
                };
                match fence::write(
                    self.stats,
                    Some(self.cache),
                    (target, bucket),
                    &users,
                    &mut counting,
                )
                .await
                {
                    Ok(done) => {
                        self.known.set(target, bucket, done.left);
                        self.parked.set(target, bucket, false);
                        self.record(target, chunk.len() as u64, &counting.ledger, done);
                        break;
                    }
                    Err(e) => {
                        let e = anyhow::Error::new(e);
                        if *stop.borrow() && backoff >= Duration::from_secs(2) {
                            anyhow::bail!("stopping while Cassandra is failing: {e:#}");
                        }
                        // Only failures while the store takes other
                        // conditional writes count against the bucket: an
                        // outage or a restart of Cassandra parks nothing.
                        match self.stats.probe().await {
                            Ok(()) => failures += 1,
                            Err(probe) => {
                                failures = 0;
                                tracing::warn!(
                                    error = format!("{:#}", anyhow::Error::new(probe)),
                                    "Cassandra takes no conditional write at all; waiting for it"
                                );
                            }
                        }
                        if failures >= park_after {
                            let why = (failures, &e);
                            self.park((target, bucket), &sources[range], why, stop)
                                .await?;
                            break;
                        }
                        tracing::warn!(target_id = %target, error = format!("{e:#}"), "stats write failed; retrying");
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(Duration::from_secs(5));
                    }
                }
            }
        }
        Ok(())
    }

    /// Counts a chunk without reading, if this consumer knows the bucket's
    /// seq and totals and the chunk's events say what each user's row holds
    /// (see the module comment). True when that write landed; false leaves
    /// the chunk to the reading path, which finds out what is true.
    async fn count_unread(
        &self,
        (target, bucket): (&TargetId, Bucket),
        chunk: &[Transition],
    ) -> bool {
        let Some((seq, totals)) = self.known.get(target, bucket) else {
            return false;
        };
        let Some(before) = beliefs(chunk) else {
            return false;
        };
        let mut ledger = Ledger::new(totals, before.clone());
        for t in chunk {
            ledger.apply_event(&t.user_id, t.version, t.from, t.to);
        }
        if ledger.gaps > 0 || ledger.replays > 0 {
            return false;
        }
        let users = ledger.changed_rows();
        // A first version's belief is no row at all.
        let expected: Vec<Option<Applied>> = users
            .iter()
            .map(|(u, _)| before.get(u).copied().filter(|a| *a != Applied::NEVER))
            .collect();
        let proposal = FencedWrite {
            read_seq: seq,
            totals: ledger.totals,
            target_type: chunk.first().map(|t| t.target_type),
            users: &users,
            before: &expected,
        };
        let place = (target, bucket);
        match fence::land_unread(self.stats, Some(self.cache), place, &proposal).await {
            Cas::Applied => {
                let left = (Some(seq.unwrap_or(0) + 1), ledger.totals);
                self.known.set(target, bucket, Some(left));
                let done = fence::Fenced {
                    ending: Ending::Written,
                    writes: 1,
                    lost: 0,
                    requests: 1,
                    left: Some(left),
                };
                self.record(target, chunk.len() as u64, &ledger, done);
                true
            }
            // Refused (another writer, a replay) or unknown: the reading
            // path reads the bucket and settles it either way.
            _ => {
                self.known.set(target, bucket, None);
                self.progress.requests.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    /// Metrics and progress, once per chunk, from its last round.
    fn record(&self, target: &TargetId, n_events: u64, ledger: &Ledger, done: fence::Fenced) {
        let p = self.progress;
        p.requests.fetch_add(done.requests, Ordering::Relaxed);
        p.fence_conflicts
            .fetch_add(u64::from(done.lost), Ordering::Relaxed);
        p.writes
            .fetch_add(u64::from(done.writes), Ordering::Relaxed);
        p.replays.fetch_add(ledger.replays, Ordering::Relaxed);
        let applied = if done.ending == Ending::Written {
            n_events - ledger.replays
        } else {
            0
        };
        metrics::counter!(crate::metrics::EVENTS, "result" => "applied").increment(applied);
        metrics::counter!(crate::metrics::EVENTS, "result" => "replay").increment(ledger.replays);
        if ledger.gaps > 0 {
            p.gaps.fetch_add(ledger.gaps, Ordering::Relaxed);
            metrics::counter!(crate::metrics::GAPS).increment(ledger.gaps);
            tracing::info!(target_id = %target, gaps = ledger.gaps, "transitions arrived out of order or were lost; counted from the applied state");
        }
    }

    /// With `--trust-events`: registers the batch's targets this process has
    /// not, before any of their events is counted, since no vote did.
    async fn register_new(
        &self,
        targets: &Targets,
        by_bucket: &ByBucket,
        stop: &watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        let mut new: HashMap<TargetId, TargetType> = HashMap::new();
        for ((target, _), (events, _)) in by_bucket {
            if let Some(first) = events.first() {
                if !targets.remembers(target) {
                    new.entry(target.clone()).or_insert(first.target_type);
                }
            }
        }
        let each = new.into_iter().map(|(target, kind)| async move {
            until_done(&target, "registering the target", stop, || {
                targets.register(&target, kind)
            })
            .await?;
            self.progress.requests.fetch_add(1, Ordering::Relaxed);
            self.progress.registrations.fetch_add(1, Ordering::Relaxed);
            Ok(())
        });
        let registered: Vec<anyhow::Result<()>> = futures::stream::iter(each)
            .buffer_unordered(self.config.parallelism.max(1))
            .collect()
            .await;
        registered.into_iter().collect()
    }

    /// The events that agree with their users' rows of `target`; the rest
    /// are dead-lettered with the reason. A transition is published only
    /// after its row committed, so no true event is ahead of its row. An
    /// event signed with this consumer's `--event-signing-key` was made by
    /// the vote API and is kept without a read (`bus::signature`); only the
    /// others' users are read. The order of the events is kept.
    async fn checked<'m>(
        &self,
        rows: &Reactions,
        target: &TargetId,
        (events, sources): (Vec<Transition>, Vec<&'m Received>),
        stop: &watch::Receiver<bool>,
    ) -> anyhow::Result<(Vec<Transition>, Vec<&'m Received>)> {
        let signed: Vec<bool> = sources.iter().map(|m| self.signed(m)).collect();
        let mut users: Vec<&UserId> = events
            .iter()
            .zip(&signed)
            .filter(|(_, signed)| !**signed)
            .map(|(t, _)| &t.user_id)
            .collect();
        users.sort_unstable();
        users.dedup();
        let mut found = HashMap::new();
        for some in users.chunks(MAX_USERS_PER_WRITE) {
            let read = until_done(target, "reading the rows behind events", stop, || {
                rows.rows_of(some, target)
            })
            .await?;
            self.progress.requests.fetch_add(1, Ordering::Relaxed);
            self.progress.row_reads.fetch_add(1, Ordering::Relaxed);
            found.extend(read);
        }
        let mut kept = (
            Vec::with_capacity(events.len()),
            Vec::with_capacity(events.len()),
        );
        for ((t, m), signed) in events.into_iter().zip(sources).zip(signed) {
            let refusal = if signed {
                None
            } else {
                contradicts(&t, found.get(&t.user_id))
            };
            match refusal {
                Some(reason) => self.dead_letter(m, &reason, "invalid", stop).await?,
                None => {
                    kept.0.push(t);
                    kept.1.push(m);
                }
            }
        }
        Ok(kept)
    }

    /// Whether `m` carries a signature this consumer's key verifies, and
    /// the metrics of how it was checked. Besides `signature` and `row`
    /// (neither side has a key), each way the two sides disagree has a label
    /// of its own, which `TallyEventSignaturesRefused` watches: signed with
    /// another key or altered, unsigned where this consumer has a key, and
    /// signed where it has none.
    fn signed(&self, m: &Received) -> bool {
        let p = self.progress;
        let by = match (self.event_key, m.signature.as_deref()) {
            (Some(key), Some(sig)) if key.verifies(&m.payload, sig) => {
                p.signed.fetch_add(1, Ordering::Relaxed);
                "signature"
            }
            (Some(_), Some(_)) => {
                p.bad_signatures.fetch_add(1, Ordering::Relaxed);
                "row_bad_signature"
            }
            (Some(_), None) => {
                p.unsigned.fetch_add(1, Ordering::Relaxed);
                "row_unsigned"
            }
            (None, Some(_)) => {
                p.unverified.fetch_add(1, Ordering::Relaxed);
                "row_unverified"
            }
            (None, None) => "row",
        };
        metrics::counter!(crate::metrics::EVENT_CHECKS, "by" => by).increment(1);
        by == "signature"
    }

    /// Parks the events of a chunk whose bucket keeps failing while
    /// Cassandra takes other conditional writes: they go to the dead-letter
    /// topic with the reason, and the rest of the partition moves on. Their
    /// users' rows stay the truth; `tally reconcile --target` recounts the
    /// target once it is writable again.
    async fn park(
        &self,
        (target, bucket): (&TargetId, Bucket),
        sources: &[&Received],
        (failures, error): (u32, &anyhow::Error),
        stop: &watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        self.known.set(target, bucket, None);
        self.parked.set(target, bucket, true);
        tracing::error!(
            target_id = %target,
            bucket = bucket.column(),
            events = sources.len(),
            error = format!("{error:#}"),
            "parking a bucket whose writes keep failing while Cassandra takes others: its events go to the dead-letter topic"
        );
        let reason = format!(
            "target {target} bucket {}: its writes failed {failures} times in a row while Cassandra took other conditional writes: {error:#}",
            bucket.column()
        );
        for m in sources {
            self.dead_letter(m, &reason, "parked", stop).await?;
        }
        self.progress
            .parked
            .fetch_add(sources.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Sends an event to the dead-letter topic and waits until Kafka has
    /// it: an event is never silently skipped. While the topic takes
    /// nothing, the consumer is unready and consumes nothing more; it tries
    /// again with a growing pause rather than spinning.
    async fn dead_letter(
        &self,
        m: &Received,
        reason: &str,
        cause: &'static str,
        stop: &watch::Receiver<bool>,
    ) -> anyhow::Result<()> {
        let mut backoff = Duration::from_millis(200);
        loop {
            match self.dead_letters.send(m, reason).await {
                Ok(()) => {
                    self.readiness.release(DEAD_LETTERS);
                    self.progress.dead_lettered.fetch_add(1, Ordering::Relaxed);
                    metrics::counter!(crate::metrics::DEAD_LETTERED, "cause" => cause).increment(1);
                    tracing::warn!(
                        partition = m.partition,
                        offset = m.offset,
                        reason,
                        "event dead-lettered"
                    );
                    return Ok(());
                }
                Err(e) if !*stop.borrow() => {
                    if self.readiness.hold(DEAD_LETTERS) {
                        tracing::error!(
                            error = format!("{e:#}"),
                            "the dead-letter topic takes nothing: consuming stops and /readyz fails until it does"
                        );
                    }
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(30));
                }
                Err(e) => {
                    anyhow::bail!("stopping before an event reached the dead-letter topic: {e:#}")
                }
            }
        }
    }
}

/// The name `/readyz` gives an unwritable dead-letter topic.
const DEAD_LETTERS: &str = "dead_letter_topic";

/// Folds one chunk of a target's events into each round's read.
struct Counting<'a> {
    events: &'a [Transition],
    /// The last round's ledger: what the chunk counted and replayed.
    ledger: Ledger,
}

impl Fold for Counting<'_> {
    async fn fold(&mut self, _: &TargetId, read: Read) -> Result<Step, StoreError> {
        let mut ledger = Ledger::new(read.head.totals, read.applied);
        for t in self.events {
            ledger.apply_event(&t.user_id, t.version, t.from, t.to);
        }
        let step = if ledger.changed.is_empty() {
            Step::Settled
        } else {
            Step::Write {
                totals: ledger.totals,
                target_type: self.events.first().map(|t| t.target_type),
                users: ledger.changed_rows(),
            }
        };
        self.ledger = ledger;
        Ok(step)
    }
}

/// What a chunk's events say each user's applied row holds before them,
/// if they arrived in order: the version before the user's first event, in
/// that event's `from` state, or no row at all before a first version.
/// `None` when some user's events are not consecutive versions.
fn beliefs(events: &[Transition]) -> Option<HashMap<UserId, Applied>> {
    let mut before = HashMap::new();
    let mut last: HashMap<&UserId, i64> = HashMap::new();
    for t in events {
        match last.get(&t.user_id) {
            None => {
                let was = if t.version == 1 {
                    Applied::NEVER
                } else {
                    Applied {
                        version: t.version - 1,
                        state: t.from,
                    }
                };
                before.insert(t.user_id.clone(), was);
            }
            Some(v) if *v + 1 == t.version => {}
            Some(_) => return None,
        }
        last.insert(&t.user_id, t.version);
    }
    Some(before)
}

/// Why an event cannot have come from the user's row it names, if it
/// cannot: there is no row, the row is at an older version, or it holds
/// another state at the event's own version. An older event is a replay or
/// was overtaken, which the apply rule handles.
fn contradicts(t: &Transition, row: Option<&Seen>) -> Option<String> {
    match row {
        None => Some(format!(
            "user {} has no reaction row for target {}: not an event of this service",
            t.user_id, t.target_id
        )),
        Some(row) if row.version < t.version => Some(format!(
            "version {} is ahead of the row of user {} for target {} (version {})",
            t.version, t.user_id, t.target_id, row.version
        )),
        // A row past the event says nothing of the event's state: a state
        // this release does not know there (a newer release's) is no reason.
        Some(row) if row.version > t.version => None,
        Some(Seen {
            state: Ok(state), ..
        }) if *state == t.to => None,
        Some(Seen { state, version }) => Some(format!(
            "the row of user {} for target {} holds {} at version {version}, not {}",
            t.user_id,
            t.target_id,
            match state {
                Ok(known) => known.as_str().to_owned(),
                Err(unknown) => format!("{unknown:?}, a state this release does not know,"),
            },
            t.to.as_str()
        )),
    }
}

/// Splits a target's events, in order, into runs with at most `max` users.
fn chunks_by_users(events: &[Transition], max: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut users): (usize, Vec<&UserId>) = (0, Vec::new());
    for (i, t) in events.iter().enumerate() {
        if !users.contains(&&t.user_id) {
            if users.len() == max {
                out.push(start..i);
                start = i;
                users.clear();
            }
            users.push(&t.user_id);
        }
    }
    if start < events.len() {
        out.push(start..events.len());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Reaction, TargetType};

    fn ev(user: &str, version: i64) -> Transition {
        Transition {
            target_id: TargetId::parse("t").unwrap_or_else(|e| panic!("{e}")),
            target_type: TargetType::Video,
            user_id: UserId::parse(user).unwrap_or_else(|e| panic!("{e}")),
            from: Reaction::None,
            to: Reaction::Like,
            version,
            occurred_at: String::new(),
        }
    }

    #[test]
    fn events_ahead_of_their_row_or_without_one_contradict_it() {
        let t = step("u", 5, Reaction::None, Reaction::Like);
        let at = |version, state| Seen {
            version,
            state: Ok(state),
        };
        assert!(contradicts(&t, None).is_some(), "no row");
        assert!(
            contradicts(&t, Some(&at(4, Reaction::None))).is_some(),
            "from the future"
        );
        assert!(
            contradicts(&t, Some(&at(5, Reaction::Dislike))).is_some(),
            "another state"
        );
        assert!(
            contradicts(&t, Some(&at(5, Reaction::Like))).is_none(),
            "the row's own"
        );
        assert!(
            contradicts(&t, Some(&at(9, Reaction::None))).is_none(),
            "overtaken"
        );
        // A newer release's state: overtaken still holds; at the event's
        // own version it cannot be the event's state.
        let unknown = |version| Seen {
            version,
            state: Err("love".to_owned()),
        };
        assert!(contradicts(&t, Some(&unknown(6))).is_none(), "overtaken");
        let reason = contradicts(&t, Some(&unknown(5))).unwrap_or_default();
        assert!(
            reason.contains("\"love\", a state this release does not know"),
            "{reason}"
        );
        assert!(
            contradicts(&t, Some(&unknown(4))).is_some(),
            "from the future"
        );
    }

    #[test]
    fn chunks_keep_order_and_bound_distinct_users() {
        let events = [
            ev("a", 1),
            ev("b", 1),
            ev("a", 2),
            ev("c", 1),
            ev("b", 2),
            ev("d", 1),
        ];
        let chunks = chunks_by_users(&events, 2);
        let shape: Vec<Vec<(&str, i64)>> = chunks
            .iter()
            .map(|c| {
                events[c.clone()]
                    .iter()
                    .map(|t| (t.user_id.as_str(), t.version))
                    .collect()
            })
            .collect();
        assert_eq!(
            shape,
            vec![
                vec![("a", 1), ("b", 1), ("a", 2)],
                vec![("c", 1), ("b", 2)],
                vec![("d", 1)]
            ]
        );
        assert_eq!(chunks_by_users(&events, 1).len(), 6);
        assert!(chunks_by_users(&[], 3).is_empty());
    }

    fn step(user: &str, version: i64, from: Reaction, to: Reaction) -> Transition {
        Transition {
            from,
            to,
            ..ev(user, version)
        }
    }

    #[test]
    fn in_order_events_say_what_each_row_held_before_them() {
        let events = [
            step("a", 1, Reaction::None, Reaction::Like),
            step("b", 4, Reaction::Dislike, Reaction::None),
            step("a", 2, Reaction::Like, Reaction::Dislike),
        ];
        let before = beliefs(&events).unwrap_or_else(|| panic!("in order"));
        let user = |u: &str| UserId::parse(u).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(before[&user("a")], Applied::NEVER);
        assert_eq!(
            before[&user("b")],
            Applied {
                version: 3,
                state: Reaction::Dislike
            }
        );
        assert_eq!(before.len(), 2);
    }

    #[test]
    fn a_replay_a_gap_or_a_reorder_within_a_chunk_says_nothing() {
        let like = |u, v| step(u, v, Reaction::None, Reaction::Like);
        assert_eq!(beliefs(&[like("a", 2), like("a", 2)]), None);
        assert_eq!(beliefs(&[like("a", 2), like("a", 4)]), None);
        assert_eq!(beliefs(&[like("a", 3), like("a", 2)]), None);
    }
}
