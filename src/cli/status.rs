//! `tally status`: one screen of what an operator checks first, from the
//! running services' `/metrics` (read twice, a second apart, for rates and
//! latencies) and the consumer group's committed offsets. Thresholds are
//! those of docs/operations.md; on a terminal, a value past one is red.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::process::ExitCode;
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

/// What `tally status --json` prints. A value is `null` when the service it
/// comes from did not answer (it is then named under `unreachable`): an
/// unknown is never shown as a zero.
#[derive(Debug, Serialize)]
pub struct Status {
    /// Rates need both reads of the vote API; `null` if either failed.
    pub votes_per_sec: Option<f64>,
    /// p95 of committed votes over the interval; `null` when there were none.
    pub vote_p95_ms: Option<f64>,
    pub reads_per_sec: Option<f64>,
    pub read_p95_ms: Option<f64>,
    /// `null` when Kafka could not be asked; empty when the group has
    /// committed nothing yet.
    pub lag: Option<Vec<Lag>>,
    pub outbox_backlog: Option<f64>,
    pub outbox_oldest_seconds: Option<f64>,
    /// Cache entries owed a drop (Redis did not take a change to them), by
    /// the API and by the consumer, and the consumer's written batches
    /// whose offsets wait for those drops: the group's lag grows meanwhile.
    pub drops_owed_api: Option<f64>,
    pub drops_owed_consumer: Option<f64>,
    pub batches_held: Option<f64>,
    /// How far Redis's clock is ahead of the vote API's host's (negative:
    /// behind), as the API last measured it.
    pub redis_clock_offset_seconds: Option<f64>,
    /// Hits over hits and misses since the API started; `null` before any lookup.
    pub cache_hit_ratio: Option<f64>,
    pub cas_not_applied: Option<f64>,
    pub cas_unknown: Option<f64>,
    pub cas_applied: Option<f64>,
    pub drift_found: Option<f64>,
    pub dead_letters: Option<f64>,
    /// How the consumer checked events since it started: by signature, by a
    /// read of the rows, and of those read, the ones where its key and the
    /// event's signing disagree (another key, no signature, no key here).
    pub checked_by_signature: Option<f64>,
    pub checked_by_row: Option<f64>,
    pub mismatched: Option<f64>,
    /// Services that did not answer, with why.
    pub unreachable: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct Lag {
    pub partition: i32,
    pub messages: i64,
    pub seconds: f64,
}

/// The exit status when a service did not answer: what could be read is
/// still printed, but a script that checks the service must not take the
/// unknowns for a healthy zero.
pub const UNREACHABLE: u8 = 4;

pub async fn run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()
        .context("Failed to build the HTTP client")?;
    loop {
        let status = read(&args, &client).await;
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
            None if status.unreachable.is_empty() => return Ok(ExitCode::SUCCESS),
            None => return Ok(ExitCode::from(UNREACHABLE)),
        }
    }
}

async fn read(args: &StatusArgs, client: &reqwest::Client) -> Status {
    let mut unreachable = Vec::new();
    let mut scrape = |what: &str, result: anyhow::Result<Metrics>| match result {
        Ok(m) => Some(m),
        Err(e) => {
            unreachable.push(format!("{what}: {e:#}"));
            None
        }
    };
    let before = scrape("tally vote", fetch(client, &args.vote_ops).await);
    tokio::time::sleep(args.interval).await;
    let vote = scrape("tally vote", fetch(client, &args.vote_ops).await);
    let consumer = scrape("tally consumer", fetch(client, &args.consumer_ops).await);
    unreachable.dedup();
    let (kafka, group) = (args.kafka.clone(), args.group.clone());
    let lag = match tokio::task::spawn_blocking(move || bus::lag::group_lag(&kafka, &group)).await {
        Ok(Ok(lag)) => Some(
            lag.into_iter()
                .map(|l| Lag {
                    partition: l.partition,
                    messages: l.messages,
                    seconds: l.seconds,
                })
                .collect(),
        ),
        Ok(Err(e)) => {
            unreachable.push(format!("kafka: {e:#}"));
            None
        }
        Err(e) => {
            unreachable.push(format!("kafka: {e}"));
            None
        }
    };
    let interval = match (&before, &vote) {
        (Some(before), Some(after)) => Some(Interval {
            before,
            after,
            secs: args.interval.as_secs_f64().max(0.001),
        }),
        _ => None,
    };
    let v = |name: &str, want: &[(&str, &str)]| vote.as_ref().map(|m| m.sum(name, want));
    let c = |name: &str, want: &[(&str, &str)]| consumer.as_ref().map(|m| m.sum(name, want));
    let cas = |outcome| v("tally_cas_total", &[("outcome", outcome)]);
    let checks = |by| c("tally_consumer_event_checks_total", &[("by", by)]);
    let (hits, misses) = (
        v("tally_cache_lookups_total", &[("result", "hit")]),
        v("tally_cache_lookups_total", &[("result", "miss")]),
    );
    let rate = |name| interval.as_ref().map(|i| i.rate(name));
    let p95 = |name, want| interval.as_ref().and_then(|i| i.p95_ms(name, want));
    Status {
        votes_per_sec: rate("tally_vote_write_seconds_count"),
        vote_p95_ms: p95("tally_vote_write_seconds_bucket", &[("outcome", "ok")]),
        reads_per_sec: rate("tally_vote_read_seconds_count"),
        read_p95_ms: p95("tally_vote_read_seconds_bucket", &[]),
        lag,
        outbox_backlog: v("tally_outbox_backlog", &[]),
        outbox_oldest_seconds: v("tally_outbox_oldest_seconds", &[]),
        drops_owed_api: v("tally_cache_drops_owed", &[]),
        drops_owed_consumer: c("tally_cache_drops_owed", &[]),
        batches_held: c("tally_consumer_batches_held", &[]),
        redis_clock_offset_seconds: v("tally_redis_clock_offset_seconds", &[])
            .filter(|o| o.is_finite()),
        cache_hit_ratio: hits
            .zip(misses)
            .and_then(|(h, m)| (h + m > 0.0).then(|| h / (h + m))),
        cas_not_applied: cas("not_applied"),
        cas_unknown: cas("unknown"),
        cas_applied: cas("applied"),
        drift_found: v("tally_reconcile_drift_found_total", &[]),
        dead_letters: c("tally_consumer_dead_lettered_total", &[]),
        checked_by_signature: checks("signature"),
        checked_by_row: c("tally_consumer_event_checks_total", &[])
            .zip(checks("signature"))
            .map(|(all, signed)| all - signed),
        mismatched: checks("row_bad_signature")
            .zip(checks("row_unsigned"))
            .zip(checks("row_unverified"))
            .map(|((a, b), c)| a + b + c),
        unreachable,
    }
}

/// Two reads of the vote API's metrics, `secs` apart.
struct Interval<'a> {
    before: &'a Metrics,
    after: &'a Metrics,
    secs: f64,
}

impl Interval<'_> {
    fn rate(&self, name: &str) -> f64 {
        (self.after.sum(name, &[]) - self.before.sum(name, &[])) / self.secs
    }

    fn p95_ms(&self, name: &str, want: &[(&str, &str)]) -> Option<f64> {
        quantile(self.before, self.after, name, want).map(|s| s * 1000.0)
    }
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

/// The screen: one line a signal, red past its threshold on a terminal. A
/// value from a service that did not answer is `-`, and never red.
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
    let n = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.0}"));
    let past = |v: Option<f64>, limit: f64| v.is_some_and(|v| v > limit);
    let mut out = String::new();
    let mut line = |label: &str, bad: bool, text: String| {
        out.push_str(&format!("{label:<22}{}\n", mark(bad, text)));
    };
    let rate = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.1}/s"));
    line(
        "votes",
        past(s.vote_p95_ms, 100.0),
        format!("{}, p95 {}", rate(s.votes_per_sec), ms(s.vote_p95_ms)),
    );
    line(
        "summary reads",
        past(s.read_p95_ms, 20.0),
        format!("{}, p95 {}", rate(s.reads_per_sec), ms(s.read_p95_ms)),
    );
    match &s.lag {
        None => line("consumer lag", false, "-".into()),
        Some(lag) if lag.is_empty() => line("consumer lag", false, "no committed offsets".into()),
        Some(lag) => {
            for l in lag {
                line(
                    &format!("lag, partition {}", l.partition),
                    l.seconds > 60.0,
                    format!("{} messages, {:.1} s", l.messages, l.seconds),
                );
            }
        }
    }
    line(
        "outbox",
        past(s.outbox_oldest_seconds, 300.0),
        format!(
            "{} unresolved, oldest {} s",
            n(s.outbox_backlog),
            n(s.outbox_oldest_seconds)
        ),
    );
    let owed = [s.drops_owed_api, s.drops_owed_consumer, s.batches_held];
    line(
        "cache drops owed",
        owed.iter().any(|v| past(*v, 0.0)),
        format!(
            "{} by the API, {} by the consumer, {} batches held for them",
            n(owed[0]),
            n(owed[1]),
            n(owed[2])
        ),
    );
    line(
        "redis clock",
        s.redis_clock_offset_seconds
            .is_some_and(|o| o.abs() > crate::cache::CLOCK_MARGIN.as_secs_f64()),
        s.redis_clock_offset_seconds.map_or("-".to_owned(), |o| {
            format!("{:+.1} ms from the vote API's host's", o * 1000.0)
        }),
    );
    line(
        "cache hit ratio",
        s.cache_hit_ratio.is_some_and(|r| r < 0.8),
        s.cache_hit_ratio
            .map_or("-".to_owned(), |r| format!("{:.1}%", r * 100.0)),
    );
    line(
        "conditional writes",
        s.cas_unknown
            .zip(s.cas_applied)
            .is_some_and(|(unknown, applied)| unknown > 0.001 * applied.max(1.0)),
        format!(
            "{} applied, {} refused, {} unknown",
            n(s.cas_applied),
            n(s.cas_not_applied),
            n(s.cas_unknown)
        ),
    );
    line("drift found", past(s.drift_found, 0.0), n(s.drift_found));
    line("dead letters", past(s.dead_letters, 0.0), n(s.dead_letters));
    line(
        "events checked",
        past(s.mismatched, 0.0),
        format!(
            "{} by signature, {} by row ({} where the keys disagree)",
            n(s.checked_by_signature),
            n(s.checked_by_row),
            n(s.mismatched)
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

    #[test]
    fn values_from_a_service_that_did_not_answer_are_unknown_never_zero_nor_red() {
        let status = Status {
            votes_per_sec: None,
            vote_p95_ms: None,
            reads_per_sec: None,
            read_p95_ms: None,
            lag: None,
            outbox_backlog: None,
            outbox_oldest_seconds: None,
            drops_owed_api: None,
            drops_owed_consumer: Some(2.0),
            batches_held: Some(0.0),
            redis_clock_offset_seconds: None,
            cache_hit_ratio: None,
            cas_not_applied: None,
            cas_unknown: None,
            cas_applied: None,
            drift_found: None,
            dead_letters: Some(0.0),
            checked_by_signature: Some(3.0),
            checked_by_row: Some(0.0),
            mismatched: Some(0.0),
            unreachable: vec!["tally vote: refused".into()],
        };
        let screen = screen(&status, false);
        assert!(
            screen.contains("votes                 -, p95 -\n"),
            "{screen}"
        );
        assert!(screen.contains("consumer lag          -\n"), "{screen}");
        assert!(
            screen.contains("outbox                - unresolved, oldest - s\n"),
            "{screen}"
        );
        // What the consumer said is still shown, and judged.
        assert!(
            screen.contains("cache drops owed      - by the API, 2 by the consumer, 0 batches held for them  (!)"),
            "{screen}"
        );
        assert!(screen.contains("drift found           -\n"), "{screen}");
        assert!(
            screen.contains("not answering         tally vote: refused  (!)"),
            "{screen}"
        );
        let json = serde_json::to_value(&status).unwrap_or_default();
        assert!(
            json["cas_applied"].is_null() && json["lag"].is_null(),
            "{json}"
        );
    }
}
