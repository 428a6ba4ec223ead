//! The pure apply rule on its own: the floor under every consumer figure in
//! BENCHMARKS.md. Runs without the stack.

use criterion::{Criterion, black_box, criterion_group, criterion_main};
use tally::domain::{Applied, Outcome, Reaction, Totals, apply};

fn apply_rule(c: &mut Criterion) {
    // One user's history replayed twice: half the events are duplicates.
    let states = [
        Reaction::Like,
        Reaction::Dislike,
        Reaction::None,
        Reaction::Like,
    ];
    let events: Vec<(i64, Reaction, Reaction)> = (0..1000)
        .map(|i| (i as i64 % 500 + 1, states[i % 4], states[(i + 1) % 4]))
        .collect();
    c.bench_function("apply 1000 events (50% replays)", |b| {
        b.iter(|| {
            let (mut applied, mut totals) = (Applied::NEVER, Totals::default());
            for &(version, from, to) in black_box(&events) {
                if let Outcome::Apply { next, delta, .. } = apply(applied, version, from, to) {
                    applied = next;
                    totals = totals.apply(delta);
                }
            }
            black_box(totals)
        })
    });
}

criterion_group!(benches, apply_rule);
criterion_main!(benches);
