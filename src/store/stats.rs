//! The `target_stats` table: durable per-target totals and the per-user
//! versions they include. Only the consumer and reconcile write it.

use std::sync::Arc;

use anyhow::Context;
use scylla::client::session::Session;
use scylla::statement::prepared::PreparedStatement;

use super::reactions::Unavailable;
use crate::domain::{TargetId, Totals};

pub struct Stats {
    session: Arc<Session>,
    totals: PreparedStatement,
}

impl Stats {
    pub async fn prepare(session: Arc<Session>) -> anyhow::Result<Stats> {
        // Only static columns: LIMIT 1 returns the partition's one value.
        let totals = session
            .prepare("SELECT likes, dislikes FROM target_stats WHERE target_id = ? LIMIT 1")
            .await
            .context("prepare totals")?;
        Ok(Stats { session, totals })
    }

    /// The durable totals of one target; zeros if nothing was counted yet.
    pub async fn totals(&self, target: &TargetId) -> Result<Totals, Unavailable> {
        let result = self
            .session
            .execute_unpaged(&self.totals, (target.as_str(),))
            .await
            .map_err(|e| Unavailable(e.into()))?;
        let row = result
            .into_rows_result()
            .map_err(|e| Unavailable(e.into()))?
            .maybe_first_row::<(Option<i64>, Option<i64>)>()
            .map_err(|e| Unavailable(e.into()))?;
        let (likes, dislikes) = row.unwrap_or((None, None));
        Ok(Totals { likes: likes.unwrap_or(0).max(0), dislikes: dislikes.unwrap_or(0).max(0) })
    }
}
