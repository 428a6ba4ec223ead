//! Overload protection, checked before anything is written: a token bucket
//! per user (429), so one client cannot monopolise its own Paxos partition,
//! and a cap on votes in flight (503), so load above capacity is refused
//! rather than queued until every request times out.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::domain::UserId;

/// Buckets kept before idle (full) ones are dropped.
const MAX_TRACKED: usize = 100_000;

pub struct UserLimiter {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<UserId, (f64, Instant)>>,
}

impl UserLimiter {
    /// `rate` votes per second per user, bursts of up to `burst`.
    pub fn new(rate: f64, burst: u32) -> UserLimiter {
        UserLimiter {
            rate: rate.max(0.001),
            burst: f64::from(burst.max(1)),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one token for `user`, or says how long until one is free.
    pub fn check(&self, user: &UserId) -> Result<(), Duration> {
        self.check_at(user, Instant::now())
    }

    fn check_at(&self, user: &UserId, now: Instant) -> Result<(), Duration> {
        let Ok(mut buckets) = self.buckets.lock() else {
            return Ok(());
        };
        if buckets.len() >= MAX_TRACKED && !buckets.contains_key(user) {
            let (rate, burst) = (self.rate, self.burst);
            buckets.retain(|_, (tokens, at)| {
                *tokens + now.duration_since(*at).as_secs_f64() * rate < burst
            });
        }
        let (tokens, at) = buckets.entry(user.clone()).or_insert((self.burst, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * self.rate).min(self.burst);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - *tokens) / self.rate))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_allowed_then_the_rate() {
        let l = UserLimiter::new(2.0, 3);
        let u = UserId::parse("u").unwrap_or_else(|e| panic!("{e}"));
        let t0 = Instant::now();
        assert!((0..3).all(|_| l.check_at(&u, t0).is_ok()));
        let wait = l.check_at(&u, t0).err().unwrap_or_default();
        assert!(
            wait > Duration::from_millis(400) && wait <= Duration::from_millis(500),
            "{wait:?}"
        );
        assert!(l.check_at(&u, t0 + Duration::from_millis(500)).is_ok());
        let other = UserId::parse("v").unwrap_or_else(|e| panic!("{e}"));
        assert!(l.check_at(&other, t0).is_ok(), "buckets are per user");
    }
}
