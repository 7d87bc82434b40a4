//! Chat templates. A model directory with a `tokenizer_config.json` holding a
//! `chat_template` (HF convention; `lmrr import-gguf` writes SmolLM2's) is
//! rendered with minijinja, as transformers renders it with Jinja2. Models
//! without one — the synthetic models — use the built-in ChatML template
//! (SmolLM2's format without its default system prompt):
//! each message renders as `<|im_start|>{role}\n{content}<|im_end|>\n`, and the
//! prompt ends with `<|im_start|>assistant\n`.
//!
//! A message may splice an earlier request's output *token ids* instead of
//! text (what an agent harness that keeps token ids sends): the rendered
//! prompt is a list of [`Part`]s, text pieces tokenized separately, so a later
//! turn's prompt starts with exactly the earlier turn's tokens and the prefix
//! cache can serve it.

/// A piece of a rendered prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Text(String),
    /// Output of the named request, spliced as token ids.
    Output(String),
}

/// Content of a chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    Text(String),
    OutputOf(String),
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: Content,
}

/// Renders messages with the ChatML template and the generation prompt.
/// Adjacent text is merged into one part.
pub fn render_chatml(messages: &[Message]) -> Vec<Part> {
    let mut parts: Vec<Part> = Vec::new();
    let push_text = |parts: &mut Vec<Part>, s: &str| match parts.last_mut() {
        Some(Part::Text(t)) => t.push_str(s),
        _ => parts.push(Part::Text(s.to_string())),
    };
    for m in messages {
        push_text(&mut parts, &format!("<|im_start|>{}\n", m.role));
        match &m.content {
            Content::Text(t) => push_text(&mut parts, t),
            Content::OutputOf(id) => parts.push(Part::Output(id.clone())),
        }
        push_text(&mut parts, "<|im_end|>\n");
    }
    push_text(&mut parts, "<|im_start|>assistant\n");
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chatml_with_spliced_output() {
        let m = [
            Message {
                role: "user".into(),
                content: Content::Text("hi".into()),
            },
            Message {
                role: "assistant".into(),
                content: Content::OutputOf("t1".into()),
            },
            Message {
                role: "user".into(),
                content: Content::Text("more".into()),
            },
        ];
        assert_eq!(
            render_chatml(&m),
            vec![
                Part::Text("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n".into()),
                Part::Output("t1".into()),
                Part::Text(
                    "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n".into()
                ),
            ]
        );
    }
}

/// Private-use characters that mark a spliced output inside rendered text.
const MARK_OPEN: char = '\u{F8F0}';
const MARK_CLOSE: char = '\u{F8F1}';

/// A model's own Jinja chat template.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

/// Largest template accepted, bytes; rendering also runs on a fuel budget so a
/// hostile template cannot loop forever.
const MAX_TEMPLATE: usize = 1 << 20;
const RENDER_FUEL: u64 = 10_000_000;

impl ChatTemplate {
    /// Reads `chat_template` (and the BOS/EOS token strings) from the bytes of
    /// a `tokenizer_config.json`; `Ok(None)` if it has no template.
    pub fn from_tokenizer_config(
        bytes: &[u8],
        path: &std::path::Path,
    ) -> Result<Option<Self>, crate::EngineError> {
        let err = |msg: String| crate::EngineError::Config {
            path: path.into(),
            msg,
        };
        let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| err(e.to_string()))?;
        let Some(src) = v.get("chat_template").and_then(|t| t.as_str()) else {
            return Ok(None);
        };
        if src.len() > MAX_TEMPLATE {
            return Err(err(format!(
                "chat_template is {} bytes, limit {MAX_TEMPLATE}",
                src.len()
            )));
        }
        let tok = |k: &str| v.get(k).and_then(|t| t.as_str()).unwrap_or("").to_string();
        let t = Self {
            source: src.to_string(),
            bos_token: tok("bos_token"),
            eos_token: tok("eos_token"),
        };
        // Fail on a template that does not compile, at load rather than at use.
        t.env().map_err(|e| err(format!("chat_template: {e}")))?;
        Ok(Some(t))
    }

    fn env(&self) -> Result<minijinja::Environment<'_>, minijinja::Error> {
        let mut env = minijinja::Environment::new();
        env.set_fuel(Some(RENDER_FUEL));
        env.add_template("chat", &self.source)?;
        Ok(env)
    }

    /// Renders `messages` with the generation prompt; spliced outputs come
    /// back as [`Part::Output`].
    pub fn render(&self, messages: &[Message]) -> Result<Vec<Part>, String> {
        let msgs: Vec<_> = messages
            .iter()
            .map(|m| {
                let content = match &m.content {
                    Content::Text(t) => t.clone(),
                    Content::OutputOf(id) => format!("{MARK_OPEN}{id}{MARK_CLOSE}"),
                };
                minijinja::context! { role => m.role.clone(), content => content }
            })
            .collect();
        let env = self.env().map_err(|e| e.to_string())?;
        let text = env
            .get_template("chat")
            .and_then(|t| {
                t.render(minijinja::context! {
                    messages => msgs,
                    add_generation_prompt => true,
                    bos_token => self.bos_token.clone(),
                    eos_token => self.eos_token.clone(),
                })
            })
            .map_err(|e| e.to_string())?;
        let mut parts = Vec::new();
        let mut rest = text.as_str();
        while let Some(i) = rest.find(MARK_OPEN) {
            if i > 0 {
                parts.push(Part::Text(rest[..i].to_string()));
            }
            let after = &rest[i + MARK_OPEN.len_utf8()..];
            let j = after
                .find(MARK_CLOSE)
                .ok_or("unterminated output marker in the rendered template")?;
            parts.push(Part::Output(after[..j].to_string()));
            rest = &after[j + MARK_CLOSE.len_utf8()..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_string()));
        }
        Ok(parts)
    }
}

#[cfg(test)]
mod template_tests {
    use super::*;

    const SMOLLM2: &str = r#"{"chat_template": "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}", "eos_token": "<|im_end|>"}"#;

    #[test]
    fn smollm2_template_inserts_its_default_system_prompt_and_keeps_splices() {
        let t = ChatTemplate::from_tokenizer_config(
            SMOLLM2.as_bytes(),
            std::path::Path::new("tc.json"),
        )
        .unwrap()
        .unwrap();
        let m = [
            Message {
                role: "user".into(),
                content: Content::Text("hi".into()),
            },
            Message {
                role: "assistant".into(),
                content: Content::OutputOf("t1".into()),
            },
        ];
        assert_eq!(
            t.render(&m).unwrap(),
            vec![
                Part::Text("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n".into()),
                Part::Output("t1".into()),
                Part::Text("<|im_end|>\n<|im_start|>assistant\n".into()),
            ]
        );
    }

    #[test]
    fn a_broken_or_endless_template_is_an_error() {
        let bad = br#"{"chat_template": "{% for %}"}"#;
        assert!(ChatTemplate::from_tokenizer_config(bad, std::path::Path::new("tc.json")).is_err());
        let endless = br#"{"chat_template": "{% for i in range(100000000) %}x{% endfor %}"}"#;
        let t = ChatTemplate::from_tokenizer_config(endless, std::path::Path::new("tc.json"))
            .unwrap()
            .unwrap();
        assert!(t.render(&[]).is_err());
    }
}
