//! Writing the `[M, seq_len]` tensors of [`super::pack`], one micro-batch (row) at a time:
//! documents copied from the flat inputs, positions counted, advantages and logprobs
//! masked, padding written, and the per-token values checked on the way. Rows are
//! independent, so the caller runs them on rayon's pool or on its own thread.

use std::mem::MaybeUninit;

use super::Samples;
use crate::CoreError;

/// The first bad per-token value found in a row, ordered by (sample, token).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct BadValue {
    pub sample: usize,
    pub token: usize,
    pub message: String,
}

/// A `[M, seq_len]` tensor allocated but not yet written. [`Fill::row`] writes every
/// slot of every row exactly once (documents tile `[0, used)`, padding `[used, seq_len)`),
/// which saves a zeroing pass over the largest buffers of the call and lets the page
/// faults of fresh memory happen on the fill threads.
pub(super) struct Unwritten<T> {
    vec: Vec<T>,
    len: usize,
}

impl<T> Unwritten<T> {
    /// Room for `len` elements, or an error (not an abort) if it cannot be allocated.
    pub fn try_new(len: usize, what: &str) -> Result<Self, CoreError> {
        let mut vec = Vec::new();
        vec.try_reserve_exact(len).map_err(|_| {
            CoreError::InvalidArgument(format!(
                "cannot allocate {what}: {len} elements of {} bytes",
                std::mem::size_of::<T>()
            ))
        })?;
        Ok(Unwritten { vec, len })
    }

    pub fn rows(&mut self, seq_len: usize) -> std::slice::ChunksMut<'_, MaybeUninit<T>> {
        self.vec.spare_capacity_mut()[..self.len].chunks_mut(seq_len)
    }

    /// # Safety
    /// Every element handed out by [`Unwritten::rows`] has been written.
    pub unsafe fn assume_written(mut self) -> Vec<T> {
        // SAFETY: capacity >= len (try_new), and the caller guarantees initialization.
        unsafe { self.vec.set_len(self.len) };
        self.vec
    }
}

/// One micro-batch's slice of every `[M, seq_len]` tensor, not yet written.
pub(super) struct Row<'a> {
    pub input_ids: &'a mut [MaybeUninit<i32>],
    pub position_ids: &'a mut [MaybeUninit<i32>],
    pub loss_mask: &'a mut [MaybeUninit<u8>],
    pub advantages: &'a mut [MaybeUninit<f32>],
    pub behaviour_logprobs: &'a mut [MaybeUninit<f32>],
    pub policy_versions: &'a mut [MaybeUninit<i32>],
}

/// Read-only inputs of the fill, shared by all rows.
pub(super) struct Fill<'a> {
    pub samples: &'a Samples<'a>,
    pub per_sample_advantages: bool,
    pub starts: &'a [usize],
    pub kept: &'a [usize],
    pub sample_index: &'a [i32],
    pub sample_index_offsets: &'a [i64],
    pub pad_token_id: i32,
}

impl Fill<'_> {
    /// Write row `m` in full (documents, then padding); return its loss-token count and
    /// its first bad value, if any.
    pub fn row(&self, m: usize, row: Row<'_>) -> (u64, Option<BadValue>) {
        let docs = &self.sample_index[self.sample_index_offsets[m] as usize..self.sample_index_offsets[m + 1] as usize];
        let s = self.samples;
        let (mut used, mut num_loss, mut max_mask, mut non_finite) = (0usize, 0u64, 0u8, false);
        for &i in docs {
            let i = i as usize;
            let (len, start) = (self.kept[i], self.starts[i]);
            let src = start..start + len;
            let dst = used..used + len;
            let mask = &s.loss_mask[src.clone()];
            let logprobs = &s.behaviour_logprobs[src.clone()];
            write_copy(&mut row.input_ids[dst.clone()], &s.token_ids[src.clone()]);
            write_copy(&mut row.loss_mask[dst.clone()], mask);
            write_copy(&mut row.policy_versions[dst.clone()], &s.policy_versions[src.clone()]);
            for (p, k) in row.position_ids[dst.clone()].iter_mut().zip(0i32..) {
                p.write(k);
            }
            write_masked(&mut row.behaviour_logprobs[dst.clone()], logprobs, mask);
            let doc_loss = mask.iter().map(|&x| u64::from(x)).sum::<u64>();
            max_mask = max_mask.max(mask.iter().fold(0u8, |a, &x| a.max(x)));
            non_finite |= non_finite_on_loss(logprobs, mask);
            if self.per_sample_advantages {
                let a = s.advantages[i];
                for (o, &x) in row.advantages[dst].iter_mut().zip(mask) {
                    o.write(if x != 0 { a } else { 0.0 });
                }
                non_finite |= doc_loss > 0 && !a.is_finite();
            } else {
                let advantages = &s.advantages[src];
                write_masked(&mut row.advantages[dst], advantages, mask);
                non_finite |= non_finite_on_loss(advantages, mask);
            }
            num_loss += doc_loss;
            used += len;
        }
        write_all(&mut row.input_ids[used..], self.pad_token_id);
        write_all(&mut row.position_ids[used..], 0);
        write_all(&mut row.loss_mask[used..], 0);
        write_all(&mut row.advantages[used..], 0.0);
        write_all(&mut row.behaviour_logprobs[used..], 0.0);
        write_all(&mut row.policy_versions[used..], -1);
        let bad = if max_mask > 1 || non_finite { self.first_bad_value(docs) } else { None };
        (num_loss, bad)
    }

    /// Slow path: locate the first bad value among `docs` (ascending sample order).
    fn first_bad_value(&self, docs: &[i32]) -> Option<BadValue> {
        let s = self.samples;
        for &i in docs {
            let i = i as usize;
            for token in 0..self.kept[i] {
                let j = self.starts[i] + token;
                let m = s.loss_mask[j];
                let adv = if self.per_sample_advantages { s.advantages[i] } else { s.advantages[j] };
                let message = if m > 1 {
                    format!("loss_mask is {m}; it must be 0 or 1")
                } else if m == 1 && !adv.is_finite() {
                    format!("advantage is {adv} on a loss token; it must be finite")
                } else if m == 1 && !s.behaviour_logprobs[j].is_finite() {
                    format!("behaviour_logprob is {} on a loss token; it must be finite", s.behaviour_logprobs[j])
                } else {
                    continue;
                };
                return Some(BadValue { sample: i, token, message });
            }
        }
        None
    }
}

// Element loops below are branch-free so that they vectorize.

fn write_copy<T: Copy>(out: &mut [MaybeUninit<T>], src: &[T]) {
    for (o, &v) in out.iter_mut().zip(src) {
        o.write(v);
    }
}

fn write_all<T: Copy>(out: &mut [MaybeUninit<T>], value: T) {
    for o in out {
        o.write(value);
    }
}

/// `out = src where mask != 0, else 0`.
fn write_masked(out: &mut [MaybeUninit<f32>], src: &[f32], mask: &[u8]) {
    for ((o, &v), &m) in out.iter_mut().zip(src).zip(mask) {
        o.write(if m != 0 { v } else { 0.0 });
    }
}

/// Whether a value under a non-zero mask is NaN or infinite.
fn non_finite_on_loss(values: &[f32], mask: &[u8]) -> bool {
    values.iter().zip(mask).fold(false, |acc, (&v, &m)| acc | ((m != 0) & !v.is_finite()))
}
