//! Llama 3.1 / 3.2 chat templates (JSON tool calling, tools in the first user message).
//!
//! Port of the official template of Llama-3.2-Instruct (3.1 differs only in the default
//! date, which callers fix with `date_string`). Quirks kept: message content is
//! `| trim`med (Python whitespace), the system block always carries the knowledge
//! cutoff and today's date, tools go into the first message (whatever its role) unless
//! `tools_in_user_message=False`, tool results are `tojson`ed (so a string result comes
//! out quoted), and an assistant turn carries exactly one tool call.

use crate::json::{dumps, Json};
use crate::message::{Arguments, Message, Role};
use crate::render::builder::{Attr, Builder};
use crate::render::RenderOptions;
use crate::text::strip;
use crate::{CoreError, Result};

pub const BOS: &str = "<|begin_of_text|>";
pub const EOT: &str = "<|eot_id|>";
const TOOLS_SYSTEM: &str = "You have access to the following functions. To call a function, please respond with JSON for a function call.Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n";
const TOOLS_USER: &str = "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.Do not use variables.\n\n";

/// Today's date as `strftime("%d %b %Y")` (UTC), the template's default `date_string`.
pub fn today() -> String {
    let (year, month, day) = crate::text::utc_today();
    format!("{day:02} {} {year}", crate::text::MONTH_ABBR[(month - 1) as usize])
}

fn tool_schemas(b: &mut Builder, tools: &[Json], m: i32) {
    for t in tools {
        b.push(&dumps(t, Some(4)), Attr::content(-1));
        b.push("\n\n", Attr::scaffold(m));
    }
}

fn header(b: &mut Builder, role: &str, m: i32) {
    b.push("<|start_header_id|>", Attr::scaffold(m));
    b.push(role, Attr::scaffold(m));
    b.push("<|end_header_id|>\n\n", Attr::scaffold(m));
}

/// One message after the system block (and after the tools-in-user message).
pub fn message(b: &mut Builder, msg: &Message, index: usize) -> Result<()> {
    let m = index as i32;
    match (msg.role, &msg.tool_calls) {
        (Role::Assistant, Some(calls)) => {
            if calls.len() != 1 {
                return Err(CoreError::InvalidMessage {
                    index,
                    reason: format!("llama3 supports exactly one tool call per message, got {}", calls.len()),
                });
            }
            let call = &calls[0];
            header(b, "assistant", m);
            let train = Attr::scaffold(m).trained();
            b.push("{\"name\": \"", train);
            b.push(&call.name, Attr::content(m).trained());
            b.push("\", \"parameters\": ", train);
            let args = match &call.arguments {
                Arguments::Value(v) => dumps(v, None),
                Arguments::Text(t) => dumps(&Json::Str(t.clone()), None),
            };
            b.push(&args, Attr::content(m).trained());
            b.push("}", train);
            b.push(EOT, train);
        }
        (Role::Tool, _) => {
            header(b, "ipython", m);
            // `content is iterable` holds for strings, so the template tojson's them
            b.push(&dumps(&Json::Str(msg.content_str().to_string()), None), Attr::content(m));
            b.push(EOT, Attr::scaffold(m));
        }
        (role, _) => {
            let Some(content) = &msg.content else {
                return Err(CoreError::InvalidMessage {
                    index,
                    reason: "llama3: this message needs a string content".into(),
                });
            };
            let train = role == Role::Assistant;
            header(b, role.as_str(), m);
            let c = Attr::content(m);
            b.push(strip(content), if train { c.trained() } else { c });
            b.push(EOT, if train { Attr::scaffold(m).trained() } else { Attr::scaffold(m) });
        }
    }
    Ok(())
}

pub fn render(b: &mut Builder, messages: &[Message], tools: Option<&[Json]>, opts: &RenderOptions) -> Result<()> {
    b.push(BOS, Attr::GLOBAL);
    let tools_in_user = opts.tools_in_user_message.unwrap_or(true);
    let date = opts.date_string.clone().unwrap_or_else(today);
    let mut rest: Vec<(usize, &Message)> = messages.iter().enumerate().collect();
    let mut system: Option<(i32, &str)> = None;
    if let Some((0, first)) = rest.first().copied() {
        if first.role == Role::System {
            system = Some((0, strip(first.content_str())));
            rest.remove(0);
        }
    }
    let sys_m = system.map_or(-1, |(i, _)| i);
    header(b, "system", sys_m);
    if tools.is_some() {
        b.push("Environment: ipython\n", Attr::scaffold(sys_m));
    }
    b.push("Cutting Knowledge Date: December 2023\n", Attr::scaffold(sys_m));
    b.push("Today Date: ", Attr::scaffold(sys_m));
    b.push(&date, Attr::content(-1));
    b.push("\n\n", Attr::scaffold(sys_m));
    if let (Some(tools), false) = (tools, tools_in_user) {
        b.push(TOOLS_SYSTEM, Attr::scaffold(sys_m));
        tool_schemas(b, tools, sys_m);
    }
    if let Some((i, text)) = system {
        b.push(text, Attr::content(i));
    }
    b.push(EOT, Attr::scaffold(sys_m));
    if let (Some(tools), true) = (tools, tools_in_user) {
        let Some((i, first)) = rest.first().copied() else {
            return Err(CoreError::InvalidArgument(
                "llama3: tools go into the first user message, but there is no message after the system prompt".into(),
            ));
        };
        rest.remove(0);
        let m = i as i32;
        header(b, "user", m);
        b.push(TOOLS_USER, Attr::scaffold(m));
        tool_schemas(b, tools, m);
        b.push(strip(first.content_str()), Attr::content(m));
        b.push(EOT, Attr::scaffold(m));
    }
    for (i, msg) in rest {
        message(b, msg, i)?;
    }
    if opts.add_generation_prompt {
        generation_prompt(b);
    }
    Ok(())
}

pub fn generation_prompt(b: &mut Builder) {
    b.push("<|start_header_id|>assistant<|end_header_id|>\n\n", Attr::GLOBAL);
}
