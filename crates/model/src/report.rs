//! How gpuplane's errors print. Each error's `Display` is whole: it names the object, says
//! what failed and, after `: `, gives its cause with the cause's own chain ([`chain`]).
//! Wrapped causes are therefore not also returned from `source()`, so no printer (anyhow's
//! `{:#}` in `main`, a log line, a gRPC status, an Event) prints a cause twice.

use std::error::Error;
use std::fmt;

/// An error and every cause below it, `: `-separated; a cause whose text the line already
/// holds is left out (many libraries print their source inside their own message too).
pub struct Chain<'a>(&'a (dyn Error + 'static));

/// See [`Chain`]. Used in `#[error(...)]` attributes: `#[error("reading {path}: {}",
/// chain(.cause))]`.
pub fn chain<'a>(e: &'a (dyn Error + 'static)) -> Chain<'a> {
    Chain(e)
}

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = self.0.to_string();
        let mut next = self.0.source();
        while let Some(cause) = next {
            let text = cause.to_string();
            if !text.is_empty() && !line.contains(&text) {
                line.push_str(": ");
                line.push_str(&text);
            }
            next = cause.source();
        }
        f.write_str(&line)
    }
}

/// `From` conversions (for `?`) into error variants that wrap a cause, without thiserror's
/// `#[from]`, which would also make the cause a `source()`:
/// `causes_from!(LabError { Socket(SocketError), Agent(NodeError) });`.
#[macro_export]
macro_rules! causes_from {
    ($error:ty { $($variant:ident($cause:ty)),+ $(,)? }) => {
        $(impl From<$cause> for $error {
            fn from(cause: $cause) -> Self {
                Self::$variant(cause)
            }
        })+
    };
}

/// The API server refuses an Event note over 1 kB.
pub const MAX_NOTE_BYTES: usize = 1024;

/// `s` cut to at most `max` bytes at a character boundary, `…` marking the cut: for messages
/// the API server bounds (Event notes) or a status must keep small (conditions).
pub fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max.saturating_sub('…'.len_utf8());
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer ({inner})")]
    struct Repeats {
        #[source]
        inner: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("middle")]
    struct Middle(#[source] std::io::Error);

    #[test]
    fn prints_each_cause_once() {
        let io = || std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        assert_eq!(chain(&io()).to_string(), "gone");
        assert_eq!(chain(&Middle(io())).to_string(), "middle: gone");
        // A library that prints its source in its message and also returns it.
        let repeats = Repeats { inner: io() };
        assert_eq!(repeats.to_string(), "outer (gone)");
        assert_eq!(chain(&repeats).to_string(), "outer (gone)");
        #[derive(Debug, thiserror::Error)]
        #[error("kube says: gone")]
        struct Suffix(#[source] std::io::Error);
        assert_eq!(chain(&Suffix(io())).to_string(), "kube says: gone");
    }
}
