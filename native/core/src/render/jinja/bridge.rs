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
//!    prefix of the new messages, as for `render`.
//!
//! `prev_ids` are never re-tokenized. Cost: the template runs over the conversation
//! (string work), the tokenizer only over the window and the new text.

use super::{common_prefix, generation_mask, push_region, JinjaTemplate};
use crate::json::Json;
use crate::message::Message;
use crate::render::bridge::Bridged;
use crate::render::builder::{Attr, Builder, Rendered};
use crate::render::{MaskConvention, RenderOptions};
use crate::tokenizer::Tokenizer;
use crate::Result;

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
        let prev_text = tok.decode(prev)?;
        let mut all = Vec::with_capacity(history.len() + new.len());
        all.extend_from_slice(history);
        all.extend_from_slice(new);
        let ctx = self.context(&all, tools, opts);
        let (rendered, rendered_spans) = self.render_spans(&ctx, all.len(), opts.add_generation_prompt)?;
        // a tokenizer that normalizes (e.g. NFC) decodes prev_ids to normalized text: compare
        // with the normalized render then (only where normalizing again changes nothing)
        let (full, spans, normalized) = if rendered.starts_with(&prev_text) {
            (rendered, rendered_spans, false)
        } else {
            match tok.normalize(&rendered)? {
                Some(n) if n.starts_with(&prev_text) && tok.normalize(&n)?.as_deref() == Some(n.as_str()) => {
                    (n, Vec::new(), true)
                }
                _ => {
                    let at = common_prefix(&prev_text, &rendered);
                    return refuse(format!(
                        "the chat template renders the conversation differently from prev_ids at character {at} \
                         (prev_ids {:?}, template {:?}): it rewrites history; split the rollout",
                        snippet(&prev_text, at),
                        snippet(&rendered, at)
                    ));
                }
            }
        };
        let base = prev_text.len();

        // the window: prev_ids from their last added token, whose text ends prev's text
        let added = tok.added_token_ids();
        let mut window_start = prev.iter().rposition(|t| added.contains(t)).unwrap_or(0);
        let mut window_text = tok.decode(&prev[window_start..])?;
        if !prev_text.ends_with(&window_text) {
            window_start = 0;
            window_text = prev_text.clone();
        }
        let offset = base - window_text.len(); // full-text position of the window

        let mut b = Builder::new();
        b.push(&window_text, Attr::GLOBAL);
        let n = history.len();
        let plain = match (normalized, opts.add_generation_prompt) {
            (true, _) => String::new(),
            (false, true) => self.render_spans(&ctx, all.len(), false)?.0,
            (false, false) => full.clone(),
        };
        let regions = if !normalized && full.starts_with(&plain) {
            self.prefix_regions(&ctx, &all, &plain, Some(&plain), n)
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
                    push_region(&mut piece, &full, r, &all[r.message], (r.message - n) as i32, &self.stops);
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
        let _ = window_start;
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
