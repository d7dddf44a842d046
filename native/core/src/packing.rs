//! First-fit-decreasing bin packing of samples into bins of `seq_len` tokens.
//!
//! Samples are taken longest first (ties by index, so the result is deterministic) and
//! each goes into the lowest-numbered bin that still has room. A max segment tree over
//! the bins' remaining capacity finds that bin in O(log n), so packing n samples costs
//! O(n log n) rather than the O(n · bins) of a linear scan.

use crate::CoreError;

/// Max segment tree over bin capacities; unopened bins have full capacity, so the
/// leftmost bin with room is either an open bin or the next one to open.
struct FirstFit {
    size: usize,
    tree: Vec<i64>,
}

impl FirstFit {
    fn new(num_bins: usize, capacity: i64) -> Self {
        let size = num_bins.max(1).next_power_of_two();
        let mut tree = vec![i64::MIN; 2 * size];
        for leaf in 0..num_bins {
            tree[size + leaf] = capacity;
        }
        for node in (1..size).rev() {
            tree[node] = tree[2 * node].max(tree[2 * node + 1]);
        }
        FirstFit { size, tree }
    }

    /// Leftmost bin with at least `need` room; takes the room and returns the bin.
    fn take(&mut self, need: i64) -> Option<usize> {
        if self.tree[1] < need {
            return None;
        }
        let mut node = 1;
        while node < self.size {
            node = if self.tree[2 * node] >= need { 2 * node } else { 2 * node + 1 };
        }
        let bin = node - self.size;
        self.tree[node] -= need;
        while node > 1 {
            node /= 2;
            self.tree[node] = self.tree[2 * node].max(self.tree[2 * node + 1]);
        }
        Some(bin)
    }
}

/// Assign each sample to a bin of `seq_len` tokens, first fit in decreasing length order.
///
/// Returns the bin index of every sample (`out[i]` for `lengths[i]`); bins are numbered
/// from 0 in the order they are opened, so the number of bins is `max(out) + 1`.
pub fn first_fit_decreasing(lengths: &[i64], seq_len: i64) -> Result<Vec<u32>, CoreError> {
    if seq_len <= 0 {
        return Err(CoreError::InvalidSeqLen { seq_len });
    }
    for (index, &length) in lengths.iter().enumerate() {
        if length < 0 {
            return Err(CoreError::NegativeLength { index, length });
        }
        if length > seq_len {
            return Err(CoreError::SequenceTooLong { index, length, seq_len });
        }
    }
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
    let mut bins = FirstFit::new(lengths.len(), seq_len);
    let mut out = vec![0u32; lengths.len()];
    for i in order {
        let bin = bins.take(lengths[i]).expect("n bins always hold n samples that each fit one bin");
        out[i] = bin as u32;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn naive(lengths: &[i64], seq_len: i64) -> Vec<u32> {
        let mut order: Vec<usize> = (0..lengths.len()).collect();
        order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
        let mut room: Vec<i64> = Vec::new();
        let mut out = vec![0u32; lengths.len()];
        for i in order {
            let bin = match room.iter().position(|&r| r >= lengths[i]) {
                Some(b) => b,
                None => {
                    room.push(seq_len);
                    room.len() - 1
                }
            };
            room[bin] -= lengths[i];
            out[i] = bin as u32;
        }
        out
    }

    #[test]
    fn packs_known_example() {
        // 6 and 4 share a bin, 5 and 5 share the next, 3 opens a third
        let out = first_fit_decreasing(&[4, 6, 5, 5, 3], 10).unwrap();
        assert_eq!(out, vec![0, 0, 1, 1, 2]);
    }

    #[test]
    fn rejects_bad_input() {
        assert_eq!(first_fit_decreasing(&[1], 0), Err(CoreError::InvalidSeqLen { seq_len: 0 }));
        assert_eq!(
            first_fit_decreasing(&[1, 11], 10),
            Err(CoreError::SequenceTooLong { index: 1, length: 11, seq_len: 10 })
        );
        assert_eq!(first_fit_decreasing(&[-1], 10), Err(CoreError::NegativeLength { index: 0, length: -1 }));
    }

    #[test]
    fn empty_input_gives_no_bins() {
        assert!(first_fit_decreasing(&[], 8).unwrap().is_empty());
    }

    proptest! {
        #[test]
        fn matches_linear_first_fit(lengths in prop::collection::vec(0i64..=64, 0..200), seq_len in 64i64..=256) {
            prop_assert_eq!(first_fit_decreasing(&lengths, seq_len).unwrap(), naive(&lengths, seq_len));
        }

        #[test]
        fn never_overfills_a_bin(lengths in prop::collection::vec(1i64..=100, 1..300), seq_len in 100i64..=500) {
            let out = first_fit_decreasing(&lengths, seq_len).unwrap();
            let num_bins = *out.iter().max().unwrap() as usize + 1;
            let mut used = vec![0i64; num_bins];
            for (i, &b) in out.iter().enumerate() {
                used[b as usize] += lengths[i];
            }
            prop_assert!(used.iter().all(|&u| u <= seq_len && u > 0));
        }
    }
}
