//! Chat messages and tool schemas, validated once from JSON-like input.
//!
//! The bindings turn Python dicts into [`Json`]; this module checks roles, field types
//! and tool-call arguments and keeps the raw value for the generic Jinja renderer.
//! Family-specific requirements (e.g. Llama's single tool call) live with the family.

use crate::json::{dumps, Json};
use crate::{CoreError, Result};

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// Arguments of a tool call as the caller gave them.
#[derive(Debug, Clone, PartialEq)]
pub enum Arguments {
    /// A JSON value (usually an object), e.g. from a Python dict.
    Value(Json),
    /// JSON text, as in the OpenAI API; validated to parse.
    Text(String),
}

impl Arguments {
    /// `tojson` of the arguments as a template writes them.
    pub fn to_json_text(&self) -> String {
        match self {
            Arguments::Value(v) => dumps(v, None),
            Arguments::Text(t) => dumps(&Json::Str(t.clone()), None),
        }
    }
}

/// One tool call of an assistant message.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: Option<String>,
    /// The `type` field ("function" unless the caller says otherwise).
    pub kind: String,
    pub name: String,
    pub arguments: Arguments,
}

/// One validated chat message.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: Role,
    /// `None` when the field is absent or null.
    pub content: Option<String>,
    pub reasoning_content: Option<String>,
    /// Present (even empty) when the message has a `tool_calls` key that is not null.
    pub tool_calls: Option<Vec<ToolCall>>,
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
    /// The message as given (for the generic Jinja renderer).
    pub raw: Json,
}

impl Message {
    pub fn content_str(&self) -> &str {
        self.content.as_deref().unwrap_or("")
    }

    /// Tool calls, or an empty slice.
    pub fn calls(&self) -> &[ToolCall] {
        self.tool_calls.as_deref().unwrap_or(&[])
    }
}

fn invalid(index: usize, reason: impl Into<String>) -> CoreError {
    CoreError::InvalidMessage { index, reason: reason.into() }
}

fn opt_str(index: usize, obj: &Json, key: &str) -> Result<Option<String>> {
    match obj.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::Str(s)) => Ok(Some(s.clone())),
        Some(other) => Err(invalid(index, format!("{key} must be a string or null, got {}", type_name(other)))),
    }
}

pub fn type_name(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "bool",
        Json::Int(_) => "int",
        Json::Float(_) => "float",
        Json::Str(_) => "str",
        Json::Array(_) => "list",
        Json::Object(_) => "dict",
    }
}

fn tool_call(message: usize, call: usize, value: &Json) -> Result<ToolCall> {
    let err = |reason: String| CoreError::InvalidToolCall { message, call, reason };
    if !value.is_object() {
        return Err(err(format!("must be a dict, got {}", type_name(value))));
    }
    // OpenAI shape {"id", "type", "function": {"name", "arguments"}} or flat {"name", "arguments"}
    let function = match value.get("function") {
        Some(f @ Json::Object(_)) => f,
        Some(other) => return Err(err(format!("function must be a dict, got {}", type_name(other)))),
        None => value,
    };
    let name = match function.get("name") {
        Some(Json::Str(s)) => s.clone(),
        Some(other) => return Err(err(format!("name must be a string, got {}", type_name(other)))),
        None => return Err(err("name is missing".into())),
    };
    let arguments = match function.get("arguments") {
        Some(Json::Str(text)) => match Json::parse(text) {
            Ok(_) => Arguments::Text(text.clone()),
            Err(e) => return Err(err(format!("arguments of {name:?} are not valid JSON ({e}): {text:?}"))),
        },
        Some(v @ Json::Object(_)) => Arguments::Value(v.clone()),
        None | Some(Json::Null) => Arguments::Value(Json::Object(vec![])),
        Some(other) => {
            return Err(err(format!("arguments of {name:?} must be a JSON string or a dict, got {}", type_name(other))))
        }
    };
    let id = match value.get("id") {
        Some(Json::Str(s)) => Some(s.clone()),
        _ => None,
    };
    let kind = match value.get("type") {
        Some(Json::Str(s)) => s.clone(),
        _ => "function".to_string(),
    };
    Ok(ToolCall { id, kind, name, arguments })
}

impl Message {
    /// Validate message `index` of a conversation for a family renderer: the four roles,
    /// string content.
    pub fn from_json(index: usize, value: &Json) -> Result<Message> {
        Message::parse(index, value.clone(), false)
    }

    /// Validate message `index`; `generic`: for the generic renderer, which hands the
    /// message to the chat template as given: any role string (roles other than system,
    /// user, assistant and tool count as non-assistant turns for attribution), content a
    /// string, a list of parts (their `text` fields are used to locate the content) or
    /// absent. The message keeps `value` as `raw`.
    fn parse(index: usize, value: Json, generic: bool) -> Result<Message> {
        if !value.is_object() {
            return Err(invalid(index, format!("must be a dict, got {}", type_name(&value))));
        }
        let role = match value.get("role") {
            Some(Json::Str(r)) => match r.as_str() {
                "system" | "developer" if generic => Role::System,
                "system" => Role::System,
                "user" => Role::User,
                "assistant" => Role::Assistant,
                "tool" | "ipython" => Role::Tool,
                _ if generic => Role::User,
                other => {
                    return Err(invalid(
                        index,
                        format!("role: unknown role {other:?}; expected system, user, assistant or tool"),
                    ))
                }
            },
            Some(other) => return Err(invalid(index, format!("role must be a string, got {}", type_name(other)))),
            None => return Err(invalid(index, "role is missing")),
        };
        let content = match value.get("content") {
            None | Some(Json::Null) => None,
            Some(Json::Str(s)) => Some(s.clone()),
            Some(Json::Array(parts)) if generic => Some(
                parts
                    .iter()
                    .filter_map(|p| match p {
                        Json::Str(s) => Some(s.as_str()),
                        part => part.get("text").and_then(Json::as_str),
                    })
                    .collect::<Vec<_>>()
                    .join(""),
            ),
            Some(_) if generic => None,
            Some(other) => {
                return Err(invalid(
                    index,
                    format!(
                        "content must be a string or null, got {} (content parts need the generic renderer)",
                        type_name(other)
                    ),
                ))
            }
        };
        let tool_calls = match value.get("tool_calls") {
            None | Some(Json::Null) => None,
            Some(Json::Array(items)) => {
                Some(items.iter().enumerate().map(|(j, c)| tool_call(index, j, c)).collect::<Result<Vec<_>>>()?)
            }
            Some(other) => return Err(invalid(index, format!("tool_calls must be a list, got {}", type_name(other)))),
        };
        if !generic {
            if tool_calls.is_some() && role != Role::Assistant {
                return Err(invalid(
                    index,
                    format!("tool_calls: only assistant messages carry tool_calls, not {}", role.as_str()),
                ));
            }
            if content.is_none() && matches!(role, Role::System | Role::User | Role::Tool) {
                return Err(invalid(index, format!("content: a {} message needs a string content", role.as_str())));
            }
        }
        // the generic renderer hands fields to the template as they are; only strings matter here
        let field = |key: &str| match (generic, value.get(key)) {
            (true, Some(Json::Str(s))) => Ok(Some(s.clone())),
            (true, _) => Ok(None),
            (false, _) => opt_str(index, &value, key),
        };
        Ok(Message {
            role,
            content,
            // as transformers: the first of reasoning_content, thinking, reasoning that is set
            reasoning_content: match field("reasoning_content")? {
                Some(r) => Some(r),
                None => match field("thinking")? {
                    Some(r) => Some(r),
                    None => field("reasoning")?,
                },
            },
            tool_calls,
            tool_call_id: field("tool_call_id")?,
            name: field("name")?,
            raw: value,
        })
    }
}

/// Validate a conversation (for a family renderer).
pub fn parse_messages(values: &[Json]) -> Result<Vec<Message>> {
    values.iter().enumerate().map(|(i, v)| Message::from_json(i, v)).collect()
}

/// Validate a conversation, taking the values (kept as the messages' `raw`, not copied);
/// `generic`: for the generic renderer (see [`Message::parse`]).
pub fn parse_messages_owned(values: Vec<Json>, generic: bool) -> Result<Vec<Message>> {
    values.into_iter().enumerate().map(|(i, v)| Message::parse(i, v, generic)).collect()
}

/// Validate tool schemas (each a dict).
pub fn parse_tools(values: &[Json]) -> Result<Vec<Json>> {
    for (i, v) in values.iter().enumerate() {
        if !v.is_object() {
            return Err(CoreError::InvalidArgument(format!("tools[{i}] must be a dict, got {}", type_name(v))));
        }
    }
    Ok(values.to_vec())
}
