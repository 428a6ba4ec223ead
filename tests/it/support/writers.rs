//! Writers of a bucket's fence that the product does not have, to put a
//! bucket in the state a test needs at the moment it needs it.

use tally::domain::TargetId;
use tally::fence::{Fold, Read, Step};
use tally::store::StoreError;

/// Another writer of one bucket's fence, as a consumer on a hot target is:
/// each round writes the totals it read, moving `seq` and nothing else.
pub struct MoveFence;

impl Fold for MoveFence {
    async fn fold(&mut self, _: &TargetId, read: Read) -> Result<Step, StoreError> {
        Ok(Step::Write {
            totals: read.head.totals,
            target_type: read.head.target_type,
            users: Vec::new(),
        })
    }
}
