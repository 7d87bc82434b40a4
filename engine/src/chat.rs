//! ChatML chat template for the synthetic models (SmolLM2's format):
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
