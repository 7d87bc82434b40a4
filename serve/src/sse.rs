//! Server-sent events, incrementally: bytes in as they arrive, whole events
//! out. Only what OpenAI-compatible streams use: events end at a blank line
//! (`\n\n`, `\r\n\r\n` or `\r\r`), `data:` lines are joined with `\n`, other
//! fields and comments are kept in the raw event but carry no data.
//!
//! Invariant: the raw bytes of the events returned, concatenated with
//! [`Parser::rest`], are exactly the bytes pushed — nothing is dropped or
//! reordered, so a proxy can forward events unchanged.

/// One complete event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    /// The event as received, its terminating blank line included.
    pub raw: Vec<u8>,
    /// Its `data` lines joined with `\n`; `None` for an event without any
    /// (a comment or keep-alive).
    pub data: Option<Vec<u8>>,
}

/// Most bytes one event may hold before the stream is called malformed.
pub const MAX_EVENT_BYTES: usize = 16 << 20;

/// An incremental parser.
#[derive(Debug, Default)]
pub struct Parser {
    buf: Vec<u8>,
}

impl Parser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds bytes; returns the events they complete. An event longer than
    /// [`MAX_EVENT_BYTES`] is an error with its size.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = event_end(&self.buf) {
            let raw: Vec<u8> = self.buf.drain(..end).collect();
            out.push(SseEvent {
                data: data_of(&raw),
                raw,
            });
        }
        if self.buf.len() > MAX_EVENT_BYTES {
            return Err(format!(
                "an event of more than {} bytes without its terminating blank line (limit {MAX_EVENT_BYTES})",
                self.buf.len()
            ));
        }
        Ok(out)
    }

    /// Bytes of an unfinished event.
    pub fn rest(&self) -> &[u8] {
        &self.buf
    }
}

/// Index just past the first blank line, if any.
fn event_end(b: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\n' if b.get(i + 1) == Some(&b'\n') => return Some(i + 2),
            b'\r'
                if b.get(i + 1) == Some(&b'\n')
                    && b.get(i + 2) == Some(&b'\r')
                    && b.get(i + 3) == Some(&b'\n') =>
            {
                return Some(i + 4)
            }
            b'\r' if b.get(i + 1) == Some(&b'\r') => return Some(i + 2),
            _ => {}
        }
        i += 1;
    }
    None
}

/// The `data` of one raw event.
fn data_of(raw: &[u8]) -> Option<Vec<u8>> {
    let mut data: Option<Vec<u8>> = None;
    for line in raw.split(|&c| c == b'\n' || c == b'\r') {
        let Some(rest) = line.strip_prefix(b"data") else {
            continue;
        };
        let value = match rest.first() {
            None => rest,
            Some(b':') => rest[1..].strip_prefix(b" ").unwrap_or(&rest[1..]),
            // `database: …` is another field.
            Some(_) => continue,
        };
        match &mut data {
            Some(d) => {
                d.push(b'\n');
                d.extend_from_slice(value);
            }
            None => data = Some(value.to_vec()),
        }
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn events_split_anywhere_come_out_whole() {
        let stream = b"data: {\"a\":1}\n\n: keep-alive\n\nevent: x\ndata: one\ndata: two\r\n\r\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut p = Parser::new();
            let mut ev = p.push(&stream[..cut]).unwrap();
            ev.extend(p.push(&stream[cut..]).unwrap());
            let data: Vec<Option<Vec<u8>>> = ev.iter().map(|e| e.data.clone()).collect();
            assert_eq!(
                data,
                vec![
                    Some(b"{\"a\":1}".to_vec()),
                    None,
                    Some(b"one\ntwo".to_vec()),
                    Some(b"[DONE]".to_vec())
                ],
                "cut at {cut}"
            );
            assert!(p.rest().is_empty());
        }
    }

    #[test]
    fn an_endless_event_is_an_error_with_its_size() {
        let mut p = Parser::new();
        let big = vec![b'x'; MAX_EVENT_BYTES + 1];
        let e = p.push(&big).unwrap_err();
        assert!(e.contains(&(MAX_EVENT_BYTES + 1).to_string()), "{e}");
    }

    proptest! {
        #[test]
        fn raw_bytes_are_kept_exactly(chunks in prop::collection::vec(prop::collection::vec(prop::sample::select(vec![b'\n', b'\r', b'd', b'a', b't', b':', b' ', b'{', b'}']), 0..40), 0..12)) {
            let mut p = Parser::new();
            let mut raw = Vec::new();
            for c in &chunks {
                for e in p.push(c).unwrap() {
                    raw.extend_from_slice(&e.raw);
                }
            }
            raw.extend_from_slice(p.rest());
            let all: Vec<u8> = chunks.concat();
            prop_assert_eq!(raw, all);
        }
    }
}
