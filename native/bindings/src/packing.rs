//! Bindings of `treadle_core::{packing, balance, batch}`: first-fit bin packing, and
//! `pack` (samples into balanced micro-batch tensors) with its `PackedBatch` result.
//!
//! Inputs are numpy arrays of one exact dtype each: contiguous ones are borrowed,
//! strided or unaligned ones are gathered once. Outputs are numpy arrays that own the
//! Rust buffers (no copy) and are read-only.

use std::borrow::Cow;

use numpy::ndarray::{Array2, Dimension, Ix1};
use numpy::{
    Element, IntoPyArray, PyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray, PyReadonlyArray1,
    PyReadonlyArrayDyn, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PySlice;
use treadle_core::balance::CostModel;
use treadle_core::batch::{self, PackConfig, SampleLayout, Samples, Truncation};
use treadle_core::CoreError;

use crate::errors::to_py_err;

/// first_fit_decreasing(lengths, seq_len)
/// --
///
/// Bin index of every sample when packing `lengths` (int64, 1-D) into bins of `seq_len`
/// tokens, first fit in decreasing length order. Returns a uint32 array of len(lengths).
#[pyfunction]
fn first_fit_decreasing<'py>(
    py: Python<'py>,
    lengths: PyReadonlyArray1<'py, i64>,
    seq_len: i64,
) -> PyResult<Bound<'py, PyArray1<u32>>> {
    // contiguous arrays are borrowed as they are; strided or unaligned ones are gathered once
    let lengths = elements(&lengths)?;
    let bins = py.detach(|| treadle_core::packing::first_fit_decreasing(&lengths, seq_len)).map_err(to_py_err)?;
    Ok(bins.into_pyarray(py))
}

// --- input conversion ------------------------------------------------------------------------

/// `"float64 array of shape (3,)"`, or the Python type name for a non-array.
fn describe(obj: &Bound<'_, PyAny>) -> String {
    match obj.cast::<PyUntypedArray>() {
        Ok(arr) => {
            let dtype = arr.dtype().str().map(|s| s.to_string()).unwrap_or_else(|_| "?".to_string());
            format!("{dtype} array of shape {:?}", arr.shape())
        }
        Err(_) => obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".to_string()),
    }
}

/// `obj` as a read-only numpy array of element `T`, or a TypeError naming the argument.
fn array<'py, T: Element, D: Dimension>(
    name: &str,
    dtype: &str,
    obj: &Bound<'py, PyAny>,
) -> PyResult<PyReadonlyArray<'py, T, D>> {
    obj.extract::<PyReadonlyArray<'py, T, D>>().map_err(|_| {
        let ndim = D::NDIM.map_or_else(|| "numpy array".to_string(), |n| format!("{n}-D numpy array"));
        PyTypeError::new_err(format!("{name} must be a {ndim} of {dtype}, got {}", describe(obj)))
    })
}

/// The array's elements in logical (C) order: borrowed when C-contiguous and aligned,
/// else gathered once (an unaligned array, e.g. `np.frombuffer` at an odd offset, is
/// copied by numpy first, since Rust may not read it in place). `as_slice` alone would
/// also hand out Fortran-ordered memory, in the wrong order.
fn elements<'a, T: Element + Copy, D: Dimension>(arr: &'a PyReadonlyArray<'_, T, D>) -> PyResult<Cow<'a, [T]>> {
    if arr.is_c_contiguous() {
        if let Ok(slice) = arr.as_slice() {
            return Ok(Cow::Borrowed(slice));
        }
    }
    if arr.is_aligned() {
        return Ok(Cow::Owned(arr.as_array().iter().copied().collect()));
    }
    let copy = arr.call_method0("copy")?;
    let copy = copy.extract::<PyReadonlyArray<'_, T, D>>()?;
    let slice = copy.as_slice().map_err(|_| PyValueError::new_err("numpy returned an unaligned copy"))?;
    Ok(Cow::Owned(slice.to_vec()))
}

// --- output conversion -----------------------------------------------------------------------

/// A read-only numpy array owning `v` (no copy).
fn frozen1<T: Element>(py: Python<'_>, v: Vec<T>) -> PyResult<Py<PyArray1<T>>> {
    let arr = PyArray1::from_vec(py, v);
    arr.try_readwrite().map_err(|e| PyValueError::new_err(e.to_string()))?.make_nonwriteable();
    Ok(arr.unbind())
}

/// A read-only `[rows, cols]` numpy array owning `v` (no copy).
fn frozen2<T: Element>(py: Python<'_>, v: Vec<T>, rows: usize, cols: usize) -> PyResult<Py<PyArray2<T>>> {
    let v = Array2::from_shape_vec((rows, cols), v).map_err(|e| PyValueError::new_err(e.to_string()))?;
    let arr = PyArray::from_owned_array(py, v);
    arr.try_readwrite().map_err(|e| PyValueError::new_err(e.to_string()))?.make_nonwriteable();
    Ok(arr.unbind())
}

// --- pack ------------------------------------------------------------------------------------

/// Every micro-batch of one trainer step, made by `pack`. Micro-batch `m` belongs to
/// rank `rank[m]` at position `index[m]`; micro-batches are ordered by (rank, index)
/// and every rank has `micro_batches_per_rank` of them, the last ones possibly padding
/// (zero documents). All arrays are read-only numpy arrays owned by this object.
#[pyclass(frozen, module = "treadle_native._core", name = "PackedBatch")]
struct PackedBatch {
    /// int32 [num_micro_batches, seq_len]: token ids, pad_token_id on padding.
    #[pyo3(get)]
    input_ids: Py<PyArray2<i32>>,
    /// int32 [num_micro_batches, seq_len]: 0 at each document start, counting up; 0 on padding.
    #[pyo3(get)]
    position_ids: Py<PyArray2<i32>>,
    /// uint8 [num_micro_batches, seq_len]: 1 where the loss applies.
    #[pyo3(get)]
    loss_mask: Py<PyArray2<u8>>,
    /// float32 [num_micro_batches, seq_len]: advantage, 0 where loss_mask = 0.
    #[pyo3(get)]
    advantages: Py<PyArray2<f32>>,
    /// float32 [num_micro_batches, seq_len]: sampling logprob, 0 where loss_mask = 0.
    #[pyo3(get)]
    behaviour_logprobs: Py<PyArray2<f32>>,
    /// int32 [num_micro_batches, seq_len]: sampling policy version as given; -1 on padding.
    #[pyo3(get)]
    policy_versions: Py<PyArray2<i32>>,
    /// int32 [num_micro_batches + num_samples]: document boundaries of every micro-batch,
    /// concatenated; micro-batch m's run from 0 to num_tokens_used[m].
    #[pyo3(get)]
    cu_seqlens: Py<PyArray1<i32>>,
    /// int64 [num_micro_batches + 1]: micro-batch m's cu_seqlens are
    /// cu_seqlens[cu_seqlens_offsets[m]:cu_seqlens_offsets[m + 1]].
    #[pyo3(get)]
    cu_seqlens_offsets: Py<PyArray1<i64>>,
    /// int32 [num_samples]: the sample of each document, micro-batch by micro-batch.
    #[pyo3(get)]
    sample_index: Py<PyArray1<i32>>,
    /// int64 [num_micro_batches + 1]: micro-batch m's documents are
    /// sample_index[sample_index_offsets[m]:sample_index_offsets[m + 1]].
    #[pyo3(get)]
    sample_index_offsets: Py<PyArray1<i64>>,
    /// int32 [num_micro_batches]: data-parallel rank of each micro-batch.
    #[pyo3(get)]
    rank: Py<PyArray1<i32>>,
    /// int32 [num_micro_batches]: position of each micro-batch among its rank's.
    #[pyo3(get)]
    index: Py<PyArray1<i32>>,
    /// int32 [num_micro_batches]: documents per micro-batch, 0 for padding micro-batches.
    #[pyo3(get)]
    num_docs: Py<PyArray1<i32>>,
    /// int32 [num_micro_batches]: non-padding tokens per micro-batch.
    #[pyo3(get)]
    num_tokens_used: Py<PyArray1<i32>>,
    /// int32 [num_micro_batches]: tokens with loss_mask = 1 per micro-batch.
    #[pyo3(get)]
    num_loss_tokens: Py<PyArray1<i32>>,
    /// int64 [num_samples]: micro-batch holding each sample.
    #[pyo3(get)]
    sample_micro_batch: Py<PyArray1<i64>>,
    /// int64 [num_samples]: token offset of each sample inside its micro-batch.
    #[pyo3(get)]
    sample_offset: Py<PyArray1<i64>>,
    /// int64 [num_samples]: tokens kept of each sample (after truncation).
    #[pyo3(get)]
    sample_num_tokens: Py<PyArray1<i64>>,
    /// bool [num_samples]: whether each sample was cut to seq_len.
    #[pyo3(get)]
    sample_truncated: Py<PyArray1<bool>>,
    /// int64 [num_samples]: tokens removed from each sample by truncation, 0 if none.
    #[pyo3(get)]
    sample_num_tokens_dropped: Py<PyArray1<i64>>,
    /// Tokens per micro-batch.
    #[pyo3(get)]
    seq_len: usize,
    /// Data-parallel ranks the batch was packed for.
    #[pyo3(get)]
    num_ranks: usize,
    /// Micro-batches over all ranks, padding included.
    #[pyo3(get)]
    num_micro_batches: usize,
    /// Micro-batches of every rank (the same on each).
    #[pyo3(get)]
    micro_batches_per_rank: usize,
    /// Samples packed.
    #[pyo3(get)]
    num_samples: usize,
    layout: SampleLayout,
    parallel: bool,
}

impl PackedBatch {
    fn new(py: Python<'_>, b: batch::PackedBatch, parallel: bool) -> PyResult<Self> {
        let (m, n) = (b.num_micro_batches(), b.seq_len);
        let layout = b.samples.clone();
        let s = b.samples;
        Ok(PackedBatch {
            input_ids: frozen2(py, b.input_ids, m, n)?,
            position_ids: frozen2(py, b.position_ids, m, n)?,
            loss_mask: frozen2(py, b.loss_mask, m, n)?,
            advantages: frozen2(py, b.advantages, m, n)?,
            behaviour_logprobs: frozen2(py, b.behaviour_logprobs, m, n)?,
            policy_versions: frozen2(py, b.policy_versions, m, n)?,
            cu_seqlens: frozen1(py, b.cu_seqlens)?,
            cu_seqlens_offsets: frozen1(py, b.cu_seqlens_offsets)?,
            sample_index: frozen1(py, b.sample_index)?,
            sample_index_offsets: frozen1(py, b.sample_index_offsets)?,
            rank: frozen1(py, b.rank)?,
            index: frozen1(py, b.index)?,
            num_docs: frozen1(py, b.num_docs)?,
            num_tokens_used: frozen1(py, b.num_tokens_used)?,
            num_loss_tokens: frozen1(py, b.num_loss_tokens)?,
            num_samples: s.micro_batch.len(),
            sample_micro_batch: frozen1(py, s.micro_batch)?,
            sample_offset: frozen1(py, s.offset)?,
            sample_num_tokens: frozen1(py, s.num_tokens)?,
            sample_truncated: frozen1(py, s.truncated)?,
            sample_num_tokens_dropped: frozen1(py, s.num_tokens_dropped)?,
            seq_len: n,
            num_ranks: b.num_ranks,
            num_micro_batches: m,
            micro_batches_per_rank: b.micro_batches_per_rank,
            layout,
            parallel,
        })
    }

    /// `m` as a micro-batch id, or an error naming the range.
    fn micro_batch_id(&self, m: i64) -> PyResult<usize> {
        match usize::try_from(m) {
            Ok(m) if m < self.num_micro_batches => Ok(m),
            _ => Err(to_py_err(CoreError::InvalidArgument(format!(
                "micro-batch {m} is out of range for {} micro-batches",
                self.num_micro_batches
            )))),
        }
    }

    /// `flat[offsets[m]:offsets[m + 1]]` as a numpy view.
    fn ragged<'py>(
        py: Python<'py>,
        flat: &Py<PyArray1<i32>>,
        offsets: &Py<PyArray1<i64>>,
        m: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let offsets = offsets.bind(py).try_readonly().map_err(|e| PyValueError::new_err(e.to_string()))?;
        let offsets = offsets.as_slice().map_err(|e| PyValueError::new_err(e.to_string()))?;
        let slice = PySlice::new(py, offsets[m] as isize, offsets[m + 1] as isize, 1);
        flat.bind(py).get_item(slice)
    }

    fn unpack_as<'py, T: Element + Copy + Default + Send + Sync>(
        &self,
        py: Python<'py>,
        values: &PyReadonlyArrayDyn<'py, T>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let shape = values.shape();
        if shape != [self.num_micro_batches, self.seq_len] {
            return Err(to_py_err(CoreError::LengthMismatch {
                what: format!(
                    "values of shape {shape:?} (must be [num_micro_batches, seq_len] = [{}, {}])",
                    self.num_micro_batches, self.seq_len
                ),
                expected: self.num_micro_batches * self.seq_len,
                got: values.len(),
            }));
        }
        let values = elements(values)?;
        let out = py.detach(|| self.layout.unpack(&values, self.parallel)).map_err(to_py_err)?;
        Ok(out.into_pyarray(py).into_any())
    }
}

#[pymethods]
impl PackedBatch {
    /// rank_micro_batches($self, rank)
    /// --
    ///
    /// Ids (int64) of the micro-batches of `rank`, in the order the rank steps through them.
    fn rank_micro_batches<'py>(&self, py: Python<'py>, rank: i64) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let per_rank = self.micro_batches_per_rank as i64;
        if rank < 0 || rank >= self.num_ranks as i64 {
            return Err(to_py_err(CoreError::InvalidArgument(format!(
                "rank {rank} is out of range for {} ranks",
                self.num_ranks
            ))));
        }
        Ok(PyArray1::from_vec(py, (rank * per_rank..(rank + 1) * per_rank).collect()))
    }

    /// micro_batch_cu_seqlens($self, micro_batch)
    /// --
    ///
    /// cu_seqlens (int32 [num_docs + 1]) of one micro-batch, a read-only view.
    fn micro_batch_cu_seqlens<'py>(&self, py: Python<'py>, micro_batch: i64) -> PyResult<Bound<'py, PyAny>> {
        let m = self.micro_batch_id(micro_batch)?;
        Self::ragged(py, &self.cu_seqlens, &self.cu_seqlens_offsets, m)
    }

    /// micro_batch_sample_index($self, micro_batch)
    /// --
    ///
    /// sample_index (int32 [num_docs]) of one micro-batch, a read-only view.
    fn micro_batch_sample_index<'py>(&self, py: Python<'py>, micro_batch: i64) -> PyResult<Bound<'py, PyAny>> {
        let m = self.micro_batch_id(micro_batch)?;
        Self::ragged(py, &self.sample_index, &self.sample_index_offsets, m)
    }

    /// unpack($self, values)
    /// --
    ///
    /// Per-token `values` laid out like this batch ([num_micro_batches, seq_len]; float32,
    /// float64, int32, int64 or uint8), e.g. the trainer's logprobs, back per sample:
    /// returns `(flat, lengths)` where `flat` holds the kept tokens of sample 0, then of
    /// sample 1, ... (same dtype as `values`) and `lengths` is `sample_num_tokens`.
    /// Padding is dropped. A wrong shape raises ShapeError, another dtype TypeError.
    fn unpack<'py>(
        &self,
        py: Python<'py>,
        values: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyAny>, Py<PyArray1<i64>>)> {
        let flat = if let Ok(v) = values.extract::<PyReadonlyArrayDyn<'py, f32>>() {
            self.unpack_as(py, &v)?
        } else if let Ok(v) = values.extract::<PyReadonlyArrayDyn<'py, f64>>() {
            self.unpack_as(py, &v)?
        } else if let Ok(v) = values.extract::<PyReadonlyArrayDyn<'py, i32>>() {
            self.unpack_as(py, &v)?
        } else if let Ok(v) = values.extract::<PyReadonlyArrayDyn<'py, i64>>() {
            self.unpack_as(py, &v)?
        } else if let Ok(v) = values.extract::<PyReadonlyArrayDyn<'py, u8>>() {
            self.unpack_as(py, &v)?
        } else {
            return Err(PyTypeError::new_err(format!(
                "values must be a numpy array of float32, float64, int32, int64 or uint8, got {}",
                describe(values)
            )));
        };
        Ok((flat, self.sample_num_tokens.clone_ref(py)))
    }

    fn __repr__(&self) -> String {
        format!(
            "PackedBatch(num_samples={}, num_micro_batches={}, num_ranks={}, micro_batches_per_rank={}, seq_len={})",
            self.num_samples, self.num_micro_batches, self.num_ranks, self.micro_batches_per_rank, self.seq_len
        )
    }
}

/// pack(lengths, token_ids, loss_mask, advantages, behaviour_logprobs, policy_versions, *, seq_len, num_ranks=1, cost="tokens", hidden_size=None, truncation="right", pad_token_id=0, parallel=True)
/// --
///
/// Pack samples into micro-batches of `seq_len` tokens balanced over `num_ranks`
/// data-parallel ranks, with every per-token tensor the loss reads (the MicroBatch
/// layout of batch.proto). Samples are given flat: sample i holds the next lengths[i]
/// entries of each per-token array.
///
/// lengths: int64 [S], each >= 1. token_ids: int32 [T], T = sum(lengths).
/// loss_mask: uint8 [T], 0 or 1. advantages: float32, [T] per token or [S] per sample
/// (broadcast). behaviour_logprobs: float32 [T]. policy_versions: int32 [T].
/// advantages and behaviour_logprobs must be finite where loss_mask = 1; elsewhere they
/// are written as 0.
///
/// Samples longer than seq_len keep their first seq_len tokens (truncation="right",
/// flagged in sample_truncated) or raise SequenceTooLongError (truncation="error").
/// Micro-batches come from first fit decreasing and go to ranks longest-processing-time
/// first by cost: "tokens" (document length) or "flops" (L + L^2 / (6 * hidden_size),
/// needs hidden_size). Every rank gets the same number of micro-batches, padded with
/// empty ones. parallel=False does all the work on the calling thread. The result holds
/// 22 bytes per token slot (num_micro_batches * seq_len).
///
/// Raises TypeError for a wrong dtype or dimensionality, ShapeError for arrays whose
/// lengths disagree, SequenceTooLongError, and TreadleNativeError (a ValueError) for any
/// other bad argument or value.
#[pyfunction]
#[pyo3(signature = (
    lengths, token_ids, loss_mask, advantages, behaviour_logprobs, policy_versions, *,
    seq_len, num_ranks=1, cost="tokens", hidden_size=None, truncation="right", pad_token_id=0, parallel=true,
))]
#[allow(clippy::too_many_arguments)]
fn pack(
    py: Python<'_>,
    lengths: &Bound<'_, PyAny>,
    token_ids: &Bound<'_, PyAny>,
    loss_mask: &Bound<'_, PyAny>,
    advantages: &Bound<'_, PyAny>,
    behaviour_logprobs: &Bound<'_, PyAny>,
    policy_versions: &Bound<'_, PyAny>,
    seq_len: i64,
    num_ranks: i64,
    cost: &str,
    hidden_size: Option<i64>,
    truncation: &str,
    pad_token_id: i32,
    parallel: bool,
) -> PyResult<PackedBatch> {
    let config = PackConfig {
        seq_len,
        num_ranks,
        cost: CostModel::parse(cost, hidden_size).map_err(to_py_err)?,
        truncation: Truncation::parse(truncation).map_err(to_py_err)?,
        pad_token_id,
        parallel,
    };
    let lengths = array::<i64, Ix1>("lengths", "int64", lengths)?;
    let token_ids = array::<i32, Ix1>("token_ids", "int32", token_ids)?;
    let loss_mask = array::<u8, Ix1>("loss_mask", "uint8", loss_mask)?;
    let advantages = array::<f32, Ix1>("advantages", "float32", advantages)?;
    let behaviour_logprobs = array::<f32, Ix1>("behaviour_logprobs", "float32", behaviour_logprobs)?;
    let policy_versions = array::<i32, Ix1>("policy_versions", "int32", policy_versions)?;
    let (lengths, token_ids, loss_mask) = (elements(&lengths)?, elements(&token_ids)?, elements(&loss_mask)?);
    let (advantages, behaviour_logprobs) = (elements(&advantages)?, elements(&behaviour_logprobs)?);
    let policy_versions = elements(&policy_versions)?;
    let samples = Samples {
        lengths: &lengths,
        token_ids: &token_ids,
        loss_mask: &loss_mask,
        advantages: &advantages,
        behaviour_logprobs: &behaviour_logprobs,
        policy_versions: &policy_versions,
    };
    let packed = py.detach(|| batch::pack(&samples, &config)).map_err(to_py_err)?;
    PackedBatch::new(py, packed, parallel)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(first_fit_decreasing, m)?)?;
    m.add_function(wrap_pyfunction!(pack, m)?)?;
    m.add_class::<PackedBatch>()?;
    Ok(())
}
