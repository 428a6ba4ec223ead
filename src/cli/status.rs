//! `tally status`: one screen of what an operator checks first, from the
//! running services' `/metrics` (read twice, a second apart, for rates and
//! latencies) and the consumer group's committed offsets. Thresholds are
//! those of docs/operations.md; on a terminal, a value past one is red.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;

use crate::bus::{self, KafkaConfig};

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// The vote API's operator address (its `--ops-listen`).
    #[arg(long = "vote-ops", env = "TALLY_VOTE_OPS", default_value = "http://127.0.0.1:9090")]
    pub vote_ops: String,

    /// The consumer's operator address (its `--listen`).
    #[arg(
        long = "consumer-ops",
        env = "TALLY_CONSUMER_OPS",
        default_value = "http://127.0.0.1:9091"
    )]
    pub consumer_ops: String,

    /// The consumer group whose lag is shown.
    #[arg(long = "consumer-group", env = "TALLY_CONSUMER_GROUP", default_value = "tally-consumer")]
    pub group: String,

    /// How long between the two reads that rates and latencies come from.
    #[arg(long, default_value = "1s", value_parser = super::values::duration_above_zero)]
    pub interval: Duration,

    /// Print JSON instead of the screen.
    #[arg(long)]
    pub json: bool,

    /// Show it again every this long, until Ctrl-C.
    #[arg(long, value_parser = super::values::duration_above_zero)]
    pub watch: Option<Duration>,

    #[command(flatten)]
    pub kafka: KafkaConfig,
}

/// What `tally status --json` prints.
#[derive(Debug, Serialize)]
pub struct Status {
    pub votes_per_sec: f64,
    /// p95 of committed votes over the interval; `None` when there were none.
    pub vote_p95_ms: Option<f64>,
    pub reads_per_sec: f64,
    pub read_p95_ms: Option<f64>,
    pub lag: Vec<Lag>,
    pub outbox_backlog: f64,
    pub outbox_oldest_seconds: f64,
    /// Cache entries owed a drop (Redis did not take a change to them), by
    /// the API and by the consumer, and the consumer's written batches
    /// whose offsets wait for those drops: the group's lag grows meanwhile.
    pub drops_owed_api: f64,
    pub drops_owed_consumer: f64,
    pub batches_held: f64,
    /// Hits over hits and misses since the API started; `None` before any lookup.
    pub cache_hit_ratio: Option<f64>,
    pub cas_not_applied: f64,
    pub cas_unknown: f64,
    pub cas_applied: f64,
    pub drift_found: f64,
    pub dead_letters: f64,
    /// How the consumer checked events since it started: by signature, by a
    /// read of the rows, and of those read, the ones where its key and the
    /// event's signing disagree (another key, no signature, no key here).
    pub checked_by_signature: f64,
    pub checked_by_row: f64,
    pub mismatched: f64,
    /// Services that did not answer, with why.
    pub unreachable: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct Lag {
    pub partition: i32,
    pub messages: i64,
    pub seconds: f64,
}

pub async fn run(args: StatusArgs) -> anyhow::Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()
        .context("Failed to build the HTTP client")?;
    loop {
        let status = read(&args, &client).await?;
        if args.json {
            println!("{}", serde_json::to_string_pretty(&status)?);
        } else {
            if args.watch.is_some() && std::io::stdout().is_terminal() {
                print!("\x1b[2J\x1b[H");
            }
            print!("{}", screen(&status, std::io::stdout().is_terminal()));
        }
        match args.watch {
            Some(every) => tokio::time::sleep(every).await,
            None => return Ok(()),
        }
    }
}

async fn read(args: &StatusArgs, client: &reqwest::Client) -> anyhow::Result<Status> {
    let mut unreachable = Vec::new();
    let mut scrape = |what: &str, result: anyhow::Result<Metrics>| match result {
        Ok(m) => m,
        Err(e) => {
            unreachable.push(format!("{what}: {e:#}"));
            Metrics::default()
        }
    };
    let before = scrape("tally vote", fetch(client, &args.vote_ops).await);
    tokio::time::sleep(args.interval).await;
    let vote = scrape("tally vote", fetch(client, &args.vote_ops).await);
    let consumer = scrape("tally consumer", fetch(client, &args.consumer_ops).await);
    unreachable.dedup();
    let secs = args.interval.as_secs_f64().max(0.001);
    let (kafka, group) = (args.kafka.clone(), args.group.clone());
    let lag = match tokio::task::spawn_blocking(move || bus::lag::group_lag(&kafka, &group)).await {
        Ok(Ok(lag)) => lag
            .into_iter()
            .map(|l| Lag {
                partition: l.partition,
                messages: l.messages,
                seconds: l.seconds,
            })
            .collect(),
        Ok(Err(e)) => {
            unreachable.push(format!("kafka: {e:#}"));
            Vec::new()
        }
        Err(e) => {
            unreachable.push(format!("kafka: {e}"));
            Vec::new()
        }
    };
    let hits = vote.sum("tally_cache_lookups_total", &[("result", "hit")]);
    let misses = vote.sum("tally_cache_lookups_total", &[("result", "miss")]);
    let cas = |outcome| vote.sum("tally_cas_total", &[("outcome", outcome)]);
    let checks = |by| consumer.sum("tally_consumer_event_checks_total", &[("by", by)]);
    Ok(Status {
        votes_per_sec: (vote.sum("tally_vote_write_seconds_count", &[])
            - before.sum("tally_vote_write_seconds_count", &[]))
            / secs,
        vote_p95_ms: quantile(
            &before,
            &vote,
            "tally_vote_write_seconds_bucket",
            &[("outcome", "ok")],
        )
        .map(|s| s * 1000.0),
        reads_per_sec: (vote.sum("tally_vote_read_seconds_count", &[])
            - before.sum("tally_vote_read_seconds_count", &[]))
            / secs,
        read_p95_ms: quantile(&before, &vote, "tally_vote_read_seconds_bucket", &[])
            .map(|s| s * 1000.0),
        lag,
        outbox_backlog: vote.sum("tally_outbox_backlog", &[]),
        outbox_oldest_seconds: vote.sum("tally_outbox_oldest_seconds", &[]),
        drops_owed_api: vote.sum("tally_cache_drops_owed", &[]),
        drops_owed_consumer: consumer.sum("tally_cache_drops_owed", &[]),
        batches_held: consumer.sum("tally_consumer_batches_held", &[]),
        cache_hit_ratio: (hits + misses > 0.0).then(|| hits / (hits + misses)),
        cas_not_applied: cas("not_applied"),
        cas_unknown: cas("unknown"),
        cas_applied: cas("applied"),
        drift_found: vote.sum("tally_reconcile_drift_found_total", &[]),
        dead_letters: consumer.sum("tally_consumer_dead_lettered_total", &[]),
        checked_by_signature: checks("signature"),
        checked_by_row: consumer.sum("tally_consumer_event_checks_total", &[])
            - checks("signature"),
        mismatched: checks("row_bad_signature") + checks("row_unsigned") + checks("row_unverified"),
        unreachable,
    })
}

/// One sample: its labels and its value.
type Sample = (Vec<(String, String)>, f64);

/// One read of a `/metrics` page: each sample by name, with its labels.
#[derive(Debug, Default)]
pub struct Metrics(HashMap<String, Vec<Sample>>);

impl Metrics {
    /// Parses the Prometheus text format (comments skipped).
    pub fn parse(text: &str) -> Metrics {
        let mut samples: HashMap<String, Vec<Sample>> = HashMap::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.trim().parse::<f64>() else {
                continue;
            };
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, labels_of(rest.trim_end_matches('}'))),
                None => (series, Vec::new()),
            };
            samples
                .entry(name.to_owned())
                .or_default()
                .push((labels, value));
        }
        Metrics(samples)
    }

    /// The sum of the samples of `name` whose labels include `want`.
    pub fn sum(&self, name: &str, want: &[(&str, &str)]) -> f64 {
        // + 0.0: an empty sum of floats is -0.0, which prints as such.
        self.matching(name, want).map(|(_, v)| v).sum::<f64>() + 0.0
    }

    fn matching<'a>(
        &'a self,
        name: &str,
        want: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = (&'a [(String, String)], f64)> + 'a {
        self.0
            .get(name)
            .into_iter()
            .flatten()
            .filter_map(move |(labels, v)| {
                want.iter()
                    .all(|(k, w)| labels.iter().any(|(lk, lv)| lk == k && lv == w))
                    .then_some((labels.as_slice(), *v))
            })
    }
}

fn labels_of(text: &str) -> Vec<(String, String)> {
    text.split(',')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().trim_matches('"').to_owned()))
        .collect()
}

/// The 0.95 quantile, in seconds, of what a histogram counted between two
/// reads, interpolated within its bucket as Prometheus does.
fn quantile(before: &Metrics, after: &Metrics, name: &str, want: &[(&str, &str)]) -> Option<f64> {
    let by_le = |m: &Metrics| {
        let mut buckets: HashMap<String, f64> = HashMap::new();
        for (labels, v) in m.matching(name, want) {
            if let Some((_, le)) = labels.iter().find(|(k, _)| k == "le") {
                *buckets.entry(le.clone()).or_default() += v;
            }
        }
        buckets
    };
    let (b, a) = (by_le(before), by_le(after));
    let mut buckets: Vec<(f64, f64)> = a
        .iter()
        .map(|(le, v)| {
            let bound = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().unwrap_or(f64::INFINITY)
            };
            (bound, v - b.get(le).copied().unwrap_or(0.0))
        })
        .collect();
    buckets.sort_by(|x, y| x.0.total_cmp(&y.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = 0.95 * total;
    let mut lower = (0.0, 0.0);
    for (bound, count) in buckets {
        if count >= rank {
            if bound.is_infinite() {
                return Some(lower.0);
            }
            let share = (rank - lower.1) / (count - lower.1).max(f64::MIN_POSITIVE);
            return Some(lower.0 + (bound - lower.0) * share);
        }
        lower = (bound, count);
    }
    None
}

async fn fetch(client: &reqwest::Client, base: &str) -> anyhow::Result<Metrics> {
    let text = client
        .get(format!("{}/metrics", base.trim_end_matches('/')))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .with_context(|| format!("no /metrics at {base}"))?
        .text()
        .await?;
    Ok(Metrics::parse(&text))
}

/// The screen: one line a signal, red past its threshold on a terminal.
pub fn screen(s: &Status, colour: bool) -> String {
    let mark = |bad: bool, text: String| {
        if colour && bad {
            format!("\x1b[31m{text}\x1b[0m")
        } else if bad {
            format!("{text}  (!)")
        } else {
            text
        }
    };
    let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1} ms"));
    let mut out = String::new();
    let mut line = |label: &str, bad: bool, text: String| {
        out.push_str(&format!("{label:<22}{}\n", mark(bad, text)));
    };
    line(
        "votes",
        s.vote_p95_ms.is_some_and(|p| p > 100.0),
        format!("{:.1}/s, p95 {}", s.votes_per_sec, ms(s.vote_p95_ms)),
    );
    line(
        "summary reads",
        s.read_p95_ms.is_some_and(|p| p > 20.0),
        format!("{:.1}/s, p95 {}", s.reads_per_sec, ms(s.read_p95_ms)),
    );
    if s.lag.is_empty() {
        line("consumer lag", false, "no committed offsets".into());
    }
    for l in &s.lag {
        line(
            &format!("lag, partition {}", l.partition),
            l.seconds > 60.0,
            format!("{} messages, {:.1} s", l.messages, l.seconds),
        );
    }
    line(
        "outbox",
        s.outbox_oldest_seconds > 300.0,
        format!(
            "{:.0} unresolved, oldest {:.0} s",
            s.outbox_backlog, s.outbox_oldest_seconds
        ),
    );
    line(
        "cache drops owed",
        s.drops_owed_api + s.drops_owed_consumer + s.batches_held > 0.0,
        format!(
            "{:.0} by the API, {:.0} by the consumer, {:.0} batches held for them",
            s.drops_owed_api, s.drops_owed_consumer, s.batches_held
        ),
    );
    line(
        "cache hit ratio",
        s.cache_hit_ratio.is_some_and(|r| r < 0.8),
        s.cache_hit_ratio
            .map_or("-".to_owned(), |r| format!("{:.1}%", r * 100.0)),
    );
    line(
        "conditional writes",
        s.cas_unknown > 0.001 * s.cas_applied.max(1.0),
        format!(
            "{:.0} applied, {:.0} refused, {:.0} unknown",
            s.cas_applied, s.cas_not_applied, s.cas_unknown
        ),
    );
    line(
        "drift found",
        s.drift_found > 0.0,
        format!("{:.0}", s.drift_found),
    );
    line(
        "dead letters",
        s.dead_letters > 0.0,
        format!("{:.0}", s.dead_letters),
    );
    line(
        "events checked",
        s.mismatched > 0.0,
        format!(
            "{:.0} by signature, {:.0} by row ({:.0} where the keys disagree)",
            s.checked_by_signature, s.checked_by_row, s.mismatched
        ),
    );
    for u in &s.unreachable {
        line("not answering", true, u.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# TYPE tally_cas_total counter\n\
        tally_cas_total{statement=\"vote\",outcome=\"applied\"} 90\n\
        tally_cas_total{statement=\"stats\",outcome=\"applied\"} 10\n\
        tally_cas_total{statement=\"vote\",outcome=\"unknown\"} 1\n\
        tally_vote_write_seconds_bucket{outcome=\"ok\",le=\"0.01\"} 50\n\
        tally_vote_write_seconds_bucket{outcome=\"ok\",le=\"0.1\"} 100\n\
        tally_vote_write_seconds_bucket{outcome=\"ok\",le=\"+Inf\"} 100\n\
        tally_outbox_backlog 3\n";

    #[test]
    fn samples_are_summed_by_the_labels_asked_for() {
        let m = Metrics::parse(PAGE);
        assert_eq!(m.sum("tally_cas_total", &[("outcome", "applied")]), 100.0);
        assert_eq!(m.sum("tally_cas_total", &[("statement", "vote")]), 91.0);
        assert_eq!(m.sum("tally_outbox_backlog", &[]), 3.0);
        assert_eq!(m.sum("absent", &[]), 0.0);
    }

    #[test]
    fn the_p95_is_interpolated_within_its_bucket_between_two_reads() {
        let before = Metrics::default();
        let after = Metrics::parse(PAGE);
        let p95 =
            quantile(&before, &after, "tally_vote_write_seconds_bucket", &[]).unwrap_or_default();
        // Rank 95 of 100 lies 45/50 of the way through (0.01, 0.1].
        assert!((p95 - 0.091).abs() < 1e-9, "{p95}");
        assert!(quantile(&after, &after, "tally_vote_write_seconds_bucket", &[]).is_none());
    }
}
