//! Streaming text: incremental detokenization and stop sequences, on the
//! engine loop (so that a stop sequence ends a request at a step boundary
//! decided by tokens alone, and is recorded as an interrupt like any other).
//!
//! [`Detok`] follows text-generation-inference's incremental decoder: it
//! decodes a short window of tokens twice (without and with the newest) and
//! emits the difference once it no longer ends in U+FFFD (a byte sequence cut
//! mid-character). A window that stays incomplete for [`MAX_WINDOW`] tokens
//! is emitted as it is (a model producing invalid UTF-8 still streams).
//! Invariant: the concatenation of everything emitted, flush included, is the
//! decoding of all tokens pushed (for the byte-level BPE decoders lmrr's
//! models use).
//!
//! [`Stopper`] holds back the longest tail of the text that could still begin
//! a stop sequence ([`partial_tail`], which `tools` reuses for its tags), and
//! cuts the text where the first one completes.

use lmrr_engine::Tokenizer;

/// Tokens held back at most while waiting for a character to complete.
pub const MAX_WINDOW: usize = 16;

/// Incremental decoder of one request's output.
#[derive(Debug, Default)]
pub struct Detok {
    tokens: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Detok {
    /// Adds a token; returns the text it completes (maybe empty).
    pub fn push(&mut self, tok: &Tokenizer, t: u32) -> String {
        self.tokens.push(t);
        let force = self.tokens.len() - self.read >= MAX_WINDOW;
        self.step(tok, force)
    }

    /// The text still held back.
    pub fn flush(&mut self, tok: &Tokenizer) -> String {
        self.step(tok, true)
    }

    fn step(&mut self, tok: &Tokenizer, force: bool) -> String {
        let before = tok
            .decode(&self.tokens[self.prefix..self.read])
            .unwrap_or_default();
        let after = tok.decode(&self.tokens[self.prefix..]).unwrap_or_default();
        if after.len() > before.len()
            && (force || !after.ends_with('\u{FFFD}'))
            && after.is_char_boundary(before.len())
            && after.starts_with(&before)
        {
            let delta = after[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.tokens.len();
            delta
        } else if force && after.len() > before.len() {
            // The decoder rewrote earlier text (not a byte-level one): send
            // the new window whole rather than lose it.
            self.prefix = self.read;
            self.read = self.tokens.len();
            after
        } else {
            String::new()
        }
    }
}

/// Length of the longest tail of `text` that is a proper prefix of one of
/// `patterns`: the bytes to hold back because a pattern may still complete
/// there once more text arrives (always a character boundary of `text`).
pub fn partial_tail<'a>(text: &str, patterns: impl IntoIterator<Item = &'a str>) -> usize {
    let mut hold = 0;
    for p in patterns {
        for k in (1..p.len()).rev() {
            if k <= hold {
                break;
            }
            if p.is_char_boundary(k) && text.ends_with(&p[..k]) {
                hold = k;
                break;
            }
        }
    }
    hold
}

/// Stop-sequence matcher over streamed text.
#[derive(Debug)]
pub struct Stopper {
    stops: Vec<String>,
    text: String,
    emitted: usize,
    hit: bool,
}

impl Stopper {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            text: String::new(),
            emitted: 0,
            hit: false,
        }
    }

    /// Whether a stop sequence completed (nothing more is emitted then).
    pub fn hit(&self) -> bool {
        self.hit
    }

    /// Adds text; returns what can be sent now.
    pub fn push(&mut self, s: &str) -> String {
        if self.hit {
            return String::new();
        }
        self.text.push_str(s);
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        // A stop can only complete in text not yet emitted, or straddling it.
        let mut from = self.emitted.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        let found = self
            .stops
            .iter()
            .filter_map(|st| self.text[from..].find(st.as_str()).map(|p| from + p))
            .min();
        if let Some(p) = found {
            self.hit = true;
            let p = p.max(self.emitted);
            let out = self.text[self.emitted..p].to_string();
            self.emitted = p;
            return out;
        }
        let hold = partial_tail(&self.text, self.stops.iter().map(String::as_str));
        let end = (self.text.len() - hold).max(self.emitted);
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        out
    }

    /// What was held back (the request ended without a stop).
    pub fn flush(&mut self) -> String {
        if self.hit {
            return String::new();
        }
        let out = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = Stopper::new(stops.iter().map(|x| x.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            out += &s.push(p);
        }
        out += &s.flush();
        (out, s.hit())
    }

    #[test]
    fn stops_cut_the_text_even_across_pieces() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "Dxyz"]),
            ("abc ".into(), true)
        );
        assert_eq!(run(&["END"], &["abc EN", "d"]), ("abc ENd".into(), false));
        assert_eq!(run(&["\n\n", "x"], &["a\n", "\nb"]), ("a".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["é"], &["aé"]), ("a".into(), true));
    }

    #[test]
    fn detok_concatenation_is_the_whole_decoding() {
        let m = lmrr_engine::Model::synthetic(lmrr_engine::SynthSpec::embedded_default()).unwrap();
        let ids: Vec<u32> = m
            .tokenizer
            .encode("héllo wörld — ✓ done")
            .unwrap()
            .into_iter()
            .chain([249, 549, 162, 5, 300])
            .collect();
        let mut d = Detok::default();
        let mut out = String::new();
        for &t in &ids {
            out += &d.push(&m.tokenizer, t);
        }
        out += &d.flush(&m.tokenizer);
        assert_eq!(out, m.tokenizer.decode(&ids).unwrap());
    }
}
