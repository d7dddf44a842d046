//! Parsing sampled completions into content, reasoning and tool calls.
//!
//! Structural tokens that are single tokens of the vocabulary (`<|im_end|>`, `<think>`,
//! `<tool_call>`, `<|eot_id|>`, ...) are matched by id, so a model (or a user) writing the
//! same characters as ordinary text cannot spoof them. DeepSeek-R1's tool-call markers
//! are not single tokens in its tokenizer, so they are matched on the decoded text.
//! A tool call that cannot be parsed comes back with `Malformed` status and its raw
//! text, never dropped.

use crate::json::Json;
use crate::render::{deepseek, Family, Renderer};
use crate::text::{lstrip_chars, strip, strip_chars};
use crate::Result;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallStatus {
    Ok,
    /// Not parseable (bad JSON, missing name, unterminated block).
    Malformed,
}

impl CallStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            CallStatus::Ok => "ok",
            CallStatus::Malformed => "malformed",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    /// Arguments as JSON text (an object) when parsed, "" when malformed.
    pub arguments: String,
    pub status: CallStatus,
    /// The call's text exactly as sampled.
    pub raw: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub content: String,
    /// Reasoning text, when the completion has a reasoning block.
    pub reasoning: Option<String>,
    pub tool_calls: Vec<ParsedCall>,
    /// The turn-close (stop) token was sampled.
    pub stopped: bool,
    /// Number of tokens before the stop token (or all of them).
    pub num_tokens: usize,
    /// The reasoning block was opened but never closed (truncated while thinking).
    pub reasoning_truncated: bool,
}

fn parse_call_json(raw: &str, args_key: &[&str]) -> ParsedCall {
    let malformed = || ParsedCall {
        name: String::new(),
        arguments: String::new(),
        status: CallStatus::Malformed,
        raw: raw.to_string(),
    };
    let Ok(v) = Json::parse(strip(raw)) else { return malformed() };
    let Some(name) = v.get("name").and_then(Json::as_str) else { return malformed() };
    let args = args_key.iter().find_map(|k| v.get(k));
    let arguments = match args {
        Some(a @ Json::Object(_)) => crate::json::dumps(a, None),
        Some(Json::Str(s)) if Json::parse(s).map(|j| j.is_object()).unwrap_or(false) => s.clone(),
        None => "{}".to_string(),
        _ => return malformed(),
    };
    ParsedCall { name: name.to_string(), arguments, status: CallStatus::Ok, raw: raw.to_string() }
}

impl Renderer {
    /// The ids that end an assistant turn for this family.
    pub fn stop_ids(&self) -> Vec<u32> {
        let names: &[&str] = match self.family {
            Family::Qwen3 | Family::Qwen25 => &["<|im_end|>", "<|endoftext|>"],
            Family::Llama3 => &["<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"],
            Family::DeepSeekR1 => &["<｜end▁of▁sentence｜>"],
            Family::Jinja => &[],
        };
        let mut ids: Vec<u32> = names.iter().filter_map(|n| self.tokenizer.token_id(n)).collect();
        if let Some(j) = &self.jinja {
            for t in j.stop_tokens() {
                if let Some(id) = self.tokenizer.token_id(t) {
                    if !ids.contains(&id) {
                        ids.push(id);
                    }
                }
            }
        }
        ids
    }

    /// Parse a sampled completion (the ids after the generation prompt).
    pub fn parse(&self, ids: &[i64]) -> Result<Parsed> {
        let ids = self.tokenizer.check_ids(ids)?;
        let stops = self.stop_ids();
        let end = ids.iter().position(|t| stops.contains(t));
        let body = &ids[..end.unwrap_or(ids.len())];
        let mut parsed = match self.family {
            Family::Qwen3 | Family::Qwen25 => self.parse_qwen(body)?,
            Family::Llama3 => self.parse_llama(body)?,
            Family::DeepSeekR1 => self.parse_deepseek(body)?,
            Family::Jinja => Parsed { content: self.tokenizer.decode(body)?, ..Parsed::empty() },
        };
        parsed.stopped = end.is_some();
        parsed.num_tokens = body.len();
        Ok(parsed)
    }

    /// Split off a `<think>...</think>` block (by id); returns (reasoning, truncated, rest).
    fn split_reasoning<'a>(&self, body: &'a [u32], open_by_default: bool) -> Result<(Option<String>, bool, &'a [u32])> {
        let open = self.tokenizer.token_id("<think>");
        let close = self.tokenizer.token_id("</think>");
        let (Some(open), Some(close)) = (open, close) else { return Ok((None, false, body)) };
        let start = usize::from(body.first() == Some(&open));
        match body.iter().position(|&t| t == close) {
            Some(c) if c >= start => {
                let reasoning = self.tokenizer.decode(&body[start..c])?;
                Ok((Some(strip_chars(&reasoning, &['\n']).to_string()), false, &body[c + 1..]))
            }
            _ if start == 1 || open_by_default => {
                let reasoning = self.tokenizer.decode(&body[start..])?;
                Ok((Some(strip_chars(&reasoning, &['\n']).to_string()), true, &body[body.len()..]))
            }
            _ => Ok((None, false, body)),
        }
    }

    fn parse_qwen(&self, body: &[u32]) -> Result<Parsed> {
        let (reasoning, truncated, rest) =
            if self.family == Family::Qwen3 { self.split_reasoning(body, false)? } else { (None, false, body) };
        let open = self.specials.id("<tool_call>");
        let close = self.specials.id("</tool_call>");
        let mut content_ids: Vec<u32> = Vec::new();
        let mut calls = Vec::new();
        let mut i = 0;
        while i < rest.len() {
            if rest[i] == open {
                let end = rest[i + 1..].iter().position(|&t| t == close).map(|p| i + 1 + p);
                let inner = &rest[i + 1..end.unwrap_or(rest.len())];
                let raw = self.tokenizer.decode(inner)?;
                let mut call = parse_call_json(&raw, &["arguments", "parameters"]);
                if end.is_none() {
                    call.status = CallStatus::Malformed; // unterminated: the turn was cut inside the call
                    call.raw = raw;
                }
                calls.push(call);
                i = end.map_or(rest.len(), |e| e + 1);
            } else {
                content_ids.push(rest[i]);
                i += 1;
            }
        }
        let content = self.tokenizer.decode(&content_ids)?;
        Ok(Parsed {
            content: strip_chars(&content, &['\n']).to_string(),
            reasoning,
            reasoning_truncated: truncated,
            tool_calls: calls,
            ..Parsed::empty()
        })
    }

    fn parse_llama(&self, body: &[u32]) -> Result<Parsed> {
        let python_tag = self.tokenizer.token_id("<|python_tag|>");
        let (text_ids, tagged) = match python_tag.and_then(|p| body.iter().position(|&t| t == p)) {
            Some(p) => (&body[p + 1..], true),
            None => (body, false),
        };
        let text = self.tokenizer.decode(text_ids)?;
        let trimmed = strip(&text);
        let looks_like_call = tagged || (trimmed.starts_with('{') && trimmed.contains("\"name\""));
        if looks_like_call {
            let call = parse_call_json(trimmed, &["parameters", "arguments"]);
            return Ok(Parsed { content: String::new(), tool_calls: vec![call], ..Parsed::empty() });
        }
        Ok(Parsed { content: trimmed.to_string(), ..Parsed::empty() })
    }

    fn parse_deepseek(&self, body: &[u32]) -> Result<Parsed> {
        let (reasoning, truncated, rest) = self.split_reasoning(body, self.think_prefill)?;
        let text = self.tokenizer.decode(rest)?;
        let (content, calls_text) = match text.find("<｜tool▁calls▁begin｜>") {
            Some(p) => (&text[..p], Some(&text[p + "<｜tool▁calls▁begin｜>".len()..])),
            None => (text.as_str(), None),
        };
        let mut calls = Vec::new();
        if let Some(calls_text) = calls_text {
            let calls_text = calls_text.split("<｜tool▁calls▁end｜>").next().unwrap_or_default();
            for block in calls_text.split("<｜tool▁call▁begin｜>").skip(1) {
                calls.push(parse_deepseek_call(block));
            }
        }
        Ok(Parsed {
            content: lstrip_chars(deepseek::visible_content(content), &['\n']).to_string(),
            reasoning,
            reasoning_truncated: truncated,
            tool_calls: calls,
            ..Parsed::empty()
        })
    }
}

/// `function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>`
fn parse_deepseek_call(block: &str) -> ParsedCall {
    let raw = block.split("<｜tool▁call▁end｜>").next().unwrap_or_default();
    let malformed = || ParsedCall {
        name: String::new(),
        arguments: String::new(),
        status: CallStatus::Malformed,
        raw: raw.to_string(),
    };
    if !block.contains("<｜tool▁call▁end｜>") {
        return malformed();
    }
    let Some((_, after_sep)) = raw.split_once("<｜tool▁sep｜>") else { return malformed() };
    let Some((name, args)) = after_sep.split_once('\n') else { return malformed() };
    let args = args.trim_start_matches("```json").trim_end_matches("```");
    let args = strip_chars(args, &['\n']);
    match Json::parse(args) {
        Ok(v) if v.is_object() => ParsedCall {
            name: name.to_string(),
            arguments: args.to_string(),
            status: CallStatus::Ok,
            raw: raw.to_string(),
        },
        _ => malformed(),
    }
}

impl Parsed {
    fn empty() -> Parsed {
        Parsed {
            content: String::new(),
            reasoning: None,
            tool_calls: vec![],
            stopped: false,
            num_tokens: 0,
            reasoning_truncated: false,
        }
    }
}
