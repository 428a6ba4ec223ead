//! How a target's durable state is split: its voters fall into a fixed
//! number of buckets, each its own partition of `target_stats`.
//!
//! A user's bucket is the slice of the Murmur3 token ring that the token of
//! their user id falls in. The ring is cut into `count` equal, contiguous
//! slices, so a bucket is a token range: reconcile reads one bucket's rows
//! of `reactions` with a token-range restriction, in the order the bucket's
//! applied rows are clustered in, and never holds more than a page of either.
//! The mapping depends only on the user id and the count, which is fixed per
//! keyspace when it is created: a user never changes bucket.

use std::fmt;

/// Most buckets a keyspace may have; a read of a target's totals reads every
/// bucket, so more than this costs every cache miss far more than it saves.
pub const MAX_BUCKETS: u32 = 1024;

/// The bucket count fixed for a keyspace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    count: u32,
}

/// One bucket of a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bucket(u32);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the bucket count must be 1 to {MAX_BUCKETS}, not {0}")]
pub struct BadBucketCount(pub i64);

impl Layout {
    pub fn new(count: i64) -> Result<Layout, BadBucketCount> {
        match u32::try_from(count) {
            Ok(c) if (1..=MAX_BUCKETS).contains(&c) => Ok(Layout { count: c }),
            _ => Err(BadBucketCount(count)),
        }
    }

    pub fn count(self) -> u32 {
        self.count
    }

    /// Every bucket, in token order.
    pub fn buckets(self) -> impl Iterator<Item = Bucket> {
        (0..self.count).map(Bucket)
    }

    /// The bucket holding `token`.
    pub fn of_token(self, token: i64) -> Bucket {
        let offset = offset(token);
        Bucket(((offset * u128::from(self.count)) >> 64) as u32)
    }

    /// The tokens of a bucket, both ends included.
    pub fn range(self, bucket: Bucket) -> (i64, i64) {
        let start = |b: u32| -> u128 {
            // The smallest offset whose bucket is b: ceil(b * 2^64 / count).
            (u128::from(b) << 64).div_ceil(u128::from(self.count))
        };
        let lo = start(bucket.0);
        let hi = start(bucket.0 + 1) - 1;
        (token_at(lo), token_at(hi))
    }

    /// A bucket by its number, if the layout has it.
    pub fn bucket(self, n: i64) -> Option<Bucket> {
        u32::try_from(n)
            .ok()
            .filter(|n| *n < self.count)
            .map(Bucket)
    }
}

impl Bucket {
    /// The bucket of the lowest tokens, where a walk of a target starts.
    pub const FIRST: Bucket = Bucket(0);

    pub fn index(self) -> u32 {
        self.0
    }

    /// The value stored in the `bucket` column.
    pub fn column(self) -> i32 {
        self.0 as i32
    }
}

impl fmt::Display for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A token's distance from the start of the ring.
fn offset(token: i64) -> u128 {
    u128::from((token as u64) ^ (1 << 63))
}

fn token_at(offset: u128) -> i64 {
    ((offset as u64) ^ (1 << 63)) as i64
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layout(n: i64) -> Layout {
        Layout::new(n).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn counts_outside_the_bounds_are_refused() {
        for bad in [0, -1, 1025, i64::MAX] {
            assert_eq!(Layout::new(bad), Err(BadBucketCount(bad)));
        }
        assert_eq!(layout(16).count(), 16);
        assert_eq!(layout(4).bucket(3), Some(Bucket(3)));
        assert_eq!(layout(4).bucket(4), None);
        assert_eq!(layout(4).bucket(-1), None);
    }

    #[test]
    fn one_bucket_spans_the_ring_and_the_ends_fall_in_the_end_buckets() {
        assert_eq!(layout(1).range(Bucket(0)), (i64::MIN, i64::MAX));
        let l = layout(16);
        assert_eq!(l.of_token(i64::MIN), Bucket(0));
        assert_eq!(l.of_token(i64::MAX), Bucket(15));
        assert_eq!(l.range(Bucket(0)).0, i64::MIN);
        assert_eq!(l.range(Bucket(15)).1, i64::MAX);
        assert_eq!(layout(2).range(Bucket(1)), (0, i64::MAX));
    }

    proptest! {
        #[test]
        fn a_token_falls_in_the_range_of_its_bucket(count in 1i64..=1024, token: i64) {
            let l = layout(count);
            let b = l.of_token(token);
            prop_assert!(b.index() < l.count());
            let (lo, hi) = l.range(b);
            prop_assert!(lo <= token && token <= hi);
        }

        #[test]
        fn the_ranges_tile_the_ring_in_order(count in 1i64..=1024) {
            let l = layout(count);
            let mut next = Some(i64::MIN);
            for b in l.buckets() {
                let (lo, hi) = l.range(b);
                prop_assert_eq!(Some(lo), next);
                prop_assert!(lo <= hi);
                prop_assert_eq!(l.of_token(lo), b);
                prop_assert_eq!(l.of_token(hi), b);
                next = hi.checked_add(1);
            }
            prop_assert_eq!(next, None);
        }
    }
}
