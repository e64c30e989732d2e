//! The name rules the API server applies throughout a ResourceSlice: DNS labels and
//! subdomains, driver names, qualified attribute names, label names and values, semver.
//!
//! Each check pushes onto the same [`Checker`] as the field checks, so one slice gives one
//! list of violations in field order.

use super::{invalid, Checker, Problem};
pub(super) use crate::names::DNS_SUBDOMAIN_MAX;
use crate::names::{is_dns_label, is_dns_subdomain, is_qualified_name_part, DNS_LABEL_MAX};
/// Longest driver name and attribute-name domain.
const DRIVER_NAME_MAX: usize = 63;
/// Longest attribute or capacity name after the domain.
const ID_MAX: usize = 32;
/// Longest qualified attribute name shown untruncated in a path (`domain/id`).
const KEY_PATH_MAX: usize = DRIVER_NAME_MAX + 1 + ID_MAX;

impl Checker {
    /// `validateQualifiedName`: a C identifier of at most 32 bytes, optionally prefixed by a
    /// driver-name-like domain and a slash.
    pub(super) fn qualified_name(&mut self, name: &str, path: &str) {
        let parts: Vec<&str> = name.split('/').collect();
        match parts.as_slice() {
            [id] => self.c_identifier(id, path),
            [domain, id] => {
                if domain.is_empty() {
                    self.push(path, invalid("", "the domain must not be empty"));
                } else {
                    self.driver_name(domain, path);
                }
                if id.is_empty() {
                    self.push(path, invalid("", "the name must not be empty"));
                } else {
                    self.c_identifier(id, path);
                }
            }
            // Like the server (a TODO upstream), names with more than one slash go unchecked.
            _ => {}
        }
    }

    fn c_identifier(&mut self, id: &str, path: &str) {
        if id.len() > ID_MAX {
            self.push(path, Problem::TooLong { max: ID_MAX });
        }
        let mut bytes = id.bytes();
        let ok = bytes
            .next()
            .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
            && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !ok {
            self.push(path, invalid(id, "a valid C identifier must start with alphabetic character or '_', followed by a string of alphanumeric characters or '_' (regex used for validation is '[A-Za-z_][A-Za-z0-9_]*')"));
        }
    }

    /// `ValidateCSIDriverName`: at most 63 bytes, a DNS subdomain once lower-cased.
    pub(super) fn driver_name(&mut self, name: &str, path: &str) {
        if name.is_empty() {
            self.push(path, Problem::Required(String::new()));
            return;
        }
        if name.len() > DRIVER_NAME_MAX {
            self.push(
                path,
                Problem::TooLong {
                    max: DRIVER_NAME_MAX,
                },
            );
        }
        if !is_dns_subdomain(&name.to_ascii_lowercase()) {
            self.push(path, invalid(name, SUBDOMAIN_MSG));
        }
    }

    pub(super) fn dns_subdomain(&mut self, name: &str, path: &str) {
        if name.len() > DNS_SUBDOMAIN_MAX {
            self.push(
                path,
                Problem::TooLong {
                    max: DNS_SUBDOMAIN_MAX,
                },
            );
        }
        if !is_dns_subdomain(name) {
            self.push(path, invalid(name, SUBDOMAIN_MSG));
        }
    }

    pub(super) fn dns_label(&mut self, name: &str, path: &str) {
        if name.len() > DNS_LABEL_MAX {
            self.push(path, Problem::TooLong { max: DNS_LABEL_MAX });
        }
        if !is_dns_label(name) {
            self.push(path, invalid(name, LABEL_MSG));
        }
    }

    pub(super) fn counter_name(&mut self, name: &str, path: &str) {
        self.dns_label(name, path);
    }

    /// `ValidateLabelName`: `[prefix/]name`, prefix a DNS subdomain, name a qualified-name part.
    pub(super) fn label_name(&mut self, key: &str, path: &str) {
        let (prefix, name) = match key.split_once('/') {
            Some((p, n)) => (Some(p), n),
            None => (None, key),
        };
        if let Some(p) = prefix {
            if p.is_empty() {
                self.push(path, invalid(key, "prefix part must be non-empty"));
            } else if p.len() > DNS_SUBDOMAIN_MAX || !is_dns_subdomain(p) {
                self.push(path, invalid(key, format!("prefix part {SUBDOMAIN_MSG}")));
            }
        }
        if name.is_empty() {
            self.push(path, invalid(key, "name part must be non-empty"));
        } else if name.len() > DNS_LABEL_MAX {
            self.push(
                path,
                invalid(key, "name part must be no more than 63 bytes"),
            );
        } else if !is_qualified_name_part(name) {
            self.push(path, invalid(key, QUALIFIED_MSG));
        }
    }

    pub(super) fn label_value(&mut self, value: &str, path: &str) {
        if value.len() > DNS_LABEL_MAX {
            self.push(path, invalid(value, "must be no more than 63 bytes"));
        }
        if !is_qualified_name_part(value) {
            self.push(path, invalid(value, "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"));
        }
    }
}

const SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character";
const LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character";
const QUALIFIED_MSG: &str = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character";

/// Long keys are cut in the middle in paths, like the server's `truncateIfTooLong`.
pub(super) fn truncate_key(key: &str) -> String {
    if key.len() <= KEY_PATH_MAX || !key.is_ascii() {
        return key.to_string();
    }
    let remaining = KEY_PATH_MAX - 3;
    format!(
        "{}...{}",
        &key[..remaining.div_ceil(2)],
        &key[key.len() - remaining / 2..]
    )
}

/// semver.org 2.0.0, as the server's regular expression has it.
pub fn is_semver(v: &str) -> bool {
    let (core_pre, build) = match v.split_once('+') {
        Some((a, b)) => (a, Some(b)),
        None => (v, None),
    };
    let (core, pre) = match core_pre.split_once('-') {
        Some((a, b)) => (a, Some(b)),
        None => (core_pre, None),
    };
    let numeric = |s: &str| {
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'))
    };
    let nums: Vec<&str> = core.split('.').collect();
    if nums.len() != 3 || !nums.iter().all(|n| numeric(n)) {
        return false;
    }
    let ident =
        |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if let Some(pre) = pre {
        let ok = pre
            .split('.')
            .all(|p| ident(p) && (numeric(p) || p.bytes().any(|b| !b.is_ascii_digit())));
        if !ok {
            return false;
        }
    }
    if let Some(build) = build {
        if !build.split('.').all(ident) {
            return false;
        }
    }
    true
}
