//! The API server's name grammars (apimachinery's `validation` package) as predicates: RFC
//! 1123 labels and subdomains, and the name part of a qualified name. The ResourceSlice
//! checker, the id newtypes and the API server double all ask these, so they agree with the
//! server and with each other; the callers word their own errors.

/// Longest DNS label (device names, counter names, label-name parts).
pub const DNS_LABEL_MAX: usize = 63;
/// Longest DNS subdomain (object names, node names, pool-name parts).
pub const DNS_SUBDOMAIN_MAX: usize = 253;
/// Longest name part of a qualified name (label keys, extended resource names).
pub const QUALIFIED_NAME_MAX: usize = 63;

fn label_char(c: u8) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-'
}

/// `IsDNS1123Label`: at most 63 bytes of `[a-z0-9-]`, alphanumeric at both ends.
pub fn is_dns_label(s: &str) -> bool {
    s.len() <= DNS_LABEL_MAX && is_label_shape(s)
}

fn is_label_shape(l: &str) -> bool {
    !l.is_empty() && l.bytes().all(label_char) && !l.starts_with('-') && !l.ends_with('-')
}

/// `IsDNS1123Subdomain`: at most 253 bytes of dot-separated labels. Like the server, it does
/// not bound a single label's length.
pub fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= DNS_SUBDOMAIN_MAX && s.split('.').all(is_label_shape)
}

/// The name part of `IsQualifiedName` without its length bound: `[A-Za-z0-9_.-]`,
/// alphanumeric at both ends. Label values share this shape.
pub fn is_qualified_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    match (b.first(), b.last()) {
        (Some(f), Some(l)) => {
            f.is_ascii_alphanumeric()
                && l.is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grammars_match_the_servers() {
        for ok in ["a", "a-b", "0", "nvidia.com", "gpu.gpuplane.dev", "a.b-c.d"] {
            assert!(is_dns_subdomain(ok), "{ok}");
        }
        for bad in [
            "", "A", "a..b", ".a", "a.", "-a", "a-", "a.-b", "a_b", "a/b",
        ] {
            assert!(!is_dns_subdomain(bad), "{bad}");
        }
        assert!(is_dns_subdomain(&format!("{}.b", "a".repeat(100))));
        assert!(!is_dns_subdomain(&"a".repeat(254)));
        assert!(is_dns_label(&"a".repeat(63)) && !is_dns_label(&"a".repeat(64)));
        assert!(!is_dns_label("a.b"));
        for ok in ["a", "A_b.c-D", "3g.40gb"] {
            assert!(is_qualified_name_part(ok), "{ok}");
        }
        for bad in ["", "-a", "a_", ".a", "a/b", "a b"] {
            assert!(!is_qualified_name_part(bad), "{bad}");
        }
    }
}
