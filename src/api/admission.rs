//! Admission: how many requests of one kind run at once, adapted to what the
//! stores finish in time.
//!
//! A fixed cap far above capacity lets admitted work queue inside Cassandra
//! until every request is slow, while refused work still burns the CPU. This
//! is an AIMD limit instead, on a moving average of how long requests take
//! (so one slow answer, a GC pause, does not cut it). While the average is
//! within the target, each request that finishes while the limit was in use
//! raises the limit by 1/limit (one per limit's worth of requests); while it
//! is above, the limit is cut by a tenth, at most once per two targets.
//! It starts at its ceiling, so it only ever matters under load.
//!
//! A request above the limit waits in a short queue (as many places as the
//! limit): a burst, or a closed loop of clients up to twice the limit, is
//! served rather than refused. A queue as long as the limit frees in about
//! one average request's time, so a request waits for the longer of
//! `queue_wait` and two averages, but never more than four targets: a wait
//! shorter than the queue's own turnover would refuse the clients of a
//! closed loop only to have them send again at once. A request that finds
//! the queue full, or waits out its time, is refused with 503 and
//! Retry-After, before its token is verified or its body read. Waiting costs
//! nothing but a timer; a refusal costs about what `/healthz` does.
//!
//! The queue is first come, first served: the places are the permits of a
//! fair semaphore, so a place given back goes straight to the longest
//! waiter, and a newcomer finds none free while anyone waits. Under a steady
//! overload a newcomer that took every freed place left the waiters to wait
//! out their time and be refused late, after holding a connection for up to
//! four targets; served in turn, the queue moves, the waiters are admitted,
//! and the excess finds the queue full and is refused at once.
//!
//! Refusals are answered at once up to `refusal_ratio` times the rate at
//! which admitted requests complete, and in turn beyond it (`pacing.rs`):
//! clients that send again the moment they are refused are slowed to that
//! rate instead of taking the CPU the admitted work runs on.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::pacing::Pacing;

#[derive(Debug, Clone, Copy)]
pub struct AdmissionConfig {
    /// While requests take longer than this on average, the limit falls.
    pub target: Duration,
    /// The limit never falls below this: some work always runs.
    pub min: usize,
    /// Nor rises above this.
    pub max: usize,
    /// The shortest a request may wait for a place before it is refused
    /// (see the module comment for when it waits longer).
    pub queue_wait: Duration,
    /// Refusals answered at once per admitted request completed (0: all).
    pub refusal_ratio: f64,
}

pub struct Admission {
    kind: &'static str,
    config: AdmissionConfig,
    state: Mutex<State>,
    /// As many permits as the limit: tokio's semaphore hands them out in
    /// the order they were asked for.
    places: Arc<Semaphore>,
}

struct State {
    limit: f64,
    in_flight: usize,
    /// Requests waiting for a place.
    waiting: usize,
    /// Moving average of how long requests took, in seconds.
    average: f64,
    last_cut: Option<Instant>,
    /// Places the limit lost while they were in use: as many of the next
    /// ones given back are not returned to `places`.
    owed: usize,
    pacing: Pacing,
}

/// The weight of the newest answer in the moving average.
const WEIGHT: f64 = 0.1;

/// A request's place among those running; giving it back (drop) reports how
/// long the request took.
pub struct Permit {
    admission: Arc<Admission>,
    /// Its place; taken only when the permit is dropped.
    place: Option<OwnedSemaphorePermit>,
    started: Instant,
    /// Whether the limit was in use when this request was admitted: only
    /// then does a fast answer say the limit may grow.
    busy: bool,
    /// Whether the request got past its checks (its token, its user's
    /// limits) to the stores: only such a request's time says what the
    /// stores finish in time.
    at_work: bool,
}

impl Permit {
    /// Marks the request as past its checks, on its way to the stores.
    pub fn at_work(&mut self) {
        self.at_work = true;
    }
}

impl Admission {
    pub fn new(kind: &'static str, config: AdmissionConfig) -> Arc<Admission> {
        let min = config.min.max(1);
        let config = AdmissionConfig {
            min,
            max: config.max.max(min),
            ..config
        };
        let admission = Admission {
            kind,
            config,
            places: Arc::new(Semaphore::new(config.max)),
            state: Mutex::new(State {
                limit: config.max as f64,
                in_flight: 0,
                waiting: 0,
                average: 0.0,
                last_cut: None,
                owed: 0,
                pacing: Pacing::new(config.refusal_ratio, Instant::now()),
            }),
        };
        admission.export(config.max as f64);
        Arc::new(admission)
    }

    /// A permit, at once or after a wait in the queue; `None` when the
    /// queue is full or the wait ran out.
    pub async fn admit(self: &Arc<Self>) -> Option<Permit> {
        // A place is free only while no one waits for it.
        if let Ok(place) = self.places.clone().try_acquire_owned() {
            return Some(self.admitted(place));
        }
        let queued = {
            let mut state = self.lock();
            if state.waiting as f64 >= state.limit.floor() {
                None
            } else {
                state.waiting += 1;
                Some(Queued(self))
            }
        };
        let permit = match queued {
            None => None,
            Some(_place) => {
                let deadline = tokio::time::Instant::now() + self.wait_bound();
                // A wait that runs out as its place comes leaves the place
                // to the next waiter: the semaphore takes it back.
                let place = self.places.clone().acquire_owned();
                match tokio::time::timeout_at(deadline, place).await {
                    Ok(Ok(place)) => Some(self.admitted(place)),
                    // Out of time (the semaphore is never closed).
                    Ok(Err(_)) | Err(_) => None,
                }
            }
        };
        if permit.is_none() {
            metrics::counter!(crate::metrics::ADMISSION_REFUSED, "kind" => self.kind).increment(1);
            let now = Instant::now();
            let turn = self.lock().pacing.refusal(now);
            if !turn.is_zero() {
                metrics::counter!(crate::metrics::ADMISSION_PACED, "kind" => self.kind)
                    .increment(1);
                // From the instant the turn was counted from, so that the
                // refusals of one tick wake together.
                tokio::time::sleep_until(tokio::time::Instant::from_std(now + turn)).await;
            }
        }
        permit
    }

    fn admitted(self: &Arc<Self>, place: OwnedSemaphorePermit) -> Permit {
        let mut state = self.lock();
        state.in_flight += 1;
        let busy = state.in_flight as f64 * 2.0 >= state.limit;
        Permit {
            admission: self.clone(),
            place: Some(place),
            started: Instant::now(),
            busy,
            at_work: false,
        }
    }

    /// How long a request may wait in the queue now.
    fn wait_bound(&self) -> Duration {
        let turnover = Duration::from_secs_f64(self.lock().average * 2.0);
        turnover
            .min(self.config.target * 4)
            .max(self.config.queue_wait)
    }

    /// The current limit.
    pub fn limit(&self) -> usize {
        self.lock().limit.floor() as usize
    }

    /// Adapts the limit to a request that did its work in `took` (`None`
    /// for one refused before it reached the stores), and moves the places
    /// with it; `true` when the place being given back is to be forgotten,
    /// because the limit fell while it was in use.
    fn release(&self, took: Option<Duration>, busy: bool, now: Instant) -> bool {
        let mut state = self.lock();
        state.in_flight = state.in_flight.saturating_sub(1);
        let before = state.limit;
        // A request refused in microseconds (no token, over its user's rate)
        // says nothing of what the stores finish in time: counted, a flood
        // of them held the average under the target while the stores were
        // slow, and raised the limit and the pace of refusals.
        if let Some(took) = took {
            self.adapt(&mut state, took, busy, now);
        }
        let after = state.limit;
        let (had, has) = (before.floor() as usize, after.floor() as usize);
        if has > had {
            let paid = (has - had).min(state.owed);
            state.owed -= paid;
            self.places.add_permits(has - had - paid);
        } else {
            state.owed += had - has;
        }
        // Free places go first (there are none while anyone waits), then
        // this one.
        let free = self.places.forget_permits(state.owed);
        state.owed -= free;
        let forget = state.owed > 0;
        if forget {
            state.owed -= 1;
        }
        drop(state);
        if has != had {
            self.export(after);
        }
        forget
    }

    /// Moves the average and the limit by one request's time.
    fn adapt(&self, state: &mut State, took: Duration, busy: bool, now: Instant) {
        state.pacing.completed(now);
        state.average += (took.as_secs_f64() - state.average) * WEIGHT;
        if state.average > self.config.target.as_secs_f64() {
            // At most one cut per two targets: the average needs that long
            // to show what the last cut did.
            let cut_long_ago = state
                .last_cut
                .is_none_or(|at| now.duration_since(at) >= self.config.target * 2);
            if cut_long_ago {
                state.limit = (state.limit * 0.9).max(self.config.min as f64);
                state.last_cut = Some(now);
            }
        } else if busy {
            state.limit = (state.limit + 1.0 / state.limit).min(self.config.max as f64);
        }
    }

    fn export(&self, limit: f64) {
        metrics::gauge!(crate::metrics::ADMISSION_LIMIT, "kind" => self.kind).set(limit.floor());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is a few numbers, valid after any panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A place in the queue, given back however the wait ends (a permit, a
/// timeout, or a client that hung up and dropped the request).
struct Queued<'a>(&'a Admission);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.waiting = state.waiting.saturating_sub(1);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let took = self.at_work.then(|| self.started.elapsed());
        let forget = self.admission.release(took, self.busy, Instant::now());
        if let Some(place) = self.place.take() {
            if forget {
                place.forget();
            }
            // Otherwise dropped here: back to the semaphore, which gives it
            // to the longest waiter.
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(min: usize, max: usize) -> Arc<Admission> {
        Admission::new(
            "test",
            AdmissionConfig {
                target: Duration::from_millis(20),
                min,
                max,
                queue_wait: Duration::from_millis(50),
                refusal_ratio: 0.0,
            },
        )
    }

    /// Admits until the limit, then queues as many as the limit, then
    /// refuses; a released permit goes to a waiter; a wait that runs out is
    /// refused.
    #[tokio::test]
    async fn admits_to_the_limit_queues_as_many_and_refuses_the_rest() {
        let a = admission(2, 2);
        let mut running = fill(&a, 2).await;
        assert_eq!(running.len(), 2);
        let (first, second) = (tokio::spawn(wait(a.clone())), tokio::spawn(wait(a.clone())));
        tokio::task::yield_now().await;
        assert_eq!(a.lock().waiting, 2);
        assert!(
            a.admit().await.is_none(),
            "the queue is full: refused at once"
        );

        drop(running.pop());
        let admitted = [first, second].map(|t| async move { t.await.ok().flatten() });
        let [first, second] = admitted;
        let (first, second) = tokio::join!(first, second);
        assert_eq!(
            usize::from(first.is_some()) + usize::from(second.is_some()),
            1,
            "one place freed, one waiter admitted; the other waited out its time"
        );
        assert_eq!(a.lock().waiting, 0);
    }

    /// Requests refused before their work (no token, over a user's rate)
    /// take microseconds: they neither pull the average down nor raise the
    /// limit while the stores are slow; the same answers from the stores
    /// would.
    #[test]
    fn requests_refused_before_their_work_do_not_move_the_limit() {
        let a = admission(2, 100);
        let t0 = Instant::now();
        a.lock().average = 0.2;
        a.lock().limit = 50.0;
        for _ in 0..1000 {
            a.release(None, true, t0);
        }
        assert_eq!(a.lock().average, 0.2);
        assert_eq!(a.limit(), 50);
        for _ in 0..1000 {
            a.release(Some(Duration::ZERO), true, t0);
        }
        assert!(a.lock().average < 0.02, "{}", a.lock().average);
        assert!(a.limit() > 50);
    }

    /// A queued request may wait two average requests' time when that is
    /// longer than `queue_wait`, but never more than four targets.
    #[test]
    fn a_queued_request_waits_for_the_queues_turnover_within_bounds() {
        let a = admission(2, 2);
        let wait = Duration::from_millis(50);
        assert_eq!(a.wait_bound(), wait, "no answers yet: the configured wait");
        a.lock().average = 0.010;
        assert_eq!(a.wait_bound(), wait, "fast answers: the configured wait");
        a.lock().average = 0.035;
        assert_eq!(a.wait_bound(), Duration::from_millis(70), "two averages");
        a.lock().average = 5.0;
        assert_eq!(a.wait_bound(), Duration::from_millis(80), "four targets");
    }

    /// With requests taking longer than `queue_wait` on average, a waiter is
    /// still admitted when a place frees after `queue_wait` has passed.
    #[tokio::test]
    async fn a_waiter_outlasts_queue_wait_while_requests_take_longer() {
        // Wide margins on both sides, so a slow machine cannot decide it:
        // the waiter may wait 1 s, the configured wait is 50 ms, and the
        // place frees after 300 ms.
        let a = Admission::new(
            "test",
            AdmissionConfig {
                target: Duration::from_millis(250),
                min: 1,
                max: 1,
                queue_wait: Duration::from_millis(50),
                refusal_ratio: 0.0,
            },
        );
        a.lock().average = 0.5;
        let running = a.admit().await;
        assert!(running.is_some());
        let waiter = tokio::spawn(wait(a.clone()));
        // How long the running request holds its place.
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(running);
        let admitted = waiter.await.ok().flatten();
        assert!(
            admitted.is_some(),
            "freed after 300 ms, within the 1 s turnover though past the 50 ms wait"
        );
    }

    /// A place freed while someone waits goes to the waiter, not to a
    /// request that arrives before the waiter has run: that one finds the
    /// queue full and is refused at once.
    #[tokio::test]
    async fn a_freed_place_goes_to_the_waiter_not_to_a_newcomer() {
        let a = admission(1, 1);
        let running = a.admit().await;
        assert!(running.is_some());
        let waiter = tokio::spawn(wait(a.clone()));
        until_waiting(&a, 1).await;
        drop(running);
        // The place is the waiter's, though it has not run yet (one thread).
        assert!(
            a.admit().await.is_none(),
            "a newcomer does not jump the queue"
        );
        let admitted = waiter.await.ok().flatten();
        assert!(admitted.is_some(), "the waiter got the place");
        assert!(
            a.admit().await.is_none(),
            "the place is the waiter's while it runs"
        );
    }

    /// With room left in the queue, a newcomer queues behind the waiter a
    /// place was freed for, rather than taking it on its way in.
    #[tokio::test]
    async fn places_go_to_waiters_in_the_order_they_came() {
        use futures::FutureExt as _;
        let a = admission(2, 2);
        let mut running = fill(&a, 2).await;
        let first = tokio::spawn(wait(a.clone()));
        until_waiting(&a, 1).await;
        drop(running.pop());
        assert!(
            a.admit().now_or_never().is_none(),
            "the newcomer waits: the freed place is the first waiter's"
        );
        let first = first.await.ok().flatten();
        assert!(first.is_some(), "the first waiter got it");
    }

    /// Places given back together go to as many waiters: none is lost
    /// between a waiter's last look and its wait.
    #[tokio::test]
    async fn places_freed_at_once_admit_as_many_waiters() {
        let a = admission(3, 3);
        let mut running = fill(&a, 3).await;
        let waiters: Vec<_> = (0..3).map(|_| tokio::spawn(wait(a.clone()))).collect();
        until_waiting(&a, 3).await;
        running.clear();
        let mut admitted = Vec::new();
        for w in waiters {
            admitted.extend(w.await.ok().flatten());
        }
        assert_eq!(admitted.len(), 3, "three places freed, three admitted");
    }

    /// A limit cut while its places are in use takes them back as they are
    /// given back; a limit that grows again gets them back first.
    #[test]
    fn places_follow_the_limit_down_and_up() {
        let a = admission(1, 4);
        let free = |a: &Admission| a.places.available_permits();
        assert_eq!(free(&a), 4);
        let mut permits = Vec::new();
        for _ in 0..4 {
            let place = a.places.clone().try_acquire_owned();
            permits.extend(place.ok().map(|p| a.admitted(p)));
        }
        assert_eq!(permits.len(), 4);
        // Slow answers: the limit is cut once from 4 (to 3.6, so 3 places).
        let t0 = Instant::now();
        a.lock().average = 1.0;
        for p in &mut permits {
            p.started = Instant::now() - Duration::from_secs(1);
            p.at_work();
        }
        drop(permits.pop());
        assert_eq!(a.limit(), 3);
        assert_eq!(free(&a), 0, "the place given back went with the cut");
        drop(permits.pop());
        assert_eq!(free(&a), 1, "the next one is free again");
        // Fast answers while busy grow the limit back to 4.
        a.lock().average = 0.0;
        for _ in 0..40 {
            a.lock().in_flight += 1;
            let _ = a.release(Some(Duration::ZERO), true, t0);
        }
        assert_eq!(a.limit(), 4);
        assert_eq!(free(&a), 2, "one place back for the limit's growth");
        // Fast, so no cut moves the places while the last two go back.
        for p in &mut permits {
            p.started = Instant::now();
        }
        drop(permits);
        assert_eq!(free(&a), 4);
    }

    async fn wait(a: Arc<Admission>) -> Option<Permit> {
        a.admit().await
    }

    /// The permits of up to `n` requests admitted one after another.
    async fn fill(a: &Arc<Admission>, n: usize) -> Vec<Permit> {
        let mut running = Vec::new();
        for _ in 0..n {
            running.extend(a.admit().await);
        }
        running
    }

    /// Yields until `n` requests wait in the queue.
    async fn until_waiting(a: &Admission, n: usize) {
        while a.lock().waiting < n {
            tokio::task::yield_now().await;
        }
    }

    #[test]
    fn fast_answers_under_load_raise_the_limit_and_slow_ones_cut_it() {
        let a = admission(4, 100);
        let t0 = Instant::now();
        assert_eq!(a.limit(), 100, "it starts at its ceiling");
        a.lock().limit = 4.0;
        let fast = Duration::from_millis(5);
        for _ in 0..200 {
            a.lock().in_flight += 1;
            a.release(Some(fast), true, t0);
        }
        let grown = a.limit();
        assert!(
            grown > 10,
            "200 fast answers under load grow the limit: {grown}"
        );

        // Fast answers while idle say nothing about capacity.
        for _ in 0..200 {
            a.lock().in_flight += 1;
            a.release(Some(fast), false, t0);
        }
        assert_eq!(a.limit(), grown);

        // One slow answer moves the average, but not past the target.
        a.lock().in_flight += 1;
        a.release(Some(Duration::from_millis(100)), true, t0);
        assert!(a.limit() >= grown, "one slow answer does not cut");

        // A burst of slow answers within one target interval cuts once.
        let slow = Duration::from_millis(50);
        for _ in 0..50 {
            a.lock().in_flight += 1;
            a.release(Some(slow), true, t0);
        }
        let cut = a.limit();
        assert!(cut < grown && cut >= grown * 8 / 10, "{grown} -> {cut}");

        // Slow answers over a long time cut to the floor, never below.
        for i in 0..200u64 {
            a.lock().in_flight += 1;
            a.release(Some(slow), true, t0 + Duration::from_millis(40 * (i + 1)));
        }
        assert_eq!(a.limit(), 4);
    }

    #[test]
    fn the_limit_never_passes_its_ceiling() {
        let a = admission(2, 8);
        a.lock().limit = 2.0;
        let t0 = Instant::now();
        for _ in 0..10_000 {
            a.lock().in_flight += 1;
            a.release(Some(Duration::ZERO), true, t0);
        }
        assert_eq!(a.limit(), 8);
    }
}
