//! A claim's identity as the kubelet names it, checked once where it arrives: a claim UID
//! ([`ClaimUid`], which ends up in file names: a CDI spec `gpuplane-claim-<uid>.json` and CDI
//! device names) and its namespace and name ([`ObjectName`], DNS subdomains). Past the gRPC
//! edge a [`super::ClaimRef`] holds only these, so nothing further in re-validates them.

/// Why a claim's UID, namespace or name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("claim UID `{0}` is not lower-case hex digits and dashes")]
    Uid(String),
    #[error("claim {what} `{value}` is not a DNS subdomain")]
    Name { what: &'static str, value: String },
}

/// A Kubernetes UID as the API server makes them (a UUID): lower-case hex digits and dashes,
/// starting and ending with a digit, at most 64 characters. Nothing else may reach a file name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ClaimUid(String);

impl ClaimUid {
    pub fn parse(uid: impl Into<String>) -> Result<ClaimUid, IdentityError> {
        let uid = uid.into();
        let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
        let ok = !uid.is_empty()
            && uid.len() <= 64
            && uid.bytes().all(|b| hex(b) || b == b'-')
            && uid.bytes().next().is_some_and(hex)
            && uid.bytes().last().is_some_and(hex);
        if ok {
            Ok(ClaimUid(uid))
        } else {
            Err(IdentityError::Uid(uid))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A namespace or object name: a DNS subdomain (lower-case alphanumerics, `-` and `.`,
/// alphanumeric at both ends, at most 253 characters).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectName(String);

impl ObjectName {
    /// `what` names the field in the refusal (`namespace`, `name`).
    pub fn parse(
        what: &'static str,
        value: impl Into<String>,
    ) -> Result<ObjectName, IdentityError> {
        let value = value.into();
        let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
        let ok = !value.is_empty()
            && value.len() <= 253
            && value.bytes().all(|b| alnum(b) || b == b'-' || b == b'.')
            && value.bytes().next().is_some_and(alnum)
            && value.bytes().last().is_some_and(alnum);
        if ok {
            Ok(ObjectName(value))
        } else {
            Err(IdentityError::Name { what, value })
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

str_newtype!(ClaimUid);
str_newtype!(ObjectName);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids_and_names() {
        for ok in ["0b5c3f2e-1111-4222-8333-444455556666", "a", "0"] {
            assert_eq!(ClaimUid::parse(ok).unwrap(), ok);
        }
        for bad in [
            "",
            "-a",
            "a-",
            "../x",
            "A0",
            "0b5c/..",
            "g",
            &"a".repeat(65),
        ] {
            assert_eq!(
                ClaimUid::parse(bad),
                Err(IdentityError::Uid(bad.to_string())),
                "{bad}"
            );
        }
        for ok in ["default", "a.b-c", "x"] {
            assert_eq!(ObjectName::parse("name", ok).unwrap(), ok);
        }
        for bad in ["", "a/b", "..", "-a", "A", "a b", &"a".repeat(254)] {
            let e = ObjectName::parse("namespace", bad).unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("claim namespace `{bad}` is not a DNS subdomain")
            );
        }
    }
}
