//! Stop strings on streamed text: text is released as soon as it cannot be the start of a stop
//! string, and ends before the first stop string found.

/// Cuts a stream of text pieces at the first of some stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    text: String,
    released: usize,
    stopped: bool,
}

impl StopStrings {
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), ..Self::default() }
    }

    /// Adds a piece; returns the text now safe to show and whether a stop string was reached
    /// (the text before it is then all released, the stop string itself never).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.text += piece;
        // Search from where a stop string could start that was not yet complete.
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let mut from = self.released.saturating_sub(longest);
        while !self.text.is_char_boundary(from) {
            from -= 1;
        }
        if let Some(cut) = self.stops.iter().filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i)).min() {
            self.text.truncate(cut);
            self.stopped = true;
            return (self.release(cut), true);
        }
        let mut end = self.text.len().saturating_sub(longest.saturating_sub(1)).max(self.released);
        while !self.text.is_char_boundary(end) {
            end -= 1;
        }
        (self.release(end), false)
    }

    /// The text held back at the end of the stream.
    pub fn finish(&mut self) -> String {
        self.release(self.text.len())
    }

    /// All text released or held so far (without any stop string).
    pub fn text(&self) -> &str {
        &self.text
    }

    fn release(&mut self, end: usize) -> String {
        let out = self.text[self.released.min(end)..end].to_string();
        self.released = self.released.max(end);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::StopStrings;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for piece in pieces {
            let (text, stopped) = s.push(piece);
            out += &text;
            if stopped {
                return (out, true);
            }
        }
        out += &s.finish();
        (out, false)
    }

    #[test]
    fn cuts_at_a_stop_string_split_over_pieces() {
        assert_eq!(run(&["</s>"], &["Hello <", "/", "s> more"]), ("Hello ".into(), true));
        assert_eq!(run(&["END", "ST"], &["aaS", "TOP"]), ("aa".into(), true));
        assert_eq!(run(&["xyz"], &["no", " stop", " here x"]), ("no stop here x".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn never_releases_a_prefix_that_may_complete() {
        let mut s = StopStrings::new(vec!["stop".into()]);
        // The last len("stop") - 1 bytes wait until they cannot begin "stop".
        assert_eq!(s.push("go st"), ("go".into(), false));
        assert_eq!(s.push("o"), (" ".into(), false));
        assert_eq!(s.push("rm"), ("st".into(), false));
        assert_eq!(s.finish(), "orm");
    }

    #[test]
    fn multibyte_text_is_cut_on_character_boundaries() {
        assert_eq!(run(&["ßx"], &["日本", "語ß", "x!"]), ("日本語".into(), true));
        assert_eq!(run(&["日本"], &["é", "é"]), ("éé".into(), false));
    }
}
