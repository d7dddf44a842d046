//! DeepSeek-R1 (distilled Qwen/Llama) chat template.
//!
//! Port of the official template, quirks included:
//! - every system message is dropped from its place; the last one's content is written
//!   right after BOS, without any marker;
//! - assistant content loses everything up to the last `</think>` (reasoning is never
//!   kept in history);
//! - tool calls (assistant messages with `content: None`): the template's `is_first` flag
//!   is never reset, so only the very first tool call of the conversation opens with
//!   `<｜Assistant｜><｜tool▁calls▁begin｜>`, and every later call is written with a
//!   leading newline and closed by `<｜tool▁calls▁end｜><｜end▁of▁sentence｜>` on its own;
//!   arguments must be a JSON string;
//! - tool outputs: the first of the conversation opens `<｜tool▁outputs▁begin｜>`, later
//!   ones start with a newline; an assistant answer right after tool outputs is written
//!   after `<｜tool▁outputs▁end｜>` with no `<｜Assistant｜>` marker;
//! - the generation prompt is `<｜Assistant｜>` (the think-prefill variant adds `<think>\n`),
//!   and is skipped while a tool-output block is open.

use crate::message::{Arguments, Message, Role};
use crate::render::builder::{Attr, Builder};
use crate::render::RenderOptions;
use crate::text::split_last;
use crate::{CoreError, Result};

pub const BOS: &str = "<｜begin▁of▁sentence｜>";
pub const EOS: &str = "<｜end▁of▁sentence｜>";
pub const USER: &str = "<｜User｜>";
pub const ASSISTANT: &str = "<｜Assistant｜>";

/// The template's `ns` namespace, carried across messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct State {
    pub is_first: bool,
    pub is_tool: bool,
    pub is_output_first: bool,
}

impl Default for State {
    fn default() -> Self {
        State { is_first: false, is_tool: false, is_output_first: true }
    }
}

/// Content of an assistant message as the template keeps it (after the last `</think>`).
pub fn visible_content(content: &str) -> &str {
    if content.contains("</think>") {
        split_last(content, "</think>")
    } else {
        content
    }
}

pub fn message(b: &mut Builder, msg: &Message, index: usize, ns: &mut State) -> Result<()> {
    let m = index as i32;
    let train = Attr::scaffold(m).trained();
    match msg.role {
        Role::User => {
            ns.is_tool = false;
            b.push(USER, Attr::scaffold(m));
            b.push(msg.content_str(), Attr::content(m));
        }
        Role::Assistant if msg.content.is_none() => {
            ns.is_tool = false;
            for (j, call) in msg.calls().iter().enumerate() {
                let Arguments::Text(arguments) = &call.arguments else {
                    return Err(CoreError::InvalidToolCall {
                        message: index,
                        call: j,
                        reason: "deepseek-r1 needs tool-call arguments as a JSON string".into(),
                    });
                };
                let opening = !ns.is_first;
                if opening {
                    b.push(ASSISTANT, Attr::scaffold(m));
                    b.push("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", train);
                    ns.is_first = true;
                } else {
                    b.push("\n<｜tool▁call▁begin｜>", train);
                }
                b.push(&call.kind, train);
                b.push("<｜tool▁sep｜>", train);
                b.push(&call.name, Attr::content(m).trained());
                b.push("\n```json\n", train);
                b.push(arguments, Attr::content(m).trained());
                b.push("\n```<｜tool▁call▁end｜>", train);
                if !opening {
                    b.push("<｜tool▁calls▁end｜><｜end▁of▁sentence｜>", train);
                }
            }
        }
        Role::Assistant => {
            let content = msg.content_str();
            if ns.is_tool {
                b.push("<｜tool▁outputs▁end｜>", Attr::scaffold(m));
                b.push(content, Attr::content(m).trained());
                b.push(EOS, train);
                ns.is_tool = false;
            } else {
                b.push(ASSISTANT, Attr::scaffold(m));
                b.push(visible_content(content), Attr::content(m).trained());
                b.push(EOS, train);
            }
        }
        Role::Tool => {
            ns.is_tool = true;
            if ns.is_output_first {
                b.push("<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>", Attr::scaffold(m));
                ns.is_output_first = false;
            } else {
                b.push("\n<｜tool▁output▁begin｜>", Attr::scaffold(m));
            }
            b.push(msg.content_str(), Attr::content(m));
            b.push("<｜tool▁output▁end｜>", Attr::scaffold(m));
        }
        Role::System => {}
    }
    Ok(())
}

pub fn render(b: &mut Builder, messages: &[Message], opts: &RenderOptions, think_prefill: bool) -> Result<State> {
    let system = messages.iter().rev().find(|m| m.role == Role::System);
    b.push(BOS, Attr::GLOBAL);
    if let Some(sys) = system {
        let i = messages.iter().rposition(|m| m.role == Role::System).unwrap_or(0) as i32;
        b.push(sys.content_str(), Attr::content(i));
    }
    let mut ns = State::default();
    for (i, msg) in messages.iter().enumerate() {
        message(b, msg, i, &mut ns)?;
    }
    if ns.is_tool {
        b.push("<｜tool▁outputs▁end｜>", Attr::GLOBAL);
    }
    if opts.add_generation_prompt && !ns.is_tool {
        generation_prompt(b, think_prefill);
    }
    Ok(ns)
}

pub fn generation_prompt(b: &mut Builder, think_prefill: bool) {
    b.push(ASSISTANT, Attr::GLOBAL);
    if think_prefill {
        b.push("<think>\n", Attr::GLOBAL);
    }
}
