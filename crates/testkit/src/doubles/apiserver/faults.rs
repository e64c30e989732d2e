//! Fault injection and the request log.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What an injected fault does to a matching request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultAction {
    /// Answer with this HTTP code and a `Status` body; the request is not carried out.
    /// `retry_after` adds a `Retry-After` header (seconds).
    Status { code: u16, retry_after: Option<u64> },
    /// Carry the request out, then hold the answer back this long (a slow server: the write
    /// lands even if the client has given up by then).
    Delay(Duration),
}

/// A fault matched on the method and a substring of the path and query, firing `times` times
/// or for a while, else until cleared.
///
/// Mind the kube client's retries: with its default config it retries 429, 503 and 504 on its
/// own (honouring `Retry-After`), so a fault with those codes that fires fewer times than the
/// client retries is invisible to the caller except as latency.
#[derive(Debug, Clone)]
pub struct Fault {
    /// `GET`, `PUT`, ... or `*` for any.
    pub method: String,
    /// Matched against the path and query as sent, e.g. `/resourceslices`, `watch=true`.
    pub path_contains: String,
    pub action: FaultAction,
    /// Fire this many times, then disappear.
    pub times: Option<u32>,
    /// Disappear this long after injection.
    pub lasting: Option<Duration>,
}

impl Fault {
    /// Answer `code` (e.g. 500) with a `Status`.
    pub fn status(method: &str, path_contains: &str, code: u16) -> Fault {
        Fault {
            method: method.to_ascii_uppercase(),
            path_contains: path_contains.into(),
            action: FaultAction::Status {
                code,
                retry_after: None,
            },
            times: None,
            lasting: None,
        }
    }

    /// 429 TooManyRequests with `Retry-After: secs`.
    pub fn throttle(method: &str, path_contains: &str, retry_after_secs: u64) -> Fault {
        let mut f = Fault::status(method, path_contains, 429);
        f.action = FaultAction::Status {
            code: 429,
            retry_after: Some(retry_after_secs),
        };
        f
    }

    /// 409 Conflict, as if someone else had written first.
    pub fn conflict(method: &str, path_contains: &str) -> Fault {
        Fault::status(method, path_contains, 409)
    }

    /// Handle the request, then answer only after `delay`.
    pub fn delay(method: &str, path_contains: &str, delay: Duration) -> Fault {
        let mut f = Fault::status(method, path_contains, 500);
        f.action = FaultAction::Delay(delay);
        f
    }

    /// Fire `n` times.
    pub fn times(mut self, n: u32) -> Fault {
        self.times = Some(n);
        self
    }

    /// Fire for `d` from injection.
    pub fn lasting(mut self, d: Duration) -> Fault {
        self.lasting = Some(d);
        self
    }

    fn matches(&self, method: &str, path_and_query: &str) -> bool {
        (self.method == "*" || self.method.eq_ignore_ascii_case(method))
            && path_and_query.contains(&self.path_contains)
    }
}

/// Names an injected fault for `ApiServerDouble::clear_fault`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FaultId(pub u64);

struct Armed {
    id: FaultId,
    fault: Fault,
    remaining: Option<u32>,
    until: Option<Instant>,
}

#[derive(Default)]
pub(crate) struct FaultBook {
    armed: Vec<Armed>,
    next: u64,
}

impl FaultBook {
    pub fn inject(&mut self, fault: Fault) -> FaultId {
        self.next += 1;
        let id = FaultId(self.next);
        self.armed.push(Armed {
            id,
            remaining: fault.times,
            until: fault.lasting.map(|d| Instant::now() + d),
            fault,
        });
        id
    }

    pub fn clear(&mut self, id: FaultId) {
        self.armed.retain(|a| a.id != id);
    }

    pub fn clear_all(&mut self) {
        self.armed.clear();
    }

    /// The action of the first live fault matching the request, counting it as fired.
    pub fn fire(&mut self, method: &str, path_and_query: &str) -> Option<FaultAction> {
        let now = Instant::now();
        self.armed
            .retain(|a| a.remaining != Some(0) && a.until.is_none_or(|u| now < u));
        let a = self
            .armed
            .iter_mut()
            .find(|a| a.fault.matches(method, path_and_query))?;
        if let Some(n) = &mut a.remaining {
            *n -= 1;
        }
        Some(a.fault.action.clone())
    }
}

/// Bounded log of (method, path and query).
pub(crate) struct RequestLog {
    entries: VecDeque<(String, String)>,
    cap: usize,
}

impl Default for RequestLog {
    fn default() -> Self {
        RequestLog {
            entries: VecDeque::new(),
            cap: 100_000,
        }
    }
}

impl RequestLog {
    pub fn push(&mut self, method: &str, path_and_query: &str) {
        if self.entries.len() == self.cap {
            self.entries.pop_front();
        }
        self.entries
            .push_back((method.to_string(), path_and_query.to_string()));
    }

    pub fn all(&self) -> Vec<(String, String)> {
        self.entries.iter().cloned().collect()
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }
}

pub(crate) fn is_write(method: &str) -> bool {
    matches!(method, "POST" | "PUT" | "PATCH" | "DELETE")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_fires_its_count_then_disappears() {
        let mut book = FaultBook::default();
        book.inject(Fault::status("put", "/resourceslices", 500).times(2));
        assert!(book
            .fire("GET", "/apis/resource.k8s.io/v1/resourceslices")
            .is_none());
        assert!(book
            .fire("PUT", "/apis/resource.k8s.io/v1/resourceslices/a")
            .is_some());
        assert!(book
            .fire("PUT", "/apis/resource.k8s.io/v1/resourceslices/a")
            .is_some());
        assert!(book
            .fire("PUT", "/apis/resource.k8s.io/v1/resourceslices/a")
            .is_none());
    }

    #[test]
    fn a_fault_without_count_lasts_until_cleared() {
        let mut book = FaultBook::default();
        let id = book.inject(Fault::delay("*", "pods", Duration::from_millis(1)));
        for _ in 0..5 {
            assert!(book.fire("DELETE", "/api/v1/namespaces/a/pods/p").is_some());
        }
        book.clear(id);
        assert!(book.fire("DELETE", "/api/v1/namespaces/a/pods/p").is_none());
    }

    #[test]
    fn a_lasting_fault_expires() {
        let mut book = FaultBook::default();
        book.inject(Fault::status("GET", "watch=", 500).lasting(Duration::ZERO));
        assert!(book.fire("GET", "/api/v1/pods?watch=true").is_none());
    }
}
