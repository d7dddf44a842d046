//! A direct encoder for GPT-style byte-level BPE tokenizers (Qwen2/2.5/3, DeepSeek's Qwen
//! distills, Llama 3): the same ids and offsets as tokenizers' `encode`, without its
//! per-byte alignment bookkeeping (most of its time).
//!
//! It is used only for a `tokenizer.json` of exactly this shape, read from the file:
//!
//! - added tokens matched as written (no `lstrip`, `rstrip`, `single_word`, `normalized`),
//!   leftmost-longest, before anything else;
//! - normalizer none or NFC, and then only for texts already in NFC (checked per call:
//!   NFC changes nothing then; other texts go to tokenizers);
//! - pre-tokenizer `Sequence[Split(Regex, Isolated), ByteLevel(no prefix space, no regex)]`:
//!   the regex, compiled by the same Oniguruma with the same options, cuts each stretch
//!   between added tokens into pieces (matches and the gaps between them);
//! - model BPE without dropout, byte fallback, affixes or unknown token needs (every byte
//!   has a token), `ignore_merges` honoured; merges applied as tokenizers' `Word::merge_all`
//!   does (lowest rank first, then leftmost; a queued merge still valid when its pair
//!   still yields the same token);
//! - no truncation or padding; post-processor steps that leave ids and offsets alone when
//!   no special tokens are added (`ByteLevel` without offset trimming, a template holding
//!   the sequence once): Llama 3's.
//!
//! A token's offsets are those of the characters its bytes belong to (a token holding part
//! of a multi-byte character spans the whole character, as in tokenizers). Anything else
//! keeps tokenizers' own encoder. `tokenizer.rs`'s tests compare both on every shared
//! tokenizer and on random texts.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Mutex;

use aho_corasick::{AhoCorasick, MatchKind};
use serde::Deserialize;
use serde_json::Value;

use crate::tokenizer::{char_to_byte, ByteMap, Encoded};

#[derive(Deserialize)]
struct File {
    #[serde(default)]
    truncation: Option<Value>,
    #[serde(default)]
    padding: Option<Value>,
    #[serde(default)]
    normalizer: Option<Value>,
    #[serde(default)]
    pre_tokenizer: Option<Value>,
    #[serde(default)]
    post_processor: Option<Value>,
    #[serde(default)]
    added_tokens: Vec<AddedToken>,
    model: Model,
}

#[derive(Deserialize)]
struct AddedToken {
    id: u32,
    content: String,
    #[serde(default)]
    single_word: bool,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
    #[serde(default)]
    normalized: bool,
}

#[derive(Deserialize)]
struct Model {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    dropout: Option<f64>,
    #[serde(default)]
    continuing_subword_prefix: Option<String>,
    #[serde(default)]
    end_of_word_suffix: Option<String>,
    #[serde(default)]
    byte_fallback: bool,
    #[serde(default)]
    ignore_merges: bool,
    vocab: HashMap<String, u32>,
    merges: Vec<MergeEntry>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum MergeEntry {
    Text(String),
    Pair(String, String),
}

/// Biggest piece kept in the cache, and how many pieces it holds before it starts over.
const CACHE_PIECE_BYTES: usize = 256;
const CACHE_ENTRIES: usize = 200_000;

pub(crate) struct FastBpe {
    added: Option<AhoCorasick>,
    added_ids: Vec<u32>,
    split: onig::Regex,
    nfc: bool,
    byte_ids: [u32; 256],
    vocab: HashMap<Vec<u8>, u32>,
    /// Each model token's length in bytes, by id.
    lens: Vec<u32>,
    ignore_merges: bool,
    /// (left, right) -> (rank, merged id)
    merges: HashMap<(u32, u32), (u32, u32)>,
    cache: Mutex<PieceCache>,
}

/// Piece bytes -> token ids.
type PieceCache = HashMap<Box<[u8]>, Box<[u32]>>;

fn is_null(v: &Option<Value>) -> bool {
    v.as_ref().is_none_or(Value::is_null)
}

fn kind(v: &Value) -> Option<&str> {
    v.get("type").and_then(Value::as_str)
}

/// A post-processor step that changes neither ids nor offsets when no special tokens are
/// added: `ByteLevel` without offset trimming, or a template holding the sequence once
/// (its special tokens are left out).
fn leaves_ids_alone(step: &Value) -> bool {
    match kind(step) {
        Some("ByteLevel") => step.get("trim_offsets") == Some(&Value::Bool(false)),
        Some("TemplateProcessing") => step
            .get("single")
            .and_then(Value::as_array)
            .is_some_and(|pieces| pieces.iter().filter(|p| p.get("Sequence").is_some()).count() == 1),
        _ => false,
    }
}

/// A byte-level token's bytes (None: a character outside GPT-2's byte map).
fn token_bytes(map: &ByteMap, token: &str) -> Option<Vec<u8>> {
    token.chars().map(|c| map.get(c as usize).copied().flatten()).collect()
}

impl FastBpe {
    /// The fast encoder for this `tokenizer.json`, when it has the supported shape.
    pub(crate) fn from_json(json: &str) -> Option<FastBpe> {
        let file: File = serde_json::from_str(json).ok()?;
        if !is_null(&file.truncation) || !is_null(&file.padding) {
            return None;
        }
        let nfc = match &file.normalizer {
            None | Some(Value::Null) => false,
            Some(n) if kind(n) == Some("NFC") => true,
            Some(_) => return None,
        };
        match &file.post_processor {
            None | Some(Value::Null) => {}
            Some(p) if kind(p) == Some("Sequence") => {
                for step in p.get("processors")?.as_array()? {
                    if !leaves_ids_alone(step) {
                        return None;
                    }
                }
            }
            Some(p) if leaves_ids_alone(p) => {}
            Some(_) => return None,
        }
        // Sequence[Split(Regex, Isolated, not inverted), ByteLevel(no prefix space, no regex)]
        let pre = file.pre_tokenizer.as_ref()?;
        let steps = pre.get("pretokenizers")?.as_array()?;
        let [split, byte_level] = steps.as_slice() else { return None };
        if kind(pre) != Some("Sequence")
            || kind(split) != Some("Split")
            || split.get("behavior").and_then(Value::as_str) != Some("Isolated")
            || split.get("invert") != Some(&Value::Bool(false))
            || kind(byte_level) != Some("ByteLevel")
            || byte_level.get("add_prefix_space") != Some(&Value::Bool(false))
            || byte_level.get("use_regex") != Some(&Value::Bool(false))
        {
            return None;
        }
        let pattern = split.get("pattern")?.get("Regex")?.as_str()?;
        let split = onig::Regex::new(pattern).ok()?;

        let m = file.model;
        let plain = |s: &Option<String>| s.as_deref().is_none_or(str::is_empty);
        if m.kind.as_deref().is_some_and(|k| k != "BPE")
            || m.dropout.is_some_and(|d| d > 0.0)
            || m.byte_fallback
            || !plain(&m.continuing_subword_prefix)
            || !plain(&m.end_of_word_suffix)
        {
            return None;
        }
        let mut vocab: HashMap<Vec<u8>, u32> = HashMap::with_capacity(m.vocab.len());
        let mut by_text: HashMap<&str, u32> = HashMap::with_capacity(m.vocab.len());
        let map = char_to_byte();
        for (t, &id) in &m.vocab {
            vocab.insert(token_bytes(&map, t)?, id);
            by_text.insert(t.as_str(), id);
        }
        let mut lens = vec![0u32; vocab.values().max().map_or(0, |&m| m as usize + 1)];
        for (bytes, &id) in &vocab {
            lens[id as usize] = bytes.len() as u32;
        }
        let mut byte_ids = [0u32; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = *vocab.get(&vec![b as u8])?; // every byte has a token: no unknown token
        }
        let mut merges = HashMap::with_capacity(m.merges.len());
        let mut joined = String::new();
        for (rank, entry) in m.merges.iter().enumerate() {
            let (a, b) = match entry {
                MergeEntry::Text(s) => s.split_once(' ')?,
                MergeEntry::Pair(a, b) => (a.as_str(), b.as_str()),
            };
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            let merged = by_text.get(joined.as_str())?;
            merges.insert((*by_text.get(a)?, *by_text.get(b)?), (rank as u32, *merged));
        }

        if file.added_tokens.iter().any(|t| t.lstrip || t.rstrip || t.single_word || t.normalized) {
            return None;
        }
        let added_ids = file.added_tokens.iter().map(|t| t.id).collect();
        let added = if file.added_tokens.is_empty() {
            None
        } else {
            let patterns: Vec<&str> = file.added_tokens.iter().map(|t| t.content.as_str()).collect();
            Some(AhoCorasick::builder().match_kind(MatchKind::LeftmostLongest).build(patterns).ok()?)
        };
        Some(FastBpe {
            added,
            added_ids,
            split,
            nfc,
            byte_ids,
            vocab,
            lens,
            ignore_merges: m.ignore_merges,
            merges,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// Ids and (with `offsets`; else none) byte offsets of `text`; None where tokenizers
    /// must encode it.
    pub(crate) fn encode(&self, text: &str, offsets: bool) -> Option<Encoded> {
        if self.nfc && !text.is_ascii() && !unicode_normalization_alignments::is_nfc(text) {
            return None;
        }
        let mut ids = Vec::with_capacity(text.len() / 3);
        let mut offs = Vec::with_capacity(if offsets { text.len() / 3 } else { 0 });
        let mut at = 0;
        if let Some(ac) = &self.added {
            for m in ac.find_iter(text) {
                self.encode_stretch(text, at, m.start(), &mut ids, offsets.then_some(&mut offs));
                ids.push(self.added_ids[m.pattern().as_usize()]);
                if offsets {
                    offs.push((m.start(), m.end()));
                }
                at = m.end();
            }
        }
        self.encode_stretch(text, at, text.len(), &mut ids, offsets.then_some(&mut offs));
        Some(Encoded { ids, offsets: offs })
    }

    /// A stretch without added tokens: cut by the regex into pieces, each encoded alone.
    fn encode_stretch(
        &self,
        text: &str,
        from: usize,
        to: usize,
        ids: &mut Vec<u32>,
        mut offs: Option<&mut Vec<(usize, usize)>>,
    ) {
        if from == to {
            return;
        }
        let stretch = &text[from..to];
        let mut prev = 0;
        for (s, e) in self.split.find_iter(stretch) {
            if s > prev {
                self.encode_piece(text, from + prev, from + s, ids, offs.as_deref_mut());
            }
            if e > s {
                self.encode_piece(text, from + s, from + e, ids, offs.as_deref_mut());
            }
            prev = e;
        }
        if prev < stretch.len() {
            self.encode_piece(text, from + prev, to, ids, offs);
        }
    }

    fn encode_piece(
        &self,
        text: &str,
        from: usize,
        to: usize,
        ids: &mut Vec<u32>,
        offs: Option<&mut Vec<(usize, usize)>>,
    ) {
        let piece = &text.as_bytes()[from..to];
        let cached = if piece.len() <= CACHE_PIECE_BYTES {
            self.cache.lock().unwrap_or_else(|e| e.into_inner()).get(piece).cloned()
        } else {
            None
        };
        let tokens: Box<[u32]> = match cached {
            Some(t) => t,
            None => {
                let t = self.bpe(piece).into_boxed_slice();
                if piece.len() <= CACHE_PIECE_BYTES {
                    let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
                    if cache.len() >= CACHE_ENTRIES {
                        cache.clear();
                    }
                    cache.insert(piece.into(), t.clone());
                }
                t
            }
        };
        ids.extend_from_slice(&tokens);
        if let Some(offs) = offs {
            // each token spans the characters its bytes belong to
            let mut pos = from;
            for &id in tokens.iter() {
                let len = self.token_len(id);
                let (mut s, mut e) = (pos, pos + len);
                while !text.is_char_boundary(s) {
                    s -= 1;
                }
                while !text.is_char_boundary(e) {
                    e += 1;
                }
                offs.push((s, e));
                pos += len;
            }
        }
    }

    /// Byte length of a token of the model's vocabulary.
    fn token_len(&self, id: u32) -> usize {
        self.lens.get(id as usize).map_or(0, |&l| l as usize)
    }

    /// BPE of one piece, as tokenizers' `Word::merge_all` does it.
    fn bpe(&self, piece: &[u8]) -> Vec<u32> {
        if self.ignore_merges {
            if let Some(&id) = self.vocab.get(piece) {
                return vec![id];
            }
        }
        struct Symbol {
            id: u32,
            prev: isize,
            next: isize,
            alive: bool,
        }
        let n = piece.len();
        let mut symbols: Vec<Symbol> = piece
            .iter()
            .enumerate()
            .map(|(i, &b)| Symbol {
                id: self.byte_ids[b as usize],
                prev: i as isize - 1,
                next: if i + 1 < n { i as isize + 1 } else { -1 },
                alive: true,
            })
            .collect();
        // min-heap on (rank, position)
        let mut queue: BinaryHeap<Reverse<(u32, usize, u32)>> = BinaryHeap::with_capacity(n);
        for i in 0..n.saturating_sub(1) {
            if let Some(&(rank, new_id)) = self.merges.get(&(symbols[i].id, symbols[i + 1].id)) {
                queue.push(Reverse((rank, i, new_id)));
            }
        }
        while let Some(Reverse((_, pos, new_id))) = queue.pop() {
            if !symbols[pos].alive || symbols[pos].next < 0 {
                continue;
            }
            let next = symbols[pos].next as usize;
            match self.merges.get(&(symbols[pos].id, symbols[next].id)) {
                Some(&(_, id)) if id == new_id => {}
                _ => continue,
            }
            symbols[pos].id = new_id;
            symbols[next].alive = false;
            let after = symbols[next].next;
            symbols[pos].next = after;
            if after >= 0 {
                symbols[after as usize].prev = pos as isize;
            }
            if symbols[pos].prev >= 0 {
                let p = symbols[pos].prev as usize;
                if let Some(&(rank, id)) = self.merges.get(&(symbols[p].id, symbols[pos].id)) {
                    queue.push(Reverse((rank, p, id)));
                }
            }
            if after >= 0 {
                if let Some(&(rank, id)) = self.merges.get(&(symbols[pos].id, symbols[after as usize].id)) {
                    queue.push(Reverse((rank, pos, id)));
                }
            }
        }
        symbols.iter().filter(|s| s.alive).map(|s| s.id).collect()
    }
}
