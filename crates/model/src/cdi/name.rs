//! CDI names: the `kind` (`vendor/class`), device names and fully qualified names
//! (`vendor/class=name`), validated by the rules of the CDI parser
//! (`container-device-interface/pkg/parser/parser.go`):
//!
//! - vendor and class: ASCII letters, digits, `_`, `-`, `.`; start with a letter, end with a
//!   letter or digit;
//! - device name: ASCII letters, digits, `_`, `-`, `.`, `:`; start and end with a letter or digit.

use std::fmt;
use std::str::FromStr;

/// Why a CDI name was rejected. Every variant carries the offending input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("CDI {what} is empty")]
    Empty { what: &'static str },
    #[error("CDI {what} `{name}` must start with {must}")]
    BadStart {
        what: &'static str,
        name: String,
        must: &'static str,
    },
    #[error("CDI {what} `{name}` must end with a letter or digit")]
    BadEnd { what: &'static str, name: String },
    #[error("CDI {what} `{name}` contains `{ch}` (allowed: {allowed})")]
    BadChar {
        what: &'static str,
        name: String,
        ch: char,
        allowed: &'static str,
    },
    #[error("CDI kind `{0}` is not of the form vendor/class")]
    NotAKind(String),
    #[error("`{0}` is not a qualified CDI device name (vendor/class=name)")]
    NotQualified(String),
}

fn check(
    what: &'static str,
    name: &str,
    start_ok: fn(char) -> bool,
    must: &'static str,
    inner_ok: fn(char) -> bool,
    allowed: &'static str,
) -> Result<(), NameError> {
    let mut chars = name.chars();
    let Some(first) = chars.next() else {
        return Err(NameError::Empty { what });
    };
    if !start_ok(first) {
        return Err(NameError::BadStart {
            what,
            name: name.to_string(),
            must,
        });
    }
    if let Some(ch) = name.chars().find(|c| !inner_ok(*c)) {
        return Err(NameError::BadChar {
            what,
            name: name.to_string(),
            ch,
            allowed,
        });
    }
    if !name
        .chars()
        .last()
        .is_some_and(|c| c.is_ascii_alphanumeric())
    {
        return Err(NameError::BadEnd {
            what,
            name: name.to_string(),
        });
    }
    Ok(())
}

fn vendor_class_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')
}

fn device_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':')
}

fn check_vendor_or_class(what: &'static str, s: &str) -> Result<(), NameError> {
    check(
        what,
        s,
        |c| c.is_ascii_alphabetic(),
        "a letter",
        vendor_class_char,
        "letters, digits, `_`, `-`, `.`",
    )
}

/// A CDI device name, e.g. `0`, `GPU-5b3c…`, `0:1`, `all`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceName(String);

impl DeviceName {
    pub fn new(name: impl Into<String>) -> Result<Self, NameError> {
        let name = name.into();
        check(
            "device name",
            &name,
            |c| c.is_ascii_alphanumeric(),
            "a letter or digit",
            device_char,
            "letters, digits, `_`, `-`, `.`, `:`",
        )?;
        Ok(DeviceName(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// CDI before 0.5.0 required device names to start with a letter.
    #[cfg(test)]
    fn starts_with_letter(&self) -> bool {
        self.0.starts_with(|c: char| c.is_ascii_alphabetic())
    }
}

impl FromStr for DeviceName {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DeviceName::new(s)
    }
}

impl fmt::Display for DeviceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for DeviceName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// A CDI kind, `vendor/class`, e.g. `nvidia.com/gpu`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Kind {
    vendor: String,
    class: String,
}

impl Kind {
    /// The kind NVIDIA's own CDI specs use, so `nvidia.com/gpu=0` in pod specs keeps working.
    #[cfg(test)]
    const NVIDIA_GPU: &'static str = "nvidia.com/gpu";

    pub fn new(vendor: &str, class: &str) -> Result<Self, NameError> {
        check_vendor_or_class("vendor", vendor)?;
        check_vendor_or_class("class", class)?;
        Ok(Kind {
            vendor: vendor.to_string(),
            class: class.to_string(),
        })
    }

    /// `nvidia.com/gpu`.
    pub fn nvidia_gpu() -> Self {
        Kind {
            vendor: "nvidia.com".to_string(),
            class: "gpu".to_string(),
        }
    }

    pub fn vendor(&self) -> &str {
        &self.vendor
    }

    pub fn class(&self) -> &str {
        &self.class
    }
}

impl Default for Kind {
    fn default() -> Self {
        Kind::nvidia_gpu()
    }
}

impl FromStr for Kind {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (vendor, class) = s
            .split_once('/')
            .ok_or_else(|| NameError::NotAKind(s.to_string()))?;
        Kind::new(vendor, class)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.vendor, self.class)
    }
}

/// A fully qualified CDI device name, `vendor/class=name`: what `--device` and the kubelet's
/// `CDIDevices` take.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QualifiedName {
    pub kind: Kind,
    pub name: DeviceName,
}

impl QualifiedName {
    pub fn new(kind: Kind, name: DeviceName) -> Self {
        QualifiedName { kind, name }
    }
}

impl FromStr for QualifiedName {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (kind, name) = s
            .split_once('=')
            .ok_or_else(|| NameError::NotQualified(s.to_string()))?;
        Ok(QualifiedName {
            kind: kind.parse()?,
            name: name.parse()?,
        })
    }
}

impl fmt::Display for QualifiedName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.kind, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names() {
        for ok in [
            "0",
            "0:1",
            "all",
            "GPU-5b3c8e1a-0000-4000-8000-000000000001",
            "MIG-4a1b2c3d-0000-4000-8000-000000000002",
            "a_b.c-d:e",
            "x",
        ] {
            let n: DeviceName = ok.parse().unwrap();
            assert_eq!(n.to_string(), ok);
            assert_eq!(n.as_str().parse::<DeviceName>().unwrap(), n);
        }
        for bad in [
            "", "-a", ".a", ":0", "a-", "0:", "a/b", "a=b", "a b", "é", "gpu\n",
        ] {
            assert!(bad.parse::<DeviceName>().is_err(), "{bad:?} accepted");
        }
        assert!(!DeviceName::new("0").unwrap().starts_with_letter());
        assert!(DeviceName::new("all").unwrap().starts_with_letter());
        let err = DeviceName::new("a b").unwrap_err();
        assert!(err.to_string().contains("`a b`"), "{err}");
    }

    #[test]
    fn kinds() {
        let k: Kind = "nvidia.com/gpu".parse().unwrap();
        assert_eq!(k, Kind::nvidia_gpu());
        assert_eq!(k.to_string(), Kind::NVIDIA_GPU);
        assert_eq!((k.vendor(), k.class()), ("nvidia.com", "gpu"));
        assert_eq!(
            "vendor.io/class.x".parse::<Kind>().unwrap().class(),
            "class.x"
        );
        for bad in [
            "",
            "gpu",
            "/gpu",
            "nvidia.com/",
            "1nvidia.com/gpu",
            "nvidia.com/gpu/x",
            "nvidia.com/g:pu",
            "nvidia.com-/gpu",
            "nvidia.com/gpu=0",
        ] {
            assert!(bad.parse::<Kind>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn qualified_names_round_trip() {
        for s in [
            "nvidia.com/gpu=0",
            "nvidia.com/gpu=all",
            "example.org/mig=0:3",
        ] {
            let q: QualifiedName = s.parse().unwrap();
            assert_eq!(q.to_string(), s);
        }
        let q: QualifiedName = "nvidia.com/gpu=GPU-abc".parse().unwrap();
        assert_eq!(q.kind, Kind::nvidia_gpu());
        assert_eq!(q.name.as_str(), "GPU-abc");
        assert_eq!(
            QualifiedName::new(Kind::nvidia_gpu(), DeviceName::new("1").unwrap()).to_string(),
            "nvidia.com/gpu=1"
        );
        for bad in [
            "nvidia.com/gpu",
            "gpu=0",
            "nvidia.com/gpu=",
            "nvidia.com/gpu=0=1",
            "=0",
        ] {
            assert!(bad.parse::<QualifiedName>().is_err(), "{bad:?} accepted");
        }
    }
}
