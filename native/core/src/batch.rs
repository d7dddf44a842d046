//! Samples into the fixed-length micro-batch tensors of one trainer step, and back.
//!
//! [`pack`] takes S samples as flat, concatenated per-token arrays plus one length per
//! sample, and builds every micro-batch of `seq_len` tokens with the fields of
//! `MicroBatch` in `proto/treadle/proto/v1/batch.proto`:
//!
//! ```text
//!  lengths [S] ─truncate─▶ kept [S] ─first_fit_decreasing─▶ bin [S] ─assign_to_ranks─▶ slot [bins]
//!                                                                                        │
//!  token_ids, loss_mask, advantages,          ┌──────────── rows, ordered by (rank, index) ┘
//!  behaviour_logprobs, policy_versions [T] ───┴─ fill (rayon over rows) ─▶ [M, seq_len] tensors
//!                                                                          cu_seqlens, sample_index
//!                                                                          per-sample layout ─▶ unpack
//! ```
//!
//! Contract and decisions (the Python tests check each):
//! - A sample longer than `seq_len` keeps its first `seq_len` tokens under
//!   [`Truncation::Right`] (flagged, with the count dropped) or fails the whole call with
//!   `SequenceTooLong` under [`Truncation::Error`]. No sample is ever left out.
//! - A zero-length sample is an error (`InvalidArgument`): every document holds at least
//!   one token, so `cu_seqlens` is strictly increasing (what varlen attention kernels
//!   expect) and advantages given per sample cannot be mistaken for per-token ones.
//! - A document never straddles micro-batches. Documents of a micro-batch are in
//!   ascending sample order; `position_ids` restart at 0 for each.
//! - Every rank gets `ceil(bins / num_ranks)` micro-batches; missing ones are padding
//!   micro-batches (zero documents, all padding) placed last on their rank.
//! - On padding: `input_ids` = `pad_token_id`, `policy_versions` = -1, everything else 0.
//!   `advantages` and `behaviour_logprobs` are 0 wherever `loss_mask` is 0, whatever
//!   the input held there (NaN included). Where `loss_mask` is 1 they must be finite,
//!   and `loss_mask` must be 0 or 1: a bad value fails the call naming the sample and
//!   token (only kept tokens are checked; truncated ones never reach the batch).
//! - Memory: 22 bytes per token slot (`num_micro_batches * seq_len`), at most
//!   [`MAX_TOKEN_SLOTS`] slots and [`MAX_RANKS`] ranks; an allocation the system refuses
//!   is an error, not an abort.
//!
//! Not here: choosing `seq_len`, computing advantages, serializing to protobuf.

use std::ops::Range;

use rayon::prelude::*;

mod fill;

use fill::{BadValue, Fill, Row, Unwritten};

use crate::balance::{assign_to_ranks, CostModel};
use crate::packing::first_fit_decreasing;
use crate::CoreError;

/// Most data-parallel ranks a batch is packed for.
pub const MAX_RANKS: usize = 1 << 20;

/// Most token slots (`num_micro_batches * seq_len`) in one batch: flat token offsets fit
/// int32, and the tensors (22 bytes a slot) stay under 48 GB.
pub const MAX_TOKEN_SLOTS: usize = i32::MAX as usize;

/// What to do with a sample longer than `seq_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncation {
    /// Keep the first `seq_len` tokens; the sample is flagged `truncated`.
    Right,
    /// Fail with [`CoreError::SequenceTooLong`].
    Error,
}

impl Truncation {
    /// The policy of that name: `"right"` or `"error"`.
    pub fn parse(name: &str) -> Result<Self, CoreError> {
        match name {
            "right" => Ok(Truncation::Right),
            "error" => Ok(Truncation::Error),
            other => Err(CoreError::InvalidArgument(format!(
                "unknown truncation {other:?}; expected \"right\" or \"error\""
            ))),
        }
    }
}

/// S samples as flat arrays: sample `i` holds tokens `sum(lengths[..i])..sum(lengths[..=i])`.
#[derive(Debug, Clone, Copy)]
pub struct Samples<'a> {
    /// Tokens per sample, each >= 1.  # [S]
    pub lengths: &'a [i64],
    /// Token ids.  # [T], T = sum(lengths)
    pub token_ids: &'a [i32],
    /// 1 where the loss applies (sampled tokens), else 0.  # [T]
    pub loss_mask: &'a [u8],
    /// Per token (# [T]) or per sample (# [S], broadcast over the sample's tokens). The
    /// length decides; the two agree when T == S, since then every sample has one token.
    pub advantages: &'a [f32],
    /// Sampling logprob of each token.  # [T]
    pub behaviour_logprobs: &'a [f32],
    /// Policy version that sampled each token, -1 where not sampled.  # [T]
    pub policy_versions: &'a [i32],
}

/// How to pack: micro-batch length, ranks, cost model, truncation, padding, threads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PackConfig {
    /// Tokens per micro-batch, 1..=i32::MAX.
    pub seq_len: i64,
    /// Data-parallel ranks, 1..=[`MAX_RANKS`].
    pub num_ranks: i64,
    /// Cost of a micro-batch when balancing ranks.
    pub cost: CostModel,
    /// Policy for samples longer than `seq_len`.
    pub truncation: Truncation,
    /// Token id written on padding.
    pub pad_token_id: i32,
    /// Fill micro-batches on rayon's pool; `false` does all the work on the calling thread.
    pub parallel: bool,
}

impl PackConfig {
    /// One rank, token cost, right truncation, pad id 0, parallel.
    pub fn new(seq_len: i64) -> Self {
        PackConfig {
            seq_len,
            num_ranks: 1,
            cost: CostModel::Tokens,
            truncation: Truncation::Right,
            pad_token_id: 0,
            parallel: true,
        }
    }
}

/// Where each sample landed; enough to map per-token outputs back to samples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SampleLayout {
    /// Tokens per micro-batch.
    pub seq_len: usize,
    /// Micro-batches in the batch (real and padding).
    pub num_micro_batches: usize,
    /// Micro-batch holding the sample.  # [S]
    pub micro_batch: Vec<i64>,
    /// Token offset of the sample's document inside its micro-batch.  # [S]
    pub offset: Vec<i64>,
    /// Tokens kept (after truncation).  # [S]
    pub num_tokens: Vec<i64>,
    /// Whether the sample was cut to `seq_len`.  # [S]
    pub truncated: Vec<bool>,
    /// Tokens removed by truncation, 0 if none.  # [S]
    pub num_tokens_dropped: Vec<i64>,
}

/// Every micro-batch of one step. Per-token tensors are row-major `[M, seq_len]` in one
/// buffer each; ragged per-document arrays are flat with `[M + 1]` offsets. Micro-batch
/// `m` is `(rank[m], index[m])` and micro-batches are ordered by (rank, index).
#[derive(Debug, Clone, PartialEq)]
pub struct PackedBatch {
    /// Tokens per micro-batch.
    pub seq_len: usize,
    /// Data-parallel ranks.
    pub num_ranks: usize,
    /// Micro-batches per rank (the same on every rank).
    pub micro_batches_per_rank: usize,
    /// Token ids, `pad_token_id` on padding.  # [M, seq_len]
    pub input_ids: Vec<i32>,
    /// Position in the document, 0 at each document start and on padding.  # [M, seq_len]
    pub position_ids: Vec<i32>,
    /// 1 where the loss applies.  # [M, seq_len]
    pub loss_mask: Vec<u8>,
    /// Advantage, 0 where loss_mask = 0.  # [M, seq_len]
    pub advantages: Vec<f32>,
    /// Sampling logprob, 0 where loss_mask = 0.  # [M, seq_len]
    pub behaviour_logprobs: Vec<f32>,
    /// Sampling policy version, copied; -1 on padding.  # [M, seq_len]
    pub policy_versions: Vec<i32>,
    /// Document boundaries of every micro-batch, concatenated; micro-batch `m` has
    /// `num_docs[m] + 1` entries from 0 to `num_tokens_used[m]`.  # [M + S]
    pub cu_seqlens: Vec<i32>,
    /// Where micro-batch `m`'s cu_seqlens start.  # [M + 1]
    pub cu_seqlens_offsets: Vec<i64>,
    /// Sample of each document, micro-batch by micro-batch.  # [S]
    pub sample_index: Vec<i32>,
    /// Where micro-batch `m`'s documents start in `sample_index`.  # [M + 1]
    pub sample_index_offsets: Vec<i64>,
    /// Rank of each micro-batch.  # [M]
    pub rank: Vec<i32>,
    /// Position of each micro-batch among its rank's.  # [M]
    pub index: Vec<i32>,
    /// Documents per micro-batch (0 for padding micro-batches).  # [M]
    pub num_docs: Vec<i32>,
    /// Non-padding tokens per micro-batch.  # [M]
    pub num_tokens_used: Vec<i32>,
    /// Tokens with loss_mask = 1 per micro-batch.  # [M]
    pub num_loss_tokens: Vec<i32>,
    /// Where each sample went.
    pub samples: SampleLayout,
}

impl PackedBatch {
    /// Micro-batches over all ranks (M).
    pub fn num_micro_batches(&self) -> usize {
        self.samples.num_micro_batches
    }

    /// Ids of the micro-batches of `rank`, in the order the rank steps through them.
    pub fn rank_micro_batches(&self, rank: usize) -> Result<Range<usize>, CoreError> {
        if rank >= self.num_ranks {
            return Err(CoreError::InvalidArgument(format!(
                "rank {rank} is out of range for {} ranks",
                self.num_ranks
            )));
        }
        let per_rank = self.micro_batches_per_rank;
        Ok(rank * per_rank..(rank + 1) * per_rank)
    }

    /// Per-token `values` laid out like the batch (`[M, seq_len]`, row-major) back per
    /// sample; see [`SampleLayout::unpack`].
    pub fn unpack<T: Copy + Default + Send + Sync>(&self, values: &[T], parallel: bool) -> Result<Vec<T>, CoreError> {
        self.samples.unpack(values, parallel)
    }
}

impl SampleLayout {
    /// Per-token `values` laid out like the batch (`[M, seq_len]`, row-major), back in
    /// sample order: the kept tokens of sample 0, then of sample 1, ... in one flat
    /// vector (`num_tokens` gives the split).
    pub fn unpack<T: Copy + Default + Send + Sync>(&self, values: &[T], parallel: bool) -> Result<Vec<T>, CoreError> {
        let expected = self.num_micro_batches.checked_mul(self.seq_len).ok_or_else(too_big)?;
        if values.len() != expected {
            return Err(CoreError::LengthMismatch {
                what: format!("values ([num_micro_batches, seq_len] = [{}, {}])", self.num_micro_batches, self.seq_len),
                expected,
                got: values.len(),
            });
        }
        let num_samples = self.micro_batch.len();
        if self.offset.len() != num_samples || self.num_tokens.len() != num_samples {
            return Err(CoreError::InvalidArgument("sample layout arrays differ in length".to_string()));
        }
        let mut total = 0usize;
        for &n in &self.num_tokens {
            total = usize::try_from(n).ok().and_then(|n| total.checked_add(n)).ok_or_else(too_big)?;
        }
        let mut out = try_filled(total, T::default(), "unpacked values")?;
        let mut dsts: Vec<&mut [T]> = Vec::with_capacity(num_samples);
        let mut rest = out.as_mut_slice();
        for &n in &self.num_tokens {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n as usize);
            dsts.push(head);
            rest = tail;
        }
        let copy = |(i, dst): (usize, &mut [T])| -> Result<(), CoreError> {
            let src = self.source(i, dst.len()).and_then(|r| values.get(r));
            let src =
                src.ok_or_else(|| CoreError::InvalidArgument(format!("sample {i} lies outside the micro-batches")))?;
            dst.copy_from_slice(src);
            Ok(())
        };
        if parallel {
            dsts.into_par_iter().enumerate().try_for_each(copy)?;
        } else {
            dsts.into_iter().enumerate().try_for_each(copy)?;
        }
        Ok(out)
    }

    /// Flat `[M * seq_len]` range of sample `i`'s kept tokens, if it lies in one row.
    fn source(&self, i: usize, len: usize) -> Option<Range<usize>> {
        let row = usize::try_from(self.micro_batch[i]).ok()?;
        let offset = usize::try_from(self.offset[i]).ok()?;
        if row >= self.num_micro_batches || offset.checked_add(len)? > self.seq_len {
            return None;
        }
        let start = row * self.seq_len + offset;
        Some(start..start + len)
    }
}

fn too_big() -> CoreError {
    CoreError::InvalidArgument("sizes overflow the address space".to_string())
}

/// A vector of `len` copies of `value`, or an error (not an abort) if it cannot be allocated.
fn try_filled<T: Copy>(len: usize, value: T, what: &str) -> Result<Vec<T>, CoreError> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        CoreError::InvalidArgument(format!(
            "cannot allocate {what}: {len} elements of {} bytes",
            std::mem::size_of::<T>()
        ))
    })?;
    v.resize(len, value);
    Ok(v)
}

fn check_len(what: &str, expected: usize, got: usize) -> Result<(), CoreError> {
    if expected == got {
        Ok(())
    } else {
        Err(CoreError::LengthMismatch { what: what.to_string(), expected, got })
    }
}

/// Pack `samples` into micro-batches of `config.seq_len` tokens balanced over
/// `config.num_ranks` ranks (see the module docs for the contract).
pub fn pack(samples: &Samples<'_>, config: &PackConfig) -> Result<PackedBatch, CoreError> {
    let PackConfig { seq_len, num_ranks, cost, truncation, pad_token_id, parallel } = *config;
    if seq_len <= 0 {
        return Err(CoreError::InvalidSeqLen { seq_len });
    }
    if seq_len > i64::from(i32::MAX) {
        return Err(CoreError::InvalidArgument(format!(
            "seq_len {seq_len} exceeds {} (position_ids and cu_seqlens are int32)",
            i32::MAX
        )));
    }
    if !(1..=MAX_RANKS as i64).contains(&num_ranks) {
        return Err(CoreError::InvalidArgument(format!("num_ranks must be in 1..={MAX_RANKS}, got {num_ranks}")));
    }
    let (seq_len, num_ranks) = (seq_len as usize, num_ranks as usize);

    // lengths: validate, truncate, and find each sample's first token
    let lengths = samples.lengths;
    let num_samples = lengths.len();
    if num_samples > i32::MAX as usize {
        return Err(CoreError::InvalidArgument(format!(
            "{num_samples} samples exceed {} (sample_index is int32)",
            i32::MAX
        )));
    }
    let mut starts = Vec::with_capacity(num_samples);
    let mut kept = Vec::with_capacity(num_samples);
    let mut kept_i64 = Vec::with_capacity(num_samples);
    let mut num_tokens = 0usize;
    for (index, &length) in lengths.iter().enumerate() {
        if length < 0 {
            return Err(CoreError::NegativeLength { index, length });
        }
        if length == 0 {
            return Err(CoreError::InvalidArgument(format!(
                "sample {index} has length 0; every sample needs at least one token (drop empty samples before packing)"
            )));
        }
        if length > seq_len as i64 && truncation == Truncation::Error {
            return Err(CoreError::SequenceTooLong { index, length, seq_len: seq_len as i64 });
        }
        starts.push(num_tokens);
        num_tokens = usize::try_from(length)
            .ok()
            .and_then(|l| num_tokens.checked_add(l))
            .ok_or_else(|| CoreError::InvalidArgument(format!("the sum of lengths overflows at sample {index}")))?;
        let k = (length as usize).min(seq_len);
        kept.push(k);
        kept_i64.push(k as i64);
    }
    check_len("token_ids (sum of lengths)", num_tokens, samples.token_ids.len())?;
    check_len("loss_mask", num_tokens, samples.loss_mask.len())?;
    let per_sample_advantages = samples.advantages.len() != num_tokens;
    if per_sample_advantages && samples.advantages.len() != num_samples {
        return Err(CoreError::LengthMismatch {
            what: format!("advantages (one per token, or one per sample = {num_samples})"),
            expected: num_tokens,
            got: samples.advantages.len(),
        });
    }
    check_len("behaviour_logprobs", num_tokens, samples.behaviour_logprobs.len())?;
    check_len("policy_versions", num_tokens, samples.policy_versions.len())?;

    // bins, their costs, and their slots (rank * per_rank + index) on the ranks
    let bin = first_fit_decreasing(&kept_i64, seq_len as i64)?;
    let num_bins = bin.iter().map(|&b| b as usize + 1).max().unwrap_or(0);
    let mut bin_cost = vec![0.0f64; num_bins];
    for (&b, &k) in bin.iter().zip(&kept) {
        bin_cost[b as usize] += cost.doc_cost(k);
    }
    let per_rank = num_bins.div_ceil(num_ranks);
    let num_micro_batches = per_rank * num_ranks; // < num_bins + num_ranks, no overflow
    let num_slots = num_micro_batches.checked_mul(seq_len).filter(|&n| n <= MAX_TOKEN_SLOTS).ok_or_else(|| {
        CoreError::InvalidArgument(format!(
            "{num_micro_batches} micro-batches of {seq_len} tokens exceed {MAX_TOKEN_SLOTS} token slots; \
             use fewer ranks or a shorter seq_len"
        ))
    })?;
    let assignment = assign_to_ranks(&bin_cost, num_ranks)?;
    debug_assert_eq!(assignment.micro_batches_per_rank, per_rank);

    // documents per micro-batch (CSR, ascending sample order) and per-sample layout
    let mut num_docs = try_filled(num_micro_batches, 0i32, "num_docs")?;
    let sample_micro_batch: Vec<i64> = bin.iter().map(|&b| assignment.slot[b as usize] as i64).collect();
    for &m in &sample_micro_batch {
        num_docs[m as usize] += 1;
    }
    let mut sample_index_offsets = Vec::with_capacity(num_micro_batches + 1);
    sample_index_offsets.push(0i64);
    for &n in &num_docs {
        sample_index_offsets.push(sample_index_offsets.last().unwrap() + i64::from(n));
    }
    let mut cursor: Vec<i64> = sample_index_offsets[..num_micro_batches].to_vec();
    let mut num_tokens_used = try_filled(num_micro_batches, 0i32, "num_tokens_used")?;
    let mut sample_index = vec![0i32; num_samples];
    let mut sample_offset = vec![0i64; num_samples];
    for (i, &m) in sample_micro_batch.iter().enumerate() {
        let m = m as usize;
        sample_index[cursor[m] as usize] = i as i32;
        cursor[m] += 1;
        sample_offset[i] = i64::from(num_tokens_used[m]);
        num_tokens_used[m] += kept[i] as i32; // fits: first fit never overfills seq_len
    }
    let mut cu_seqlens = Vec::with_capacity(num_micro_batches + num_samples);
    let mut cu_seqlens_offsets = Vec::with_capacity(num_micro_batches + 1);
    for m in 0..num_micro_batches {
        cu_seqlens_offsets.push(cu_seqlens.len() as i64);
        let mut end = 0i32;
        cu_seqlens.push(end);
        for &i in &sample_index[sample_index_offsets[m] as usize..sample_index_offsets[m + 1] as usize] {
            end += kept[i as usize] as i32;
            cu_seqlens.push(end);
        }
    }
    cu_seqlens_offsets.push(cu_seqlens.len() as i64);

    // the [M, seq_len] tensors, one allocation each, written row by row
    let mut input_ids = Unwritten::<i32>::try_new(num_slots, "input_ids")?;
    let mut position_ids = Unwritten::<i32>::try_new(num_slots, "position_ids")?;
    let mut loss_mask = Unwritten::<u8>::try_new(num_slots, "loss_mask")?;
    let mut advantages = Unwritten::<f32>::try_new(num_slots, "advantages")?;
    let mut behaviour_logprobs = Unwritten::<f32>::try_new(num_slots, "behaviour_logprobs")?;
    let mut policy_versions = Unwritten::<i32>::try_new(num_slots, "policy_versions")?;
    let rows: Vec<Row<'_>> = input_ids
        .rows(seq_len)
        .zip(position_ids.rows(seq_len))
        .zip(loss_mask.rows(seq_len))
        .zip(advantages.rows(seq_len))
        .zip(behaviour_logprobs.rows(seq_len))
        .zip(policy_versions.rows(seq_len))
        .map(|(((((input_ids, position_ids), loss_mask), advantages), behaviour_logprobs), policy_versions)| Row {
            input_ids,
            position_ids,
            loss_mask,
            advantages,
            behaviour_logprobs,
            policy_versions,
        })
        .collect();
    debug_assert_eq!(rows.len(), num_micro_batches);
    let fill = Fill {
        samples,
        per_sample_advantages,
        starts: &starts,
        kept: &kept,
        sample_index: &sample_index,
        sample_index_offsets: &sample_index_offsets,
        pad_token_id,
    };
    let filled: Vec<(u64, Option<BadValue>)> = if parallel {
        rows.into_par_iter().enumerate().map(|(m, row)| fill.row(m, row)).collect()
    } else {
        rows.into_iter().enumerate().map(|(m, row)| fill.row(m, row)).collect()
    };
    let mut num_loss_tokens = Vec::with_capacity(num_micro_batches);
    let mut first_bad: Option<BadValue> = None;
    for (num_loss, bad) in filled {
        num_loss_tokens.push(num_loss as i32); // <= seq_len once values are valid
        if let Some(bad) = bad {
            if first_bad.as_ref().is_none_or(|b| bad < *b) {
                first_bad = Some(bad);
            }
        }
    }
    if let Some(BadValue { sample, token, message }) = first_bad {
        return Err(CoreError::InvalidArgument(format!("sample {sample}, token {token}: {message}")));
    }
    // SAFETY: `rows` covered every slot of each tensor (num_micro_batches rows of seq_len),
    // and `Fill::row` wrote each of its row's slots.
    let (input_ids, position_ids, loss_mask, advantages, behaviour_logprobs, policy_versions) = unsafe {
        (
            input_ids.assume_written(),
            position_ids.assume_written(),
            loss_mask.assume_written(),
            advantages.assume_written(),
            behaviour_logprobs.assume_written(),
            policy_versions.assume_written(),
        )
    };

    let rank = (0..num_micro_batches).map(|m| (m / per_rank) as i32).collect();
    let index = (0..num_micro_batches).map(|m| (m % per_rank) as i32).collect();
    let num_tokens_dropped: Vec<i64> = lengths.iter().zip(&kept).map(|(&l, &k)| l - k as i64).collect();
    let truncated = num_tokens_dropped.iter().map(|&d| d > 0).collect();
    Ok(PackedBatch {
        seq_len,
        num_ranks,
        micro_batches_per_rank: per_rank,
        input_ids,
        position_ids,
        loss_mask,
        advantages,
        behaviour_logprobs,
        policy_versions,
        cu_seqlens,
        cu_seqlens_offsets,
        sample_index,
        sample_index_offsets,
        rank,
        index,
        num_docs,
        num_tokens_used,
        num_loss_tokens,
        samples: SampleLayout {
            seq_len,
            num_micro_batches,
            micro_batch: sample_micro_batch,
            offset: sample_offset,
            num_tokens: kept_i64,
            truncated,
            num_tokens_dropped,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Owned inputs for tests: per-sample token ids, masks all 1 unless given.
    struct Owned {
        lengths: Vec<i64>,
        token_ids: Vec<i32>,
        loss_mask: Vec<u8>,
        advantages: Vec<f32>,
        behaviour_logprobs: Vec<f32>,
        policy_versions: Vec<i32>,
    }

    impl Owned {
        /// Sample i has tokens 1000 * (i + 1) + position, so every token is traceable.
        fn new(lengths: &[i64]) -> Self {
            let mut o = Owned {
                lengths: lengths.to_vec(),
                token_ids: vec![],
                loss_mask: vec![],
                advantages: vec![],
                behaviour_logprobs: vec![],
                policy_versions: vec![],
            };
            for (i, &l) in lengths.iter().enumerate() {
                for t in 0..l.max(0) {
                    o.token_ids.push(1000 * (i as i32 + 1) + t as i32);
                    o.loss_mask.push(u8::from(t % 3 != 0));
                    o.advantages.push(i as f32 + 0.5);
                    o.behaviour_logprobs.push(-(t as f32) - 0.25);
                    o.policy_versions.push(if t % 3 != 0 { i as i32 } else { -1 });
                }
            }
            o
        }

        fn samples(&self) -> Samples<'_> {
            Samples {
                lengths: &self.lengths,
                token_ids: &self.token_ids,
                loss_mask: &self.loss_mask,
                advantages: &self.advantages,
                behaviour_logprobs: &self.behaviour_logprobs,
                policy_versions: &self.policy_versions,
            }
        }
    }

    fn config(seq_len: i64, num_ranks: i64) -> PackConfig {
        PackConfig { num_ranks, ..PackConfig::new(seq_len) }
    }

    fn row<T>(v: &[T], seq_len: usize, m: usize) -> &[T] {
        &v[m * seq_len..(m + 1) * seq_len]
    }

    #[test]
    fn pack_known_example() {
        // first fit decreasing: 5 -> bin 0, 3 -> bin 0 (full at 8), 2 -> bin 1
        let o = Owned::new(&[3, 5, 2]);
        let b = pack(&o.samples(), &PackConfig { pad_token_id: 7, ..config(8, 1) }).unwrap();
        assert_eq!(b.num_micro_batches(), 2);
        assert_eq!(row(&b.input_ids, 8, 0), [1000, 1001, 1002, 2000, 2001, 2002, 2003, 2004]);
        assert_eq!(row(&b.position_ids, 8, 0), [0, 1, 2, 0, 1, 2, 3, 4]);
        assert_eq!(row(&b.input_ids, 8, 1), [3000, 3001, 7, 7, 7, 7, 7, 7]);
        assert_eq!(row(&b.position_ids, 8, 1), [0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(row(&b.loss_mask, 8, 1), [0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(row(&b.advantages, 8, 1), [0.0, 2.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(row(&b.behaviour_logprobs, 8, 1), [0.0, -1.25, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(row(&b.policy_versions, 8, 1), [-1, 2, -1, -1, -1, -1, -1, -1]);
        assert_eq!(b.cu_seqlens, [0, 3, 8, 0, 2]);
        assert_eq!(b.cu_seqlens_offsets, [0, 3, 5]);
        assert_eq!(b.sample_index, [0, 1, 2]);
        assert_eq!(b.sample_index_offsets, [0, 2, 3]);
        assert_eq!(b.num_docs, [2, 1]);
        assert_eq!(b.num_tokens_used, [8, 2]);
        assert_eq!(b.num_loss_tokens, [2 + 3, 1]);
        assert_eq!(b.samples.micro_batch, [0, 0, 1]);
        assert_eq!(b.samples.offset, [0, 3, 0]);
    }

    #[test]
    fn pack_right_truncation_keeps_the_head_and_flags_it() {
        let o = Owned::new(&[10, 4]);
        let b = pack(&o.samples(), &config(6, 1)).unwrap();
        assert_eq!(b.samples.num_tokens, [6, 4]);
        assert_eq!(b.samples.truncated, [true, false]);
        assert_eq!(b.samples.num_tokens_dropped, [4, 0]);
        let m = b.samples.micro_batch[0] as usize;
        assert_eq!(row(&b.input_ids, 6, m), [1000, 1001, 1002, 1003, 1004, 1005]);
        assert_eq!(
            b.unpack(&b.input_ids, false).unwrap(),
            [1000, 1001, 1002, 1003, 1004, 1005, 2000, 2001, 2002, 2003]
        );
    }

    #[test]
    fn pack_error_truncation_rejects_overlong() {
        let o = Owned::new(&[3, 7]);
        let c = PackConfig { truncation: Truncation::Error, ..config(6, 1) };
        assert_eq!(pack(&o.samples(), &c), Err(CoreError::SequenceTooLong { index: 1, length: 7, seq_len: 6 }));
    }

    #[test]
    fn pack_rejects_bad_lengths_and_config() {
        let o = Owned::new(&[3, 2]);
        assert_eq!(pack(&o.samples(), &config(0, 1)), Err(CoreError::InvalidSeqLen { seq_len: 0 }));
        assert!(matches!(pack(&o.samples(), &config(1 << 40, 1)), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(pack(&o.samples(), &config(8, 0)), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(pack(&o.samples(), &config(8, -3)), Err(CoreError::InvalidArgument(_))));
        let neg = Owned { lengths: vec![3, -2], ..Owned::new(&[3, 2]) };
        assert_eq!(pack(&neg.samples(), &config(8, 1)), Err(CoreError::NegativeLength { index: 1, length: -2 }));
        let zero = Owned::new(&[3, 0, 2]);
        match pack(&zero.samples(), &config(8, 1)) {
            Err(CoreError::InvalidArgument(msg)) => assert!(msg.contains("sample 1 has length 0"), "{msg}"),
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        // two micro-batches of i32::MAX tokens each: more slots than a batch may hold
        assert!(matches!(pack(&o.samples(), &config(i64::from(i32::MAX), 2)), Err(CoreError::InvalidArgument(_))));
        assert!(matches!(pack(&o.samples(), &config(8, MAX_RANKS as i64 + 1)), Err(CoreError::InvalidArgument(_))));
        let huge = Owned { lengths: vec![i64::MAX, i64::MAX, 2], ..Owned::new(&[3, 2]) };
        assert!(matches!(pack(&huge.samples(), &config(8, 1)), Err(CoreError::InvalidArgument(_))));
    }

    #[test]
    fn pack_names_the_mismatched_array() {
        let o = Owned::new(&[3, 2]);
        let cases: [(&str, Samples<'_>); 5] = [
            ("token_ids (sum of lengths)", Samples { token_ids: &o.token_ids[1..], ..o.samples() }),
            ("loss_mask", Samples { loss_mask: &o.loss_mask[1..], ..o.samples() }),
            (
                "advantages (one per token, or one per sample = 2)",
                Samples { advantages: &o.advantages[1..], ..o.samples() },
            ),
            ("behaviour_logprobs", Samples { behaviour_logprobs: &o.behaviour_logprobs[1..], ..o.samples() }),
            ("policy_versions", Samples { policy_versions: &o.policy_versions[1..], ..o.samples() }),
        ];
        for (what, samples) in cases {
            assert_eq!(
                pack(&samples, &config(8, 1)),
                Err(CoreError::LengthMismatch { what: what.to_string(), expected: 5, got: 4 }),
            );
        }
    }

    #[test]
    fn pack_broadcasts_per_sample_advantages_on_loss_tokens() {
        let o = Owned::new(&[4, 3]);
        let per_sample = [2.0f32, -1.0];
        let b = pack(&Samples { advantages: &per_sample, ..o.samples() }, &config(8, 1)).unwrap();
        let adv = b.unpack(&b.advantages, false).unwrap();
        assert_eq!(adv, [0.0, 2.0, 2.0, 0.0, 0.0, -1.0, -1.0]);
    }

    #[test]
    fn pack_zeroes_nan_off_the_loss_and_rejects_it_on_the_loss() {
        let mut o = Owned::new(&[4, 3]);
        o.advantages[0] = f32::NAN; // loss_mask 0 there
        o.behaviour_logprobs[3] = f32::NEG_INFINITY; // loss_mask 0 there
        let b = pack(&o.samples(), &config(8, 1)).unwrap();
        assert!(b.advantages.iter().chain(&b.behaviour_logprobs).all(|x| x.is_finite()));
        o.advantages[5] = f32::NAN; // sample 1, token 1: a loss token
        o.behaviour_logprobs[6] = f32::INFINITY; // sample 1, token 2: later, not reported
        match pack(&o.samples(), &config(8, 1)) {
            Err(CoreError::InvalidArgument(msg)) => {
                assert!(msg.starts_with("sample 1, token 1: advantage is NaN"), "{msg}")
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn pack_rejects_loss_mask_values_other_than_0_and_1() {
        let mut o = Owned::new(&[4, 3]);
        o.loss_mask[2] = 2;
        match pack(&o.samples(), &PackConfig { parallel: false, ..config(8, 1) }) {
            Err(CoreError::InvalidArgument(msg)) => {
                assert!(msg.starts_with("sample 0, token 2: loss_mask is 2"), "{msg}")
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn pack_pads_every_rank_to_the_same_count() {
        // three full micro-batches on two ranks: one padding micro-batch, last on rank 1
        let o = Owned::new(&[4, 4, 4]);
        let b = pack(&o.samples(), &PackConfig { pad_token_id: 9, ..config(4, 2) }).unwrap();
        assert_eq!((b.num_micro_batches(), b.micro_batches_per_rank), (4, 2));
        assert_eq!(b.rank, [0, 0, 1, 1]);
        assert_eq!(b.index, [0, 1, 0, 1]);
        assert_eq!(b.num_docs, [1, 1, 1, 0]);
        assert_eq!(b.rank_micro_batches(1), Ok(2..4));
        assert!(b.rank_micro_batches(2).is_err());
        assert_eq!(row(&b.input_ids, 4, 3), [9; 4]);
        assert_eq!(row(&b.policy_versions, 4, 3), [-1; 4]);
        assert_eq!(&b.cu_seqlens[b.cu_seqlens_offsets[3] as usize..], [0]);
    }

    #[test]
    fn pack_empty_input_gives_no_micro_batches() {
        let o = Owned::new(&[]);
        let b = pack(&o.samples(), &config(8, 4)).unwrap();
        assert_eq!(b.num_micro_batches(), 0);
        assert!(b.input_ids.is_empty() && b.cu_seqlens.is_empty());
        assert_eq!(b.cu_seqlens_offsets, [0]);
        assert_eq!(b.unpack::<f32>(&[], true).unwrap(), Vec::<f32>::new());
    }

    #[test]
    fn pack_balances_flops_not_tokens_when_asked() {
        // bins [8], [2, 2, 2, 2], [1, 1] on two ranks. Tokens: 8, 8, 2, so the small bin
        // joins rank 0 on the tie. Flops (hidden_size 1): 8 + 64/6 > 4 * (2 + 4/6), so the
        // small bin joins the rank of the four short documents instead.
        let o = Owned::new(&[8, 2, 2, 2, 2, 1, 1]);
        let by_tokens = pack(&o.samples(), &config(8, 2)).unwrap();
        let c = PackConfig { cost: CostModel::Flops { hidden_size: 1 }, ..config(8, 2) };
        let by_flops = pack(&o.samples(), &c).unwrap();
        let rank_of = |b: &PackedBatch, s: usize| b.rank[b.samples.micro_batch[s] as usize];
        assert_eq!(rank_of(&by_tokens, 5), rank_of(&by_tokens, 0));
        assert_eq!(rank_of(&by_flops, 5), rank_of(&by_flops, 1));
        assert_ne!(rank_of(&by_flops, 0), rank_of(&by_flops, 1));
    }

    #[test]
    fn unpack_rejects_the_wrong_shape() {
        let o = Owned::new(&[3, 2]);
        let b = pack(&o.samples(), &config(8, 1)).unwrap();
        assert!(matches!(b.unpack(&[0f32; 7], true), Err(CoreError::LengthMismatch { expected: 8, got: 7, .. })));
    }

    fn lengths_and_config() -> impl Strategy<Value = (Vec<i64>, i64, i64)> {
        (prop::collection::vec(1i64..=48, 0..120), 8i64..=40, 1i64..=5)
    }

    proptest! {
        #[test]
        fn pack_places_every_token_once_in_its_own_document((lengths, seq_len, num_ranks) in lengths_and_config()) {
            let o = Owned::new(&lengths);
            let b = pack(&o.samples(), &config(seq_len, num_ranks)).unwrap();
            let n = seq_len as usize;
            let mut start = 0usize;
            for (i, &l) in lengths.iter().enumerate() {
                let k = (l as usize).min(n);
                prop_assert_eq!(b.samples.num_tokens[i], k as i64);
                prop_assert_eq!(b.samples.truncated[i], l as usize > n);
                prop_assert_eq!(b.samples.num_tokens_dropped[i], l - k as i64);
                let (m, off) = (b.samples.micro_batch[i] as usize, b.samples.offset[i] as usize);
                prop_assert!(off + k <= n);
                let src = start..start + k;
                prop_assert_eq!(&row(&b.input_ids, n, m)[off..off + k], &o.token_ids[src.clone()]);
                prop_assert_eq!(&row(&b.loss_mask, n, m)[off..off + k], &o.loss_mask[src.clone()]);
                prop_assert_eq!(&row(&b.policy_versions, n, m)[off..off + k], &o.policy_versions[src.clone()]);
                let positions: Vec<i32> = (0..k as i32).collect();
                prop_assert_eq!(&row(&b.position_ids, n, m)[off..off + k], &positions[..]);
                // the document of sample i in micro-batch m is exactly [off, off + k)
                let docs = &b.sample_index[b.sample_index_offsets[m] as usize..b.sample_index_offsets[m + 1] as usize];
                let cu = &b.cu_seqlens[b.cu_seqlens_offsets[m] as usize..b.cu_seqlens_offsets[m + 1] as usize];
                let d = docs.iter().position(|&s| s as usize == i).expect("sample listed in its micro-batch");
                prop_assert_eq!((cu[d] as usize, cu[d + 1] as usize), (off, off + k));
                start += l as usize;
            }
            // documents tile each row from 0; the rest is padding
            for m in 0..b.num_micro_batches() {
                let cu = &b.cu_seqlens[b.cu_seqlens_offsets[m] as usize..b.cu_seqlens_offsets[m + 1] as usize];
                prop_assert_eq!(cu[0], 0);
                prop_assert!(cu.windows(2).all(|w| w[0] < w[1]));
                prop_assert_eq!(*cu.last().unwrap(), b.num_tokens_used[m]);
                prop_assert_eq!(cu.len() as i32, b.num_docs[m] + 1);
                let used = b.num_tokens_used[m] as usize;
                prop_assert!(row(&b.input_ids, n, m)[used..].iter().all(|&t| t == 0));
                prop_assert!(row(&b.policy_versions, n, m)[used..].iter().all(|&v| v == -1));
                prop_assert!(row(&b.position_ids, n, m)[used..].iter().all(|&p| p == 0));
                let loss: u32 = row(&b.loss_mask, n, m).iter().map(|&x| u32::from(x)).sum();
                prop_assert_eq!(loss as i32, b.num_loss_tokens[m]);
            }
            // equal counts per rank, ordered by (rank, index)
            prop_assert_eq!(b.num_micro_batches(), b.micro_batches_per_rank * num_ranks as usize);
            for m in 0..b.num_micro_batches() {
                prop_assert_eq!((b.rank[m] as usize, b.index[m] as usize), (m / b.micro_batches_per_rank, m % b.micro_batches_per_rank));
            }
        }

        #[test]
        fn pack_unpack_is_lossless((lengths, seq_len, num_ranks) in lengths_and_config()) {
            let o = Owned::new(&lengths);
            let b = pack(&o.samples(), &config(seq_len, num_ranks)).unwrap();
            let mut kept_ids = vec![];
            let mut kept_masks = vec![];
            let mut start = 0usize;
            for &l in &lengths {
                let k = (l as usize).min(seq_len as usize);
                kept_ids.extend_from_slice(&o.token_ids[start..start + k]);
                kept_masks.extend_from_slice(&o.loss_mask[start..start + k]);
                start += l as usize;
            }
            prop_assert_eq!(b.unpack(&b.input_ids, true).unwrap(), kept_ids);
            prop_assert_eq!(b.unpack(&b.loss_mask, false).unwrap(), kept_masks);
        }

        #[test]
        fn pack_parallel_matches_single_thread((lengths, seq_len, num_ranks) in lengths_and_config(), flops in any::<bool>()) {
            let o = Owned::new(&lengths);
            let cost = if flops { CostModel::Flops { hidden_size: 16 } } else { CostModel::Tokens };
            let c = PackConfig { cost, pad_token_id: 3, ..config(seq_len, num_ranks) };
            let parallel = pack(&o.samples(), &c).unwrap();
            let single = pack(&o.samples(), &PackConfig { parallel: false, ..c }).unwrap();
            prop_assert_eq!(parallel, single);
        }
    }
}
