//! A loaded `tokenizer.json` (HF tokenizers, the same code the Python package runs) with
//! the lookups the renderers need.

use std::path::Path;

use crate::{CoreError, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Number of ids the tokenizer can produce (base vocabulary + added tokens).
    pub vocab_size: usize,
}

/// Ids and byte offsets of an encoded text.
pub struct Encoded {
    pub ids: Vec<u32>,
    /// `(start, end)` byte offsets of each token in the input text.
    pub offsets: Vec<(usize, usize)>,
}

impl Tokenizer {
    /// Load `tokenizer.json` (or a folder containing it).
    pub fn from_path(path: &Path) -> Result<Tokenizer> {
        let file = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
        if !file.is_file() {
            return Err(CoreError::Tokenizer(format!("{} does not exist", file.display())));
        }
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| CoreError::Tokenizer(format!("{}: {e}", file.display())))?;
        Ok(Tokenizer::from_tokenizer(inner))
    }

    /// Load from the JSON text of a `tokenizer.json`.
    pub fn from_json(json: &str) -> Result<Tokenizer> {
        let inner: tokenizers::Tokenizer =
            json.parse().map_err(|e| CoreError::Tokenizer(format!("invalid tokenizer.json: {e}")))?;
        Ok(Tokenizer::from_tokenizer(inner))
    }

    fn from_tokenizer(inner: tokenizers::Tokenizer) -> Tokenizer {
        let added_max = inner.get_added_tokens_decoder().keys().max().map_or(0, |&m| m as usize + 1);
        let vocab_size = inner.get_vocab_size(true).max(added_max);
        Tokenizer { inner, vocab_size }
    }

    /// Encode `text` as `tokenizer(text, add_special_tokens=False)` does.
    pub fn encode(&self, text: &str) -> Result<Encoded> {
        let enc = self.inner.encode(text, false).map_err(|e| CoreError::Tokenizer(format!("encode failed: {e}")))?;
        Ok(Encoded { ids: enc.get_ids().to_vec(), offsets: enc.get_offsets().to_vec() })
    }

    /// Ids only (no offsets).
    pub fn encode_ids(&self, text: &str) -> Result<Vec<u32>> {
        let enc =
            self.inner.encode_fast(text, false).map_err(|e| CoreError::Tokenizer(format!("encode failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Id of a token given by its text (vocabulary or added token).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Text of a token id (vocabulary or added token).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Ids of the added tokens (special or not): the tokenizer splits text at them
    /// before anything else, so a token boundary always falls on each side of one.
    pub fn added_token_ids(&self) -> Vec<u32> {
        self.inner.get_added_tokens_decoder().keys().copied().collect()
    }

    /// Decode ids to text, keeping special tokens (so they stay visible).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| CoreError::Tokenizer(format!("decode failed: {e}")))
    }

    /// Check every id is inside the vocabulary.
    pub fn check_ids(&self, ids: &[i64]) -> Result<Vec<u32>> {
        ids.iter()
            .enumerate()
            .map(|(position, &id)| {
                if id < 0 || id as usize >= self.vocab_size {
                    Err(CoreError::TokenOutOfVocab { position, id, vocab_size: self.vocab_size })
                } else {
                    Ok(id as u32)
                }
            })
            .collect()
    }
}
