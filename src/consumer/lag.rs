//! The consumer's own view of its lag, measured every `INTERVAL` and
//! exported per partition.

use tokio::sync::watch;

use crate::bus::lag::{INTERVAL, Positions};
use crate::bus::source::Source;

/// Measures lag every `INTERVAL`, logs it and sets the gauges.
pub async fn report(source: Source, positions: Positions, mut stop: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(INTERVAL);
    let mut n: u64 = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let (s, p) = (source.clone(), positions.clone());
        let Ok(lags) = tokio::task::spawn_blocking(move || s.lag(&p)).await else {
            continue;
        };
        for l in &lags {
            let p = l.partition.to_string();
            metrics::gauge!(crate::metrics::CONSUMER_LAG_MESSAGES, "partition" => p.clone())
                .set(l.messages as f64);
            metrics::gauge!(crate::metrics::CONSUMER_LAG_SECONDS, "partition" => p).set(l.seconds);
        }
        let worst = lags.iter().map(|l| l.seconds).fold(0.0, f64::max);
        let behind: i64 = lags.iter().map(|l| l.messages).sum();
        n += 1;
        if n % 6 == 1 || behind > 0 {
            tracing::info!(
                messages_behind = behind,
                seconds_behind = worst,
                partitions = lags.len(),
                "consumer lag"
            );
        }
    }
}
