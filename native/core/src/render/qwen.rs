//! Qwen2.5 and Qwen3 chat templates (ChatML with Qwen's tool block and tool calls).
//!
//! A line-by-line port of the official Jinja templates (`qwen2.5-instruct` and `qwen3`
//! `tokenizer_config.json`), including their quirks:
//! - Qwen2.5 writes a default system prompt when there is none, and `tojson`s tool-call
//!   arguments even when they are already a JSON string (they come out quoted).
//! - Qwen3 keeps an assistant turn's reasoning (`<think>` block) only for turns after the
//!   last real user query, and for those only when the reasoning is non-empty or the turn
//!   is the last message; `</think>` inside content is split out as reasoning. Tool-call
//!   arguments given as a string are written raw.
//! - Consecutive tool results share one `user` turn as `<tool_response>` blocks.

use crate::json::dumps;
use crate::json::Json;
use crate::message::{Arguments, Message, Role, ToolCall};
use crate::render::builder::{Attr, Builder};
use crate::render::RenderOptions;
use crate::text::{lstrip_chars, rstrip_chars, split_first, split_last, strip_chars};
use crate::{CoreError, Result};

pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";
const QWEN25_DEFAULT_SYSTEM: &str = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";
const TOOLS_HEAD: &str = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>";
const TOOLS_TAIL: &str = "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    Qwen25,
    Qwen3,
}

/// Neighbourhood of a message inside the conversation (what the template's `loop` sees).
#[derive(Debug, Clone, Copy)]
pub struct Place {
    pub index: i32,
    pub first: bool,
    pub last: bool,
    pub prev_role: Option<Role>,
    pub next_role: Option<Role>,
}

impl Place {
    pub fn of(messages: &[Message], i: usize) -> Place {
        Place {
            index: i as i32,
            first: i == 0,
            last: i + 1 == messages.len(),
            prev_role: i.checked_sub(1).map(|j| messages[j].role),
            next_role: messages.get(i + 1).map(|m| m.role),
        }
    }
}

fn tools_block(b: &mut Builder, version: Version, messages: &[Message], tools: &[Json]) {
    let has_system = messages[0].role == Role::System;
    let sys = if has_system { 0 } else { -1 };
    b.push("<|im_start|>system\n", Attr::scaffold(sys));
    match version {
        Version::Qwen3 => {
            if has_system {
                b.push(messages[0].content_str(), Attr::content(0));
                b.push("\n\n", Attr::scaffold(0));
            }
            b.push(TOOLS_HEAD, Attr::scaffold(sys));
        }
        Version::Qwen25 => {
            if has_system {
                b.push(messages[0].content_str(), Attr::content(0));
            } else {
                b.push(QWEN25_DEFAULT_SYSTEM, Attr::scaffold(-1));
            }
            b.push("\n\n", Attr::scaffold(sys));
            b.push(TOOLS_HEAD, Attr::scaffold(sys));
        }
    }
    for tool in tools {
        b.push("\n", Attr::scaffold(sys));
        b.push(&dumps(tool, None), Attr::content(-1));
    }
    b.push(TOOLS_TAIL, Attr::scaffold(sys));
}

fn system_block(b: &mut Builder, version: Version, messages: &[Message]) {
    if messages[0].role == Role::System {
        b.push("<|im_start|>system\n", Attr::scaffold(0));
        b.push(messages[0].content_str(), Attr::content(0));
        b.push("<|im_end|>\n", Attr::scaffold(0));
    } else if version == Version::Qwen25 {
        b.push("<|im_start|>system\n", Attr::GLOBAL);
        b.push(QWEN25_DEFAULT_SYSTEM, Attr::GLOBAL);
        b.push("<|im_end|>\n", Attr::GLOBAL);
    }
}

/// A plain turn: `<|im_start|>role\ncontent<|im_end|>\n`.
fn plain_turn(b: &mut Builder, role: &str, content: &str, m: i32, train: bool) {
    b.push(IM_START, Attr::scaffold(m));
    b.push(role, Attr::scaffold(m));
    b.push("\n", Attr::scaffold(m));
    let c = Attr::content(m);
    b.push(content, if train { c.trained() } else { c });
    b.push(IM_END, if train { Attr::scaffold(m).trained() } else { Attr::scaffold(m) });
    b.push("\n", Attr::scaffold(m));
}

fn tool_call_json(b: &mut Builder, version: Version, call: &ToolCall, m: i32) {
    let scaffold = Attr::scaffold(m).trained();
    let content = Attr::content(m).trained();
    b.push("<tool_call>\n{\"name\": \"", scaffold);
    b.push(&call.name, content);
    b.push("\", \"arguments\": ", scaffold);
    match (&call.arguments, version) {
        (Arguments::Text(text), Version::Qwen3) => b.push(text, content),
        (args, _) => b.push(&args.to_json_text(), content),
    }
    b.push("}\n</tool_call>", scaffold);
}

/// A tool result: opens the shared `user` turn if the previous message is not a tool
/// result, closes it if the next one is not.
pub fn tool_message(b: &mut Builder, msg: &Message, place: Place) {
    let m = place.index;
    if place.first || place.prev_role != Some(Role::Tool) {
        b.push("<|im_start|>user", Attr::scaffold(m));
    }
    b.push("\n<tool_response>\n", Attr::scaffold(m));
    b.push(msg.content_str(), Attr::content(m));
    b.push("\n</tool_response>", Attr::scaffold(m));
    if place.last || place.next_role != Some(Role::Tool) {
        b.push("<|im_end|>\n", Attr::scaffold(m));
    }
}

/// The (reasoning, content) pair Qwen3's template derives from an assistant message.
pub fn qwen3_split_reasoning(msg: &Message) -> (String, String) {
    let content = msg.content_str();
    if let Some(r) = &msg.reasoning_content {
        return (r.clone(), content.to_string());
    }
    if content.contains("</think>") {
        let head = rstrip_chars(split_first(content, "</think>"), &['\n']);
        let reasoning = lstrip_chars(split_last(head, "<think>"), &['\n']);
        let rest = lstrip_chars(split_last(content, "</think>"), &['\n']);
        return (reasoning.to_string(), rest.to_string());
    }
    (String::new(), content.to_string())
}

/// Qwen3: whether the assistant turn is written with its `<think>` block.
pub fn qwen3_keeps_reasoning(after_last_query: bool, last: bool, reasoning: &str) -> bool {
    after_last_query && (last || !reasoning.is_empty())
}

pub fn qwen3_assistant(b: &mut Builder, msg: &Message, place: Place, after_last_query: bool) {
    let m = place.index;
    let (reasoning, content) = qwen3_split_reasoning(msg);
    b.push("<|im_start|>assistant\n", Attr::scaffold(m));
    if qwen3_keeps_reasoning(after_last_query, place.last, &reasoning) {
        b.push("<think>\n", Attr::scaffold(m).trained());
        b.push(strip_chars(&reasoning, &['\n']), Attr::content(m).trained());
        b.push("\n</think>\n\n", Attr::scaffold(m).trained());
        b.push(lstrip_chars(&content, &['\n']), Attr::content(m).trained());
    } else {
        b.push(&content, Attr::content(m).trained());
    }
    for (j, call) in msg.calls().iter().enumerate() {
        if (j == 0 && !content.is_empty()) || j > 0 {
            b.push("\n", Attr::scaffold(m).trained());
        }
        tool_call_json(b, Version::Qwen3, call, m);
    }
    b.push(IM_END, Attr::scaffold(m).trained());
    b.push("\n", Attr::scaffold(m));
}

pub fn qwen25_assistant(b: &mut Builder, msg: &Message, index: usize) -> Result<()> {
    let m = index as i32;
    let has_calls = !msg.calls().is_empty();
    if !has_calls {
        let Some(content) = &msg.content else {
            return Err(CoreError::InvalidMessage {
                index,
                reason: "qwen2.5: an assistant message without tool calls needs a string content".into(),
            });
        };
        plain_turn(b, "assistant", content, m, true);
        return Ok(());
    }
    b.push("<|im_start|>assistant", Attr::scaffold(m));
    let content = msg.content_str();
    if !content.is_empty() {
        b.push("\n", Attr::scaffold(m));
        b.push(content, Attr::content(m).trained());
    }
    for (j, call) in msg.calls().iter().enumerate() {
        // the first newline belongs to the generation prompt when there is no content
        let first_nl = if j == 0 && content.is_empty() { Attr::scaffold(m) } else { Attr::scaffold(m).trained() };
        b.push("\n", first_nl);
        tool_call_json(b, Version::Qwen25, call, m);
    }
    b.push(IM_END, Attr::scaffold(m).trained());
    b.push("\n", Attr::scaffold(m));
    Ok(())
}

/// Index of the last user message that is a real query (not a wrapped tool response),
/// or `len - 1` when there is none (Qwen3's `ns.last_query_index`).
pub fn qwen3_last_query_index(messages: &[Message]) -> usize {
    for (i, m) in messages.iter().enumerate().rev() {
        if m.role == Role::User {
            if let Some(c) = &m.content {
                if !(c.starts_with("<tool_response>") && c.ends_with("</tool_response>")) {
                    return i;
                }
            }
        }
    }
    messages.len().saturating_sub(1)
}

pub fn render(
    b: &mut Builder,
    version: Version,
    messages: &[Message],
    tools: &[Json],
    opts: &RenderOptions,
) -> Result<()> {
    if messages.is_empty() {
        return Err(CoreError::InvalidArgument("messages must not be empty".into()));
    }
    if !tools.is_empty() {
        tools_block(b, version, messages, tools);
    } else {
        system_block(b, version, messages);
    }
    let last_query = qwen3_last_query_index(messages);
    for (i, msg) in messages.iter().enumerate() {
        let place = Place::of(messages, i);
        match msg.role {
            Role::User => plain_turn(b, "user", msg.content_str(), i as i32, false),
            Role::System if i > 0 => plain_turn(b, "system", msg.content_str(), i as i32, false),
            Role::System => {}
            Role::Assistant => match version {
                Version::Qwen3 => qwen3_assistant(b, msg, place, i > last_query),
                Version::Qwen25 => qwen25_assistant(b, msg, i)?,
            },
            Role::Tool => tool_message(b, msg, place),
        }
    }
    if opts.add_generation_prompt {
        generation_prompt(b, version, opts);
    }
    Ok(())
}

pub fn generation_prompt(b: &mut Builder, version: Version, opts: &RenderOptions) {
    b.push("<|im_start|>assistant\n", Attr::GLOBAL);
    if version == Version::Qwen3 && opts.enable_thinking == Some(false) {
        b.push("<think>\n\n</think>\n\n", Attr::GLOBAL);
    }
}
