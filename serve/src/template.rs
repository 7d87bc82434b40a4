//! Chat prompts for the server: OpenAI messages (and `tools`) rendered to the
//! prompt text the model was trained on.
//!
//! - A model with its own Jinja template (`tokenizer_config.json`) is
//!   rendered with minijinja as transformers renders it: `messages` as sent
//!   (role, content, and `tool_calls` / `tool_call_id` / `name`), `tools` and
//!   `tool_choice` when the template reads them, `add_generation_prompt`,
//!   `bos_token`, `eos_token`, HF's `raise_exception` and Python string
//!   methods (minijinja-contrib's pycompat). A template that never mentions
//!   `tools` gets none: the request's tools are ignored and a warning says so.
//! - A model without one (the synthetic models) uses the engine's built-in
//!   ChatML, exactly as `lmrr generate --chat` and session scripts do, so a
//!   plain chat request and `lmrr generate --chat` send the same tokens.
//!   Roles pass through (`tool` renders as `<|im_start|>tool`); an assistant
//!   turn's `tool_calls` are written after its content as
//!   `<tool_call>{json}</tool_call>` lines (the Hermes convention); `tools`
//!   are ignored with a warning.
//!
//! Rendering runs on a fuel budget, like the engine's, so a template cannot
//! loop forever; a template error is the server's fault (500), not the
//! client's.

use lmrr_engine::chat::{Content, Message, Part};
use lmrr_engine::Model;
use serde_json::{Map, Value};

use crate::api::ChatMessage;
use crate::error::ApiError;

/// The engine's fuel for template rendering (`engine/src/chat.rs`).
const RENDER_FUEL: u64 = 10_000_000;

/// Renders chat requests for one model.
pub struct Renderer {
    /// The model's template, compiled once (its source is leaked: one
    /// template per server process).
    jinja: Option<Jinja>,
    /// Without a template: whether the vocabulary has ChatML's tokens (the
    /// built-in ChatML is used only then).
    chatml: bool,
}

struct Jinja {
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
    reads_tools: bool,
}

/// A rendered prompt and what was left out of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    pub text: String,
    pub warnings: Vec<String>,
}

fn raise_exception(msg: String) -> Result<String, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        msg,
    ))
}

impl Renderer {
    /// Compiles the model's template, if it has one.
    pub fn new(model: &Model) -> Result<Self, String> {
        let Some(t) = &model.chat_template else {
            return Ok(Self {
                jinja: None,
                chatml: model.speaks_chatml(),
            });
        };
        let source: &'static str = Box::leak(t.source().to_string().into_boxed_str());
        let mut env = minijinja::Environment::new();
        env.set_fuel(Some(RENDER_FUEL));
        env.add_function("raise_exception", raise_exception);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_template("chat", source)
            .map_err(|e| format!("chat template: {e}"))?;
        let (bos, eos) = t.special_tokens();
        Ok(Self {
            jinja: Some(Jinja {
                env,
                bos: bos.to_string(),
                eos: eos.to_string(),
                reads_tools: source.contains("tools"),
            }),
            chatml: false,
        })
    }

    /// Whether `tools` reach the template.
    pub fn reads_tools(&self) -> bool {
        self.jinja.as_ref().is_some_and(|j| j.reads_tools)
    }

    /// Renders messages (with the generation prompt) to prompt text.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        tool_choice: Option<&Value>,
    ) -> Result<Rendered, ApiError> {
        let mut warnings = Vec::new();
        if tools.is_some() && !self.reads_tools() {
            warnings.push(format!(
                "`tools` ignored: {} does not read them",
                if self.jinja.is_some() {
                    "the model's chat template"
                } else {
                    "the built-in ChatML template"
                }
            ));
        }
        let text = match &self.jinja {
            None if !self.chatml => {
                return Err(ApiError::bad_request(
                    "the model has no chat template and its vocabulary has no ChatML tokens: \
                     use /v1/completions with a plain prompt",
                ))
            }
            None => chatml(messages),
            Some(j) => {
                let msgs: Vec<Value> = messages
                    .iter()
                    .map(|m| {
                        let mut o = Map::new();
                        o.insert("role".into(), Value::String(m.role.clone()));
                        o.insert(
                            "content".into(),
                            Value::String(m.content.clone().unwrap_or_default()),
                        );
                        for (k, v) in &m.extra {
                            let v = if k == "tool_calls" {
                                arguments_as_objects(v)
                            } else {
                                v.clone()
                            };
                            o.insert(k.clone(), v);
                        }
                        Value::Object(o)
                    })
                    .collect();
                let tools = if j.reads_tools { tools } else { None };
                let ctx = minijinja::context! {
                    messages => minijinja::Value::from(minijinja::value::Serde(&msgs)),
                    tools => tools.map(|t| minijinja::Value::from(minijinja::value::Serde(t))),
                    tool_choice => tool_choice.map(|t| minijinja::Value::from(minijinja::value::Serde(t))),
                    add_generation_prompt => true,
                    bos_token => j.bos.clone(),
                    eos_token => j.eos.clone(),
                };
                j.env
                    .get_template("chat")
                    .and_then(|t| t.render(ctx))
                    .map_err(|e| {
                        ApiError::server(format!("rendering the model's chat template: {e}"))
                    })?
            }
        };
        Ok(Rendered { text, warnings })
    }
}

/// The engine's built-in ChatML (see `lmrr_engine::chat::render_chatml`),
/// with tool calls written into the assistant's content.
fn chatml(messages: &[ChatMessage]) -> String {
    let msgs: Vec<Message> = messages
        .iter()
        .map(|m| {
            let mut content = m.content.clone().unwrap_or_default();
            if let Some(Value::Array(calls)) = m.extra.get("tool_calls").map(arguments_as_objects) {
                for c in &calls {
                    if !content.is_empty() {
                        content.push('\n');
                    }
                    content.push_str(&format!("<tool_call>\n{c}\n</tool_call>"));
                }
            }
            Message {
                role: m.role.clone(),
                content: Content::Text(content),
            }
        })
        .collect();
    lmrr_engine::chat::render_chatml(&msgs)
        .into_iter()
        .map(|p| match p {
            Part::Text(t) => t,
            // Only `Content::OutputOf` messages splice, and none is built here.
            Part::Output(_) => String::new(),
        })
        .collect()
}

/// An assistant turn's `tool_calls` as templates expect them: OpenAI sends
/// each call's `function.arguments` as a JSON string, and chat templates
/// (Qwen's and Hermes', through `tojson`) were trained on the object, so a
/// string that parses as a JSON object is given as that object, as vLLM and
/// llama.cpp's server do. Anything else is passed as sent.
fn arguments_as_objects(calls: &Value) -> Value {
    let mut calls = calls.clone();
    if let Value::Array(list) = &mut calls {
        for c in list {
            if let Some(Value::Object(f)) = c.get_mut("function") {
                if let Some(Value::String(a)) = f.get("arguments") {
                    if let Ok(obj @ Value::Object(_)) = serde_json::from_str::<Value>(a) {
                        f.insert("arguments".into(), obj);
                    }
                }
            }
        }
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(content.into()),
            extra: Map::new(),
        }
    }

    #[test]
    fn chatml_matches_the_engine_for_plain_messages() {
        let m = [msg("system", "be brief"), msg("user", "hi")];
        assert_eq!(
            chatml(&m),
            "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    fn with_template(src: &str) -> Renderer {
        let mut files = lmrr_engine::SynthSpec::embedded_default().build();
        let cfg = serde_json::json!({"chat_template": src, "eos_token": "<|im_end|>"});
        files.tokenizer_config = Some((cfg.to_string().into_bytes(), "tc.json".into()));
        Renderer::new(&Model::from_files(files).unwrap()).unwrap()
    }

    #[test]
    fn a_template_that_reads_tools_gets_them_and_the_tool_calls() {
        let r = with_template(
            "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}\
             [{{ m.role }}] {{ m.content.strip() }}{% if m.tool_calls %} CALLS {{ m.tool_calls[0].function.name }}{% endif %}\
             {% if m.tool_call_id %} ID {{ m.tool_call_id }}{% endif %}\n{% endfor %}",
        );
        assert!(r.reads_tools());
        let mut a = msg("assistant", "");
        a.extra.insert(
            "tool_calls".into(),
            serde_json::json!([{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]),
        );
        let mut t = msg("tool", "  files  ");
        t.extra.insert("tool_call_id".into(), "c1".into());
        let tools = serde_json::json!([{"type": "function", "function": {"name": "ls"}}]);
        let out = r
            .render(&[msg("user", "list"), a, t], Some(&tools), None)
            .unwrap();
        assert!(out.warnings.is_empty());
        assert!(out.text.starts_with("TOOLS [{"), "{}", out.text);
        assert!(out.text.contains("[assistant]  CALLS ls"), "{}", out.text);
        assert!(out.text.contains("[tool] files ID c1"), "{}", out.text);
    }

    #[test]
    fn tools_a_template_ignores_are_a_warning_and_raise_exception_is_a_500() {
        let r = with_template("{% for m in messages %}{{ m.content }}{% endfor %}");
        let tools = serde_json::json!([{"type": "function"}]);
        let out = r.render(&[msg("user", "x")], Some(&tools), None).unwrap();
        assert_eq!(out.text, "x");
        assert_eq!(out.warnings.len(), 1);
        let r = with_template("{{ raise_exception('roles must alternate') }}");
        let e = r.render(&[msg("user", "x")], None, None).unwrap_err();
        assert_eq!(e.status, 500);
        assert!(e.message.contains("roles must alternate"), "{e}");
    }

    #[test]
    fn a_call_s_string_arguments_reach_the_template_as_the_object_they_hold() {
        let r = with_template(
            "{% for m in messages %}{% for c in m.tool_calls or [] %}\
             {{ c.function.name }} {{ c.function.arguments | tojson }} \
             {% if c.function.arguments is mapping %}OBJ {{ c.function.arguments.city }}{% else %}STR{% endif %}\n\
             {% endfor %}{% endfor %}",
        );
        let mut a = msg("assistant", "");
        a.extra.insert(
            "tool_calls".into(),
            serde_json::json!([
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "raw", "arguments": "not json"}},
                {"id": "c3", "type": "function", "function": {"name": "list", "arguments": "[1, 2]"}},
            ]),
        );
        let out = r
            .render(&[msg("user", "x"), a.clone()], None, None)
            .unwrap();
        assert!(
            out.text.contains("weather {\"city\": \"Paris\"} OBJ Paris"),
            "{}",
            out.text
        );
        // Not an object: passed as sent, a string.
        assert!(out.text.contains("raw \"not json\" STR"), "{}", out.text);
        assert!(out.text.contains("list \"[1, 2]\" STR"), "{}", out.text);
        // The built-in ChatML writes the object too.
        let text = chatml(&[msg("user", "x"), a]);
        assert!(text.contains(r#""arguments":{"city":"Paris"}"#), "{text}");
        assert!(text.contains(r#""arguments":"not json""#), "{text}");
    }

    #[test]
    fn tool_calls_are_written_into_chatml() {
        let mut a = msg("assistant", "");
        a.extra.insert(
            "tool_calls".into(),
            serde_json::json!([{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
        );
        let text = chatml(&[msg("user", "x"), a, msg("tool", "42")]);
        assert!(
            text.contains("<|im_start|>assistant\n<tool_call>\n{"),
            "{text}"
        );
        assert!(text.contains("<|im_start|>tool\n42<|im_end|>"), "{text}");
    }
}
