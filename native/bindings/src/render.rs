//! Bindings of `treadle_core::render`: the `Renderer` class and its results.

use std::path::PathBuf;

use numpy::{IntoPyArray, PyArray1};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use rayon::prelude::*;
use treadle_core::json::Json;
use treadle_core::message::{parse_messages_owned, parse_tools, Message};
use treadle_core::render::bridge::Bridged;
use treadle_core::render::parse::{Parsed, ParsedCall};
use treadle_core::render::{Family, MaskConvention, RenderOptions, Rendered, Renderer, RendererConfig};

use crate::convert::{ids_from_py, to_json, to_json_list};
use crate::errors::to_py_err;

/// A rendered conversation: token ids and per-token attribution (numpy arrays of equal length).
#[pyclass(module = "treadle_native", name = "Rendered", frozen)]
pub struct PyRendered {
    /// The rendered text (what the chat template produces).
    #[pyo3(get)]
    text: String,
    /// Token ids, int32 [n].
    #[pyo3(get)]
    token_ids: Py<PyArray1<i32>>,
    /// Index of the message each token belongs to, int32 [n]; -1 outside any message.
    #[pyo3(get)]
    message_index: Py<PyArray1<i32>>,
    /// 1 where the model generates the token (assistant turns), uint8 [n].
    #[pyo3(get)]
    loss_mask: Py<PyArray1<u8>>,
    /// 1 where the token comes from caller-provided text, 0 for template scaffold, uint8 [n].
    #[pyo3(get)]
    is_content: Py<PyArray1<u8>>,
    /// Generic (jinja) renderer only: whether every prefix rendered as a prefix of the next.
    #[pyo3(get)]
    prefix_stable: Option<bool>,
    len: usize,
}

impl PyRendered {
    pub fn new(py: Python<'_>, r: Rendered, prefix_stable: Option<bool>) -> PyRendered {
        let len = r.token_ids.len();
        let ids: Vec<i32> = r.token_ids.into_iter().map(|t| t as i32).collect();
        PyRendered {
            text: r.text,
            token_ids: ids.into_pyarray(py).unbind(),
            message_index: r.message_index.into_pyarray(py).unbind(),
            loss_mask: r.loss_mask.into_pyarray(py).unbind(),
            is_content: r.is_content.into_pyarray(py).unbind(),
            prefix_stable,
            len,
        }
    }
}

#[pymethods]
impl PyRendered {
    fn __len__(&self) -> usize {
        self.len
    }

    fn __repr__(&self) -> String {
        format!("Rendered(num_tokens={}, prefix_stable={:?})", self.len, self.prefix_stable)
    }
}

/// Renderer(family, tokenizer, *, chat_template=None, bos_token=None, eos_token=None)
/// --
///
/// Renders chats to token ids exactly as the family's chat template + tokenizer do.
/// `family`: "qwen3", "qwen2.5", "llama3", "deepseek-r1", or "jinja" (any HF chat
/// template, given as `chat_template` or read from tokenizer_config.json). `tokenizer`:
/// a tokenizer.json file or a folder holding one.
#[pyclass(module = "treadle_native", name = "Renderer", frozen)]
pub struct PyRenderer {
    inner: Renderer,
}

pub struct Call {
    pub messages: Vec<Message>,
    pub tools: Option<Vec<Json>>,
}

/// Validate messages as the renderer's family needs them (the generic renderer takes any role and content parts).
fn parse_for(generic: bool, values: Vec<Json>) -> PyResult<Vec<Message>> {
    parse_messages_owned(values, generic).map_err(to_py_err)
}

/// Extra template variables (`**template_kwargs`) as JSON values.
fn template_kwargs(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(String, Json)>> {
    let mut out = Vec::new();
    if let Some(d) = kwargs {
        for (k, v) in d.iter() {
            let key: String = k.extract()?;
            let value = to_json(&v, &format!("template_kwargs.{key}"))?;
            out.push((key, value));
        }
    }
    Ok(out)
}

pub fn convert_call(messages: &Bound<'_, PyAny>, tools: Option<&Bound<'_, PyAny>>, generic: bool) -> PyResult<Call> {
    let messages = parse_for(generic, to_json_list(messages, "messages")?)?;
    let tools = match tools {
        Some(t) if !t.is_none() => Some(parse_tools(&to_json_list(t, "tools")?).map_err(to_py_err)?),
        _ => None,
    };
    Ok(Call { messages, tools })
}

#[pymethods]
impl PyRenderer {
    #[new]
    #[pyo3(signature = (family, tokenizer, *, chat_template=None, bos_token=None, eos_token=None, force=false, loss_mask="auto"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        family: &str,
        tokenizer: PathBuf,
        chat_template: Option<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
        force: bool,
        loss_mask: &str,
    ) -> PyResult<Self> {
        let loss_mask: MaskConvention = loss_mask.parse().map_err(to_py_err)?;
        let config = RendererConfig { chat_template, bos_token, eos_token, force, loss_mask };
        let inner = py.detach(|| Renderer::new(family, &tokenizer, config)).map_err(to_py_err)?;
        Ok(PyRenderer { inner })
    }

    /// The family name.
    #[getter]
    fn family(&self) -> &'static str {
        self.inner.family.name()
    }

    /// Why this renderer was chosen (one line, for startup logs).
    #[getter]
    fn selection(&self) -> &str {
        &self.inner.selection
    }

    /// sha256 of the chat template (line endings and one trailing newline normalized),
    /// or None when the model has no template (a family port used as named).
    #[getter]
    fn template_sha256(&self) -> Option<String> {
        self.inner.template_sha256.clone()
    }

    /// Generic renderer: the loss-mask convention in force ("sampled" or "generation");
    /// None for the family ports (which mark what the model generates).
    #[getter]
    fn loss_mask_convention(&self) -> Option<&'static str> {
        self.inner.jinja.as_ref().map(|j| match j.mask_convention() {
            MaskConvention::Generation => "generation",
            _ => "sampled",
        })
    }

    /// Ids that end an assistant turn (stop tokens), int32 [k].
    #[getter]
    fn stop_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i32>> {
        let ids: Vec<i32> = self.inner.stop_ids().into_iter().map(|t| t as i32).collect();
        ids.into_pyarray(py)
    }

    /// Number of token ids the tokenizer can produce.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.tokenizer.vocab_size
    }

    /// render(messages, tools=None, add_generation_prompt=False, *, enable_thinking=None, date_string=None, tools_in_user_message=None, **template_kwargs)
    /// --
    ///
    /// Render one conversation (a list of message dicts) to a `Rendered`. Extra keyword
    /// arguments are template variables (generic renderer), as transformers passes them.
    #[pyo3(signature = (messages, tools=None, add_generation_prompt=false, *, enable_thinking=None, date_string=None, tools_in_user_message=None, **template_kwargs))]
    #[allow(clippy::too_many_arguments)]
    fn render(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        tools: Option<&Bound<'_, PyAny>>,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
        date_string: Option<String>,
        tools_in_user_message: Option<bool>,
        template_kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyRendered> {
        let call = convert_call(messages, tools, self.generic())?;
        let opts = RenderOptions {
            add_generation_prompt,
            enable_thinking,
            date_string,
            tools_in_user_message,
            template_kwargs: self.kwargs(template_kwargs)?,
        };
        let (r, stable) =
            py.detach(|| self.inner.render_checked(&call.messages, call.tools.as_deref(), &opts)).map_err(to_py_err)?;
        Ok(PyRendered::new(py, r, stable))
    }

    /// render_batch(conversations, tools=None, add_generation_prompt=False, *, enable_thinking=None, date_string=None, tools_in_user_message=None, **template_kwargs)
    /// --
    ///
    /// Render many conversations in parallel (all threads, GIL released). `tools` is
    /// shared by every conversation.
    #[pyo3(signature = (conversations, tools=None, add_generation_prompt=false, *, enable_thinking=None, date_string=None, tools_in_user_message=None, **template_kwargs))]
    #[allow(clippy::too_many_arguments)]
    fn render_batch(
        &self,
        py: Python<'_>,
        conversations: &Bound<'_, PyAny>,
        tools: Option<&Bound<'_, PyAny>>,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
        date_string: Option<String>,
        tools_in_user_message: Option<bool>,
        template_kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Vec<PyRendered>> {
        let tools = match tools {
            Some(t) if !t.is_none() => Some(parse_tools(&to_json_list(t, "tools")?).map_err(to_py_err)?),
            _ => None,
        };
        let mut calls = Vec::new();
        for (i, conv) in conversations.try_iter()?.enumerate() {
            let conv = conv?;
            let values = to_json_list(&conv, &format!("conversations[{i}]"))?;
            calls.push(parse_for(self.generic(), values)?);
        }
        let opts = RenderOptions {
            add_generation_prompt,
            enable_thinking,
            date_string,
            tools_in_user_message,
            template_kwargs: self.kwargs(template_kwargs)?,
        };
        let results = py.detach(|| {
            calls
                .par_iter()
                .map(|msgs| self.inner.render_checked(msgs, tools.as_deref(), &opts))
                .collect::<Result<Vec<_>, _>>()
        });
        let results = results.map_err(to_py_err)?;
        Ok(results.into_iter().map(|(r, s)| PyRendered::new(py, r, s)).collect())
    }

    /// bridge(prev_ids, new_messages, add_generation_prompt=True, *, prev_messages=None, tools=None, enable_thinking=None, **template_kwargs)
    /// --
    ///
    /// Extend `prev_ids` (a conversation ending with a sampled assistant turn, possibly
    /// truncated) by `new_messages`, append-only. Returns a `Bridge`; when `ok` is False
    /// the template would rewrite history and `reason` says why. The generic renderer
    /// needs `prev_messages` (the conversation `prev_ids` render, the sampled turn last)
    /// and the `tools` the conversation was rendered with.
    #[pyo3(signature = (prev_ids, new_messages, add_generation_prompt=true, *, prev_messages=None, tools=None, enable_thinking=None, **template_kwargs))]
    #[allow(clippy::too_many_arguments)]
    fn bridge(
        &self,
        py: Python<'_>,
        prev_ids: &Bound<'_, PyAny>,
        new_messages: &Bound<'_, PyAny>,
        add_generation_prompt: bool,
        prev_messages: Option<&Bound<'_, PyAny>>,
        tools: Option<&Bound<'_, PyAny>>,
        enable_thinking: Option<bool>,
        template_kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyBridge> {
        let prev = ids_from_py(prev_ids, "prev_ids")?;
        let generic = self.generic();
        let call = convert_call(new_messages, tools, generic)?;
        let prev_messages = prev_messages.filter(|h| !h.is_none());
        let history = |h: &Bound<'_, PyAny>| parse_for(generic, to_json_list(h, "prev_messages")?);
        let opts = RenderOptions {
            add_generation_prompt,
            enable_thinking,
            template_kwargs: self.kwargs(template_kwargs)?,
            ..RenderOptions::default()
        };
        let tools = call.tools.as_deref();
        // a family port bridges by its rules without the conversation; only where they
        // refuse does the model's template need it (converting 200 messages costs as
        // much as the port's whole bridge)
        let bridged = match prev_messages {
            Some(h) if generic => {
                let h = history(h)?;
                py.detach(|| self.inner.bridge(&prev, &call.messages, &opts, Some(&h), tools))
            }
            Some(h) => {
                let port =
                    py.detach(|| self.inner.bridge(&prev, &call.messages, &opts, None, tools)).map_err(to_py_err)?;
                if port.ok || self.inner.proof.is_none() {
                    Ok(port)
                } else {
                    let h = history(h)?;
                    py.detach(|| self.inner.bridge(&prev, &call.messages, &opts, Some(&h), tools))
                }
            }
            None => py.detach(|| self.inner.bridge(&prev, &call.messages, &opts, None, tools)),
        }
        .map_err(to_py_err)?;
        Ok(PyBridge::new(py, &prev, bridged))
    }

    /// parse(completion_ids)
    /// --
    ///
    /// Parse sampled completion ids (after the generation prompt) into content,
    /// reasoning and tool calls. Structural tokens are matched by id.
    fn parse(&self, py: Python<'_>, completion_ids: &Bound<'_, PyAny>) -> PyResult<PyParsed> {
        let ids = ids_from_py(completion_ids, "completion_ids")?;
        let parsed = py.detach(|| self.inner.parse(&ids)).map_err(to_py_err)?;
        Ok(PyParsed::new(parsed))
    }

    fn __repr__(&self) -> String {
        format!("Renderer(family={:?}, vocab_size={})", self.inner.family.name(), self.inner.tokenizer.vocab_size)
    }
}

impl PyRenderer {
    fn generic(&self) -> bool {
        self.inner.family == Family::Jinja
    }

    fn kwargs(&self, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(String, Json)>> {
        template_kwargs(kwargs)
    }
}

/// Result of `Renderer.bridge`.
#[pyclass(module = "treadle_native", name = "Bridge", frozen)]
pub struct PyBridge {
    /// True when the conversation extends append-only.
    #[pyo3(get)]
    ok: bool,
    /// Why it cannot ("" when ok).
    #[pyo3(get)]
    reason: String,
    /// prev_ids followed by the appended ids, int32 (just prev_ids when not ok).
    #[pyo3(get)]
    token_ids: Py<PyArray1<i32>>,
    /// The appended part: ids, int32 [k].
    #[pyo3(get)]
    appended_ids: Py<PyArray1<i32>>,
    /// Index into new_messages of each appended token, int32 [k]; -1 for inserted scaffold
    /// (the generic renderer counts what closes the sampled turn as the first new message's).
    #[pyo3(get)]
    message_index: Py<PyArray1<i32>>,
    /// Loss mask of the appended tokens, uint8 [k].
    #[pyo3(get)]
    loss_mask: Py<PyArray1<u8>>,
    /// Content flag of the appended tokens, uint8 [k].
    #[pyo3(get)]
    is_content: Py<PyArray1<u8>>,
    /// The sampled turn was truncated and its close token was appended.
    #[pyo3(get)]
    closed_turn: bool,
    /// The appended text.
    #[pyo3(get)]
    text: String,
}

impl PyBridge {
    fn new(py: Python<'_>, prev: &[i64], b: Bridged) -> PyBridge {
        let appended: Vec<i32> = b.appended.token_ids.iter().map(|&t| t as i32).collect();
        let mut all: Vec<i32> = prev.iter().map(|&t| t as i32).collect();
        all.extend_from_slice(&appended);
        PyBridge {
            ok: b.ok,
            reason: b.reason,
            token_ids: all.into_pyarray(py).unbind(),
            appended_ids: appended.into_pyarray(py).unbind(),
            message_index: b.appended.message_index.into_pyarray(py).unbind(),
            loss_mask: b.appended.loss_mask.into_pyarray(py).unbind(),
            is_content: b.appended.is_content.into_pyarray(py).unbind(),
            closed_turn: b.closed_turn,
            text: b.appended.text,
        }
    }
}

#[pymethods]
impl PyBridge {
    fn __bool__(&self) -> bool {
        self.ok
    }

    fn __repr__(&self) -> String {
        if self.ok {
            format!("Bridge(ok=True, closed_turn={})", self.closed_turn)
        } else {
            format!("Bridge(ok=False, reason={:?})", self.reason)
        }
    }
}

/// One tool call parsed from a completion.
#[pyclass(module = "treadle_native", name = "ParsedToolCall", frozen)]
#[derive(Clone)]
pub struct PyParsedToolCall {
    /// Tool name ("" when malformed).
    #[pyo3(get)]
    name: String,
    /// Arguments as JSON text of an object ("" when malformed).
    #[pyo3(get)]
    arguments: String,
    /// "ok" or "malformed".
    #[pyo3(get)]
    status: &'static str,
    /// The call's text exactly as sampled.
    #[pyo3(get)]
    raw_text: String,
}

#[pymethods]
impl PyParsedToolCall {
    fn __repr__(&self) -> String {
        format!("ParsedToolCall(name={:?}, status={:?})", self.name, self.status)
    }
}

impl From<ParsedCall> for PyParsedToolCall {
    fn from(c: ParsedCall) -> Self {
        PyParsedToolCall { name: c.name, arguments: c.arguments, status: c.status.as_str(), raw_text: c.raw }
    }
}

/// Result of `Renderer.parse`.
#[pyclass(module = "treadle_native", name = "Parsed", frozen)]
pub struct PyParsed {
    /// Visible answer text.
    #[pyo3(get)]
    content: String,
    /// Reasoning text, or None when the completion has no reasoning block.
    #[pyo3(get)]
    reasoning: Option<String>,
    /// Tool calls in order (malformed ones included, with status "malformed").
    #[pyo3(get)]
    tool_calls: Vec<PyParsedToolCall>,
    /// The turn-close token was sampled (False: truncated).
    #[pyo3(get)]
    stopped: bool,
    /// Tokens before the stop token.
    #[pyo3(get)]
    num_tokens: usize,
    /// A reasoning block was opened and never closed.
    #[pyo3(get)]
    reasoning_truncated: bool,
}

impl PyParsed {
    fn new(p: Parsed) -> PyParsed {
        PyParsed {
            content: p.content,
            reasoning: p.reasoning,
            tool_calls: p.tool_calls.into_iter().map(Into::into).collect(),
            stopped: p.stopped,
            num_tokens: p.num_tokens,
            reasoning_truncated: p.reasoning_truncated,
        }
    }
}

#[pymethods]
impl PyParsed {
    fn __repr__(&self) -> String {
        format!(
            "Parsed(content={:?}, reasoning={}, tool_calls={}, stopped={})",
            self.content.chars().take(40).collect::<String>(),
            self.reasoning.is_some(),
            self.tool_calls.len(),
            self.stopped
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyRenderer>()?;
    m.add_class::<PyRendered>()?;
    m.add_class::<PyBridge>()?;
    m.add_class::<PyParsed>()?;
    m.add_class::<PyParsedToolCall>()?;
    Ok(())
}
