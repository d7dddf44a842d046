//! Micro-batches onto data-parallel ranks: a cost per micro-batch and a balanced,
//! lockstep-safe assignment.
//!
//! Every rank gets the same number of micro-batches (FSDP ranks step in lockstep, so a
//! rank with one micro-batch fewer would hang in a collective); the caller pads with
//! empty micro-batches. Within that constraint the assignment is longest processing
//! time first: micro-batches in decreasing cost (ties by id) each go to the least-loaded
//! rank that still has room (ties by lowest rank). Deterministic for equal inputs.
//!
//! This module knows costs and ranks only; which documents form a micro-batch is
//! [`crate::packing`]'s business and the tensors are [`crate::batch`]'s.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::CoreError;

/// How much work a micro-batch is, as a sum over its documents.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum CostModel {
    /// A document of `L` tokens costs `L`: balances tokens per rank.
    Tokens,
    /// A document of `L` tokens costs `L + L² / (6 · hidden_size)`: the per-token linear
    /// layers plus causal attention's quadratic term, relative to the linear cost of one
    /// token. Long documents weigh more than their token count.
    Flops { hidden_size: u32 },
}

impl CostModel {
    /// The model of that name: `"tokens"` (no `hidden_size`) or `"flops"` (needs a
    /// positive `hidden_size`).
    pub fn parse(name: &str, hidden_size: Option<i64>) -> Result<Self, CoreError> {
        match (name, hidden_size) {
            ("tokens", None) => Ok(CostModel::Tokens),
            ("tokens", Some(h)) => Err(CoreError::InvalidArgument(format!(
                "hidden_size ({h}) only applies to cost=\"flops\"; drop it or use cost=\"flops\""
            ))),
            ("flops", Some(h)) if h > 0 && h <= i64::from(u32::MAX) => Ok(CostModel::Flops { hidden_size: h as u32 }),
            ("flops", Some(h)) => {
                Err(CoreError::InvalidArgument(format!("hidden_size must be in 1..={}, got {h}", u32::MAX)))
            }
            ("flops", None) => Err(CoreError::InvalidArgument("cost=\"flops\" needs hidden_size".to_string())),
            (other, _) => Err(CoreError::InvalidArgument(format!(
                "unknown cost model {other:?}; expected \"tokens\" or \"flops\""
            ))),
        }
    }

    /// Cost of one document of `length` tokens.
    pub fn doc_cost(&self, length: usize) -> f64 {
        let l = length as f64;
        match *self {
            CostModel::Tokens => l,
            CostModel::Flops { hidden_size } => l + l * l / (6.0 * f64::from(hidden_size)),
        }
    }
}

/// Where each micro-batch goes: `slot[b] = rank * micro_batches_per_rank + index`, so
/// sorting micro-batches by slot orders them by (rank, index within rank). Slots that
/// no micro-batch takes are the padding micro-batches, always the last of their rank.
#[derive(Debug, Clone, PartialEq)]
pub struct RankAssignment {
    /// Micro-batches every rank steps through (real and padding).
    pub micro_batches_per_rank: usize,
    /// Slot of each input micro-batch.  # [num_bins]
    pub slot: Vec<usize>,
    /// Summed cost per rank.  # [num_ranks]
    pub loads: Vec<f64>,
}

/// Heap entry: the least-loaded rank pops first, lowest rank on ties.
#[derive(PartialEq)]
struct RankLoad {
    load: f64,
    rank: usize,
}

impl Eq for RankLoad {}

impl Ord for RankLoad {
    fn cmp(&self, other: &Self) -> Ordering {
        self.load.total_cmp(&other.load).then(self.rank.cmp(&other.rank))
    }
}

impl PartialOrd for RankLoad {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Assign micro-batches of the given `costs` to `num_ranks` ranks, each rank getting
/// `ceil(num_bins / num_ranks)` slots, longest processing time first (see the module
/// docs). Within a rank, micro-batches are ordered costliest first, so the peak memory
/// of a step shows on its first micro-batch.
pub fn assign_to_ranks(costs: &[f64], num_ranks: usize) -> Result<RankAssignment, CoreError> {
    if num_ranks == 0 {
        return Err(CoreError::InvalidArgument("num_ranks must be at least 1, got 0".to_string()));
    }
    if let Some((bin, cost)) = costs.iter().enumerate().find(|(_, c)| !(c.is_finite() && **c >= 0.0)) {
        return Err(CoreError::InvalidArgument(format!(
            "micro-batch {bin} has cost {cost}; costs must be finite and non-negative"
        )));
    }
    let per_rank = costs.len().div_ceil(num_ranks);
    let mut order: Vec<usize> = (0..costs.len()).collect();
    order.sort_by(|&a, &b| costs[b].total_cmp(&costs[a]).then(a.cmp(&b)));
    let mut heap: BinaryHeap<Reverse<RankLoad>> =
        (0..num_ranks).map(|rank| Reverse(RankLoad { load: 0.0, rank })).collect();
    let mut filled = vec![0usize; num_ranks];
    let mut loads = vec![0.0f64; num_ranks];
    let mut slot = vec![0usize; costs.len()];
    for bin in order {
        let Reverse(RankLoad { load, rank }) =
            heap.pop().expect("ranks * per_rank >= bins, so a rank with room remains");
        slot[bin] = rank * per_rank + filled[rank];
        filled[rank] += 1;
        loads[rank] = load + costs[bin];
        if filled[rank] < per_rank {
            heap.push(Reverse(RankLoad { load: loads[rank], rank }));
        }
    }
    Ok(RankAssignment { micro_batches_per_rank: per_rank, slot, loads })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cost_model_parse_checks_names_and_hidden_size() {
        assert_eq!(CostModel::parse("tokens", None), Ok(CostModel::Tokens));
        assert_eq!(CostModel::parse("flops", Some(4096)), Ok(CostModel::Flops { hidden_size: 4096 }));
        for (name, hidden) in
            [("flops", None), ("flops", Some(0)), ("flops", Some(-1)), ("tokens", Some(8)), ("Tokens", None)]
        {
            assert!(matches!(CostModel::parse(name, hidden), Err(CoreError::InvalidArgument(_))), "{name} {hidden:?}");
        }
    }

    #[test]
    fn flops_cost_grows_quadratically() {
        let flops = CostModel::Flops { hidden_size: 1 };
        assert_eq!(flops.doc_cost(6), 6.0 + 6.0);
        assert_eq!(CostModel::Tokens.doc_cost(6), 6.0);
        // one document of 2L costs more than two of L under flops, the same under tokens
        assert!(flops.doc_cost(2000) > 2.0 * flops.doc_cost(1000));
    }

    #[test]
    fn assign_known_example() {
        // costs 9, 7, 6, 5, 1 on 2 ranks, 3 slots each:
        // 9 -> r0, 7 -> r1, 6 -> r1 (7 < 9), 5 -> r0 (9 < 13), 1 -> r1 (13 < 14)
        let a = assign_to_ranks(&[5.0, 9.0, 1.0, 7.0, 6.0], 2).unwrap();
        assert_eq!(a.micro_batches_per_rank, 3);
        assert_eq!(a.slot, vec![1, 0, 5, 3, 4]);
        assert_eq!(a.loads, vec![14.0, 14.0]);
    }

    #[test]
    fn assign_respects_room_before_load() {
        // one huge micro-batch: the other rank must still stop at per_rank slots
        let a = assign_to_ranks(&[100.0, 1.0, 1.0, 1.0], 2).unwrap();
        assert_eq!(a.micro_batches_per_rank, 2);
        let ranks: Vec<usize> = a.slot.iter().map(|s| s / 2).collect();
        assert_eq!(ranks, vec![0, 1, 1, 0]);
    }

    #[test]
    fn assign_rejects_bad_input() {
        assert!(matches!(assign_to_ranks(&[1.0], 0), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(assign_to_ranks(&[1.0, f64::NAN], 2), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(assign_to_ranks(&[-1.0], 2), Err(CoreError::InvalidArgument(_))));
    }

    #[test]
    fn assign_no_bins_gives_no_slots() {
        let a = assign_to_ranks(&[], 4).unwrap();
        assert_eq!(a.micro_batches_per_rank, 0);
        assert!(a.slot.is_empty());
    }

    proptest! {
        #[test]
        fn assign_slots_are_distinct_and_balanced(
            costs in prop::collection::vec(0.0f64..1000.0, 0..200),
            num_ranks in 1usize..17,
        ) {
            let a = assign_to_ranks(&costs, num_ranks).unwrap();
            let per_rank = a.micro_batches_per_rank;
            prop_assert_eq!(per_rank, costs.len().div_ceil(num_ranks));
            let mut seen = vec![false; per_rank * num_ranks];
            let mut count = vec![0usize; num_ranks];
            for &s in &a.slot {
                prop_assert!(!seen[s]);
                seen[s] = true;
                count[s / per_rank] += 1;
            }
            // padding slots are the tail of each rank
            for rank in 0..num_ranks {
                let row = &seen[rank * per_rank..(rank + 1) * per_rank];
                prop_assert!(row.iter().take(count[rank]).all(|&x| x));
            }
            // list-scheduling bound: max load <= ideal + max cost * (1 - 1/R)
            let total: f64 = costs.iter().sum();
            let max_cost = costs.iter().copied().fold(0.0, f64::max);
            let max_load = a.loads.iter().copied().fold(0.0, f64::max);
            let bound = total / num_ranks as f64 + max_cost * (1.0 - 1.0 / num_ranks as f64);
            prop_assert!(max_load <= bound * (1.0 + 1e-12) + 1e-9, "{} > {}", max_load, bound);
        }
    }
}
