//! Append-only extension of a sampled conversation (`bridge`).
//!
//! `prev` holds the ids of a conversation whose last turn is an assistant turn sampled
//! by the policy — possibly truncated (no turn-close token). `bridge` returns the ids to
//! append so that `prev + appended` is the conversation continued with `new_messages`
//! (tool results, a user reply, ...) and, optionally, the next generation prompt.
//! `prev` is never re-tokenized: a truncated turn is closed by appending its close token.
//!
//! It refuses (`ok = false`, with the reason) when the family's chat template, rendering
//! the continued conversation, would not reproduce `prev` — e.g. Qwen3 dropping the
//! reasoning of earlier turns once a new user query arrives, DeepSeek-R1 dropping all
//! reasoning from history, Llama trimming whitespace the model sampled, or a turn cut
//! inside its reasoning or a tool call. The caller then splits the rollout into separate
//! samples instead of training on a history the model will never see again.
//!
//! Cost: a scan of `prev` for structural ids plus decoding and re-rendering the last
//! turn only; independent of how long the conversation is otherwise.

use crate::json::{dumps, Json};
use crate::message::{Arguments, Message, Role, ToolCall};
use crate::render::builder::{Attr, Builder, Rendered};
use crate::render::qwen::{self, Place, Version};
use crate::render::{deepseek, llama3, Family, RenderOptions, Renderer};
use crate::text::strip;
use crate::Result;

#[derive(Debug, Clone, PartialEq)]
pub struct Bridged {
    pub ok: bool,
    /// Why the conversation cannot be extended ("" when ok).
    pub reason: String,
    /// Ids and attribution to append (message index refers to `new_messages`, -1 for
    /// the inserted turn close and the generation prompt).
    pub appended: Rendered,
    /// A close token was inserted because `prev` ended inside the assistant turn.
    pub closed_turn: bool,
}

fn refuse(reason: impl Into<String>) -> Result<Bridged> {
    Ok(Bridged { ok: false, reason: reason.into(), appended: Rendered::default(), closed_turn: false })
}

/// The sampled last turn located in `prev`.
struct LastTurn {
    /// Ids of the turn body (after the role header, before the close token).
    body_start: usize,
    body_end: usize,
    /// The close token is present (at body_end).
    closed: bool,
}

impl Renderer {
    /// Extend `prev` (ids ending with a sampled assistant turn) by `new_messages`.
    /// `history` (the messages `prev` renders, the sampled turn last) and `tools` are
    /// needed by the generic renderer, which proves each bridge by rendering.
    pub fn bridge(
        &self,
        prev: &[i64],
        new_messages: &[Message],
        opts: &RenderOptions,
        history: Option<&[Message]>,
        tools: Option<&[Json]>,
    ) -> Result<Bridged> {
        let prev = self.tokenizer.check_ids(prev)?;
        if prev.is_empty() {
            return refuse("prev_ids is empty: render the conversation instead");
        }
        let port = match self.family {
            Family::Qwen3 => self.bridge_qwen(Version::Qwen3, &prev, new_messages, opts),
            Family::Qwen25 => self.bridge_qwen(Version::Qwen25, &prev, new_messages, opts),
            Family::Llama3 => self.bridge_llama(&prev, new_messages, opts),
            Family::DeepSeekR1 => self.bridge_deepseek(&prev, new_messages, opts),
            Family::Jinja => match history {
                Some(h) => {
                    let jinja = self.jinja.as_ref().expect("the generic renderer has a template");
                    jinja.bridge(&self.tokenizer, &self.stop_ids(), &prev, h, new_messages, tools, opts)
                }
                None => refuse(
                    "the generic renderer bridges only given prev_messages (the conversation prev_ids render); \
                     render the whole conversation",
                ),
            },
        }?;
        // where the port's rules refuse, the model's own template may still prove the bridge
        if !port.ok {
            if let (Some(proof), Some(h)) = (&self.proof, history) {
                let proved = proof.bridge(&self.tokenizer, &self.stop_ids(), &prev, h, new_messages, tools, opts)?;
                if proved.ok {
                    return Ok(proved);
                }
            }
        }
        Ok(port)
    }

    /// Find the last turn opened by `header` (ids) and its close token.
    fn last_turn(
        &self,
        prev: &[u32],
        header: &[u32],
        close_ids: &[u32],
        allowed_tail: &[u32],
    ) -> std::result::Result<LastTurn, String> {
        let pos = (0..prev.len().saturating_sub(header.len() - 1))
            .rev()
            .find(|&i| prev[i..].starts_with(header))
            .ok_or_else(|| "prev_ids does not end with an assistant turn (no assistant header found)".to_string())?;
        let body_start = pos + header.len();
        match prev[body_start..].iter().position(|t| close_ids.contains(t)) {
            Some(c) => {
                let close = body_start + c;
                let tail = &prev[close + 1..];
                if !tail.is_empty() && tail != allowed_tail {
                    return Err(format!(
                        "{} tokens follow the assistant turn's close token; prev_ids must end with the sampled turn",
                        tail.len()
                    ));
                }
                Ok(LastTurn { body_start, body_end: close, closed: true })
            }
            None => Ok(LastTurn { body_start, body_end: prev.len(), closed: false }),
        }
    }

    fn finish(&self, b: Builder, closed_turn: bool) -> Result<Bridged> {
        Ok(Bridged { ok: true, reason: String::new(), appended: b.encode(&self.tokenizer)?, closed_turn })
    }

    // --- Qwen ------------------------------------------------------------------------------
    fn bridge_qwen(&self, version: Version, prev: &[u32], new: &[Message], opts: &RenderOptions) -> Result<Bridged> {
        let im_start = self.specials.id("<|im_start|>");
        let im_end = self.specials.id("<|im_end|>");
        let mut header = vec![im_start];
        header.extend(self.tokenizer.encode_ids("assistant\n")?);
        let newline = self.tokenizer.encode_ids("\n")?;
        let turn = match self.last_turn(prev, &header, &[im_end], &newline) {
            Ok(t) => t,
            Err(reason) => return refuse(reason),
        };
        let new_query = new.iter().any(|m| {
            m.role == Role::User && {
                let c = m.content_str();
                !(c.starts_with("<tool_response>") && c.ends_with("</tool_response>"))
            }
        });
        if version == Version::Qwen3 && new_query {
            if let Some(at) = self.qwen3_reasoning_after_last_query(prev, im_start) {
                return refuse(format!(
                    "a new user query makes Qwen3's template drop the reasoning of earlier assistant turns \
                     (the turn at token {at} has a <think> block): split the rollout"
                ));
            }
        }
        let body = &prev[turn.body_start..turn.body_end];
        let sampled = self.tokenizer.decode(body)?;
        let canonical = self.qwen_canonical_turn(version, body, !new_query)?;
        if canonical.as_deref() != Some(sampled.as_str()) {
            return refuse(match canonical {
                None => "the last assistant turn has a tool call the template cannot reproduce (malformed or cut off)"
                    .to_string(),
                Some(c) => format!(
                    "the chat template would render the last assistant turn differently ({}); split the rollout",
                    first_difference(&sampled, &c)
                ),
            });
        }
        let mut b = Builder::new();
        if !turn.closed {
            b.push(qwen::IM_END, Attr::GLOBAL);
        }
        if prev.len() == turn.body_end + 1 || !turn.closed {
            b.push("\n", Attr::GLOBAL);
        }
        let last_new_query = new.iter().rposition(|m| m.role == Role::User);
        for (j, msg) in new.iter().enumerate() {
            let place = Place {
                index: j as i32,
                first: false,
                last: j + 1 == new.len(),
                prev_role: Some(if j == 0 { Role::Assistant } else { new[j - 1].role }),
                next_role: new.get(j + 1).map(|m| m.role),
            };
            match msg.role {
                Role::User | Role::System => {
                    b.push(qwen::IM_START, Attr::scaffold(place.index));
                    b.push(msg.role.as_str(), Attr::scaffold(place.index));
                    b.push("\n", Attr::scaffold(place.index));
                    b.push(msg.content_str(), Attr::content(place.index));
                    b.push("<|im_end|>\n", Attr::scaffold(place.index));
                }
                Role::Tool => qwen::tool_message(&mut b, msg, place),
                Role::Assistant => match version {
                    Version::Qwen3 => qwen::qwen3_assistant(&mut b, msg, place, last_new_query.is_none_or(|q| j > q)),
                    Version::Qwen25 => qwen::qwen25_assistant(&mut b, msg, j)?,
                },
            }
        }
        if opts.add_generation_prompt {
            qwen::generation_prompt(&mut b, version, opts);
        }
        self.finish(b, !turn.closed)
    }

    /// Token position of an assistant turn after the last real user query that has a
    /// `<think>` block (Qwen3 drops those once a new query arrives).
    fn qwen3_reasoning_after_last_query(&self, prev: &[u32], im_start: u32) -> Option<usize> {
        let think = self.specials.id("<think>");
        let tool_response = self.specials.id("<tool_response>");
        let user = self.tokenizer.encode_ids("user\n").ok()?;
        let assistant = self.tokenizer.encode_ids("assistant\n").ok()?;
        let starts: Vec<usize> = prev.iter().enumerate().filter(|&(_, &t)| t == im_start).map(|(i, _)| i).collect();
        let mut last_query = None;
        for (k, &s) in starts.iter().enumerate() {
            let head = &prev[s + 1..];
            if head.starts_with(&user) && head.get(user.len()) != Some(&tool_response) {
                last_query = Some(k);
            }
        }
        let from = last_query.map_or(0, |k| k + 1);
        for (k, &s) in starts.iter().enumerate().skip(from) {
            if prev[s + 1..].starts_with(&assistant) {
                let end = starts.get(k + 1).copied().unwrap_or(prev.len());
                if prev[s..end].contains(&think) {
                    return Some(s);
                }
            }
        }
        None
    }

    /// How Qwen's template would write the sampled turn `body` (None: it cannot).
    fn qwen_canonical_turn(&self, version: Version, body: &[u32], after_last_query: bool) -> Result<Option<String>> {
        let open = self.specials.id("<tool_call>");
        let close = self.specials.id("</tool_call>");
        let first_call = body.iter().position(|&t| t == open).unwrap_or(body.len());
        let mut content = self.tokenizer.decode(&body[..first_call])?;
        let mut calls = Vec::new();
        let mut i = first_call;
        while i < body.len() {
            if body[i] != open {
                // text between or after calls is not something the template writes
                if self.tokenizer.decode(&body[i..i + 1])? == "\n" && body.get(i + 1) == Some(&open) {
                    i += 1;
                    continue;
                }
                return Ok(None);
            }
            let Some(end) = body[i + 1..].iter().position(|&t| t == close).map(|p| i + 1 + p) else { return Ok(None) };
            let raw = self.tokenizer.decode(&body[i + 1..end])?;
            let Some(call) = qwen_call_from_raw(version, &raw) else { return Ok(None) };
            calls.push(call);
            i = end + 1;
        }
        if !calls.is_empty() && content.ends_with('\n') {
            content.pop(); // the template's separator between content and the first call
        }
        let msg = Message {
            role: Role::Assistant,
            content: Some(content),
            reasoning_content: None,
            tool_calls: (!calls.is_empty()).then_some(calls),
            tool_call_id: None,
            name: None,
            raw: Json::Null,
        };
        let mut b = Builder::new();
        let place = Place { index: 0, first: false, last: false, prev_role: None, next_role: Some(Role::Tool) };
        match version {
            Version::Qwen3 => qwen::qwen3_assistant(&mut b, &msg, place, after_last_query),
            Version::Qwen25 => qwen::qwen25_assistant(&mut b, &msg, 0)?,
        }
        let text = b.text;
        let Some(inner) = text.strip_prefix("<|im_start|>assistant") else { return Ok(None) };
        let inner = inner.strip_prefix('\n').unwrap_or(inner);
        Ok(inner.strip_suffix("<|im_end|>\n").map(str::to_string))
    }

    // --- Llama 3 ---------------------------------------------------------------------------
    fn bridge_llama(&self, prev: &[u32], new: &[Message], opts: &RenderOptions) -> Result<Bridged> {
        let header = self.tokenizer.encode_ids("<|start_header_id|>assistant<|end_header_id|>\n\n")?;
        let eot = self.specials.id("<|eot_id|>");
        let eom = self.specials.id("<|eom_id|>");
        let turn = match self.last_turn(prev, &header, &[eot, eom], &[]) {
            Ok(t) => t,
            Err(reason) => return refuse(reason),
        };
        let sampled = self.tokenizer.decode(&prev[turn.body_start..turn.body_end])?;
        let canonical = llama_canonical_turn(&sampled);
        if canonical != sampled {
            return refuse(format!(
                "Llama's template would render the last assistant turn differently ({}); split the rollout",
                first_difference(&sampled, &canonical)
            ));
        }
        let mut b = Builder::new();
        if !turn.closed {
            b.push(llama3::EOT, Attr::GLOBAL);
        }
        for (j, msg) in new.iter().enumerate() {
            llama3::message(&mut b, msg, j)?;
        }
        if opts.add_generation_prompt {
            llama3::generation_prompt(&mut b);
        }
        self.finish(b, !turn.closed)
    }

    // --- DeepSeek-R1 -----------------------------------------------------------------------
    fn bridge_deepseek(&self, prev: &[u32], new: &[Message], opts: &RenderOptions) -> Result<Bridged> {
        let assistant = self.specials.id("<｜Assistant｜>");
        let eos = self.specials.id("<｜end▁of▁sentence｜>");
        let turn = match self.last_turn(prev, &[assistant], &[eos], &[]) {
            Ok(t) => t,
            Err(reason) => return refuse(reason),
        };
        if new.iter().any(|m| m.role == Role::System) {
            return refuse(
                "DeepSeek-R1's template moves every system message to the start of the conversation; \
                 split the rollout",
            );
        }
        let sampled = self.tokenizer.decode(&prev[turn.body_start..turn.body_end])?;
        if sampled.contains("<｜tool▁calls▁begin｜>") {
            return refuse("DeepSeek-R1's template rewrites tool-call turns in history (its is_first flag is never reset); split the rollout");
        }
        let visible = deepseek::visible_content(&sampled);
        if visible != sampled {
            return refuse("DeepSeek-R1's template drops the reasoning (up to </think>) of assistant turns in history; split the rollout");
        }
        // the markers are not single tokens (their ids depend on the text around them): match the text
        let history = self.tokenizer.decode(prev)?;
        let mut ns = deepseek::State {
            is_first: history.contains("<｜tool▁calls▁begin｜>"),
            is_tool: false,
            is_output_first: !history.contains("<｜tool▁outputs▁begin｜>"),
        };
        let mut b = Builder::new();
        if !turn.closed {
            b.push(deepseek::EOS, Attr::GLOBAL);
        }
        for (j, msg) in new.iter().enumerate() {
            deepseek::message(&mut b, msg, j, &mut ns)?;
        }
        if ns.is_tool {
            b.push("<｜tool▁outputs▁end｜>", Attr::GLOBAL);
        }
        if opts.add_generation_prompt && !ns.is_tool {
            deepseek::generation_prompt(&mut b, self.think_prefill);
        }
        self.finish(b, !turn.closed)
    }
}

fn qwen_call_from_raw(version: Version, raw: &str) -> Option<ToolCall> {
    let inner = raw.strip_prefix("\n{\"name\": \"")?.strip_suffix("}\n")?;
    let (name, args) = inner.split_once("\", \"arguments\": ")?;
    let value = Json::parse(args).ok()?;
    let arguments = match version {
        Version::Qwen3 => Arguments::Text(args.to_string()),
        Version::Qwen25 => Arguments::Value(value),
    };
    Some(ToolCall { id: None, kind: "function".into(), name: name.to_string(), arguments })
}

/// How Llama's template writes an assistant turn whose sampled text is `sampled`.
fn llama_canonical_turn(sampled: &str) -> String {
    if let Ok(v) = Json::parse(sampled) {
        if let (Some(name), Some(params)) = (v.get("name").and_then(Json::as_str), v.get("parameters")) {
            return format!("{{\"name\": \"{name}\", \"parameters\": {}}}", dumps(params, None));
        }
    }
    strip(sampled).to_string()
}

fn first_difference(a: &str, b: &str) -> String {
    let at = a.chars().zip(b.chars()).take_while(|(x, y)| x == y).count();
    let sample: String = a.chars().skip(at).take(20).collect();
    let canon: String = b.chars().skip(at).take(20).collect();
    format!("at character {at}: sampled {sample:?}, template {canon:?}")
}
