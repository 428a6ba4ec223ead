//! A reaction is data: every declared reaction goes through the whole
//! pipeline (a vote, the consumer, the summary) under its own name. The
//! `third-reaction` build runs this with a third one (`love`), proving that a
//! reaction is its declaration and one migration.

use std::time::Duration;

use tally::domain::{Reaction, Totals};

use crate::support::{TestEnv, TestResult, new_key};

#[tokio::test]
async fn every_declared_reaction_is_voted_counted_and_served_under_its_own_name() -> TestResult {
    let env = TestEnv::new().await;
    let app = env.spawn_app().await;
    for (i, reaction) in Reaction::COUNTED.iter().enumerate() {
        let reply = app
            .vote(&format!("u{i}"), new_key(), "video_all", reaction.as_str())
            .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
        let body = reply.json();
        assert_eq!(body["user_state"], reaction.as_str());
        let total = reaction.total_name().unwrap_or_default();
        assert_eq!(
            body[total], 1,
            "the answer counts the voter's own {reaction}: {body}"
        );
    }
    // One more voter reacts with every reaction in turn and then removes it,
    // moving each total up and down again.
    for reaction in Reaction::ALL.iter().skip(1).chain([&Reaction::None]) {
        let reply = app
            .vote("fickle", new_key(), "video_all", reaction.as_str())
            .await;
        assert_eq!(reply.status, 200, "{}", reply.body);
    }
    let consumer = env.start_consumer();
    env.wait_until_no_drift(Duration::from_secs(60)).await;
    consumer.stop().await;

    let one_each = Totals::count(Reaction::COUNTED.iter().copied());
    assert_eq!(env.stats().await["video_all"].totals, one_each);
    let summary = app.summary("u0", "video_all").await.json();
    let item = &summary["items"]["video_all"];
    let served: Totals =
        serde_json::from_value(item.clone()).unwrap_or_else(|e| panic!("{e}: {item}"));
    assert_eq!(served, one_each, "served {item}");
    assert_eq!(item["user_state"], Reaction::COUNTED[0].as_str());
    Ok(())
}
