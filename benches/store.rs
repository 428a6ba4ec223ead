//! One vote write in flight, through the real store code: the read plus the
//! conditional batch (change + idempotency record), against a plain upsert
//! of the same row. Also: a first reaction (IF NOT EXISTS) against a change
//! (IF version = ?). Needs the local stack (`scripts/stack.sh up`).

#[path = "support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use tally::domain::{TargetId, UserId};
use tally::store::Cas;
use tally::store::Store;

fn id<T>(r: Result<T, tally::domain::IdError>) -> T {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// One vote; with one writer in flight it cannot lose a race.
async fn lwt_vote(store: &Store, user: &UserId, target: &TargetId, n: u64) {
    match support::lwt_vote(store, user, target, n).await {
        Cas::Applied => {}
        other => panic!("one writer in flight cannot lose: {other:?}"),
    }
}

fn vote_write(c: &mut Criterion) {
    if !support::stack_up() {
        support::skip_message("store bench");
        return;
    }
    let rt = tokio::runtime::Runtime::new().unwrap_or_else(|e| panic!("{e}"));
    let env = rt.block_on(support::bench_env("store", 1));
    let store = Arc::new(
        rt.block_on(Store::open(&env.cassandra, Duration::from_secs(3600)))
            .unwrap_or_else(|e| panic!("{e:#}")),
    );
    let session = rt
        .block_on(tally::store::connect_keyspace(&env.cassandra))
        .unwrap_or_else(|e| panic!("{e:#}"));
    let upsert = rt
        .block_on(session.prepare("INSERT INTO reactions (user_id, target_id, target_type, state, version) VALUES (?, ?, ?, ?, ?)"))
        .unwrap_or_else(|e| panic!("{e}"));

    let mut group = c.benchmark_group("vote write, one in flight");
    group
        .sample_size(60)
        .measurement_time(Duration::from_secs(10));

    let version = AtomicI64::new(0);
    group.bench_function("plain upsert (no read, no condition)", |b| {
        b.to_async(&rt).iter(|| async {
            let v = version.fetch_add(1, Ordering::Relaxed);
            let state = if v % 2 == 0 { "like" } else { "none" };
            session
                .execute_unpaged(&upsert, ("bench_u", "bench_t", "video", state, v))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
        })
    });

    let n = AtomicU64::new(0);
    let (user, target) = (
        id(UserId::parse("bench_lwt_user")),
        id(TargetId::parse("bench_t")),
    );
    group.bench_function("LWT change (read + IF version = ?)", |b| {
        b.to_async(&rt)
            .iter(|| lwt_vote(&store, &user, &target, n.fetch_add(1, Ordering::Relaxed)))
    });
    group.bench_function("LWT first reaction (read + IF NOT EXISTS)", |b| {
        b.to_async(&rt).iter(|| async {
            let i = n.fetch_add(1, Ordering::Relaxed);
            let fresh = id(UserId::parse(&format!("first_{i}")));
            lwt_vote(&store, &fresh, &target, i).await
        })
    });
    group.finish();
    rt.block_on(env.drop_all());
}

criterion_group!(benches, vote_write);
criterion_main!(benches);
