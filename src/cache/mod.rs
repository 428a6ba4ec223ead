//! The only code that speaks Redis: the per-target count cache.

mod owed;

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use deadpool_redis::{Pool, Runtime};
use redis::aio::MultiplexedConnection;
use redis::{IntoConnectionInfo, Script};

use crate::bus::{KafkaConfig, lag};
use crate::cli::values;
use crate::domain::reaction::N_COUNTED;
use crate::domain::{Applied, Bucket, Layout, Reaction, TargetId, Totals, UserId};
use crate::secret::Secret;
use crate::store::stats::Heads;

/// Where Redis is.
#[derive(clap::Args, Debug, Clone)]
pub struct RedisConfig {
    /// Redis URL of the count cache; `rediss://` speaks TLS. Keep the
    /// password out of it: use `--redis-password`.
    #[arg(long = "redis-url", env = "TALLY_REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    pub url: String,

    /// ACL user to log in as.
    #[arg(
        long = "redis-user",
        id = "redis_user",
        value_name = "USER",
        env = "TALLY_REDIS_USER",
        requires = "redis_password"
    )]
    pub user: Option<String>,

    /// That user's password (alone: the `default` user's).
    #[arg(
        long = "redis-password",
        id = "redis_password",
        value_name = "PASSWORD",
        env = "TALLY_REDIS_PASSWORD",
        hide_env_values = true
    )]
    pub password: Option<Secret>,

    /// With `rediss://`, trust the certificate authorities in this PEM file
    /// rather than the system's.
    #[arg(
        long = "redis-tls-ca",
        id = "redis_tls_ca",
        value_name = "FILE",
        env = "TALLY_REDIS_TLS_CA"
    )]
    pub tls_ca: Option<PathBuf>,

    /// Prefix of every cache key, so several deployments (or tests) can share a Redis.
    /// Not empty, and without `:d:` or `:daily:` inside or `:d` or `:daily` at its end, where the keys name their kind.
    #[arg(long = "redis-prefix", env = "TALLY_REDIS_PREFIX", default_value = "tally", value_parser = prefix_of_its_own)]
    pub prefix: String,

    /// Longest one cache operation may take, waiting for a connection
    /// included. A Redis that hangs costs a vote or a read this long, no more.
    #[arg(long = "redis-timeout", env = "TALLY_REDIS_TIMEOUT", default_value = "500ms", value_parser = values::duration_above_zero)]
    pub timeout: Duration,
}

/// How long the vote path may spend counting one change, given the deadline
/// of one Redis call (see `Cache::change_budget`).
fn change_budget(timeout: Duration) -> Duration {
    timeout * 2 + Duration::from_secs(1)
}

impl RedisConfig {
    /// `Cache::change_budget` of a cache made with these settings, known
    /// before connecting, so a setting that must outlast a vote can be
    /// checked against it.
    pub fn change_budget(&self) -> Duration {
        change_budget(self.timeout)
    }

    pub fn local(prefix: &str) -> RedisConfig {
        RedisConfig {
            url: "redis://127.0.0.1:6379".into(),
            prefix: prefix.into(),
            timeout: Duration::from_millis(500),
            user: None,
            password: None,
            tls_ca: None,
        }
    }

    /// Where and as whom to connect, with the CA if one is given.
    /// Refuses settings no connection can be made with (a URL that does not
    /// parse, an unreadable CA, a CA without TLS), before any store is
    /// connected to. Whether Redis answers is learnt later.
    pub fn check(&self) -> Result<(), String> {
        self.connection_info()
            .map(|_| ())
            .map_err(|e| format!("{e:#}"))
    }

    fn connection_info(&self) -> anyhow::Result<redis::ConnectionInfo> {
        let mut info = self
            .url
            .as_str()
            .into_connection_info()
            .with_context(|| format!("Bad --redis-url {}", without_password(&self.url)))?;
        if let Some(password) = &self.password {
            info.redis.password = Some(password.expose().to_owned());
            info.redis.username = self.user.clone();
        }
        let Some(ca) = &self.tls_ca else {
            return Ok(info);
        };
        anyhow::ensure!(
            matches!(info.addr, redis::ConnectionAddr::TcpTls { .. }),
            "--redis-tls-ca needs a rediss:// URL"
        );
        let root_cert = std::fs::read(ca)
            .with_context(|| format!("Cannot read the Redis CA file {}", ca.display()))?;
        let certificates = redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(root_cert),
        };
        let client =
            redis::Client::build_with_tls(info, certificates).context("Bad Redis TLS settings")?;
        Ok(client.get_connection_info().clone())
    }
}

/// A key prefix whose keys no other deployment's sweep takes for its own.
/// Entries are `PREFIX:d:TARGET` and daily counters `PREFIX:daily:USER:DAY`,
/// and a sweep drops `PREFIX:d:*`, which would also take every key of a
/// prefix that is `PREFIX:d` or begins with `PREFIX:d:`, and the counters of
/// users named `d...` of one that is `PREFIX:daily`: a prefix naming a kind
/// so is refused, whatever shares the Redis.
fn prefix_of_its_own(prefix: &str) -> Result<String, String> {
    if prefix.is_empty() {
        return Err("a prefix must not be empty".into());
    }
    // `d` for entries, `daily` for the votes a user cast today.
    let names_a_kind = ["d", "daily"]
        .iter()
        .any(|kind| prefix.contains(&format!(":{kind}:")) || prefix.ends_with(&format!(":{kind}")));
    if names_a_kind {
        return Err(format!(
            "{prefix:?} holds \":d:\" or \":daily:\", or ends in \":d\" or \":daily\", which name the kind of a key: \
             a deployment whose prefix is what comes before would drop this one's entries \
             with its own"
        ));
    }
    Ok(prefix.to_owned())
}

/// `text` matching itself only, in a Redis glob pattern.
fn glob_escaped(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

/// A URL as it may be printed: any password in it replaced.
fn without_password(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            format!("{}://***@{}", &url[..scheme], &url[at + 1..])
        }
        _ => url.to_owned(),
    }
}

pub fn pool(config: &RedisConfig) -> anyhow::Result<Pool> {
    let manager =
        deadpool_redis::Manager::new(config.connection_info()?).context("Bad Redis settings")?;
    Pool::builder(manager)
        .config(deadpool_redis::PoolConfig::default())
        .runtime(Runtime::Tokio1)
        .build()
        .context("Cannot build the Redis pool")
}

#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("no Redis connection")]
    Pool(#[from] deadpool_redis::PoolError),
    #[error("Redis refused the command")]
    Redis(#[from] redis::RedisError),
    #[error("Redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("a cache entry had {0} totals where {N_COUNTED} were expected")]
    Shape(usize),
    #[error("a cache entry's served totals are not numbers: {0:?}")]
    Served(String),
    #[error("the answer to a change was not understood: {0}")]
    Answer(String),
}

impl CacheError {
    /// Whether Redis answered the command with an error: it ran, and said no
    /// (out of memory under `noeviction`, a script that failed), unlike a
    /// command that never reached it or whose answer never came.
    fn answered_no(&self) -> bool {
        matches!(self, CacheError::Redis(_)) && !self.spoils_connection()
    }

    /// Whether Redis refused a command because its key holds another type
    /// than the command's.
    fn is_wrong_type(&self) -> bool {
        matches!(self, CacheError::Redis(e) if e.code() == Some("WRONGTYPE"))
    }

    /// Whether the connection it came on may be broken or stuck, and is
    /// better not used again.
    fn spoils_connection(&self) -> bool {
        match self {
            CacheError::Timeout(_) => true,
            // Taking a connection failed: none was shared, so none to let go.
            CacheError::Pool(_) => false,
            CacheError::Redis(e) => {
                e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_timeout()
                    || e.is_unrecoverable_error()
                    // A former primary, after a failover.
                    || e.kind() == redis::ErrorKind::ReadOnly
            }
            CacheError::Shape(_) | CacheError::Served(_) | CacheError::Answer(_) => false,
        }
    }
}

// One entry per target, a hash:
//   s:<b>        the `target_stats` seq bucket b's base was read or written at
//   b:<b>:<name> bucket b's base: its durable totals as of s:<b>
//   k            how many buckets have a base
//   z            present once a read's miss filled the entry: every bucket
//                without an s: field then has the empty base at seq 0.
//                Most buckets of most targets were never written, and
//                writing their empty bases was most of a miss's Redis work
//   v            the served totals, "<n>|<n>" in `Totals` order: the bases
//                of all buckets plus every pending change; present only once
//                every bucket has a base. One field, so a page's read parses
//                one value per target (redis-rs's reply parser was a fifth
//                of a page's instructions with a field per total)
//   p:<user>     a pending change, "version|to|from|ms": the vote path counted
//                the user at `to` (their row at `version`) at `ms`, and the
//                base counts them at `from`
//   c:<user>     "version|ms": a base at `ms` counted the user's row at
//                `version` ahead of a vote that changed it (reconcile's
//                recount, or the consumer counting a later vote's event
//                first); that vote's own change, if it comes later, is
//                already counted
//   g            the fence of fills: a token set before a fill reads the
//                durable heads, which the fill must find unchanged to land.
//                A drop (DEL, eviction, FLUSHALL, a restart that keeps
//                nothing, expiry) takes
//                it with the entry, and with it any base a write through
//                had put there; heads read before that write would serve
//                the older base until the bucket's next write or the TTL
// The consumer (and reconcile) write each durable write of a bucket through
// to its entry, if a fill has armed one, with its seq: that bucket's base becomes exact, the pending changes it now
// includes go, and an older seq never overwrites a newer one. A read's miss
// fills every bucket the same way, newer seq winning (an empty bucket by
// `z`, at seq 0). So a served count is wrong at most until the consumer
// catches up, however entries expire and refill.

/// Shared by the scripts: reads and writes the served totals, moves one of
/// them for a state (none counts nowhere), records a bucket's base if it is
/// newer, and recomputes the served totals from the bases and the pending
/// changes.
const LIB: &str = r"
local function served(key, names)
  local out, i = {}, 0
  local v = redis.call('HGET', key, 'v')
  if v then
    for x in string.gmatch(v, '[^|]+') do i = i + 1; out[i] = tonumber(x) end
  end
  for j = i + 1, #names do out[j] = 0 end
  return out
end
local function serve(key, totals)
  redis.call('HSET', key, 'v', table.concat(totals, '|'))
end
local function move(totals, names, state, d)
  for i, name in ipairs(names) do
    if name == state then totals[i] = totals[i] + d end
  end
end
local function parse(p)
  local v, to, from, ms = string.match(p, '^(%d+)|([^|]*)|([^|]*)|(%d+)$')
  return tonumber(v), to, from, tonumber(ms)
end
local function now_ms()
  local t = redis.call('TIME')
  return t[1] * 1000 + math.floor(t[2] / 1000)
end
local function complete(key, nb)
  if redis.call('HEXISTS', key, 'z') == 1 then return true end
  return tonumber(redis.call('HGET', key, 'k') or '0') >= nb
end
local function set_base(key, names, b, seq, base)
  local f = 's:' .. b
  local cur = redis.call('HGET', key, f)
  if cur and tonumber(cur) >= tonumber(seq) then return false end
  if not cur then redis.call('HINCRBY', key, 'k', 1) end
  redis.call('HSET', key, f, seq)
  for i, name in ipairs(names) do redis.call('HSET', key, 'b:' .. b .. ':' .. name, base[i]) end
  return true
end
-- Sets the entry's TTL to at least `secs`, never shortening it: a vote's
-- change, a mark and the lag-following TTL each need the entry to live that
-- long, and a later write with a shorter TTL must not cut them short.
local function at_least(key, secs)
  if redis.call('TTL', key) < tonumber(secs) then redis.call('EXPIRE', key, secs) end
end
local function arm(key, token, ttl)
  if redis.call('HSETNX', key, 'g', token) == 1 and redis.call('TTL', key) < 0 then
    redis.call('EXPIRE', key, ttl)
  end
  return redis.call('HGET', key, 'g')
end
local function armed(key, token)
  return redis.call('HGET', key, 'g') == token
end
local function fill(key, names, nb, at)
  local n = #names
  for b = 0, nb - 1 do
    local seq = ARGV[at + b * (n + 1)]
    local base, empty = {}, tonumber(seq) == 0
    for i = 1, n do
      base[i] = ARGV[at + b * (n + 1) + i]
      if tonumber(base[i]) ~= 0 then empty = false end
    end
    -- An empty base at seq 0 is what `z` says of a bucket with no field.
    if not empty then set_base(key, names, b, seq, base) end
  end
  redis.call('HSET', key, 'z', 1)
end
local function recompute(key, names, nb, stale, marks_before)
  if not complete(key, nb) then return end
  local v = {}
  for _, name in ipairs(names) do v[name] = 0 end
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local f = all[i]
    local kind = string.sub(f, 1, 2)
    if kind == 'b:' then
      local name = string.match(f, '^b:%d+:(.*)$')
      if v[name] then v[name] = v[name] + tonumber(all[i + 1]) end
    elseif kind == 'p:' then
      local _, to, from, ms = parse(all[i + 1])
      if stale and (ms == nil or ms < stale) then
        redis.call('HDEL', key, f)
      else
        if v[to] then v[to] = v[to] + 1 end
        if v[from] then v[from] = v[from] - 1 end
      end
    elseif kind == 'c:' and marks_before then
      local ms = tonumber(string.match(all[i + 1], '|(%d+)$'))
      if ms == nil or ms < marks_before then redis.call('HDEL', key, f) end
    end
  end
  local totals = {}
  for i, name in ipairs(names) do totals[i] = v[name] end
  serve(key, totals)
end
";

/// A committed vote's change: `user` now at `to` (row `version`), from
/// `from`. Refused after `deadline` (Redis time, ms): by then the vote has
/// given up on the cache and may have published, so the consumer's write
/// may already hold the change. An entry without every bucket's base is
/// filled from the durable heads given, if its fence is still `token`
/// (else the script answers -2); with none given, the script arms the
/// fence with `token` and answers the fence the heads must be read under.
/// ARGV: n, ttl, deadline, buckets, n names, user, version, to, from,
/// token, then '' or, per bucket, seq and n base.
const APPLY: &str = r"
local n = tonumber(ARGV[1])
local nb = tonumber(ARGV[4])
local now = now_ms()
if now > tonumber(ARGV[3]) then return -1 end
local names = {}
for i = 1, n do names[i] = ARGV[4 + i] end
local user, version, to, from = ARGV[5 + n], tonumber(ARGV[6 + n]), ARGV[7 + n], ARGV[8 + n]
if not complete(KEYS[1], nb) then
  if ARGV[10 + n] == '' then return arm(KEYS[1], ARGV[9 + n], ARGV[2]) end
  if not armed(KEYS[1], ARGV[9 + n]) then return -2 end
  fill(KEYS[1], names, nb, 10 + n)
  recompute(KEYS[1], names, nb, nil, nil)
  at_least(KEYS[1], ARGV[2])
end
local counted = redis.call('HGET', KEYS[1], 'c:' .. user)
if counted and tonumber(string.match(counted, '^(%d+)|')) >= version then
  return served(KEYS[1], names)
end
local field = 'p:' .. user
local cur = redis.call('HGET', KEYS[1], field)
local totals = served(KEYS[1], names)
if cur then
  local cv, cto, cfrom = parse(cur)
  if cv >= version then return totals end
  move(totals, names, cto, -1)
  move(totals, names, to, 1)
  redis.call('HSET', KEYS[1], field, version .. '|' .. to .. '|' .. cfrom .. '|' .. now)
else
  move(totals, names, from, -1)
  move(totals, names, to, 1)
  redis.call('HSET', KEYS[1], field, version .. '|' .. to .. '|' .. from .. '|' .. now)
end
serve(KEYS[1], totals)
-- An entry holding a change the consumer has yet to count lives at least
-- the TTL from now, which follows the consumer's lag: its write-throughs,
-- which keep entries alive, stop while it lags.
at_least(KEYS[1], ARGV[2])
return totals
";

/// A read's miss: records every bucket's durable head (a newer seq wins)
/// and answers the served totals, if the entry's fence is still `token`;
/// else nothing, and the entry is left as it is.
/// ARGV: n, ttl, buckets, token, n names, then per bucket seq and n base.
const FILL: &str = r"
local n = tonumber(ARGV[1])
local nb = tonumber(ARGV[3])
if not armed(KEYS[1], ARGV[4]) then return false end
local names = {}
for i = 1, n do names[i] = ARGV[4 + i] end
local was = complete(KEYS[1], nb)
fill(KEYS[1], names, nb, 5 + n)
recompute(KEYS[1], names, nb, nil, nil)
if not was then at_least(KEYS[1], ARGV[2]) end
return served(KEYS[1], names)
";

/// A durable write of one bucket, written through: the bucket's base at
/// `seq` (if newer than the entry's), and the users it counted, each at
/// (version, state). A pending change the write includes goes even when a
/// newer write got here first: the newer base includes it too (seqs order a
/// bucket's writes), and left in place it would be counted twice. A pending change older than `stale` ms is dropped too:
/// the consumer has counted it long since, and only a write-through that
/// failed (Redis down) left it. An entry still missing other buckets' bases
/// keeps this one and serves nothing until a read fills the rest.
/// Users counted ahead of their votes get a `c:` mark, so that a vote's
/// change arriving later is not counted again; a mark only rises (a late
/// write-through's older mark would let a step between the two through),
/// and keeps its entry as long as it lasts, `stale`, whatever the TTL: an
/// entry gone before the step came would be filled with the change counted
/// and the step would count it again. An entry no fill has armed
/// (none, or one holding marks alone) gets only the marks: the read or vote
/// that fills it arms its fence first and then reads every bucket's head,
/// this write's or newer. A base written there by a write through that
/// arrived after a drop (one that had timed out, say) could be older than
/// a write whose base the drop took, and in a one-bucket layout it would be
/// complete and served until the TTL.
/// ARGV: n, ttl, stale, buckets, n names, bucket, seq, n base, k, then k
/// times user, version, state, then m, then m times user, version.
const WRITE_THROUGH: &str = r"
local n = tonumber(ARGV[1])
local nb = tonumber(ARGV[4])
local k = tonumber(ARGV[7 + 2 * n])
local m_at = 8 + 2 * n + 3 * k
local function mark(now)
  for j = 0, tonumber(ARGV[m_at]) - 1 do
    local at = m_at + 1 + 2 * j
    local field = 'c:' .. ARGV[at]
    local cur = redis.call('HGET', KEYS[1], field)
    if not cur or tonumber(string.match(cur, '^(%d+)')) <= tonumber(ARGV[at + 1]) then
      redis.call('HSET', KEYS[1], field, ARGV[at + 1] .. '|' .. now)
    end
  end
end
-- A mark must last as long as a late step may come, whatever the TTL.
local function keep_marks()
  if tonumber(ARGV[m_at]) > 0 then
    at_least(KEYS[1], math.ceil(MARK_LIFE_MS / 1000))
  end
end
if redis.call('HEXISTS', KEYS[1], 'g') == 0 then
  if tonumber(ARGV[m_at]) > 0 then
    mark(now_ms())
    at_least(KEYS[1], ARGV[2])
    keep_marks()
  end
  return 0
end
local names = {}
for i = 1, n do names[i] = ARGV[4 + i] end
local base = {}
for i = 1, n do base[i] = ARGV[6 + n + i] end
local newer = set_base(KEYS[1], names, ARGV[5 + n], ARGV[6 + n], base)
for j = 0, k - 1 do
  local at = 8 + 2 * n + 3 * j
  local field = 'p:' .. ARGV[at]
  local cur = redis.call('HGET', KEYS[1], field)
  if cur then
    local pv, pto, pfrom, pms = parse(cur)
    if pv <= tonumber(ARGV[at + 1]) then
      redis.call('HDEL', KEYS[1], field)
    elseif newer then
      redis.call('HSET', KEYS[1], field, pv .. '|' .. pto .. '|' .. ARGV[at + 2] .. '|' .. (pms or 0))
    end
  end
end
local now = now_ms()
mark(now)
recompute(KEYS[1], names, nb, now - tonumber(ARGV[3]), now - MARK_LIFE_MS)
at_least(KEYS[1], ARGV[2])
keep_marks()
if newer then return 1 end
return 0
";

/// Pending changes a bucket's base counts already, taken out: each user's
/// at most at its version, if the entry holds that bucket's base at `seq`
/// or newer. Writes nothing to an entry without such a base (or none).
/// ARGV: n, buckets, n names, bucket, seq, k, then k times user, version.
const SETTLE: &str = r"
local n = tonumber(ARGV[1])
local nb = tonumber(ARGV[2])
local names = {}
for i = 1, n do names[i] = ARGV[2 + i] end
local base = tonumber(redis.call('HGET', KEYS[1], 's:' .. ARGV[3 + n]) or '-1')
if base < tonumber(ARGV[4 + n]) then return 0 end
local taken = 0
for j = 0, tonumber(ARGV[5 + n]) - 1 do
  local field = 'p:' .. ARGV[6 + n + 2 * j]
  local cur = redis.call('HGET', KEYS[1], field)
  if cur and parse(cur) <= tonumber(ARGV[7 + n + 2 * j]) then
    redis.call('HDEL', KEYS[1], field)
    taken = taken + 1
  end
end
if taken > 0 then recompute(KEYS[1], names, nb, nil, nil) end
return taken
";

/// Drops an entry whose base of a bucket is older than `seq`, a durable
/// head a round read and found its events counted in (or reconcile found
/// its bucket counted in): a write landed there that was never written
/// through (its writer had no Redis, died between the two, or timed out and
/// landed after all), or its write through is still on the way, and a drop
/// is safe either way. No entry, no drop. An entry no fill has armed holds
/// marks alone (reconcile's, or the consumer's) and serves nothing: it is
/// not behind (its fill will read the heads after arming), and a drop would
/// take the marks. An armed one with no base of a bucket is behind any head
/// of it: its fill may have read the heads before that write landed. An entry kept is asked
/// whether it holds a pending change of any of the round's users, which
/// only a settle takes out.
/// ARGV: k, then k times bucket and seq, then the users.
/// Returns 2 if it dropped the entry, 1 if it kept one holding such a
/// change, 0 otherwise.
const DROP_BEHIND: &str = r"
if redis.call('HEXISTS', KEYS[1], 'g') == 0 then return 0 end
local k = tonumber(ARGV[1])
for i = 0, k - 1 do
  local cur = tonumber(redis.call('HGET', KEYS[1], 's:' .. ARGV[2 + 2 * i]) or '0')
  if cur < tonumber(ARGV[3 + 2 * i]) then
    redis.call('DEL', KEYS[1])
    return 2
  end
end
for i = 2 + 2 * k, #ARGV do
  if redis.call('HEXISTS', KEYS[1], 'p:' .. ARGV[i]) == 1 then return 1 end
end
return 0
";

/// The names of the counted reactions, in `Totals` order.
fn names() -> Vec<&'static str> {
    Reaction::COUNTED.iter().map(|r| r.as_str()).collect()
}

/// Totals from an entry's `v` field, "<n>|<n>" in `Totals` order.
fn served_totals(v: &str) -> Result<Totals, CacheError> {
    let mut values = [0; N_COUNTED];
    let mut n = 0;
    for part in v.split('|') {
        let value = part.parse().map_err(|_| CacheError::Served(v.to_owned()))?;
        if let Some(slot) = values.get_mut(n) {
            *slot = value;
        }
        n += 1;
    }
    if n != N_COUNTED {
        return Err(CacheError::Shape(n));
    }
    Ok(never_below_zero(values))
}

/// Totals from served values in field order.
fn totals_of(values: Vec<i64>) -> Result<Totals, CacheError> {
    let n = values.len();
    <[i64; N_COUNTED]>::try_from(values)
        .map(never_below_zero)
        .map_err(|_| CacheError::Shape(n))
}

/// A count below zero (a change counted before the base caught up with the
/// one before it) is served as 0.
fn never_below_zero(values: [i64; N_COUNTED]) -> Totals {
    Totals::from_values(values.map(|x| x.max(0)))
}

/// The token an entry's fence held before a fill read the durable heads:
/// the fill lands only if the entry still holds it. Random, so no entry
/// made after a drop (or after Redis lost everything) can hold it again.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Fence(String);

impl Fence {
    fn new() -> Fence {
        // 64 random bits: an entry nobody reacted to holds little more than
        // its fence.
        Fence(format!("{:016x}", uuid::Uuid::new_v4().as_u64_pair().0))
    }
}

/// What a vote's change did to its target's entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Counted {
    /// Counted, or already counted.
    Yes,
    /// The entry lacks a base: read every bucket's head, then apply again
    /// with them under this fence.
    NeedsHeads(Fence),
    /// The entry was dropped after the fence was armed: the heads read under
    /// it may predate a write whose base went with the drop.
    Dropped,
}

/// What a round that wrote nothing found in its target's entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behind {
    /// Its base of the bucket was older than the round's head: dropped.
    Dropped,
    /// Up to date, and holding a pending change of one of the round's
    /// users, for a settle to take out.
    Pending,
    /// Up to date with nothing of theirs pending, or no entry at all.
    Settled,
}

/// A change the vote path counts in the cache, ahead of the consumer.
#[derive(Debug, Clone)]
pub struct Pending<'a> {
    pub user: &'a UserId,
    pub version: i64,
    pub from: Reaction,
    pub to: Reaction,
}

/// What a durable write of one bucket wrote, to write through to the cache.
#[derive(Debug, Clone, Copy)]
pub struct Written<'a> {
    pub buckets: Layout,
    pub bucket: Bucket,
    pub seq: i64,
    pub totals: Totals,
    pub users: &'a [(UserId, Applied)],
    /// Those of `users` counted ahead of the vote that changed them (whose
    /// cache step may still be to come): reconcile's, and the consumer's
    /// users counted past a version it never counted.
    pub ahead: &'a [(UserId, i64)],
}

/// A vote counted against its user's limit for the day, under that day's key.
#[derive(Debug)]
#[must_use = "a vote that left no record is given back with `Cache::uncount_vote`"]
pub struct CountedToday(String);

/// The per-target count cache. Entries converge by construction: the
/// vote path adds pending changes, and every durable write replaces the base
/// (see the entry layout above). The TTL follows the consumer's lag (see
/// `TtlPolicy`), so an idle entry is not refilled from totals that are behind.
#[derive(Clone)]
pub struct Cache {
    pool: Pool,
    /// The connection every operation shares (see `conn`).
    held: Arc<Mutex<Held>>,
    prefix: Arc<str>,
    apply: Arc<Script>,
    fill: Arc<Script>,
    write_through: Arc<Script>,
    settle: Arc<Script>,
    drop_behind: Arc<Script>,
    uncount: Arc<Script>,
    ttl_secs: Arc<AtomicU64>,
    /// How old a pending change may be before a write-through drops it, ms.
    stale_ms: Arc<AtomicU64>,
    timeout: Duration,
    /// Entries a change, a write through or a settle could not reach, shared by every
    /// clone (see `owed`).
    owed: Arc<Mutex<owed::Owed>>,
}

/// The connection a cache's operations share: `None` until the first one,
/// and again after one failed on it. Each is numbered as it is taken, so a
/// failure lets go of the connection it came on and no later one.
#[derive(Default)]
struct Held {
    taken: u64,
    conn: Option<(u64, deadpool_redis::Connection)>,
}

/// A vote given back to its user's count of the day: only a count that is
/// still there, and never below zero (a count lost meanwhile, to an
/// eviction or a failover, would come back as -1, with no TTL).
const UNCOUNT: &str = "if tonumber(redis.call('GET', KEYS[1]) or '0') > 0 then \
    return redis.call('DECR', KEYS[1]) end return 0";

/// How long a `c:` mark lasts, and keeps its entry: as long as a late cache
/// step may still come, longer than `tally vote` lets a vote take.
const MARK_LIFE: Duration = crate::cast::LONGEST_VOTE.saturating_add(crate::cast::CLOCK_ROOM);

/// How old a pending change may grow before a write-through drops it: far
/// beyond a healthy consumer's lag. A lagging consumer's changes may be
/// older, so the bound follows the lag (see `Cache::follow_lag`).
const PENDING_STALE: Duration = Duration::from_secs(30);

/// Keys dropped a round trip when the drops owed are paid.
const DROPS_A_ROUND_TRIP: usize = 500;

/// How often the consumer checks that Redis is the process it was.
const RUN_CHECKED_EVERY: Duration = Duration::from_secs(1);

/// How often a process that owes drops tries Redis again.
const DROPS_OWED_EVERY: Duration = Duration::from_millis(250);

/// A tick every `period`, the first at once; one that comes late delays
/// the rest rather than bunching them to catch up.
fn every(period: Duration) -> tokio::time::Interval {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick
}

/// How often the API measures Redis's clock against its own.
const CLOCK_CHECKED_EVERY: Duration = Duration::from_secs(5);

/// Measurements a check takes, keeping the one of the shortest round trip.
const CLOCK_SAMPLES: usize = 3;

/// Redis's clock against this host's (`Cache::clock_offset`), in seconds.
#[derive(Debug, Clone, Copy)]
pub struct ClockOffset {
    /// How far Redis's clock is ahead; negative when it is behind.
    pub ahead: f64,
    /// Give or take: half the round trip of the measurement.
    pub within: f64,
}

/// How much earlier than its own deadline a vote's change is refused by
/// Redis: a margin for the clocks of the API and Redis to disagree.
pub const CLOCK_MARGIN: Duration = Duration::from_millis(100);

impl Cache {
    pub fn new(config: &RedisConfig, ttl: Duration) -> anyhow::Result<Cache> {
        let script = |body: &str| {
            let marks = millis(MARK_LIFE);
            Arc::new(Script::new(&format!(
                "local MARK_LIFE_MS = {marks}\n{LIB}\n{body}"
            )))
        };
        Ok(Cache {
            pool: pool(config)?,
            held: Arc::default(),
            prefix: config.prefix.as_str().into(),
            apply: script(APPLY),
            fill: script(FILL),
            write_through: script(WRITE_THROUGH),
            settle: script(SETTLE),
            drop_behind: Arc::new(Script::new(DROP_BEHIND)),
            uncount: Arc::new(Script::new(UNCOUNT)),
            ttl_secs: Arc::new(AtomicU64::new(ttl.as_secs().max(1))),
            stale_ms: Arc::new(AtomicU64::new(millis(PENDING_STALE))),
            timeout: config.timeout,
            owed: Arc::default(),
        })
    }

    /// The same cache over a pool of its own, whose connections are made
    /// (and driven) by the runtime that first asks for them: one per HTTP
    /// worker keeps each worker's Redis round trips on its own thread. The
    /// TTL is shared, so it still follows the consumer's lag everywhere.
    pub fn with_own_pool(&self, config: &RedisConfig) -> anyhow::Result<Cache> {
        Ok(Cache {
            pool: pool(config)?,
            held: Arc::default(),
            ..self.clone()
        })
    }

    /// The same cache remembering at most `most` entries owed a drop by key
    /// (`owed::MOST_OWED` otherwise); past that, every entry is dropped.
    pub fn remembering_drops(self, most: usize) -> Cache {
        Cache {
            owed: Arc::new(Mutex::new(owed::Owed::with_most(most))),
            ..self
        }
    }

    fn key(&self, target: &TargetId) -> String {
        // `d` for a bucketed entry with its served totals in one field and
        // no field for an empty bucket once filled (`z`); entries of earlier
        // layouts (`b`, a field per total; `c`, a field for every bucket)
        // are never read and expire. Built by hand: `format!` was 5.6% of
        // the instructions of a page of 21 ids (callgrind, BENCHMARKS.md
        // section 13).
        let mut key = String::with_capacity(self.prefix.len() + 3 + target.as_str().len());
        key.push_str(&self.prefix);
        key.push_str(":d:");
        key.push_str(target.as_str());
        key
    }

    pub fn ttl(&self) -> Duration {
        Duration::from_secs(self.ttl_secs.load(Ordering::Relaxed))
    }

    pub fn set_ttl(&self, ttl: Duration) {
        self.ttl_secs.store(ttl.as_secs().max(1), Ordering::Relaxed);
    }

    /// Keeps pending changes at least twice the consumers' lag, plus a
    /// margin: a write-through drops older ones as left behind, and while
    /// the consumer lags, changes that old are still to be counted. Dropped,
    /// the served counts went back by every vote of the lag until the
    /// consumer caught up.
    pub fn follow_lag(&self, lag_seconds: f64) {
        let lagging = Duration::from_secs_f64((lag_seconds.max(0.0) * 2.0 + 10.0).min(1e9));
        let stale = lagging.clamp(PENDING_STALE, values::LONGEST);
        self.stale_ms.store(millis(stale), Ordering::Relaxed);
    }

    /// The same cache, whose write-throughs drop no pending change as left
    /// behind: for a writer that does not follow the consumers' lag
    /// (`tally reconcile`), which would take a change the consumer has yet
    /// to count for one it counted long ago. The consumer's and the API's
    /// write-throughs, which follow the lag, do that.
    pub fn keeping_pending_changes(self) -> Cache {
        Cache {
            stale_ms: Arc::new(AtomicU64::new(u64::MAX / 4)),
            ..self
        }
    }

    /// How old a pending change may grow before a write-through drops it.
    pub fn pending_stale(&self) -> Duration {
        Duration::from_millis(self.stale_ms.load(Ordering::Relaxed))
    }

    /// A connection for one operation, and the number it is shared under.
    /// deadpool-redis checks every connection it hands out with a round
    /// trip (UNWATCH and PING), which doubled the round trips of a page's
    /// read; a multiplexed connection carries any number of operations at
    /// once, so one is taken from the pool and shared until an operation on
    /// it fails (`within`).
    async fn conn(&self) -> Result<(u64, MultiplexedConnection), CacheError> {
        if let Some(shared) = self.shared() {
            return Ok(shared);
        }
        let fresh = self.pool.get().await?;
        let Ok(mut held) = self.held.lock() else {
            return Ok((0, (*fresh).clone()));
        };
        let Held { taken, conn } = &mut *held;
        // Another operation may have got one first: then that one is shared
        // and this one goes back to the pool.
        let (n, shared) = conn.get_or_insert_with(|| {
            *taken += 1;
            (*taken, fresh)
        });
        Ok((*n, (**shared).clone()))
    }

    fn shared(&self) -> Option<(u64, MultiplexedConnection)> {
        let held = self.held.lock().ok()?;
        held.conn.as_ref().map(|(n, c)| (*n, (**c).clone()))
    }

    /// Bounds one operation, waiting for a connection included: a Redis that
    /// accepts connections but never answers must not hold a vote or a read.
    /// A failure that may have left its connection broken or stuck lets that
    /// connection go; the next operation takes another.
    async fn within<T, Op, Fut>(&self, op: Op) -> Result<T, CacheError>
    where
        Op: FnOnce(MultiplexedConnection) -> Fut,
        Fut: Future<Output = Result<T, redis::RedisError>>,
    {
        let mut used = None;
        let result = tokio::time::timeout(self.timeout, async {
            let (n, conn) = self.conn().await?;
            used = Some(n);
            Ok::<T, CacheError>(op(conn).await?)
        })
        .await
        .unwrap_or(Err(CacheError::Timeout(self.timeout)));
        if let (Err(e), Some(n)) = (&result, used) {
            if e.spoils_connection() {
                self.let_go(n);
            }
        }
        result
    }

    /// Lets the shared connection numbered `n` go, out of the pool too, if it
    /// is still the shared one: a late failure on an earlier connection must
    /// not throw away the fresh one taken since.
    fn let_go(&self, n: u64) {
        let spoiled = self.held.lock().ok().and_then(|mut held| {
            if held.conn.as_ref().is_some_and(|(m, _)| *m == n) {
                held.conn.take()
            } else {
                None
            }
        });
        drop(spoiled.map(|(_, c)| deadpool_redis::Connection::take(c)));
    }

    /// Served totals for many targets in one round trip; `None` is a miss.
    pub async fn get_many(&self, targets: &[TargetId]) -> Result<Vec<Option<Totals>>, CacheError> {
        // Sized up front: growing each command's buffers as its arguments
        // came was a twentieth of a page's instructions.
        let mut pipe = redis::Pipeline::with_capacity(targets.len());
        for t in targets {
            let key = self.key(t);
            let mut hget = redis::Cmd::with_capacity(3, "HGETv".len() + key.len());
            hget.arg("HGET").arg(key).arg("v");
            pipe.add_command(hget);
        }
        let rows: Vec<Option<String>> = match self
            .within(|mut c| async move { pipe.query_async(&mut c).await })
            .await
        {
            Ok(rows) => rows,
            Err(e) => {
                self.drop_wrong_typed(targets.iter(), &e).await;
                return Err(e);
            }
        };
        rows.iter()
            .map(|v| v.as_deref().map(served_totals).transpose())
            .collect()
    }

    /// Arms the fence of each target's entry, in one round trip, before
    /// their fills read the durable heads (see `fill`).
    pub async fn arm_many(&self, targets: &[&TargetId]) -> Result<Vec<Fence>, CacheError> {
        // What the `arm` script does, as plain commands in one transaction:
        // a script call per miss cost Redis about 12 us, and a page of ids
        // nobody has reacted to has 21 misses. `EXPIRE NX` (Redis 7) leaves
        // a live entry's TTL as it is.
        let ttl = self.ttl().as_secs();
        let mut pipe = redis::Pipeline::with_capacity(3 * targets.len());
        pipe.atomic();
        for t in targets {
            let key = self.key(t);
            pipe.cmd("HSETNX")
                .arg(&key)
                .arg("g")
                .arg(Fence::new().0)
                .ignore();
            pipe.cmd("EXPIRE").arg(&key).arg(ttl).arg("NX").ignore();
            pipe.cmd("HGET").arg(key).arg("g");
        }
        let tokens: Vec<String> = match self
            .within(|mut c| async move { pipe.query_async(&mut c).await })
            .await
        {
            Ok(tokens) => tokens,
            Err(e) => {
                self.drop_wrong_typed(targets.iter().copied(), &e).await;
                return Err(e);
            }
        };
        Ok(tokens.into_iter().map(Fence).collect())
    }

    /// After a read of many entries failed because a key among them is not
    /// a hash (`WRONGTYPE`: something else wrote under this prefix), drops
    /// each such key. One such key fails every page that holds its id
    /// whole, and its fills too, so those pages would read every id from
    /// Cassandra until a vote on it dropped the key; entries are hashes
    /// only, and a drop of one is always safe.
    async fn drop_wrong_typed<'t>(
        &self,
        targets: impl Iterator<Item = &'t TargetId>,
        error: &CacheError,
    ) {
        if !error.is_wrong_type() {
            return;
        }
        let keys: Vec<String> = targets.map(|t| self.key(t)).collect();
        let mut pipe = redis::Pipeline::with_capacity(keys.len());
        for key in &keys {
            pipe.cmd("TYPE").arg(key);
        }
        let kinds: Vec<String> = match self
            .within(|mut c| async move { pipe.query_async(&mut c).await })
            .await
        {
            Ok(kinds) => kinds,
            Err(e) => {
                tracing::warn!(error = %e, "could not find the cache keys that are not entries");
                return;
            }
        };
        let mut unlink = redis::cmd("UNLINK");
        let mut wrong = 0;
        for (key, kind) in keys.iter().zip(&kinds) {
            if !matches!(kind.as_str(), "hash" | "none") {
                unlink.arg(key);
                wrong += 1;
            }
        }
        if wrong == 0 {
            return;
        }
        match self
            .within(|mut c| async move { unlink.query_async::<u64>(&mut c).await })
            .await
        {
            Ok(n) => tracing::warn!(
                dropped = n,
                "dropped cache keys of this prefix that were not entries (not hashes)"
            ),
            Err(e) => tracing::warn!(error = %e, "could not drop cache keys that are not entries"),
        }
    }

    /// Records the durable heads of every bucket (a newer seq wins) and
    /// returns what the entry serves, if the entry's fence is still the one
    /// armed before the heads were read. Otherwise the entry was dropped
    /// since, perhaps with the base of a write the heads predate, and the
    /// answer is `None`: the entry is left for a fill read after the drop.
    pub async fn fill(
        &self,
        target: &TargetId,
        fence: &Fence,
        heads: &Heads,
    ) -> Result<Option<Totals>, CacheError> {
        let mut call = self.fill.key(self.key(target));
        call.arg(N_COUNTED)
            .arg(self.ttl().as_secs())
            .arg(heads.0.len())
            .arg(&fence.0)
            .arg(names());
        push_heads(&mut call, heads);
        let values: Option<Vec<i64>> = self
            .within(|mut c| async move { call.invoke_async(&mut c).await })
            .await?;
        values.map(totals_of).transpose()
    }

    /// How long the vote path may spend counting one change, from its
    /// commit: Redis refuses the change after that (see `apply`).
    pub fn change_budget(&self) -> Duration {
        change_budget(self.timeout)
    }

    /// The moment after which Redis refuses a change counted now: the
    /// budget, less a margin for the clocks of the API and Redis.
    pub fn change_deadline(&self) -> SystemTime {
        SystemTime::now() + self.change_budget().saturating_sub(CLOCK_MARGIN)
    }

    /// Counts a committed change ahead of the consumer, if Redis runs it
    /// before `deadline` (from `change_deadline`, taken once per change).
    /// With `durable` (every bucket's head, read under the fence given) an
    /// entry missing a base is filled first, if its fence still holds;
    /// without, such an entry is only armed, and the answer is the fence to
    /// read the heads under.
    pub async fn apply(
        &self,
        target: &TargetId,
        change: &Pending<'_>,
        buckets: Layout,
        durable: Option<(&Fence, &Heads)>,
        deadline: SystemTime,
    ) -> Result<Counted, CacheError> {
        let deadline_ms = deadline
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let mut call = self.apply.key(self.key(target));
        call.arg(N_COUNTED)
            .arg(self.ttl().as_secs())
            .arg(u64::try_from(deadline_ms).unwrap_or(u64::MAX))
            .arg(buckets.count())
            .arg(names())
            .arg(change.user.as_str())
            .arg(change.version)
            .arg(change.to.as_str())
            .arg(change.from.as_str());
        match durable {
            Some((fence, heads)) => {
                call.arg(&fence.0);
                push_heads(&mut call, heads);
            }
            None => {
                call.arg(&Fence::new().0).arg("");
            }
        }
        let answer: Result<redis::Value, CacheError> = self
            .within(|mut c| async move { call.invoke_async(&mut c).await })
            .await;
        let answer = match answer {
            Ok(a) => a,
            Err(e) => return Err(self.left_behind(target, "vote", e).await),
        };
        match answer {
            // Too late: Redis ran it after the vote gave up waiting.
            redis::Value::Int(-1) => Err(self
                .left_behind(target, "vote", CacheError::Timeout(self.timeout))
                .await),
            redis::Value::Int(-2) => Ok(Counted::Dropped),
            redis::Value::BulkString(token) => Ok(Counted::NeedsHeads(Fence(
                String::from_utf8(token).map_err(|e| CacheError::Answer(e.to_string()))?,
            ))),
            redis::Value::Array(_) => Ok(Counted::Yes),
            other => Err(CacheError::Answer(format!("unexpected answer {other:?}"))),
        }
    }

    /// Writes a durable write through: the bucket's base becomes exact as of
    /// `written.seq` (unless the entry already holds a newer one), and the
    /// pending changes it now includes go.
    pub async fn write_through(
        &self,
        target: &TargetId,
        written: &Written<'_>,
    ) -> Result<(), CacheError> {
        let mut call = self.write_through.key(self.key(target));
        call.arg(N_COUNTED)
            .arg(self.ttl().as_secs())
            .arg(self.stale_ms.load(Ordering::Relaxed))
            .arg(written.buckets.count())
            .arg(names())
            .arg(written.bucket.index())
            .arg(written.seq)
            .arg(&written.totals.values()[..])
            .arg(written.users.len());
        for (user, applied) in written.users {
            call.arg(user.as_str())
                .arg(applied.version)
                .arg(applied.state.as_str());
        }
        call.arg(written.ahead.len());
        for (user, version) in written.ahead {
            call.arg(user.as_str()).arg(*version);
        }
        let written: Result<i64, CacheError> = self
            .within(|mut c| async move { call.invoke_async(&mut c).await })
            .await;
        match written {
            Ok(_) => Ok(()),
            Err(e) => Err(self.left_behind(target, "write_through", e).await),
        }
    }

    /// Takes out the pending changes of `users` (each at most at its
    /// version) that `bucket`'s base counts, if the entry's base of it is at
    /// `seq` or newer: a durable round found those users counted at those
    /// versions as of `seq`, and wrote nothing that would write them
    /// through. Answers how many it took out.
    pub async fn settle(
        &self,
        target: &TargetId,
        (buckets, bucket): (Layout, Bucket),
        seq: i64,
        users: &[(&UserId, i64)],
    ) -> Result<u64, CacheError> {
        let mut call = self.settle.key(self.key(target));
        call.arg(N_COUNTED)
            .arg(buckets.count())
            .arg(names())
            .arg(bucket.index())
            .arg(seq)
            .arg(users.len());
        for (user, version) in users {
            call.arg(user.as_str()).arg(*version);
        }
        let taken: Result<u64, CacheError> = self
            .within(|mut c| async move { call.invoke_async(&mut c).await })
            .await;
        match taken {
            Ok(n) => Ok(n),
            Err(e) => Err(self.left_behind(target, "settle", e).await),
        }
    }

    /// Drops the entry if its base of any bucket in `heads` is older than
    /// the seq given, a head a durable round read and wrote nothing after,
    /// and otherwise answers whether it holds a pending change of any of
    /// `users` (see `DROP_BEHIND`): one round trip for every round that
    /// writes nothing. One Redis did not answer is owed a drop.
    pub async fn drop_if_behind(
        &self,
        target: &TargetId,
        heads: &[(Bucket, i64)],
        users: &[(&UserId, i64)],
    ) -> Result<Behind, CacheError> {
        match self.behind(target, heads, users).await {
            Err(e) => Err(self.left_behind(target, "drop_behind", e).await),
            answer => answer,
        }
    }

    /// `drop_if_behind` for a check whose next run makes the same test: one
    /// Redis did not answer is owed nothing. (A sweep that owed a drop for
    /// every target it checked during an outage would empty the cache.)
    pub async fn drop_if_behind_once(
        &self,
        target: &TargetId,
        heads: &[(Bucket, i64)],
    ) -> Result<Behind, CacheError> {
        self.behind(target, heads, &[]).await
    }

    async fn behind(
        &self,
        target: &TargetId,
        heads: &[(Bucket, i64)],
        users: &[(&UserId, i64)],
    ) -> Result<Behind, CacheError> {
        let mut call = self.drop_behind.key(self.key(target));
        call.arg(heads.len());
        for (bucket, seq) in heads {
            call.arg(bucket.index()).arg(*seq);
        }
        for (user, _) in users {
            call.arg(user.as_str());
        }
        let answer: i64 = self
            .within(|mut c| async move { call.invoke_async(&mut c).await })
            .await?;
        Ok(match answer {
            2 => Behind::Dropped,
            1 => Behind::Pending,
            _ => Behind::Settled,
        })
    }

    /// After a change could not be written to a target's entry: if Redis
    /// answered no, drops the entry and counts it, and answers whether the
    /// entry is gone. Nothing else would bring that entry up to date before
    /// it expired: under `maxmemory` with `noeviction` Redis refuses every
    /// write, the consumer's writes through too, and goes on serving reads
    /// from the entry. A DEL needs no memory. A dropped entry is like one
    /// that expired: the next read fills it from the durable totals, or,
    /// while writes are refused, serves them.
    async fn drop_refused(
        &self,
        target: &TargetId,
        step: &'static str,
        error: &CacheError,
    ) -> bool {
        if !error.answered_no() {
            return false;
        }
        metrics::counter!(crate::metrics::CACHE_WRITES_REFUSED, "step" => step).increment(1);
        match self.invalidate(target).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(target_id = %target, error = %e, "could not drop a cache entry Redis refused to change");
                false
            }
        }
    }

    /// After a vote's change, a write through or a settle failed: an entry
    /// Redis refused is dropped at once, and one it did not answer for (or
    /// could not drop) is owed a drop, sent once Redis answers
    /// (`drop_owed`). No later step may fix that entry before the TTL: the
    /// consumer's write through is what fixes a vote's, and it may fail too
    /// and its process die with its own drops owed; a write through's
    /// changes are counted already, and the bucket may see no other write.
    async fn left_behind(
        &self,
        target: &TargetId,
        step: &'static str,
        error: CacheError,
    ) -> CacheError {
        if !self.drop_refused(target, step, &error).await {
            self.owe(target);
        }
        error
    }

    /// Owes `target`'s entry a drop: a change to it may have been lost.
    pub fn owe(&self, target: &TargetId) {
        let mut owed = self.owed();
        owed.owe(self.key(target));
        metrics::gauge!(crate::metrics::CACHE_DROPS_OWED).set(owed.len() as f64);
    }

    /// The drops owed. A panic while another held them leaves them whole
    /// (each change is one map operation), so they are used all the same.
    fn owed(&self) -> std::sync::MutexGuard<'_, owed::Owed> {
        self.owed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether any entry is owed a drop.
    pub fn owes_drops(&self) -> bool {
        self.owed().any()
    }

    /// A mark for every failure so far to owe a drop: `paid_through` says
    /// when all of them are paid.
    pub fn owed_mark(&self) -> u64 {
        self.owed().last_failure()
    }

    /// Whether every drop owed for failures up to `mark` has been sent.
    pub fn paid_through(&self, mark: u64) -> bool {
        self.owed().paid_through(mark)
    }

    /// Drops the entries owed a drop, as many as Redis takes now; on an
    /// error the rest stay owed. Answers how many were dropped (a sweep of
    /// every entry counts as one).
    pub async fn drop_owed(&self) -> Result<usize, CacheError> {
        let mut dropped = 0;
        let sweep = self.owed().sweep_due();
        if let Some(as_of) = sweep {
            self.drop_every_entry().await?;
            let mut owed = self.owed();
            owed.swept(as_of);
            metrics::gauge!(crate::metrics::CACHE_DROPS_OWED).set(owed.len() as f64);
            dropped += 1;
        }
        loop {
            let due = self.owed().due(DROPS_A_ROUND_TRIP);
            if due.is_empty() {
                return Ok(dropped);
            }
            let mut pipe = redis::Pipeline::with_capacity(due.len());
            for (key, _) in &due {
                pipe.cmd("DEL").arg(key).ignore();
            }
            self.within(|mut c| async move { pipe.query_async::<()>(&mut c).await })
                .await?;
            dropped += due.len();
            let mut owed = self.owed();
            owed.paid(&due);
            metrics::gauge!(crate::metrics::CACHE_DROPS_OWED).set(owed.len() as f64);
        }
    }

    /// Drops every count entry of this prefix, a batch of keys a round
    /// trip: for an outage that owed more entries than are remembered.
    async fn drop_every_entry(&self) -> Result<(), CacheError> {
        let pattern = format!("{}:d:*", glob_escaped(&self.prefix));
        let mut cursor: u64 = 0;
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(DROPS_A_ROUND_TRIP);
            let (next, keys): (u64, Vec<String>) = self
                .within(|mut c| async move { scan.query_async(&mut c).await })
                .await?;
            if !keys.is_empty() {
                let unlink = redis::cmd("UNLINK").arg(&keys).to_owned();
                self.within(|mut c| async move { unlink.query_async::<()>(&mut c).await })
                    .await?;
            }
            if next == 0 {
                return Ok(());
            }
            cursor = next;
        }
    }

    /// Drops every entry if Redis is another process than the one that
    /// answered the last check, one that came up holding entries: a restart
    /// that loaded a snapshot, or a replica promoted after it missed the last
    /// writes through, serves bases older than writes whose writes through it
    /// never saw, and the fence of fills cannot tell (it came back with
    /// them). Redis's `run_id` is new with every process; the last one seen
    /// is kept in Redis itself, so a snapshot or a replica brings back an id
    /// that is not its own, and a Redis that started empty holds none.
    /// Answers whether it dropped every entry.
    pub async fn drop_entries_of_another_run(&self) -> Result<bool, CacheError> {
        let key = self.run_key();
        let mut pipe = redis::pipe();
        pipe.atomic().cmd("INFO").arg("server").cmd("GET").arg(&key);
        let (info, seen): (String, Option<String>) = self
            .within(|mut c| async move { pipe.query_async(&mut c).await })
            .await?;
        let run = info
            .lines()
            .find_map(|line| line.strip_prefix("run_id:"))
            .map(str::trim)
            .ok_or_else(|| CacheError::Answer("INFO server names no run_id".into()))?;
        if seen.as_deref() == Some(run) {
            return Ok(false);
        }
        let other = seen.is_some();
        if other {
            self.drop_every_entry().await?;
        }
        let record = redis::cmd("SET").arg(&key).arg(run).to_owned();
        self.within(|mut c| async move { record.query_async::<()>(&mut c).await })
            .await?;
        Ok(other)
    }

    /// Where the `run_id` of the Redis process the entries were last
    /// checked against is kept.
    fn run_key(&self) -> String {
        format!("{}:run", self.prefix)
    }

    /// Checks Redis's run (`drop_entries_of_another_run`) every second, for
    /// as long as the process runs.
    pub async fn keep_checking_runs(self) {
        let mut tick = every(RUN_CHECKED_EVERY);
        let mut refused = false;
        loop {
            tick.tick().await;
            match self.drop_entries_of_another_run().await {
                Ok(true) => tracing::warn!(
                    "Redis came back holding entries of another process (a snapshot loaded, a replica promoted): dropped every entry; reads fill them from the durable totals"
                ),
                Ok(false) => refused = false,
                // A setting to fix (an ACL without INFO, say): said once.
                Err(e) if e.answered_no() => {
                    if !std::mem::replace(&mut refused, true) {
                        tracing::warn!(
                            error = format!("{:#}", anyhow::Error::new(e)),
                            "Redis refused the check of which process serves the cache (INFO, SCAN, UNLINK): after a restart from a snapshot or a failover, entries may serve older totals until they expire"
                        );
                    }
                }
                // Redis away: the owed drops and the next check see to it.
                Err(e) => {
                    tracing::debug!(error = %e, "could not check which Redis process serves the cache")
                }
            }
        }
    }

    /// How far Redis's clock is ahead of this host's (negative: behind),
    /// and how uncertain that is (half the round trip of its `TIME`).
    pub async fn clock_offset(&self) -> Result<ClockOffset, CacheError> {
        let sent = SystemTime::now();
        let (secs, micros): (u64, u64) = self
            .within(|mut c| async move { redis::cmd("TIME").query_async(&mut c).await })
            .await?;
        let answered = SystemTime::now();
        let unix = |t: SystemTime| {
            t.duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64()
        };
        let half_trip = (unix(answered) - unix(sent)).max(0.0) / 2.0;
        let redis = secs as f64 + micros as f64 / 1e6;
        Ok(ClockOffset {
            ahead: redis - (unix(sent) + half_trip),
            within: half_trip,
        })
    }

    /// Measures Redis's clock against this host's every `CLOCK_CHECKED_EVERY`
    /// and exports it, warning while the gap is wider than a vote's cache
    /// step allows: Redis refuses a change after a deadline set by this
    /// host's clock, and a Redis clock behind by more lets a late change
    /// land after the vote was published, to be counted beside the
    /// consumer's count of it.
    pub async fn keep_checking_clock(self) {
        let mut tick = every(CLOCK_CHECKED_EVERY);
        let mut apart = false;
        loop {
            tick.tick().await;
            // The quickest of a few: a TIME queued behind other work on the
            // connection or in Redis is as uncertain as its wait is long.
            let mut best: Option<ClockOffset> = None;
            for _ in 0..CLOCK_SAMPLES {
                if let Ok(o) = self.clock_offset().await
                    && best.is_none_or(|b| o.within < b.within)
                {
                    best = Some(o);
                }
            }
            let Some(offset) = best else {
                // Unknown, not the last reading kept as if it were current.
                metrics::gauge!(crate::metrics::REDIS_CLOCK_OFFSET).set(f64::NAN);
                metrics::gauge!(crate::metrics::REDIS_CLOCK_UNCERTAINTY).set(f64::NAN);
                continue;
            };
            metrics::gauge!(crate::metrics::REDIS_CLOCK_OFFSET).set(offset.ahead);
            metrics::gauge!(crate::metrics::REDIS_CLOCK_UNCERTAINTY).set(offset.within);
            let too_far = offset.ahead.abs() - offset.within > CLOCK_MARGIN.as_secs_f64();
            if too_far && !std::mem::replace(&mut apart, true) {
                tracing::warn!(
                    redis_ahead_seconds = offset.ahead,
                    "Redis's clock and this host's are further apart than a vote's cache step allows (0.1 s): behind, a late cache step may land after the consumer counted its vote, which is then served twice for a while; ahead, cache steps are refused and served counts wait for the consumer. Synchronise both clocks (NTP)"
                );
            } else if !too_far && std::mem::replace(&mut apart, false) {
                tracing::info!(
                    redis_ahead_seconds = offset.ahead,
                    "Redis's clock and this host's agree again"
                );
            }
        }
    }

    /// Sends the drops owed (`drop_owed`) whenever there are some, for as
    /// long as the process runs.
    pub async fn keep_dropping_owed(self) {
        let mut tick = every(DROPS_OWED_EVERY);
        let mut refused = false;
        loop {
            tick.tick().await;
            if !self.owes_drops() {
                continue;
            }
            match self.drop_owed().await {
                Ok(n) => {
                    refused = false;
                    tracing::info!(
                        dropped = n,
                        "dropped cache entries that changes could not reach; reads fill them from the durable totals"
                    )
                }
                // A setting to fix (an ACL without DEL, SCAN or UNLINK, say),
                // or a Redis still loading: said once, tried again each tick.
                // The consumer holds the offsets of the batches that owe them.
                Err(e) if e.answered_no() => {
                    if !std::mem::replace(&mut refused, true) {
                        tracing::warn!(
                            error = format!("{:#}", anyhow::Error::new(e)),
                            "Redis refuses the drops of cache entries that changes could not reach; they stay owed, and a consumer holds the offsets of the batches that owe them, until Redis takes them"
                        );
                    }
                }
                // Redis still away: the next tick tries again.
                Err(e) => {
                    tracing::debug!(error = %e, "cache entries owed a drop still wait for Redis")
                }
            }
        }
    }

    /// Sends the drops owed within `bound`, when a process that owes them is
    /// about to end: nothing would send them after it. Answers whether
    /// entries are still owed.
    pub async fn drop_owed_before_exit(&self, bound: Duration) -> bool {
        let _ = tokio::time::timeout(bound, async {
            while self.owes_drops() {
                if self.drop_owed().await.is_err() {
                    tokio::time::sleep(DROPS_OWED_EVERY).await;
                }
            }
        })
        .await;
        let owed = self.owes_drops();
        if owed {
            tracing::warn!(
                "cache entries that changes could not reach were not dropped: they may serve older totals until they expire"
            );
        }
        owed
    }

    /// Drops a target's entry, so the next read refills it from the durable totals.
    pub async fn invalidate(&self, target: &TargetId) -> Result<(), CacheError> {
        let del = redis::cmd("DEL").arg(self.key(target)).to_owned();
        self.within(|mut c| async move { del.query_async(&mut c).await })
            .await
    }

    /// Counts one more vote of `user` today (UTC) and returns the day's
    /// count so far, with the time until the day ends. The count lives two
    /// days, then expires.
    pub async fn count_vote_today(
        &self,
        user: &UserId,
    ) -> Result<(u64, Duration, CountedToday), CacheError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let (day, into_day) = (now / 86_400, now % 86_400);
        let key = format!("{}:daily:{}:{day}", self.prefix, user.as_str());
        let mut pipe = redis::pipe();
        pipe.incr(&key, 1).expire(&key, 2 * 86_400);
        let (count, _): (u64, i64) = self
            .within(|mut c| async move { pipe.query_async(&mut c).await })
            .await?;
        Ok((
            count,
            Duration::from_secs(86_400 - into_day),
            CountedToday(key),
        ))
    }

    /// Takes back a vote counted by `count_vote_today` that left no record:
    /// the day's limit bounds the records a user piles up, so a refusal or
    /// a replay must not use it up. The day it was counted on, not today's.
    /// A Redis that does not answer keeps the count: the user is limited a
    /// vote early, never late.
    pub async fn uncount_vote(&self, counted: CountedToday) {
        let call = self.uncount.key(&counted.0);
        if let Err(e) = self
            .within(|mut c| async move { call.invoke_async::<i64>(&mut c).await })
            .await
        {
            tracing::debug!(error = %anyhow::Error::new(e), "a vote counted against the day's limit was kept");
        }
    }

    /// Fails when Redis refuses tally's login (a wrong user, password or
    /// CA); a Redis that does not answer is only reported: the cache is
    /// rebuilt from Cassandra, and tally works through its outage.
    pub async fn check_login(&self) -> anyhow::Result<()> {
        let Err(e) = self.ping().await else {
            return Ok(());
        };
        let refused = |r: &redis::RedisError| {
            r.kind() == redis::ErrorKind::AuthenticationFailed
                || matches!(r.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"))
                || r.to_string().contains("certificate")
        };
        let cause = match &e {
            CacheError::Redis(r) => Some(r),
            CacheError::Pool(deadpool_redis::PoolError::Backend(r)) => Some(r),
            _ => None,
        };
        match cause {
            Some(r) if refused(r) => Err(anyhow::anyhow!(
                "Redis refused the login or the TLS settings: {r}"
            )),
            _ => {
                tracing::warn!(error = %anyhow::Error::new(e), "Redis does not answer yet; going on without the cache");
                Ok(())
            }
        }
    }

    pub async fn ping(&self) -> Result<(), CacheError> {
        let ping = redis::cmd("PING");
        let _: String = self
            .within(|mut c| async move { ping.query_async(&mut c).await })
            .await?;
        Ok(())
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Per bucket, in order: the seq (0 for a bucket never written) and the base.
fn push_heads(call: &mut redis::ScriptInvocation<'_>, heads: &Heads) {
    for h in &heads.0 {
        call.arg(h.seq.unwrap_or(0)).arg(&h.totals.values()[..]);
    }
}

/// How long cache entries live from their last fill, write-through or vote:
/// twice the consumer's lag and more, so that an entry voted on during the
/// lag does not expire while the durable totals are still behind it.
#[derive(clap::Args, Debug, Clone)]
pub struct TtlPolicy {
    /// Shortest cache TTL, used while the consumer keeps up.
    #[arg(long = "cache-ttl-min", env = "TALLY_CACHE_TTL_MIN", default_value = "60s", value_parser = values::duration_within(values::SECOND, values::LONGEST))]
    pub min: Duration,

    /// Longest cache TTL, however far the consumer falls behind.
    #[arg(long = "cache-ttl-max", env = "TALLY_CACHE_TTL_MAX", default_value = "1h", value_parser = values::duration_within(values::SECOND, values::LONGEST))]
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
        // The first failure after a success is a WARN, the rest of the same
        // outage debug: a setting librdkafka refuses would otherwise leave
        // the TTL blind with nothing above debug, and an outage would warn
        // every INTERVAL.
        let mut warned = false;
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
                    cache.follow_lag(worst);
                    warned = false;
                }
                Ok(Err(e)) if !warned => {
                    warned = true;
                    tracing::warn!(
                        error = format!("{e:#}"),
                        "consumer lag unknown; keeping the cache TTL until it is known again"
                    );
                }
                Ok(Err(e)) => {
                    tracing::debug!(
                        error = format!("{e:#}"),
                        "consumer lag still unknown; keeping the cache TTL"
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
    fn no_prefix_taken_has_its_keys_in_another_ones_sweep() {
        // Every string of up to five of the pieces that matter.
        let (mut all, mut frontier) = (vec![String::new()], vec![String::new()]);
        for _ in 0..5 {
            frontier = frontier
                .iter()
                .flat_map(|s| ["a", "d", ":", "daily"].map(|c| format!("{s}{c}")))
                .collect();
            all.extend(frontier.iter().cloned());
        }
        let taken: Vec<&String> = all
            .iter()
            .filter(|p| prefix_of_its_own(p).is_ok())
            .collect();
        assert!(taken.len() > 100, "{}", taken.len());
        for &p in &taken {
            let swept = format!("{p}:d:");
            for &q in taken.iter().filter(|&&q| q != p) {
                for key in [
                    format!("{q}:d:t"),
                    format!("{q}:run"),
                    format!("{q}:daily:u:1"),
                    format!("{q}:daily:d:1"),
                ] {
                    assert!(!key.starts_with(&swept), "{p:?} sweeps {key:?} of {q:?}");
                }
            }
        }
        for refused in [
            "",
            "a:d",
            "a:d:b",
            ":d:",
            "tally:d",
            "tally:daily",
            "a:daily:b",
        ] {
            assert!(prefix_of_its_own(refused).is_err(), "{refused:?}");
        }
        assert_eq!(prefix_of_its_own("prod:tally"), Ok("prod:tally".into()));
    }

    #[test]
    fn a_prefix_matches_itself_only_in_a_scan_pattern() {
        assert_eq!(glob_escaped("tally"), "tally");
        assert_eq!(glob_escaped("a*b?[c]\\"), "a\\*b\\?\\[c\\]\\\\");
    }

    #[test]
    fn only_failures_that_may_break_the_connection_let_it_go() {
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        for spoils in [
            CacheError::Timeout(Duration::from_millis(500)),
            CacheError::Redis(redis::RedisError::from(reset)),
            CacheError::Redis(redis::RedisError::from((
                redis::ErrorKind::ReadOnly,
                "READONLY",
            ))),
        ] {
            assert!(spoils.spoils_connection(), "{spoils}");
        }
        let refused = redis::RedisError::from((redis::ErrorKind::ResponseError, "ERR script"));
        for keeps in [
            CacheError::Redis(refused),
            CacheError::Shape(3),
            CacheError::Served("x|y".into()),
            CacheError::Pool(deadpool_redis::PoolError::Closed),
        ] {
            assert!(!keeps.spoils_connection(), "{keeps}");
        }
    }

    #[test]
    fn served_totals_are_read_in_order_and_never_below_zero() {
        // 3, -1, then 2, 3, ... for the reactions a build may add.
        let value = |i: usize| match i {
            0 => 3,
            1 => -1,
            i => i as i64,
        };
        let field = |n: usize| {
            (0..n)
                .map(|i| value(i).to_string())
                .collect::<Vec<_>>()
                .join("|")
        };
        let totals = served_totals(&field(N_COUNTED)).unwrap_or_else(|e| panic!("{e}"));
        let expected: [i64; N_COUNTED] = std::array::from_fn(|i| value(i).max(0));
        assert_eq!(totals.values(), expected);
        for bad in [
            field(N_COUNTED - 1),
            field(N_COUNTED + 1),
            "3|x".into(),
            String::new(),
            "3||1".into(),
        ] {
            assert!(served_totals(&bad).is_err(), "{bad:?} should be refused");
        }
    }

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
