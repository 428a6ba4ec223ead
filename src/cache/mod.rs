//! The only code that speaks Redis: the per-target count cache.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use deadpool_redis::{Config, Pool, Runtime};
use redis::Script;

use crate::bus::{KafkaConfig, lag};
use crate::domain::reaction::N_COUNTED;
use crate::domain::{Delta, Reaction, TargetId, Totals};

/// Where Redis is.
#[derive(clap::Args, Debug, Clone)]
pub struct RedisConfig {
    /// Redis URL of the count cache.
    #[arg(long = "redis-url", env = "TALLY_REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    pub url: String,

    /// Prefix of every cache key, so several deployments (or tests) can share a Redis.
    #[arg(long = "redis-prefix", env = "TALLY_REDIS_PREFIX", default_value = "tally")]
    pub prefix: String,

    /// Longest one cache operation may take, waiting for a connection
    /// included. A Redis that hangs costs a vote or a read this long, no more.
    #[arg(long = "redis-timeout", env = "TALLY_REDIS_TIMEOUT", default_value = "500ms", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

impl RedisConfig {
    pub fn local(prefix: &str) -> RedisConfig {
        RedisConfig {
            url: "redis://127.0.0.1:6379".into(),
            prefix: prefix.into(),
            timeout: Duration::from_millis(500),
        }
    }
}

pub fn pool(config: &RedisConfig) -> anyhow::Result<Pool> {
    Config::from_url(&config.url)
        .create_pool(Some(Runtime::Tokio1))
        .with_context(|| format!("Bad Redis URL {}", config.url))
}

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("no Redis connection")]
    Pool(#[from] deadpool_redis::PoolError),
    #[error("Redis refused the command")]
    Redis(#[from] redis::RedisError),
    #[error("Redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("a cache entry had {0} fields where {N_COUNTED} were expected")]
    Shape(usize),
}

/// Moves an existing entry by a delta; an absent entry stays absent, so a
/// delta can never become a whole count. Served counts never go below zero.
/// ARGV: n, then n field names, then n moves.
const APPLY: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local n = tonumber(ARGV[1])
local out = {}
for i = 1, n do
  local v = redis.call('HINCRBY', KEYS[1], ARGV[1 + i], ARGV[1 + n + i])
  if v < 0 then redis.call('HSET', KEYS[1], ARGV[1 + i], 0); v = 0 end
  out[i] = v
end
return out
";

/// Fills a missing entry from the durable totals (with a TTL), then applies a
/// delta (zero on the read path). An existing entry is never overwritten, so
/// a stale durable read cannot push a visible count backwards.
/// ARGV: n, the TTL, n field names, n durable totals, n moves.
const FILL_THEN_APPLY: &str = r"
local n = tonumber(ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then
  for i = 1, n do redis.call('HSET', KEYS[1], ARGV[2 + i], ARGV[2 + n + i]) end
  redis.call('EXPIRE', KEYS[1], ARGV[2])
end
local out = {}
for i = 1, n do
  local v = redis.call('HINCRBY', KEYS[1], ARGV[2 + i], ARGV[2 + 2 * n + i])
  if v < 0 then redis.call('HSET', KEYS[1], ARGV[2 + i], 0); v = 0 end
  out[i] = v
end
return out
";

/// An entry's fields: one per counted reaction, named after it.
fn fields() -> impl Iterator<Item = &'static str> {
    Reaction::COUNTED.iter().map(|r| r.as_str())
}

/// Totals from the values a script or HMGET returned, in field order.
fn totals_of(values: Vec<i64>) -> Result<Totals, CacheError> {
    let n = values.len();
    <[i64; N_COUNTED]>::try_from(values)
        .map(Totals::from_values)
        .map_err(|_| CacheError::Shape(n))
}

/// The per-target count cache. Entries expire after a TTL that follows the
/// consumer's lag (see `set_ttl`), and are not refreshed by deltas, so every
/// entry is rebuilt from the durable totals at least once per TTL.
#[derive(Clone)]
pub struct Cache {
    pool: Pool,
    prefix: Arc<str>,
    apply: Arc<Script>,
    fill_then_apply: Arc<Script>,
    ttl_secs: Arc<AtomicU64>,
    timeout: Duration,
}

impl Cache {
    pub fn new(config: &RedisConfig, ttl: Duration) -> anyhow::Result<Cache> {
        Ok(Cache {
            pool: pool(config)?,
            prefix: config.prefix.as_str().into(),
            apply: Arc::new(Script::new(APPLY)),
            fill_then_apply: Arc::new(Script::new(FILL_THEN_APPLY)),
            ttl_secs: Arc::new(AtomicU64::new(ttl.as_secs().max(1))),
            timeout: config.timeout,
        })
    }

    fn key(&self, target: &TargetId) -> String {
        // `c` for counts; entries of an earlier layout (`t`, fixed fields)
        // are never read and expire.
        format!("{}:c:{}", self.prefix, target.as_str())
    }

    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl_secs.load(Ordering::Relaxed))
    }

    pub fn set_ttl(&self, ttl: Duration) {
        self.ttl_secs.store(ttl.as_secs().max(1), Ordering::Relaxed);
    }

    async fn conn(&self) -> Result<deadpool_redis::Connection, CacheError> {
        Ok(self.pool.get().await?)
    }

    /// Bounds one operation, waiting for a connection included: a Redis that
    /// accepts connections but never answers must not hold a vote or a read.
    async fn within<T>(
        &self,
        op: impl Future<Output = Result<T, CacheError>>,
    ) -> Result<T, CacheError> {
        tokio::time::timeout(self.timeout, op)
            .await
            .map_err(|_| CacheError::Timeout(self.timeout))?
    }

    /// Cached totals for many targets in one round trip; `None` is a miss.
    pub async fn get_many(&self, targets: &[TargetId]) -> Result<Vec<Option<Totals>>, CacheError> {
        let mut pipe = redis::pipe();
        for t in targets {
            pipe.cmd("HMGET")
                .arg(self.key(t))
                .arg(fields().collect::<Vec<_>>());
        }
        let rows: Vec<Vec<Option<i64>>> = self
            .within(async { Ok(pipe.query_async(&mut self.conn().await?).await?) })
            .await?;
        rows.into_iter()
            .map(|row| match row.into_iter().collect::<Option<Vec<i64>>>() {
                Some(values) => totals_of(values).map(Some),
                None => Ok(None),
            })
            .collect()
    }

    /// Applies a delta to an existing entry; returns the new totals, or
    /// `None` when there is no entry.
    pub async fn apply(
        &self,
        target: &TargetId,
        delta: Delta,
    ) -> Result<Option<Totals>, CacheError> {
        let mut call = self.apply.key(self.key(target));
        call.arg(N_COUNTED)
            .arg(fields().collect::<Vec<_>>())
            .arg(&delta.values()[..]);
        let r: Option<Vec<i64>> = self
            .within(async { Ok(call.invoke_async(&mut self.conn().await?).await?) })
            .await?;
        r.map(totals_of).transpose()
    }

    /// Fills a missing entry from `durable`, then applies `delta`.
    pub async fn fill_then_apply(
        &self,
        target: &TargetId,
        durable: Totals,
        delta: Delta,
    ) -> Result<Totals, CacheError> {
        let mut call = self.fill_then_apply.key(self.key(target));
        call.arg(N_COUNTED)
            .arg(self.ttl().as_secs())
            .arg(fields().collect::<Vec<_>>())
            .arg(&durable.values()[..])
            .arg(&delta.values()[..]);
        let values: Vec<i64> = self
            .within(async { Ok(call.invoke_async(&mut self.conn().await?).await?) })
            .await?;
        totals_of(values)
    }

    /// Drops a target's entry, so the next read refills it from the durable totals.
    pub async fn invalidate(&self, target: &TargetId) -> Result<(), CacheError> {
        let del = redis::cmd("DEL").arg(self.key(target)).to_owned();
        self.within(async { Ok(del.query_async(&mut self.conn().await?).await?) })
            .await
    }

    pub async fn ping(&self) -> Result<(), CacheError> {
        let ping = redis::cmd("PING");
        let _: String = self
            .within(async { Ok(ping.query_async(&mut self.conn().await?).await?) })
            .await?;
        Ok(())
    }
}

/// How long cache entries live: longer than the worst consumer lag we accept,
/// so an entry never expires while the durable totals are still behind it.
#[derive(clap::Args, Debug, Clone)]
pub struct TtlPolicy {
    /// Shortest cache TTL, used while the consumer keeps up.
    #[arg(long = "cache-ttl-min", env = "TALLY_CACHE_TTL_MIN", default_value = "60s", value_parser = humantime::parse_duration)]
    pub min: Duration,

    /// Longest cache TTL, however far the consumer falls behind.
    #[arg(long = "cache-ttl-max", env = "TALLY_CACHE_TTL_MAX", default_value = "1h", value_parser = humantime::parse_duration)]
    pub max: Duration,
}

impl TtlPolicy {
    /// Twice the observed lag plus a margin, within [min, max].
    pub fn ttl_for_lag(&self, lag_seconds: f64) -> Duration {
        let wanted = Duration::from_secs_f64((lag_seconds.max(0.0) * 2.0 + 10.0).min(1e9));
        wanted.clamp(self.min, self.max.max(self.min))
    }

    /// Measures the consumer group's lag from outside (it keeps rising while
    /// every consumer is down), exports it, and keeps the cache TTL longer
    /// than it: an entry must not expire, and be refilled from durable
    /// totals, while those are still behind. Runs for as long as the API.
    pub async fn follow_consumer_lag(self, cache: Cache, kafka: KafkaConfig, group: String) {
        let mut tick = tokio::time::interval(lag::INTERVAL);
        loop {
            tick.tick().await;
            let (k, g) = (kafka.clone(), group.clone());
            match tokio::task::spawn_blocking(move || lag::group_lag(&k, &g)).await {
                Ok(Ok(lags)) => {
                    for l in &lags {
                        let p = l.partition.to_string();
                        metrics::gauge!(crate::metrics::GROUP_LAG_MESSAGES, "partition" => p.clone())
                            .set(l.messages as f64);
                        metrics::gauge!(crate::metrics::GROUP_LAG_SECONDS, "partition" => p)
                            .set(l.seconds);
                    }
                    let worst = lags.iter().map(|l| l.seconds).fold(0.0, f64::max);
                    cache.set_ttl(self.ttl_for_lag(worst));
                }
                Ok(Err(e)) => {
                    tracing::debug!(
                        error = format!("{e:#}"),
                        "consumer lag unknown; keeping the cache TTL"
                    );
                }
                Err(e) => tracing::debug!(error = %e, "lag task failed"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ttl_follows_lag_within_bounds() {
        let p = TtlPolicy {
            min: Duration::from_secs(60),
            max: Duration::from_secs(3600),
        };
        assert_eq!(p.ttl_for_lag(0.0), Duration::from_secs(60));
        assert_eq!(p.ttl_for_lag(100.0), Duration::from_secs(210));
        assert_eq!(p.ttl_for_lag(1e7), Duration::from_secs(3600));
        assert_eq!(p.ttl_for_lag(f64::NAN.max(0.0)), Duration::from_secs(60));
    }
}
