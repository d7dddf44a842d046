//! Attribution where a template does not render a conversation prefix-stably (it rewrites
//! earlier turns, e.g. drops their reasoning): the conversation is rendered once more with
//! each message's content and reasoning wrapped in markers holding a random nonce. When
//! that text, markers cut out, is exactly the real render, the markers say where every
//! field is; otherwise (the template transforms the text in a way the markers change)
//! the caller falls back to searching for the content.
//!
//! A marker wraps the field's text without its leading and trailing whitespace, so
//! templates that `strip()` a field strip it as they would the real one. Empty fields are
//! not marked (templates test them for truth), nor non-string content.
//!
//! An assistant turn is trained from the end of its generation prompt (the prompt's tail
//! found before the turn's first field, or its first line where the template rewrote the
//! rest) through its end-of-turn token after its last field, as in the prefix-stable case.

use super::env;
use super::{common_prefix, nonce, stop_after, JinjaTemplate};
use crate::json::Json;
use crate::message::{Message, Role};
use crate::render::builder::Attr;
use crate::render::RenderOptions;

/// Message fields located: content, then reasoning under any of its names (the template
/// context aliases them to one another).
const FIELDS: [&[&str]; 2] = [&["content"], &["reasoning_content", "thinking", "reasoning"]];
const END: char = '\u{F8FF}';

/// `(start, end, attribution)` of located text, in order and not overlapping.
pub(crate) type Pieces = Vec<(usize, usize, Attr)>;

fn marked(value: &str, prefix: &str, message: usize, field: usize) -> Option<String> {
    let core = value.trim();
    if core.is_empty() {
        return None;
    }
    let lead = &value[..value.len() - value.trim_start().len()];
    let trail = &value[lead.len() + core.len()..];
    Some(format!("{lead}{prefix}{message}.{field}s{END}{core}{prefix}{message}.{field}e{END}{trail}"))
}

fn mark_message(raw: &Json, message: usize, prefix: &str) -> Json {
    let Json::Object(fields) = raw else { return raw.clone() };
    let fields = fields
        .iter()
        .map(|(k, v)| {
            let field = FIELDS.iter().position(|names| names.contains(&k.as_str()));
            match (field, v) {
                (Some(f), Json::Str(s)) => match marked(s, prefix, message, f) {
                    Some(m) => (k.clone(), Json::Str(m)),
                    None => (k.clone(), v.clone()),
                },
                _ => (k.clone(), v.clone()),
            }
        })
        .collect();
    Json::Object(fields)
}

/// A marker found: message, field, whether it ends the field, position in the cut text.
type Mark = (usize, usize, bool, usize);

/// `text` without the markers, and each marker; None where a marker is cut short.
fn cut(text: &str, prefix: &str) -> Option<(String, Vec<Mark>)> {
    let mut out = String::with_capacity(text.len());
    let mut marks = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find(prefix) {
        out.push_str(&rest[..at]);
        let body = &rest[at + prefix.len()..];
        let close = body.find(END)?;
        let (id, kind) = body[..close].split_at(close.checked_sub(1)?);
        let (m, f) = id.split_once('.')?;
        marks.push((m.parse().ok()?, f.parse().ok()?, kind == "e", out.len()));
        rest = &body[close + END.len_utf8()..];
    }
    out.push_str(rest);
    Some((out, marks))
}

impl JinjaTemplate {
    /// Attribution of `full` (the render of `messages`) located by a marked render; None
    /// where it cannot be proved (see the module docstring).
    pub(crate) fn located_pieces(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
        opts: &RenderOptions,
        full: &str,
    ) -> Option<Pieces> {
        let prefix = format!("{END}at{}:", nonce());
        let raws: Vec<Json> = messages.iter().enumerate().map(|(i, m)| mark_message(&m.raw, i, &prefix)).collect();
        let ctx = env::prepare_context(raws.iter(), tools, &self.special_tokens, &opts.kwargs());
        let (text, _) = self.render_spans(&ctx, messages.len(), opts.add_generation_prompt).ok()?;
        let (plain, marks) = cut(&text, &prefix)?;
        if plain != full {
            return None;
        }
        // every field shown at most once, whole
        let mut spans = vec![[(None, None); FIELDS.len()]; messages.len()];
        for &(m, f, is_end, pos) in &marks {
            let slot = spans.get_mut(m)?.get_mut(f)?;
            let side = if is_end { &mut slot.1 } else { &mut slot.0 };
            if side.replace(pos).is_some() {
                return None;
            }
        }
        let mut located: Vec<[Option<(usize, usize)>; FIELDS.len()]> = Vec::with_capacity(messages.len());
        for fields in &spans {
            let mut out = [None; FIELDS.len()];
            for (f, &(s, e)) in fields.iter().enumerate() {
                out[f] = match (s, e) {
                    (Some(s), Some(e)) if s <= e => Some((s, e)),
                    (None, None) => None,
                    _ => return None,
                };
            }
            located.push(out);
        }
        let first = |i: usize| located[i].iter().flatten().map(|s| s.0).min();
        let last = |i: usize| located[i].iter().flatten().map(|s| s.1).max();
        let ctx = self.context(messages, tools, opts);
        let mut pieces = Pieces::new();
        let mut lo = 0;
        for (i, msg) in messages.iter().enumerate() {
            let m = i as i32;
            if msg.role != Role::Assistant {
                if let Some((s, e)) = located[i][0] {
                    if s < lo {
                        return None;
                    }
                    pieces.push((s, e, Attr::content(m)));
                    lo = e;
                }
                continue;
            }
            let hi = (i + 1..messages.len()).find_map(first).unwrap_or(full.len());
            let window_end = first(i).unwrap_or(hi);
            if window_end < lo || last(i).is_some_and(|l| l > hi) {
                return None; // fields out of the messages' order
            }
            let (with, _) = self.render_spans(&ctx, i, true).ok()?;
            let (without, _) = self.render_spans(&ctx, i, false).ok()?;
            let prompt = &with[common_prefix(&with, &without)..];
            let from = prompt_end(&full[lo..window_end], prompt).map(|p| lo + p).or(first(i))?;
            let after = last(i).map_or(from, |l| l.max(from));
            if after > hi {
                return None;
            }
            let to = stop_after(full, after, hi, &self.stops).unwrap_or(after);
            let (cs, ce) = located[i][0].unwrap_or((to, to));
            let mut cuts = vec![from, to, cs.clamp(from, to), ce.clamp(from, to)];
            cuts.sort_unstable();
            cuts.dedup();
            for w in cuts.windows(2) {
                let attr = if w[0] >= cs && w[1] <= ce { Attr::content(m) } else { Attr::scaffold(m) };
                pieces.push((w[0], w[1], attr.trained()));
            }
            lo = to;
        }
        Some(pieces)
    }
}

/// Where the generation prompt ends in `window` (the text before an assistant turn's
/// first field): after its last occurrence, or of its longest leading lines where the
/// template rewrote the rest for this turn (e.g. dropped a prefilled `<think>`).
fn prompt_end(window: &str, prompt: &str) -> Option<usize> {
    let mut cut = prompt.len();
    while cut > 0 {
        let p = &prompt[..cut];
        if let Some(at) = window.rfind(p) {
            return Some(at + p.len());
        }
        cut = prompt[..cut - 1].rfind('\n').map_or(0, |n| n + 1);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_wrap_the_stripped_text_and_are_cut_back_out() {
        let m = marked("\n  4 + 4 \n", "<P>", 3, 1).unwrap();
        assert_eq!(m, format!("\n  <P>3.1s{END}4 + 4<P>3.1e{END} \n"));
        assert_eq!(marked(" \n", "<P>", 0, 0), None);
        let (text, marks) = cut(&format!("a{m}b"), "<P>").unwrap();
        assert_eq!(text, "a\n  4 + 4 \nb");
        assert_eq!(marks, vec![(3, 1, false, 4), (3, 1, true, 9)]);
        assert!(cut("a<P>3.1s", "<P>").is_none());
    }

    #[test]
    fn the_prompt_ends_after_its_last_occurrence_or_its_leading_lines() {
        assert_eq!(prompt_end("x<a>\ny<a>\n", "<a>\n"), Some(10));
        assert_eq!(prompt_end("x<a>\n", "<a>\n<think>\n"), Some(5));
        assert_eq!(prompt_end("x", "<a>\n"), None);
        assert_eq!(prompt_end("x", ""), None);
    }
}
