//! Tool calls in a chat answer: the Hermes convention that Qwen2.5 and its
//! kin are trained on, `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`
//! blocks in the generated text, shown to the client as OpenAI's
//! `tool_calls` (after vLLM's `hermes` tool parser).
//!
//! Presentation only: the engine, the bundle, the logprob entries and
//! `usage` never pass through here; this module decides what the client is
//! shown of the text the engine generated, once the request had `tools`.
//!
//! Small models often write the call without the tags: the whole answer one
//! JSON object, bare or in a ```` ```json ```` fence, sometimes with every
//! brace doubled as a format string escapes it (`{{"name": …}}`). Such an
//! answer is a call when its object (undoubled, where only that parses)
//! parses as a block's body would and its `name` is one of the request's
//! tools ([`bare_call`]); otherwise it is content, verbatim.
//! Streamed, an answer that begins like one (`{`, or a prefix of the fence)
//! is held back to its end, as nothing before the end can tell.
//!
//! A *block* is [`OPEN`] up to the first [`CLOSE`] after it (non-greedy, as
//! vLLM's regex). A block whose body is a JSON object with a non-empty string
//! `name` and an `arguments` object — or a string holding one, passed on as
//! written — is a call ([`parse_call`]); an object's arguments are written
//! compactly, keys in `serde_json`'s order (sorted). Invariants:
//! - Nothing the model wrote is lost but whitespace: every byte is in a call's
//!   block or in the content, a block that is not a call (or has no [`CLOSE`]
//!   before the end) stays in the content verbatim, and the content is the
//!   text outside the calls with its leading and trailing whitespace removed.
//! - The stream and the whole agree: [`ToolStream`] fed the text cut anywhere
//!   yields the same calls, and content pieces that concatenate to the same
//!   content, as [`split`] of the whole text ([`split`] is that stream fed
//!   one piece). Text that may begin [`OPEN`] is held back like a stop
//!   sequence's prefix ([`crate::detok::partial_tail`]), an open block until
//!   its [`CLOSE`] (or the end), and trailing whitespace until more content
//!   follows it.

use serde_json::Value;

use crate::detok::partial_tail;

/// Opens a call.
pub const OPEN: &str = "<tool_call>";
/// Closes a call.
pub const CLOSE: &str = "</tool_call>";

/// One call the model made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments object as JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

impl ToolCall {
    /// OpenAI's `tool_calls` entry, `index` counting the answer's calls from
    /// 0 and `request` the response's id.
    pub fn to_json(&self, request: &str, index: usize) -> Value {
        serde_json::json!({
            "id": call_id(request, index),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        })
    }
}

/// A call's id: `call_<request>_<index>`, unique within a server's run as
/// its request names are.
pub fn call_id(request: &str, index: usize) -> String {
    format!("call_{request}_{index}")
}

/// Why a block's body is not a call (the block then stays in the content).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadCall {
    #[error("its body is not JSON: {0}")]
    Json(String),
    #[error("its body is {0}, not an object")]
    NotObject(&'static str),
    #[error("`name` is {0}, not a non-empty string")]
    Name(&'static str),
    #[error("`arguments` is {0}, not an object or a string holding one")]
    Arguments(&'static str),
    #[error("`arguments` is a string that does not hold a JSON object")]
    ArgumentsText,
}

/// JSON's name for a value's type, for [`BadCall`].
fn kind(v: Option<&Value>) -> &'static str {
    match v {
        None => "missing",
        Some(Value::Null) => "null",
        Some(Value::Bool(_)) => "a boolean",
        Some(Value::Number(_)) => "a number",
        Some(Value::String(s)) if s.is_empty() => "an empty string",
        Some(Value::String(_)) => "a string",
        Some(Value::Array(_)) => "an array",
        Some(Value::Object(_)) => "an object",
    }
}

/// A block's body (the text between [`OPEN`] and [`CLOSE`]) as a call.
pub fn parse_call(body: &str) -> Result<ToolCall, BadCall> {
    let v: Value = serde_json::from_str(body.trim()).map_err(|e| BadCall::Json(e.to_string()))?;
    let Value::Object(m) = &v else {
        return Err(BadCall::NotObject(kind(Some(&v))));
    };
    let name = match m.get("name") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        other => return Err(BadCall::Name(kind(other))),
    };
    let arguments = match m.get("arguments") {
        Some(a @ Value::Object(_)) => a.to_string(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(_)) => s.clone(),
            _ => return Err(BadCall::ArgumentsText),
        },
        other => return Err(BadCall::Arguments(kind(other))),
    };
    Ok(ToolCall { name, arguments })
}

/// Opens the fence a bare call may be written in.
pub const FENCE: &str = "```json";

/// The names of a request's `tools` (`[{"type": "function", "function":
/// {"name": …}}]`); entries without one are skipped.
pub fn names(tools: &Value) -> Vec<String> {
    tools
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t.pointer("/function/name").and_then(Value::as_str))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// A whole answer written as one call without the tags: one JSON object,
/// bare or fenced in ```` ```json … ``` ````, that [`parse_call`] takes and
/// whose `name` is one of `names`.
pub fn bare_call(answer: &str, names: &[String]) -> Option<ToolCall> {
    let t = answer.trim();
    let body = match t.strip_prefix(FENCE) {
        Some(rest) => rest.strip_suffix("```")?,
        None => t,
    };
    let body = body.trim();
    if !body.starts_with('{') {
        return None;
    }
    let named = |c: ToolCall| names.contains(&c.name).then_some(c);
    match parse_call(body) {
        Ok(c) => named(c),
        // The object written with a format string's doubled braces
        // (`{{"name": …, "arguments": {…}}}`, as str.format escapes them):
        // a call only if undoubling every `{{` and `}}` gives one.
        Err(_) if body.starts_with("{{") => parse_call(&undouble_braces(body)).ok().and_then(named),
        Err(_) => None,
    }
}

/// `text` with each `{{` made `{` and each `}}` made `}`, read left to right
/// (str.format's unescaping; a lone brace stays as it is).
fn undouble_braces(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        out.push(c);
        if (c == '{' || c == '}') && chars.peek() == Some(&c) {
            chars.next();
        }
    }
    out
}

/// Whether an answer that begins with `start` (leading whitespace dropped)
/// may still turn out to be a bare call: it is empty, begins with `{` or
/// the fence, or is a prefix of the fence.
fn may_be_bare(start: &str) -> bool {
    start.is_empty()
        || start.starts_with('{')
        || start.starts_with(FENCE)
        || FENCE.starts_with(start)
}

/// What the stream lets through, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Content text (never empty).
    Content(String),
    Call(ToolCall),
}

/// Tool-call reader over streamed text.
#[derive(Debug, Default)]
pub struct ToolStream {
    /// Text received and not yet let through: a tail that may begin
    /// [`OPEN`], or (when `open`) a block from its [`OPEN`] on.
    buf: String,
    /// `buf` begins with an [`OPEN`] whose [`CLOSE`] has not arrived.
    open: bool,
    /// Where in `buf` a [`CLOSE`] may still begin (bytes before were searched).
    scanned: usize,
    /// Content let through so far holds more than whitespace.
    started: bool,
    /// Whitespace after the last content let through: sent with the next
    /// content, dropped at the end.
    ws: String,
    calls: usize,
    rejected: Vec<BadCall>,
    /// The request's tool names, for a bare call.
    names: Vec<String>,
    /// Nothing let through yet and the answer may still be a bare call: all
    /// of it is held in `bare_buf` until it cannot be, or to the end.
    holding: bool,
    bare_buf: String,
}

impl ToolStream {
    /// A reader for a request whose tools are named `names`.
    pub fn new(names: Vec<String>) -> Self {
        Self {
            holding: !names.is_empty(),
            names,
            ..Self::default()
        }
    }

    /// Calls let through so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Why each block that is not a call was left in the content.
    pub fn rejected(&self) -> &[BadCall] {
        &self.rejected
    }

    /// Adds text; returns what can be let through now.
    pub fn push(&mut self, s: &str) -> Vec<Piece> {
        if self.holding {
            self.bare_buf.push_str(s);
            if may_be_bare(self.bare_buf.trim_start()) {
                return Vec::new();
            }
            self.holding = false;
            let held = std::mem::take(&mut self.bare_buf);
            return self.push_tagged(&held);
        }
        self.push_tagged(s)
    }

    /// [`ToolStream::push`] for text that is not a bare call.
    fn push_tagged(&mut self, s: &str) -> Vec<Piece> {
        self.buf.push_str(s);
        let mut out = Vec::new();
        loop {
            if !self.open {
                let (cut, opens) = match self.buf.find(OPEN) {
                    Some(p) => (p, true),
                    None => (self.buf.len() - partial_tail(&self.buf, [OPEN]), false),
                };
                let before: String = self.buf.drain(..cut).collect();
                self.content(&before, &mut out);
                if !opens {
                    return out;
                }
                self.open = true;
                self.scanned = OPEN.len();
            }
            let Some(q) = self.buf[self.scanned..].find(CLOSE) else {
                // A CLOSE may straddle what arrives next.
                let mut from = (self.buf.len() + 1).saturating_sub(CLOSE.len());
                while !self.buf.is_char_boundary(from) {
                    from -= 1;
                }
                self.scanned = from.max(OPEN.len());
                return out;
            };
            let end = self.scanned + q + CLOSE.len();
            let block: String = self.buf.drain(..end).collect();
            self.open = false;
            match parse_call(&block[OPEN.len()..block.len() - CLOSE.len()]) {
                Ok(c) => {
                    self.calls += 1;
                    out.push(Piece::Call(c));
                }
                Err(e) => {
                    self.rejected.push(e);
                    self.content(&block, &mut out);
                }
            }
        }
    }

    /// The end of the answer: what is still held (an unterminated block, a
    /// tail that looked like the start of [`OPEN`]) goes out as content;
    /// trailing whitespace is dropped.
    pub fn finish(&mut self) -> Vec<Piece> {
        if self.holding {
            self.holding = false;
            let held = std::mem::take(&mut self.bare_buf);
            if let Some(c) = bare_call(&held, &self.names) {
                self.calls += 1;
                return vec![Piece::Call(c)];
            }
            let mut out = self.push_tagged(&held);
            out.extend(self.finish());
            return out;
        }
        let rest = std::mem::take(&mut self.buf);
        self.open = false;
        let mut out = Vec::new();
        self.content(&rest, &mut out);
        self.ws.clear();
        out
    }

    /// Lets content through, leading whitespace of the answer dropped and
    /// trailing whitespace held.
    fn content(&mut self, s: &str, out: &mut Vec<Piece>) {
        let s = if self.started { s } else { s.trim_start() };
        let body = s.trim_end();
        if body.is_empty() {
            self.ws.push_str(s);
            return;
        }
        self.started = true;
        let mut text = std::mem::take(&mut self.ws);
        text.push_str(body);
        self.ws.push_str(&s[body.len()..]);
        match out.last_mut() {
            Some(Piece::Content(c)) => c.push_str(&text),
            _ => out.push(Piece::Content(text)),
        }
    }
}

/// A whole answer: its content (`None` when nothing but whitespace is left
/// outside the calls), its calls, and why blocks that are not calls were
/// left in the content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    pub content: Option<String>,
    pub calls: Vec<ToolCall>,
    pub rejected: Vec<BadCall>,
}

/// Splits a whole answer to a request whose tools are named `names`
/// ([`ToolStream`] fed it in one piece).
pub fn split(text: &str, names: &[String]) -> Split {
    let mut s = ToolStream::new(names.to_vec());
    let mut pieces = s.push(text);
    pieces.extend(s.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Content(c) => content.push_str(&c),
            Piece::Call(c) => calls.push(c),
        }
    }
    Split {
        content: (!content.is_empty()).then_some(content),
        calls,
        rejected: s.rejected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    /// The tools the requests below name: the tagged cases run with a bare
    /// call possible, so holding for one must not change them.
    fn names() -> Vec<String> {
        vec!["get_weather".into(), "now".into()]
    }

    fn split(text: &str) -> Split {
        super::split(text, &names())
    }

    const WEATHER: &str =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>";
    const TIME: &str = "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";

    #[test]
    fn one_call_is_a_call_and_no_content() {
        let s = split(WEATHER);
        assert_eq!(s.content, None);
        assert_eq!(
            s.calls,
            [call("get_weather", r#"{"city":"Paris","unit":"c"}"#)]
        );
        assert!(s.rejected.is_empty());
    }

    #[test]
    fn two_calls_keep_their_order() {
        let s = split(&format!("{WEATHER}\n{TIME}\n"));
        assert_eq!(s.content, None);
        assert_eq!(
            s.calls,
            [
                call("get_weather", r#"{"city":"Paris","unit":"c"}"#),
                call("now", "{}")
            ]
        );
    }

    #[test]
    fn content_around_calls_is_kept_and_trimmed() {
        let s = split(&format!("  Let me check.\n\n{WEATHER}\n"));
        assert_eq!(s.content.as_deref(), Some("Let me check."));
        assert_eq!(s.calls.len(), 1);
        let s = split(&format!("A\n{WEATHER}\nB\n"));
        assert_eq!(s.content.as_deref(), Some("A\n\nB"));
        assert_eq!(s.calls.len(), 1);
        // Without a block the text is only trimmed.
        assert_eq!(
            split("\n plain <b>answer</b> \n").content.as_deref(),
            Some("plain <b>answer</b>")
        );
        assert_eq!(split(" \n\t").content, None);
    }

    #[test]
    fn a_block_that_is_not_a_call_stays_in_the_content_verbatim() {
        let bodies = [
            ("{not json}", "not JSON"),
            ("[1, 2]", "an array"),
            (r#"{"arguments": {}}"#, "`name` is missing"),
            (r#"{"name": 3, "arguments": {}}"#, "`name` is a number"),
            (r#"{"name": "", "arguments": {}}"#, "an empty string"),
            (r#"{"name": "f"}"#, "`arguments` is missing"),
            (
                r#"{"name": "f", "arguments": [1]}"#,
                "`arguments` is an array",
            ),
            (r#"{"name": "f", "arguments": "x=1"}"#, "does not hold"),
            (r#"{"name": "f", "arguments": "[1]"}"#, "does not hold"),
        ];
        for (body, why) in bodies {
            let block = format!("<tool_call>\n{body}\n</tool_call>");
            let s = split(&format!("Before {block} after"));
            assert!(s.calls.is_empty(), "{body}");
            assert_eq!(
                s.content.as_deref(),
                Some(format!("Before {block} after").as_str()),
                "{body}"
            );
            assert_eq!(s.rejected.len(), 1, "{body}");
            assert!(
                s.rejected[0].to_string().contains(why),
                "{body}: {}",
                s.rejected[0]
            );
        }
        // A good call next to a bad one: the call goes, the bad block stays.
        let bad = "<tool_call>{\"name\": \"f\", \"arguments\": 7}</tool_call>";
        let s = split(&format!("{bad}\n{TIME}"));
        assert_eq!(s.content.as_deref(), Some(bad));
        assert_eq!(s.calls, [call("now", "{}")]);
    }

    #[test]
    fn arguments_given_as_a_string_pass_through_as_written() {
        let s = split(
            "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": [1, 2], \\\"a\\\": null}\"}</tool_call>",
        );
        assert_eq!(s.calls, [call("f", r#"{"x": [1, 2], "a": null}"#)]);
        assert_eq!(s.content, None);
    }

    #[test]
    fn an_unterminated_block_is_content() {
        let text = "Sure. <tool_call>\n{\"name\": \"now\", \"arguments\": {}}";
        let s = split(text);
        assert_eq!(s.content.as_deref(), Some(text));
        assert!(s.calls.is_empty());
        // Streamed: held from the tag on, let through at the end.
        let mut st = ToolStream::new(names());
        assert_eq!(st.push("Sure. "), [Piece::Content("Sure.".into())]);
        assert_eq!(st.push("<tool_call>\n{\"name\": "), []);
        assert_eq!(st.push("\"now\", \"arguments\": {}}"), []);
        assert_eq!(
            st.finish(),
            [Piece::Content(
                " <tool_call>\n{\"name\": \"now\", \"arguments\": {}}".into()
            )]
        );
        assert_eq!(st.calls(), 0);
    }

    #[test]
    fn a_tag_prefix_is_held_and_let_go_when_it_turns_out_not_to_be_one() {
        let mut st = ToolStream::new(names());
        assert_eq!(st.push("Hello <tool"), [Piece::Content("Hello".into())]);
        assert_eq!(st.push("box> x"), [Piece::Content(" <toolbox> x".into())]);
        assert_eq!(st.push(" <"), []);
        assert_eq!(
            st.push("/tool_call> y"),
            [Piece::Content(" </tool_call> y".into())]
        );
        assert_eq!(st.finish(), []);
        // A prefix of the tag at the very end is content.
        let mut st = ToolStream::new(names());
        assert_eq!(st.push("a <tool_ca"), [Piece::Content("a".into())]);
        assert_eq!(st.finish(), [Piece::Content(" <tool_ca".into())]);
    }

    /// The pieces of `pieces` fed one by one, content joined and calls in
    /// order; also checks that no content piece is empty.
    fn stream(pieces: &[&str]) -> (String, Vec<ToolCall>) {
        let mut st = ToolStream::new(names());
        let mut content = String::new();
        let mut calls = Vec::new();
        let mut out: Vec<Piece> = Vec::new();
        for p in pieces {
            out.extend(st.push(p));
        }
        out.extend(st.finish());
        for p in out {
            match p {
                Piece::Content(c) => {
                    assert!(!c.is_empty(), "{pieces:?}");
                    content.push_str(&c);
                }
                Piece::Call(c) => calls.push(c),
            }
        }
        assert_eq!(st.calls(), calls.len());
        (content, calls)
    }

    #[test]
    fn the_stream_cut_at_every_byte_gives_the_whole_answer() {
        let bad = "<tool_call>{oops}</tool_call>";
        let text = format!(" Checking ✓ both.\n{WEATHER}\n{bad} then <tool {TIME}\nDone é. \n");
        let content = format!("Checking ✓ both.\n\n{bad} then <tool \nDone é.");
        let calls = vec![
            call("get_weather", r#"{"city":"Paris","unit":"c"}"#),
            call("now", "{}"),
        ];
        let whole = split(&text);
        assert_eq!(whole.content.as_deref(), Some(content.as_str()));
        assert_eq!(whole.calls, calls);
        let cuts: Vec<usize> = (1..text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &i in &cuts {
            assert_eq!(
                stream(&[&text[..i], &text[i..]]),
                (content.clone(), calls.clone()),
                "cut at {i}"
            );
        }
        // Two cuts, every pair around the tags.
        for &i in &cuts {
            for &j in cuts.iter().filter(|&&j| j > i && j < i + 2 * CLOSE.len()) {
                assert_eq!(
                    stream(&[&text[..i], &text[i..j], &text[j..]]),
                    (content.clone(), calls.clone()),
                    "cuts at {i} and {j}"
                );
            }
        }
        // One character at a time.
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(stream(&pieces), (content, calls));
    }

    #[test]
    fn content_before_a_call_streams_before_the_call_completes() {
        let mut st = ToolStream::new(names());
        assert_eq!(st.push("Let me"), [Piece::Content("Let me".into())]);
        assert_eq!(
            st.push(" check.\n<tool_"),
            [Piece::Content(" check.".into())]
        );
        assert_eq!(st.push("call>\n{\"name\": \"now\", "), []);
        assert_eq!(
            st.push("\"arguments\": {}}\n</tool_call>\n"),
            [Piece::Call(call("now", "{}"))]
        );
        assert_eq!(st.finish(), []);
        assert_eq!(st.calls(), 1);
    }

    #[test]
    fn a_call_is_openai_shaped() {
        let c = call("get_weather", r#"{"city":"Paris"}"#);
        assert_eq!(
            c.to_json("chatcmpl-0-7", 1),
            json!({"id": "call_chatcmpl-0-7_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}})
        );
    }

    #[test]
    fn a_whole_answer_that_is_one_json_call_to_a_named_tool_is_a_call() {
        let want = call("get_weather", r#"{"city":"Paris"}"#);
        for text in [
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
            "\n  {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n",
            "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```",
            " ```json\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\":\\\"Paris\\\"}\"}```\n",
            // Braces doubled as str.format escapes them (Qwen2.5-Coder-1.5B
            // answering opencode wrote its call so).
            "{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}",
            "{{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}}}",
        ] {
            let s = split(text);
            assert_eq!(s.content, None, "{text:?}");
            assert_eq!(s.calls, vec![want.clone()], "{text:?}");
        }
    }

    #[test]
    fn json_that_is_not_a_call_to_a_named_tool_stays_content_verbatim() {
        for text in [
            // A tool the request did not name.
            "{\"name\": \"rm_rf\", \"arguments\": {}}",
            // Data, not a call.
            "{\"city\": \"Paris\"}",
            "```json\n[1, 2]\n```",
            // A call followed by more text: not the whole answer.
            "{\"name\": \"now\", \"arguments\": {}} and then",
            // An unclosed fence.
            "```json\n{\"name\": \"now\", \"arguments\": {}}",
            // Doubled braces that undouble to no call, or to a tool the
            // request did not name.
            "{{\"city\": \"Paris\"}}",
            "{{\"name\": \"rm_rf\", \"arguments\": {{}}}}",
            "{{\"name\": \"now\", \"arguments\": {}}",
        ] {
            let s = split(text);
            assert!(s.calls.is_empty(), "{text:?}");
            assert_eq!(s.content.as_deref(), Some(text.trim()), "{text:?}");
        }
        // Without tool names nothing is a bare call.
        let s = super::split("{\"name\": \"now\", \"arguments\": {}}", &[]);
        assert!(s.calls.is_empty());
    }

    #[test]
    fn a_bare_call_streamed_cut_anywhere_is_one_call_and_nothing_before_the_end() {
        let text = "```json\n{\"name\": \"now\", \"arguments\": {}}\n```";
        for cut in 0..=text.len() {
            let mut st = ToolStream::new(names());
            let mut out = st.push(&text[..cut]);
            out.extend(st.push(&text[cut..]));
            assert!(
                out.is_empty(),
                "cut {cut}: let through before the end: {out:?}"
            );
            assert_eq!(
                st.finish(),
                vec![Piece::Call(call("now", "{}"))],
                "cut {cut}"
            );
        }
    }

    #[test]
    fn an_answer_that_cannot_be_a_bare_call_streams_at_once() {
        let mut st = ToolStream::new(names());
        assert!(st.push("``").is_empty(), "a prefix of the fence is held");
        assert_eq!(
            st.push("`python\nprint(1)\n"),
            vec![Piece::Content("```python\nprint(1)".into())]
        );
        let mut st = ToolStream::new(names());
        assert_eq!(st.push("Sure"), vec![Piece::Content("Sure".into())]);
    }
}
