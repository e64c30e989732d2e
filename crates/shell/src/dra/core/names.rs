//! What a claim's names may be and what they become: the kubelet's UID, namespace and name
//! are checked before any of them reaches a file name or an API path, and a claim's UID names
//! its spec file and its CDI devices.

use super::errors::PrepareError;

/// CDI class of the per-claim specs; the vendor is `k8s.<driver>`.
pub const CDI_CLASS: &str = "claim";
/// File stem prefix of the per-claim specs: `gpuplane-claim-<uid>`.
pub const SPEC_STEM_PREFIX: &str = "gpuplane-claim-";

/// Kubernetes UIDs are UUIDs; accept lower-case hex and dashes, starting and ending with a
/// digit, at most 64 characters. Nothing else may reach a file name.
pub fn validate_uid(uid: &str) -> Result<(), PrepareError> {
    let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
    let ok = !uid.is_empty()
        && uid.len() <= 64
        && uid.bytes().all(|b| hex(b) || b == b'-')
        && uid.bytes().next().is_some_and(hex)
        && uid.bytes().last().is_some_and(hex);
    if ok {
        Ok(())
    } else {
        Err(PrepareError::BadUid {
            uid: uid.to_string(),
        })
    }
}

pub fn validate_name(what: &'static str, value: &str) -> Result<(), PrepareError> {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let ok = !value.is_empty()
        && value.len() <= 253
        && value.bytes().all(|b| alnum(b) || b == b'-' || b == b'.')
        && value.bytes().next().is_some_and(alnum)
        && value.bytes().last().is_some_and(alnum);
    if ok {
        Ok(())
    } else {
        Err(PrepareError::BadName {
            what,
            value: value.to_string(),
        })
    }
}

/// `gpuplane-claim-<uid>`: the spec file stem of a (validated) claim UID.
pub fn spec_stem(uid: &str) -> String {
    format!("{SPEC_STEM_PREFIX}{uid}")
}

/// `<uid>-<DRA device name>`: the CDI device name of a claim's device.
pub fn cdi_device_name(uid: &str, device: &str) -> String {
    format!("{uid}-{device}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdi;
    use std::path::Path;

    #[test]
    fn uids_and_names() {
        for ok in ["0b5c3f2e-1111-4222-8333-444455556666", "a", "0"] {
            assert!(validate_uid(ok).is_ok(), "{ok}");
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
            assert!(validate_uid(bad).is_err(), "{bad}");
        }
        for ok in ["default", "a.b-c", "x"] {
            assert!(validate_name("name", ok).is_ok(), "{ok}");
        }
        for bad in ["", "a/b", "..", "-a", "A", "a b"] {
            assert!(validate_name("name", bad).is_err(), "{bad}");
        }
        assert_eq!(spec_stem("ab-12"), "gpuplane-claim-ab-12");
        assert!(cdi::writer::spec_path(Path::new("/x"), &spec_stem("ab-12")).is_ok());
    }
}
