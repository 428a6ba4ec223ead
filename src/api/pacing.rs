//! Pacing of refusals: how soon a request that admission refused may be
//! answered.
//!
//! A refusal is cheap, but a closed loop of clients that send again the
//! moment they are refused (ignoring Retry-After) is answered as fast as the
//! server can refuse: 1,500 such connections drew about 21,000 refusals a
//! second, and the CPU those took from the stores left a tenth of the votes
//! that got through without them. So refusals are answered at most `ratio`
//! times as fast as admitted requests complete (on average over the last
//! `RECENT` whole seconds, never counting fewer than `FLOOR`): within that
//! rate at once, beyond it each in its turn, which a closed loop feels as a
//! slower server and an open loop as a later 503. An open loop of up to
//! `ratio + 1` times what the service completes is refused at once, as
//! before; a storm of any size is slowed to that rate. A wait costs a timer
//! and no more than `MAX_DELAY`. Waits end on the same `TICK`s, so the
//! refusals due within one are answered on one wake-up of the worker rather
//! than one each.
//!
//! Pure bookkeeping: the caller passes the time, so the rule is tested
//! without a clock.

use std::time::{Duration, Instant};

/// Completions a second counted at least, so a service that completes
/// little (just started, or every admitted request stuck) still refuses
/// `ratio` times this at once.
pub const FLOOR: f64 = 50.0;

/// The longest a refusal waits for its turn, before it is rounded up to a
/// tick.
pub const MAX_DELAY: Duration = Duration::from_secs(1);

/// How far ahead of the rate refusals may run in a burst: a second's worth
/// goes out at once. With a quarter second's, an open loop at ten times what
/// the service completes, against a ratio of 12, had most of its refusals
/// wait: a second of few completions (a pause of the store) left a backlog
/// that took seconds to pay off.
const BURST: Duration = Duration::from_secs(1);

/// Seconds of completions the rate is the average of: a second of few
/// completions cuts it by a fifth of the dip, not all of it. The highest of
/// them let a storm's best second set the pace: 1,500 connections drew 36
/// refusals per vote against a ratio of 20.
const RECENT: usize = 5;

const WINDOW: Duration = Duration::from_secs(1);

/// Waits end on multiples of this since the pacing began.
pub const TICK: Duration = Duration::from_millis(10);

#[derive(Debug)]
pub struct Pacing {
    /// Refusals answered at once per admitted request completed; 0 answers
    /// every refusal at once.
    ratio: f64,
    window_start: Instant,
    completed_in_window: u64,
    /// Completions a second in each of the last whole windows (none before
    /// the pacing began).
    recent: [f64; RECENT],
    /// Where the next window's rate goes in `recent`.
    next: usize,
    /// When the next refusal is due, were refusals spaced exactly at the
    /// allowed rate (the theoretical arrival time of a generic cell rate
    /// algorithm).
    due: Instant,
    /// Where the ticks are counted from.
    epoch: Instant,
    /// When the last refusal is answered: none is answered before it, so
    /// rounding up to a tick never lets a later refusal overtake it.
    last_answer: Instant,
}

impl Pacing {
    pub fn new(ratio: f64, now: Instant) -> Pacing {
        Pacing {
            ratio: ratio.max(0.0),
            window_start: now,
            completed_in_window: 0,
            recent: [0.0; RECENT],
            next: 0,
            due: now,
            epoch: now,
            last_answer: now,
        }
    }

    /// An admitted request completed.
    pub fn completed(&mut self, now: Instant) {
        self.roll(now);
        self.completed_in_window += 1;
    }

    /// How long a refusal made at `now` waits before it is answered.
    pub fn refusal(&mut self, now: Instant) -> Duration {
        if self.ratio == 0.0 {
            return Duration::ZERO;
        }
        self.roll(now);
        // However small the ratio, the spacing never exceeds what the debt
        // may reach (and never overflows a Duration).
        let most = BURST + MAX_DELAY;
        let interval =
            Duration::try_from_secs_f64(1.0 / self.allowed()).map_or(most, |i| i.min(most));
        let due = self.due.max(now);
        // At most `MAX_DELAY` after `now`: the clamp below keeps `due` within
        // `BURST + MAX_DELAY` of every earlier `now`.
        let answer_at = due.checked_sub(BURST).unwrap_or(now).max(now);
        let answer_at = if answer_at > now {
            // Rounded up to a tick, even at the longest wait, so that the
            // refusals of a saturated storm coalesce too.
            self.on_a_tick(answer_at)
        } else {
            now
        };
        // Never before the one answered last: in turn, on its tick at most.
        let answer_at = answer_at.max(self.last_answer);
        self.last_answer = answer_at;
        let delay = answer_at.saturating_duration_since(now);
        // A refusal answered early (at MAX_DELAY) still takes its turn, but
        // the debt is bounded: what is owed never reaches past the longest
        // wait, so a storm that ends leaves no backlog to slow the next.
        self.due = (due + interval).min(now + BURST + MAX_DELAY);
        delay
    }

    /// The first tick at or after `at`.
    fn on_a_tick(&self, at: Instant) -> Instant {
        let since = at.saturating_duration_since(self.epoch).as_nanos();
        let tick = TICK.as_nanos();
        let ticks = since.div_ceil(tick);
        let nanos = u64::try_from(ticks * tick - since).unwrap_or(0);
        at + Duration::from_nanos(nanos)
    }

    /// Refusals a second answered at once.
    pub fn allowed(&self) -> f64 {
        let rate = self.recent.iter().sum::<f64>() / RECENT as f64;
        self.ratio * rate.max(FLOOR)
    }

    fn roll(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.window_start);
        if elapsed >= WINDOW {
            // A window longer than one (no traffic for a while) averages
            // over all of it and fills a slot for each whole second it
            // lasted, so an idle spell reads as the low rate it was.
            let rate = self.completed_in_window as f64 / elapsed.as_secs_f64();
            let seconds = usize::try_from(elapsed.as_secs()).unwrap_or(RECENT);
            for _ in 0..seconds.clamp(1, RECENT) {
                self.recent[self.next] = rate;
                self.next = (self.next + 1) % RECENT;
            }
            self.completed_in_window = 0;
            self.window_start = now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `RECENT` seconds of `n` completions each, so the rate reads `n` a
    /// second.
    fn steady(p: &mut Pacing, start: Instant, n: u32) -> Instant {
        (0..RECENT).fold(start, |t, _| one_second_of(p, t, n))
    }

    /// Completes `n` requests evenly over one second from `start` and closes
    /// the window.
    fn one_second_of(p: &mut Pacing, start: Instant, n: u32) -> Instant {
        for i in 0..n {
            p.completed(start + WINDOW.mul_f64(f64::from(i) / f64::from(n)));
        }
        let end = start + WINDOW;
        p.roll(end);
        end
    }

    #[test]
    fn refusals_within_ratio_times_the_completions_are_answered_at_once() {
        let t0 = Instant::now();
        let mut p = Pacing::new(10.0, t0);
        let t1 = steady(&mut p, t0, 300);
        assert!((p.allowed() - 3_000.0).abs() < 1e-6, "{}", p.allowed());
        // 2,900 refusals in a second, evenly: under the rate, none waits.
        for i in 0..2_900u32 {
            let at = t1 + WINDOW.mul_f64(f64::from(i) / 2_900.0);
            assert_eq!(p.refusal(at), Duration::ZERO, "refusal {i}");
        }
    }

    #[test]
    fn a_burst_beyond_the_rate_waits_in_turn_and_never_longer_than_the_bound() {
        let t0 = Instant::now();
        let mut p = Pacing::new(10.0, t0);
        let t1 = steady(&mut p, t0, 100);
        // 1,000 a second allowed, a second's worth at once.
        let delays: Vec<Duration> = (0..5_000).map(|_| p.refusal(t1)).collect();
        let immediate = delays.iter().filter(|d| d.is_zero()).count();
        assert_eq!(immediate, 1_001, "the burst, and the one due now");
        // Those after wait their turn (a millisecond more each), rounded up
        // to a tick, up to the bound, which the rest wait.
        assert_eq!(delays[1_250], Duration::from_millis(250));
        assert_eq!(delays[1_251], Duration::from_millis(260));
        assert!(delays.iter().all(|d| d.as_nanos() % TICK.as_nanos() == 0));
        assert!(
            delays.windows(2).all(|w| w[0] <= w[1]),
            "turns are in order"
        );
        assert_eq!(delays[2_000], MAX_DELAY);
        assert!(delays[2_000..].iter().all(|d| *d == MAX_DELAY));
    }

    #[test]
    fn the_rate_is_the_recent_average_and_an_idle_spell_forgets_it() {
        let t0 = Instant::now();
        let mut p = Pacing::new(10.0, t0);
        let t = one_second_of(&mut p, t0, 500);
        assert!((p.allowed() - 1_000.0).abs() < 1e-6, "one second of five");
        let mut t = steady(&mut p, t, 400);
        assert!((p.allowed() - 4_000.0).abs() < 1e-6, "{}", p.allowed());
        t = one_second_of(&mut p, t, 100);
        assert!(
            (p.allowed() - 3_400.0).abs() < 1e-6,
            "one slow second cuts it by a fifth of the dip: {}",
            p.allowed()
        );
        t = steady(&mut p, t, 100);
        assert!(
            (p.allowed() - 1_000.0).abs() < 1e-6,
            "a slow spell, all of it"
        );
        let t = steady(&mut p, t, 400);
        p.roll(t + WINDOW * 2);
        assert!(
            (p.allowed() - 2_400.0).abs() < 1e-6,
            "two idle seconds are two slots of none: {}",
            p.allowed()
        );
        p.roll(t + WINDOW * (2 + RECENT as u32));
        assert!(
            (p.allowed() - 10.0 * FLOOR).abs() < 1e-6,
            "idle since: the floor"
        );
    }

    #[test]
    fn a_ratio_of_zero_never_delays() {
        let t0 = Instant::now();
        let mut p = Pacing::new(0.0, t0);
        assert!((0..100_000).all(|_| p.refusal(t0).is_zero()));
    }

    #[test]
    fn with_no_completions_the_floor_still_answers_some_at_once() {
        let t0 = Instant::now();
        let mut p = Pacing::new(12.0, t0);
        let t1 = t0 + Duration::from_secs(5);
        let immediate = (0..10_000).filter(|_| p.refusal(t1).is_zero()).count();
        // 600 a second: 600 in the burst, and the one due now (or not, as
        // a 1/600 s interval rounds to whole nanoseconds).
        assert!((600..=601).contains(&immediate), "{immediate}");
    }

    #[test]
    fn a_storm_that_ends_leaves_no_backlog() {
        let t0 = Instant::now();
        let mut p = Pacing::new(10.0, t0);
        let t1 = steady(&mut p, t0, 100);
        for _ in 0..100_000 {
            p.refusal(t1);
        }
        // Once the longest wait and the burst are behind, a refusal is
        // answered at once again.
        assert_eq!(p.refusal(t1 + BURST + MAX_DELAY), Duration::ZERO);
    }

    proptest! {
        /// However refusals arrive, they are answered in the order they
        /// came and none waits longer than the bound (and a tick); and while
        /// the debt cannot reach the clamp (no more arrivals than the burst's
        /// and the longest wait's worth), no stretch of time sees more
        /// answers than the rate allows plus the burst and a tick (the
        /// answers due within one go out together). Most gaps are far
        /// shorter than the rate's spacing, so the cases pace.
        #[test]
        fn answers_keep_order_and_never_outrun_the_rate_by_more_than_the_burst(
            gaps in proptest::collection::vec(
                prop_oneof![8 => 0u64..500, 1 => 0u64..100_000],
                1..2_000,
            ),
        ) {
            let t0 = Instant::now();
            // Nothing completes: the floor sets the rate, 200 a second.
            let mut p = Pacing::new(4.0, t0);
            let rate = p.allowed();
            let mut now = t0;
            let (mut arrived, mut answered) = (Vec::new(), Vec::new());
            let mut waited = false;
            for gap in &gaps {
                now += Duration::from_micros(*gap);
                arrived.push(now);
                let delay = p.refusal(now);
                prop_assert!(delay <= MAX_DELAY + TICK);
                waited |= !delay.is_zero();
                answered.push(now + delay);
            }
            prop_assert!(answered.windows(2).all(|w| w[0] <= w[1]));
            let unclamped = ((rate * (BURST + MAX_DELAY).as_secs_f64()) as usize).min(answered.len());
            let checked = &answered[..unclamped];
            for i in 0..checked.len() {
                for j in i..checked.len() {
                    let span = (checked[j] - checked[i]).as_secs_f64();
                    let most = rate * (span + BURST.as_secs_f64() + TICK.as_secs_f64()) + 1.0 + 1e-6;
                    prop_assert!(((j - i + 1) as f64) <= most, "{} answers in {span}s", j - i + 1);
                }
            }
            // More arrivals within the burst's time than the burst holds
            // must have waited: the case is not vacuous.
            if arrived.len() > 300 && (arrived[300] - arrived[0]) < BURST / 2 {
                prop_assert!(waited);
            }
        }
    }
}
