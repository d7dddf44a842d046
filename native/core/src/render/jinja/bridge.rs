//! Append-only extension (`bridge`) for any chat template.
//!
//! The family ports know their template's structure; here the template is a black box,
//! so the bridge is *proved* on each call instead of derived:
//!
//! 1. the whole conversation (the messages `prev_ids` stand for, then the new ones) is
//!    rendered; its text must start with the text of `prev_ids` exactly (sampled tokens
//!    included) — otherwise the template rewrites history and the bridge refuses, naming
//!    the first difference;
//! 2. the rest of the text is tokenized after a *window*: `prev_ids` from their last
//!    added token (the tokenizer splits text at added tokens before anything else, so
//!    no token can cross one), and the appended ids are those after the window — unless
//!    a token straddles the boundary, where the bridge refuses;
//! 3. attribution (message index, content flag, loss mask) comes from rendering each
//!    prefix of the new messages, as for `render`; the first new message's region starts
//!    where `prev_ids` end (what closes the sampled turn is its scaffold).
//!
//! `prev_ids` are never re-tokenized (where the tokenizer is byte-level they are not even
//! decoded: their bytes are compared with the render in place). Cost: the template runs
//! once over the conversation where its generation prompt is proved to be a top-level
//! tail (`prompt_split.rs`: most templates), else twice, with and without the prompt;
//! once more per further new message; the tokenizer only over the window and the new
//! text.

use std::collections::VecDeque;
use std::sync::Mutex;

use super::{common_prefix, generation_mask, push_region, JinjaTemplate};
use crate::json::Json;
use crate::message::Message;
use crate::render::bridge::Bridged;
use crate::render::builder::{Attr, Builder, Rendered};
use crate::render::{MaskConvention, RenderOptions};
use crate::tokenizer::Tokenizer;
use crate::Result;

/// How many verified `prev_ids` a template remembers (a few rollouts' worth).
const VERIFIED_KEPT: usize = 32;

/// `prev_ids` lately proved to decode to the start of a render, with their text: the next
/// bridge of a rollout extends the same ids, so only the ids after them are compared.
#[derive(Default)]
pub(crate) struct VerifiedPrefixes(Mutex<VecDeque<(Vec<u32>, String)>>);

impl VerifiedPrefixes {
    fn kept(&self) -> std::sync::MutexGuard<'_, VecDeque<(Vec<u32>, String)>> {
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// `(k, at)`: the longest remembered ids that start `ids` and whose text starts `text`.
    fn longest(&self, ids: &[u32], text: &str) -> (usize, usize) {
        let kept = self.kept();
        let known = kept.iter().filter(|(i, t)| ids.starts_with(i) && text.starts_with(t.as_str()));
        known.map(|(i, t)| (i.len(), t.len())).max().unwrap_or((0, 0))
    }

    /// Remember that `ids` decode to `text`.
    fn remember(&self, ids: &[u32], text: &str) {
        let mut kept = self.kept();
        if let Some(pos) = kept.iter().position(|(i, _)| i.as_slice() == ids) {
            let entry = kept.remove(pos).expect("found");
            kept.push_back(entry);
            return;
        }
        if kept.len() == VERIFIED_KEPT {
            kept.pop_front();
        }
        kept.push_back((ids.to_vec(), text.to_string()));
    }
}

fn refuse(reason: String) -> Result<Bridged> {
    Ok(Bridged { ok: false, reason, appended: Rendered::default(), closed_turn: false })
}

fn snippet(s: &str, at: usize) -> String {
    s[at..].chars().take(24).collect()
}

impl JinjaTemplate {
    /// Extend `prev` (the ids of `history`, ending with a sampled assistant turn) by `new`.
    #[allow(clippy::too_many_arguments)]
    pub fn bridge(
        &self,
        tok: &Tokenizer,
        stop_ids: &[u32],
        prev: &[u32],
        history: &[Message],
        new: &[Message],
        tools: Option<&[Json]>,
        opts: &RenderOptions,
    ) -> Result<Bridged> {
        let all: Vec<&Message> = history.iter().chain(new).collect();
        let ctx = self.context(all.iter().copied(), tools, opts);
        // with the prompt, where the template allows, one render gives where the text
        // without it ends (`prompt_split.rs`)
        let split = if opts.add_generation_prompt { self.render_prompt_split(&ctx, all.len()) } else { None };
        let (rendered, rendered_spans, split_at) = match split {
            Some((text, spans, at)) => (text, spans, Some(at)),
            None => {
                let (text, spans) = self.render_spans(&ctx, all.len(), opts.add_generation_prompt)?;
                (text, spans, None)
            }
        };
        // where the tokenizer can tell without decoding, prev_ids are matched against the
        // render in place; otherwise (or where they do not match) they are decoded
        let known = self.verified.longest(prev, &rendered);
        let (full, spans, normalized, base) = match tok.decoded_prefix(prev, &rendered, known) {
            Some(Some(base)) => {
                self.verified.remember(prev, &rendered[..base]);
                (rendered, rendered_spans, false, base)
            }
            _ => {
                let prev_text = tok.decode(prev)?;
                // a tokenizer that normalizes (e.g. NFC) decodes prev_ids to normalized text:
                // compare with the normalized render then (only where normalizing again
                // changes nothing)
                if rendered.starts_with(&prev_text) {
                    (rendered, rendered_spans, false, prev_text.len())
                } else {
                    match tok.normalize(&rendered)? {
                        Some(n) if n.starts_with(&prev_text) && tok.normalize(&n)?.as_deref() == Some(n.as_str()) => {
                            (n, Vec::new(), true, prev_text.len())
                        }
                        _ => {
                            let at = common_prefix(&prev_text, &rendered);
                            return refuse(format!(
                                "the chat template renders the conversation differently from prev_ids at character \
                                 {at} (prev_ids {:?}, template {:?}): it rewrites history; split the rollout",
                                snippet(&prev_text, at),
                                snippet(&rendered, at)
                            ));
                        }
                    }
                }
            }
        };
        // from here on, full[..base] is the text of prev_ids

        // the window: prev_ids from their last added token, whose text ends prev's text
        let added = tok.added_token_ids();
        let window_start = prev.iter().rposition(|t| added.contains(t)).unwrap_or(0);
        let mut window_text = tok.decode(&prev[window_start..])?;
        if !full[..base].ends_with(&window_text) {
            window_text = full[..base].to_string();
        }
        let offset = base - window_text.len(); // full-text position of the window

        let mut b = Builder::new();
        b.push(&window_text, Attr::GLOBAL);
        let n = history.len();
        // the conversation without the generation prompt: where it starts the full text
        // (the usual case), message regions are proved on it
        let plain_len = match (normalized, opts.add_generation_prompt) {
            (true, _) => None,
            (false, true) => match split_at {
                Some(at) => Some(at),
                None => self.rendered_prefix_len(&ctx, all.len(), false, &full)?,
            },
            (false, false) => Some(full.len()),
        };
        let regions = if let Some(plain) = plain_len.map(|len| &full[..len]) {
            // the first new message's region starts where prev_ids end: scaffold that
            // closes the sampled turn (a newline after its end token, the end token of a
            // truncated turn) belongs to it, and the history is not rendered again
            self.prefix_regions(&ctx, &all, plain, Some(plain), n, base)
        } else {
            None
        };
        let stable = match regions {
            Some(regions) => {
                let mut cursor = base;
                for r in &regions {
                    if r.start > cursor {
                        b.push(&full[cursor..r.start.max(cursor)], Attr::GLOBAL);
                    }
                    let mut piece = Builder::new();
                    push_region(&mut piece, &full, r, all[r.message], (r.message - n) as i32, &self.stops);
                    // the region's pieces, clipped to the appended text
                    let mut pos = r.start;
                    for (text, attr) in piece.pieces() {
                        let end = pos + text.len();
                        if end > cursor {
                            b.push(&full[pos.max(cursor)..end], attr);
                        }
                        pos = end;
                    }
                    cursor = cursor.max(r.end);
                }
                b.push(&full[cursor.max(base)..], Attr::GLOBAL);
                true
            }
            None => false,
        };
        if !stable {
            // attribute by locating each new message's content in the appended text
            let mut cursor = base;
            for (j, msg) in new.iter().enumerate() {
                let content = match (normalized, msg.content_str()) {
                    (_, "") => continue,
                    (true, c) => tok.normalize(c)?.unwrap_or_else(|| c.to_string()),
                    (false, c) => c.to_string(),
                };
                if let Some(p) = full[cursor..].find(&content) {
                    b.push(&full[cursor..cursor + p], Attr::GLOBAL);
                    b.push(&content, Attr::content(j as i32));
                    cursor += p + content.len();
                }
            }
            b.push(&full[cursor..], Attr::GLOBAL);
        }
        let (rendered, offsets) = b.encode_with_offsets(tok)?;
        let split = offsets.iter().position(|&(s, _)| s >= window_text.len()).unwrap_or(offsets.len());
        if split > 0 && offsets[split - 1].1 > window_text.len() {
            return refuse(format!(
                "the tokenizer joins the end of prev_ids with the appended text {:?} into one token; split the rollout",
                snippet(&full, base)
            ));
        }
        let mut loss_mask = rendered.loss_mask[split..].to_vec();
        if self.mask == MaskConvention::Generation && !normalized {
            let shifted: Vec<(usize, usize)> =
                offsets[split..].iter().map(|&(s, e)| (s + offset, e + offset)).collect();
            loss_mask = generation_mask(&shifted, &spans);
        }
        let appended = Rendered {
            text: full[base..].to_string(),
            token_ids: rendered.token_ids[split..].to_vec(),
            message_index: rendered.message_index[split..].to_vec(),
            loss_mask,
            is_content: rendered.is_content[split..].to_vec(),
        };
        let closed_turn = prev.last().is_some_and(|t| !stop_ids.contains(t)) && !appended.token_ids.is_empty();
        Ok(Bridged { ok: true, reason: String::new(), appended, closed_turn })
    }
}
