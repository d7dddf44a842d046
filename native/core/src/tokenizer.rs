//! A loaded `tokenizer.json` (HF tokenizers, the same code the Python package runs) with
//! the lookups the renderers need. Two paths skip tokenizers' own code where it is slow,
//! each exact to it and tested against it on every shared tokenizer: decoding byte-level
//! ids from a table of each id's bytes, and encoding GPT-style byte-level BPE
//! tokenizers (Qwen, Llama 3) with `fastbpe.rs`.

use std::path::Path;

use crate::fastbpe::FastBpe;
use crate::{CoreError, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Number of ids the tokenizer can produce (base vocabulary + added tokens): one
    /// more than the largest id.
    pub vocab_size: usize,
    /// Ids below `vocab_size` that no token has (sorted; empty for the usual tokenizers).
    /// Decoding would silently drop them, so they are outside the vocabulary too.
    holes: Vec<u32>,
    /// Byte-level tokenizers: every id's bytes, so that decoding is one copy per token
    /// (tokenizers' `decode` builds a `String` per token: 10 ms for 32k ids).
    bytes: Option<ByteTable>,
    /// The direct encoder, for tokenizers of the shape it supports (`fastbpe.rs`).
    fast: Option<FastBpe>,
}

/// Each id's bytes under a byte-level decoder (`None`: no token has the id).
/// Each id's bytes, all in one buffer: `spans[id]` is (start, length), length
/// `u32::MAX` where no token has the id.
struct ByteTable {
    spans: Vec<(u32, u32)>,
    bytes: Vec<u8>,
}

/// Byte per character of a byte-level vocabulary, indexed by the character.
pub(crate) type ByteMap = [Option<u8>; 0x144];

/// GPT-2's byte-to-character map, inverted: the byte each character of a byte-level
/// vocabulary stands for (printable Latin-1 stands for itself, the other bytes for
/// U+0100 onwards), indexed by the character.
pub(crate) fn char_to_byte() -> ByteMap {
    let mut map = [None; 0x144];
    let mut n = 0x100;
    for b in 0..=255u8 {
        if matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF) {
            map[b as usize] = Some(b);
        } else {
            map[n] = Some(b);
            n += 1;
        }
    }
    map
}

impl ByteTable {
    /// As tokenizers' byte-level decoder reads a token: its characters mapped back to
    /// bytes, or the token's own UTF-8 when one character is outside the map.
    /// `vocab`: every token's text by id (the model's, then the added tokens', which win
    /// as in tokenizers' `id_to_token`); `rest`: ids to look up one by one.
    fn build<'a>(
        vocab: impl Iterator<Item = (&'a str, u32)>,
        rest: &[u32],
        inner: &tokenizers::Tokenizer,
        vocab_size: usize,
    ) -> ByteTable {
        let map = char_to_byte();
        let mut table = ByteTable { spans: vec![(0, u32::MAX); vocab_size], bytes: Vec::new() };
        let mut add = |t: &str, id: u32| {
            let start = table.bytes.len();
            match t.chars().map(|c| map.get(c as usize).copied().flatten()).collect::<Option<Vec<u8>>>() {
                Some(b) => table.bytes.extend_from_slice(&b),
                None => table.bytes.extend_from_slice(t.as_bytes()),
            }
            table.spans[id as usize] = (start as u32, (table.bytes.len() - start) as u32);
        };
        for (t, id) in vocab {
            add(t, id);
        }
        for &id in rest {
            if let Some(t) = inner.id_to_token(id) {
                add(&t, id);
            }
        }
        table
    }

    fn decode(&self, ids: &[u32]) -> String {
        let mut out = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            if let Some(&(start, len)) = self.spans.get(id as usize) {
                if len != u32::MAX {
                    out.extend_from_slice(&self.bytes[start as usize..(start + len) as usize]);
                }
            }
        }
        match String::from_utf8(out) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        }
    }

    /// The byte length of `decode(ids)` when it is a prefix of `text` (None: it is not),
    /// compared token by token without building it; `known`: `(k, at)` where `ids[..k]`
    /// are known to decode to `text[..at]`.
    fn decoded_prefix(&self, ids: &[u32], text: &str, known: (usize, usize)) -> Option<usize> {
        let bytes = text.as_bytes();
        let (k, mut at) = known;
        for &id in &ids[k..] {
            let Some(&(start, len)) = self.spans.get(id as usize) else { continue };
            if len == u32::MAX {
                continue;
            }
            let piece = &self.bytes[start as usize..(start + len) as usize];
            let end = at + piece.len();
            // tokens are a few bytes: a plain loop, not a memcmp call per token
            if end > bytes.len() || !piece.iter().zip(&bytes[at..end]).all(|(a, b)| a == b) {
                return None;
            }
            at = end;
        }
        // the bytes are text's up to `at`: valid UTF-8 (as decode would give them) only
        // where `at` is a character boundary
        text.is_char_boundary(at).then_some(at)
    }
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
        let json =
            std::fs::read_to_string(&file).map_err(|e| CoreError::Tokenizer(format!("{}: {e}", file.display())))?;
        let inner: tokenizers::Tokenizer =
            json.parse().map_err(|e| CoreError::Tokenizer(format!("{}: {e}", file.display())))?;
        Ok(Tokenizer::from_tokenizer(inner, &json))
    }

    /// Load from the JSON text of a `tokenizer.json`.
    pub fn from_json(json: &str) -> Result<Tokenizer> {
        let inner: tokenizers::Tokenizer =
            json.parse().map_err(|e| CoreError::Tokenizer(format!("invalid tokenizer.json: {e}")))?;
        Ok(Tokenizer::from_tokenizer(inner, json))
    }

    fn from_tokenizer(inner: tokenizers::Tokenizer, json: &str) -> Tokenizer {
        let added_max = inner.get_added_tokens_decoder().keys().max().map_or(0, |&m| m as usize + 1);
        let vocab = inner.get_vocab(true);
        let vocab_max = vocab.values().max().map_or(0, |&m| m as usize + 1);
        let vocab_size = inner.get_vocab_size(true).max(added_max).max(vocab_max);
        let mut present = vec![false; vocab_size];
        for &id in vocab.values() {
            present[id as usize] = true;
        }
        let holes: Vec<u32> = (0..vocab_size as u32).filter(|&id| !present[id as usize]).collect();
        let byte_level = matches!(inner.get_decoder(), Some(tokenizers::decoders::DecoderWrapper::ByteLevel(_)));
        let bytes = byte_level.then(|| {
            let added = inner.get_added_tokens_decoder();
            let model = vocab.iter().filter(|(_, id)| !added.contains_key(id)).map(|(t, &id)| (t.as_str(), id));
            let all = model.chain(added.iter().map(|(&id, t)| (t.content.as_str(), id)));
            ByteTable::build(all, &holes, &inner, vocab_size)
        });
        let fast = FastBpe::from_json(json);
        Tokenizer { inner, vocab_size, holes, bytes, fast }
    }

    /// Encode `text` as `tokenizer(text, add_special_tokens=False)` does.
    pub fn encode(&self, text: &str) -> Result<Encoded> {
        if let Some(encoded) = self.fast.as_ref().and_then(|f| f.encode(text, true)) {
            return Ok(encoded);
        }
        let enc = self.inner.encode(text, false).map_err(|e| CoreError::Tokenizer(format!("encode failed: {e}")))?;
        Ok(Encoded { ids: enc.get_ids().to_vec(), offsets: enc.get_offsets().to_vec() })
    }

    /// Ids only (no offsets).
    pub fn encode_ids(&self, text: &str) -> Result<Vec<u32>> {
        if let Some(encoded) = self.fast.as_ref().and_then(|f| f.encode(text, false)) {
            return Ok(encoded.ids);
        }
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

    /// The tokenizer's normalizer applied to `text` (None: it has none).
    pub fn normalize(&self, text: &str) -> Result<Option<String>> {
        use tokenizers::{NormalizedString, Normalizer};
        let Some(n) = self.inner.get_normalizer() else { return Ok(None) };
        let mut ns = NormalizedString::from(text);
        n.normalize(&mut ns).map_err(|e| CoreError::Tokenizer(format!("normalize failed: {e}")))?;
        Ok(Some(ns.get().to_string()))
    }

    /// Decode ids to text, keeping special tokens (so they stay visible).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(table) = &self.bytes {
            return Ok(table.decode(ids));
        }
        self.inner.decode(ids, false).map_err(|e| CoreError::Tokenizer(format!("decode failed: {e}")))
    }

    /// Whether `decode(ids)` is a prefix of `text`: `Some(Some(len))` when it is (`len` its
    /// byte length), `Some(None)` when it is not, `None` when only decoding can tell (the
    /// tokenizer is not byte-level). Cheaper than decoding: nothing is built.
    /// `known`: `(k, at)` where `ids[..k]` are known to decode to `text[..at]`, which
    /// is not compared again (`(0, 0)` where nothing is known).
    pub fn decoded_prefix(&self, ids: &[u32], text: &str, known: (usize, usize)) -> Option<Option<usize>> {
        self.bytes.as_ref().map(|table| table.decoded_prefix(ids, text, known))
    }

    /// Check every id is inside the vocabulary (a token has it); the error names the
    /// first one that is not and its position.
    pub fn check_ids(&self, ids: &[i64]) -> Result<Vec<u32>> {
        // the usual case first, in one pass the compiler vectorizes (a negative id is a
        // huge u64)
        let vocab_size = self.vocab_size as u64;
        if self.holes.is_empty() && ids.iter().fold(true, |ok, &id| ok & ((id as u64) < vocab_size)) {
            return Ok(ids.iter().map(|&id| id as u32).collect());
        }
        ids.iter()
            .enumerate()
            .map(|(position, &id)| {
                if id < 0 || id as u64 >= self.vocab_size as u64 || self.holes.binary_search(&(id as u32)).is_ok() {
                    Err(CoreError::TokenOutOfVocab { position, id, vocab_size: self.vocab_size })
                } else {
                    Ok(id as u32)
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CoreError;

    /// A word-level tokenizer whose ids skip 1: "a" 0, "b" 2, "[UNK]" 3.
    fn with_hole() -> Tokenizer {
        Tokenizer::from_json(
            r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
                "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
                "decoder": null,
                "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 2, "[UNK]": 3}, "unk_token": "[UNK]"}}"#,
        )
        .unwrap()
    }

    #[test]
    fn ids_outside_the_vocabulary_or_in_a_hole_are_errors() {
        let t = with_hole();
        assert_eq!(t.vocab_size, 4);
        assert_eq!(t.check_ids(&[0, 2, 3]).unwrap(), vec![0, 2, 3]);
        for (ids, bad, position) in [
            (vec![0, 1], 1, 1),
            (vec![4], 4, 0),
            (vec![2, -1], -1, 1),
            (vec![i64::MAX], i64::MAX, 0),
            (vec![i64::MIN], i64::MIN, 0),
            (vec![0, 0, 1 << 40], 1 << 40, 2),
            (vec![(1 << 32) + 2], (1 << 32) + 2, 0), // must not wrap to id 2
        ] {
            assert_eq!(
                t.check_ids(&ids).unwrap_err(),
                CoreError::TokenOutOfVocab { position, id: bad, vocab_size: 4 },
                "{ids:?}"
            );
        }
    }

    /// A random number below `n` at each call, from `seed`.
    fn xorshift(mut seed: u64) -> impl FnMut(usize) -> u32 {
        move |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as u32
        }
    }

    /// The byte table decodes exactly as tokenizers does, on every shared byte-level
    /// tokenizer: random ids (half of them single bytes that split UTF-8 sequences),
    /// added tokens, ids past the vocabulary.
    #[test]
    fn byte_level_decode_is_tokenizers_decode() {
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/tokenizers");
        let mut checked = 0;
        for folder in ["qwen3", "qwen2.5-instruct", "llama-3.2-instruct", "deepseek-r1-distill-qwen"] {
            let t = Tokenizer::from_path(&root.join(folder)).expect("../shared/tokenizers");
            assert!(t.bytes.is_some(), "{folder} has a byte-level decoder");
            let added = t.added_token_ids();
            let mut next = xorshift(0x9e3779b97f4a7c15u64);
            for len in [0usize, 1, 2, 3, 7, 50, 400] {
                for _ in 0..40 {
                    let ids: Vec<u32> = (0..len)
                        .map(|_| match next(4) {
                            0 => next(256),
                            1 => added[next(added.len()) as usize],
                            2 => t.vocab_size as u32 + next(10),
                            _ => next(t.vocab_size),
                        })
                        .collect();
                    let fast = t.decode(&ids).unwrap();
                    assert_eq!(fast, t.inner.decode(&ids, false).unwrap(), "{folder} {ids:?}");
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 4 * 7 * 40);
    }

    /// `decoded_prefix` says yes exactly where the decoded text starts the text, from
    /// scratch or from a known prefix; an id whose bytes end inside a character (decode
    /// would write U+FFFD) or any differing byte is a no.
    #[test]
    fn decoded_prefix_is_decode_then_starts_with() {
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/tokenizers");
        let t = Tokenizer::from_path(&root.join("qwen3")).expect("../shared/tokenizers");
        let mut next = xorshift(0x2545f4914f6cdd1du64);
        let (mut yes, mut no) = (0, 0);
        for len in [0usize, 1, 2, 5, 60] {
            for _ in 0..200 {
                // a third of the ids are single bytes, which split UTF-8 sequences
                let ids: Vec<u32> =
                    (0..len).map(|_| if next(3) == 0 { next(256) } else { next(t.vocab_size - 300) }).collect();
                let decoded = t.decode(&ids).unwrap();
                let text = format!("{decoded}<|im_end|>é");
                let whole = t.decoded_prefix(&ids, &text, (0, 0)).expect("byte-level");
                let exact = t.inner.decode(&ids, false).unwrap() == decoded && !decoded.contains('\u{FFFD}');
                if exact {
                    assert_eq!(whole, Some(decoded.len()), "{ids:?}");
                    yes += 1;
                    // from a known prefix: the same answer
                    let k = next(len + 1) as usize;
                    let head = t.decode(&ids[..k]).unwrap();
                    if !head.contains('\u{FFFD}') {
                        assert_eq!(t.decoded_prefix(&ids, &text, (k, head.len())).unwrap(), whole);
                    }
                    // one byte changed anywhere in the decoded part: no
                    if !decoded.is_empty() {
                        let at = next(decoded.len()) as usize;
                        let mut other = text.clone().into_bytes();
                        other[at] = if other[at] == b'#' { b'%' } else { b'#' };
                        if let Ok(other) = String::from_utf8(other) {
                            assert_eq!(t.decoded_prefix(&ids, &other, (0, 0)).unwrap(), None, "{ids:?} at {at}");
                        }
                    }
                } else {
                    assert_eq!(whole, None, "{ids:?} decodes to {decoded:?}");
                    no += 1;
                }
            }
        }
        assert!(yes > 300 && no > 100, "both outcomes exercised: {yes} yes, {no} no");
        // the token of the byte 0xC3 (the first of "é"), before text that goes on with "é":
        // every byte compared matches, but the ids end inside a character
        let table = t.bytes.as_ref().unwrap();
        let lead = (0..t.vocab_size as u32).find(|&id| {
            let (start, len) = table.spans[id as usize];
            len == 1 && table.bytes[start as usize] == 0xC3
        });
        assert_eq!(t.decoded_prefix(&[lead.expect("a byte token")], "éa", (0, 0)).unwrap(), None);
    }

    #[test]
    fn ids_are_checked_without_holes_too() {
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/tokenizers");
        let t = Tokenizer::from_path(&root.join("qwen3")).expect("../shared/tokenizers");
        assert!(t.holes.is_empty());
        let last = t.vocab_size as i64 - 1;
        assert_eq!(t.check_ids(&[0, last]).unwrap(), vec![0, last as u32]);
        for (ids, position, id) in
            [(vec![0, last + 1], 1, last + 1), (vec![-1], 0, -1), (vec![5, 6, i64::MIN], 2, i64::MIN)]
        {
            assert_eq!(
                t.check_ids(&ids).unwrap_err(),
                CoreError::TokenOutOfVocab { position, id, vocab_size: t.vocab_size }
            );
        }
    }

    /// Texts built from pieces the regex, the BPE merges and the added-token split treat
    /// differently, chosen at random.
    fn random_texts(seed: u64, added: &[String], n: usize) -> Vec<String> {
        const PIECES: &[&str] = &[
            "a",
            "the",
            " cat",
            "Hello",
            "WORLD",
            "'s",
            "'T",
            "'ll",
            " don't",
            "1",
            "2024",
            " 3.14",
            "٣٤",
            " ",
            "  ",
            "   ",
            "\n",
            "\n\n",
            "\r\n",
            "\t",
            " \n ",
            "  \n",
            ".",
            ",",
            "!!",
            "==",
            " ->",
            "```",
            "{\"k\": [1, 2]}",
            "é",
            "ñandú",
            "中文字",
            " 日本語",
            "😀",
            "👩‍👩‍👧",
            "e\u{301}",
            "\u{301}",
            "Å",
            "ﬁ",
            "\u{200b}",
            "\u{feff}",
            "ß",
            "İ",
            "ǅ",
            "\u{1f}",
            "\u{7f}",
            "\u{a0}",
            "\u{3000}",
            "<",
            "|",
            ">",
            "<|",
            "|>",
            "<think",
            "</",
            "/think>",
            "Ġ",
            "Ċ",
            "ĠĠ",
            "\u{10ffff}",
        ];
        let mut state = seed | 1;
        let mut next = move |m: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % m as u64) as usize
        };
        (0..n)
            .map(|_| {
                let mut t = String::new();
                for _ in 0..next(60) {
                    match next(20) {
                        0 if !added.is_empty() => t.push_str(&added[next(added.len())]),
                        1 => t.push_str(&" ".repeat(next(300))),
                        2 => t.push_str(&"=".repeat(next(300))),
                        3 => t.push_str(&"7".repeat(next(50))),
                        4 => t.push(char::from_u32(next(0x3000) as u32).filter(|c| !c.is_control()).unwrap_or('x')),
                        _ => t.push_str(PIECES[next(PIECES.len())]),
                    }
                }
                t
            })
            .collect()
    }

    /// The direct encoder gives tokenizers' ids and offsets on every shared tokenizer it
    /// takes, for texts with and without added tokens, non-NFC texts included (those go
    /// to tokenizers), long runs of one character, and split multi-byte characters.
    #[test]
    fn direct_encoder_is_tokenizers_encode() {
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/tokenizers");
        for (folder, direct) in [
            ("qwen3", true),
            ("qwen2.5-instruct", true),
            ("deepseek-r1-distill-qwen", true),
            ("llama-3.2-instruct", true),
        ] {
            let t = Tokenizer::from_path(&root.join(folder)).expect("../shared/tokenizers");
            assert_eq!(t.fast.is_some(), direct, "{folder}");
            let added: Vec<String> = t.inner.get_added_tokens_decoder().values().map(|a| a.content.clone()).collect();
            let mut texts = random_texts(0x5eed ^ folder.len() as u64, &added, 400);
            texts.extend(["".to_string(), " ".repeat(5000), "a".repeat(3000), "<|im_start|><|im_start|>".into()]);
            for text in &texts {
                let theirs = t.inner.encode(text.as_str(), false).unwrap();
                let ours = t.encode(text).unwrap();
                assert_eq!(ours.ids, theirs.get_ids(), "{folder}: {text:?}");
                assert_eq!(ours.offsets, theirs.get_offsets(), "{folder}: {text:?}");
                assert_eq!(t.encode_ids(text).unwrap(), theirs.get_ids(), "{folder}: {text:?}");
            }
        }
    }

    /// Shapes the direct encoder does not take leave encoding to tokenizers.
    #[test]
    fn direct_encoder_refuses_other_shapes() {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/tokenizers/qwen3/tokenizer.json");
        let text = std::fs::read_to_string(path).expect("../shared/tokenizers");
        let base: serde_json::Value = serde_json::from_str(&text).unwrap();
        type Edit = fn(&mut serde_json::Value);
        let edits: [(&str, Edit); 5] = [
            ("trimmed offsets", |t| t["post_processor"]["trim_offsets"] = true.into()),
            ("stripped added token", |t| t["added_tokens"][0]["lstrip"] = true.into()),
            ("dropout", |t| t["model"]["dropout"] = 0.1.into()),
            ("NFKC", |t| t["normalizer"]["type"] = "NFKC".into()),
            ("prefix space", |t| t["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true.into()),
        ];
        assert!(Tokenizer::from_json(&text).unwrap().fast.is_some());
        for (what, edit) in edits {
            let mut t = base.clone();
            edit(&mut t);
            let tok = Tokenizer::from_json(&t.to_string()).unwrap();
            assert!(tok.fast.is_none(), "{what}");
            let sample = "Hello  world\n<|im_start|>x";
            if what != "dropout" {
                assert_eq!(
                    tok.encode(sample).unwrap().ids,
                    tok.inner.encode(sample, false).unwrap().get_ids(),
                    "{what}"
                );
            }
        }
    }
}
