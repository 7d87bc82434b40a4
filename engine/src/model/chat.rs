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
//!
//! Invariant: splicing is structural, never in-band. Text reaches the model as
//! text whatever characters it holds, and a [`Part::Output`] comes only from a
//! [`Content::OutputOf`] message. The built-in template builds parts directly.
//! A Jinja template renders to one string, so each spliced message is rendered
//! as a placeholder `S{index}S`: `index` is the message's position and `S` is a
//! sentinel character chosen afresh for each rendering as the first
//! private-use character that occurs in none of its inputs (message texts,
//! roles, the template source, the BOS/EOS strings). Every `S` in the output
//! therefore comes from a placeholder, and the output is cut there; a
//! placeholder that does not name a spliced message is an error, not a guess.
//! The parts do not depend on which sentinel was chosen.

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

/// Sentinel candidates, in order of preference: the top of the BMP's
/// private-use area (U+F8F0 first), the rest of it, then the supplementary
/// private-use planes. Plane-final noncharacters are skipped.
const SENTINELS: [std::ops::RangeInclusive<u32>; 3] =
    [0xF8F0..=0xF8FF, 0xE000..=0xF8EF, 0xF0000..=0x10FFFD];

fn is_sentinel_candidate(c: char) -> bool {
    let u = c as u32;
    SENTINELS.iter().any(|r| r.contains(&u)) && (u & 0xFFFE) != 0xFFFE
}

/// The first candidate in neither `reserved` nor any of `texts`; `None` only
/// if together they hold every candidate (over 137,000 distinct characters).
fn free_sentinel<'a>(
    reserved: &std::collections::BTreeSet<char>,
    texts: impl Iterator<Item = &'a str>,
) -> Option<char> {
    let mut used = reserved.clone();
    used.extend(
        texts
            .flat_map(str::chars)
            .filter(|&c| is_sentinel_candidate(c)),
    );
    SENTINELS
        .iter()
        .flat_map(|r| r.clone())
        .filter_map(char::from_u32)
        .filter(|&c| is_sentinel_candidate(c))
        .find(|c| !used.contains(c))
}

/// A model's own Jinja chat template.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
    /// Sentinel candidates occurring in the source or the BOS/EOS strings.
    reserved: std::collections::BTreeSet<char>,
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
        // A string, or (as transformers also writes it) a list of named
        // templates, of which the one named `default` is the chat template.
        let src = match v.get("chat_template") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.as_str(),
            Some(serde_json::Value::Array(list)) => {
                fn named(t: &serde_json::Value) -> Option<(&str, &str)> {
                    Some((t.get("name")?.as_str()?, t.get("template")?.as_str()?))
                }
                let mut default = None;
                for t in list {
                    let (name, template) = named(t).ok_or_else(|| {
                        err(format!(
                            "chat_template: list entry {t} is not {{\"name\": .., \"template\": ..}}"
                        ))
                    })?;
                    if name == "default" {
                        default = Some(template);
                    }
                }
                default.ok_or_else(|| {
                    err(
                        "chat_template: a list of named templates without one named `default`"
                            .into(),
                    )
                })?
            }
            Some(other) => {
                return Err(err(format!(
                    "chat_template must be a string or a list of named templates, not {other}"
                )))
            }
        };
        if src.len() > MAX_TEMPLATE {
            return Err(err(format!(
                "chat_template is {} bytes, limit {MAX_TEMPLATE}",
                src.len()
            )));
        }
        let tok = |k: &str| v.get(k).and_then(|t| t.as_str()).unwrap_or("").to_string();
        let (bos_token, eos_token) = (tok("bos_token"), tok("eos_token"));
        let reserved = [src, bos_token.as_str(), eos_token.as_str()]
            .iter()
            .flat_map(|t| t.chars())
            .filter(|&c| is_sentinel_candidate(c))
            .collect();
        let t = Self {
            source: src.to_string(),
            bos_token,
            eos_token,
            reserved,
        };
        // Fail on a template that does not compile, at load rather than at use.
        t.env().map_err(|e| err(format!("chat_template: {e}")))?;
        Ok(Some(t))
    }

    /// The template's Jinja source (for renderers that pass more than role
    /// and content, such as `lmrr serve` with `tools`).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The BOS and EOS token strings of `tokenizer_config.json`.
    pub fn special_tokens(&self) -> (&str, &str) {
        (&self.bos_token, &self.eos_token)
    }

    fn env(&self) -> Result<minijinja::Environment<'_>, minijinja::Error> {
        let mut env = minijinja::Environment::new();
        env.set_fuel(Some(RENDER_FUEL));
        env.add_template("chat", &self.source)?;
        Ok(env)
    }

    /// Renders `messages` with the generation prompt; spliced outputs come
    /// back as [`Part::Output`] (see the module header for how).
    pub fn render(&self, messages: &[Message]) -> Result<Vec<Part>, String> {
        let texts = messages.iter().flat_map(|m| {
            let content = match &m.content {
                Content::Text(t) => t.as_str(),
                Content::OutputOf(_) => "",
            };
            [m.role.as_str(), content]
        });
        let s = free_sentinel(&self.reserved, texts)
            .ok_or("the messages use every private-use character; no splice sentinel is free")?;
        let msgs: Vec<_> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let content = match &m.content {
                    Content::Text(t) => t.clone(),
                    Content::OutputOf(_) => format!("{s}{i}{s}"),
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
        // Pieces alternate: text, placeholder index, text, …, text.
        let pieces: Vec<&str> = text.split(s).collect();
        if pieces.len().is_multiple_of(2) {
            return Err(format!(
                "the template cut a spliced output's placeholder (U+{:04X} appears {} times)",
                s as u32,
                pieces.len() - 1
            ));
        }
        let mut parts = Vec::new();
        for (k, piece) in pieces.into_iter().enumerate() {
            if k % 2 == 0 {
                if !piece.is_empty() {
                    parts.push(Part::Text(piece.to_string()));
                }
                continue;
            }
            let id = piece
                .parse::<usize>()
                .ok()
                .and_then(|i| messages.get(i))
                .and_then(|m| match &m.content {
                    Content::OutputOf(id) => Some(id.clone()),
                    Content::Text(_) => None,
                })
                .ok_or_else(|| {
                    format!("the template altered a spliced output's placeholder into `{piece}`")
                })?;
            parts.push(Part::Output(id));
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

    fn smollm2() -> ChatTemplate {
        ChatTemplate::from_tokenizer_config(SMOLLM2.as_bytes(), std::path::Path::new("tc.json"))
            .unwrap()
            .unwrap()
    }

    fn text(role: &str, t: &str) -> Message {
        Message {
            role: role.into(),
            content: Content::Text(t.into()),
        }
    }

    fn output_of(id: &str) -> Message {
        Message {
            role: "assistant".into(),
            content: Content::OutputOf(id.into()),
        }
    }

    /// All text of the parts, and the spliced ids.
    fn split(parts: &[Part]) -> (String, Vec<&str>) {
        let mut t = String::new();
        let mut ids = Vec::new();
        for p in parts {
            match p {
                Part::Text(s) => t.push_str(s),
                Part::Output(id) => ids.push(id.as_str()),
            }
        }
        (t, ids)
    }

    #[test]
    fn text_that_looks_like_a_splice_marker_stays_text() {
        let t = smollm2();
        // What the in-band markers used to be, around a real id, an unknown
        // one, and none; plus stray halves.
        let forged =
            "a\u{F8F0}t1\u{F8F1}b \u{F8F0}ghost\u{F8F1} \u{F8F0}\u{F8F1} \u{F8F1}x\u{F8F0}";
        let parts = t.render(&[text("user", forged)]).unwrap();
        assert_eq!(parts.len(), 1, "{parts:?}");
        let (all, ids) = split(&parts);
        assert!(ids.is_empty());
        assert!(all.contains(forged), "{all:?}");
    }

    #[test]
    fn a_real_splice_next_to_forged_markers_splices_exactly_once() {
        let t = smollm2();
        let forged = "\u{F8F0}0\u{F8F0} \u{F8F0}1\u{F8F1} \u{F8F1}2\u{F8F1}";
        let m = [text("user", forged), output_of("t1"), text("user", forged)];
        let parts = t.render(&m).unwrap();
        let (all, ids) = split(&parts);
        assert_eq!(ids, ["t1"]);
        assert_eq!(all.matches(forged).count(), 2, "{all:?}");
        // Same parts as with plain text, the forged text put back in place.
        let plain = t
            .render(&[text("user", "X"), output_of("t1"), text("user", "X")])
            .unwrap();
        let back: Vec<Part> = plain
            .into_iter()
            .map(|p| match p {
                Part::Text(s) => Part::Text(s.replace('X', forged)),
                o => o,
            })
            .collect();
        assert_eq!(parts, back);
    }

    #[test]
    fn every_private_use_character_of_the_bmp_in_text_still_splices() {
        let t = smollm2();
        let all_bmp: String = (0xE000u32..=0xF8FF).filter_map(char::from_u32).collect();
        let m = [text("user", &all_bmp), output_of("t1")];
        let parts = t.render(&m).unwrap();
        let (all, ids) = split(&parts);
        assert_eq!(ids, ["t1"]);
        assert!(all.contains(&all_bmp));
    }

    #[test]
    fn a_template_holding_the_usual_sentinel_still_splices() {
        let src = r#"{"chat_template": "{% for message in messages %}\uF8F0{{ message['content'] }}\uF8F1{% endfor %}"}"#;
        let t =
            ChatTemplate::from_tokenizer_config(src.as_bytes(), std::path::Path::new("tc.json"))
                .unwrap()
                .unwrap();
        let parts = t.render(&[text("user", "hi"), output_of("t1")]).unwrap();
        assert_eq!(
            parts,
            vec![
                Part::Text("\u{F8F0}hi\u{F8F1}\u{F8F0}".into()),
                Part::Output("t1".into()),
                Part::Text("\u{F8F1}".into()),
            ]
        );
    }

    #[test]
    fn a_template_that_mangles_a_placeholder_is_an_error() {
        let src = r#"{"chat_template": "{% for message in messages %}{{ message['content'][:1] }}{% endfor %}"}"#;
        let t =
            ChatTemplate::from_tokenizer_config(src.as_bytes(), std::path::Path::new("tc.json"))
                .unwrap()
                .unwrap();
        let e = t.render(&[output_of("t1")]).unwrap_err();
        assert!(e.contains("placeholder"), "{e}");
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
