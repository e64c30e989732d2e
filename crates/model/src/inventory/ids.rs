//! The identities a device carries, checked once where they enter: a GPU or MIG device UUID
//! ([`DeviceUuid`]), a MIG profile name ([`MigProfile`]), a kubelet extended resource name
//! ([`ResourceName`]) and a device plugin device ID ([`DeviceId`], parsed at the gRPC edge). NVML, the simulation profiles, the config file and the fake NVML parse
//! them at their edge; past it the core holds only these, so nothing further in re-validates
//! them and a bad value (a `,` in a comma-joined device list, a stray newline) cannot get in.

use serde::{Deserialize, Serialize};

/// Why a UUID, profile or resource name was refused: the value and the rule it breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {value:?}: {rule}")]
pub struct IdError {
    /// `device UUID`, `MIG profile`, `resource name`.
    pub what: &'static str,
    pub value: String,
    pub rule: &'static str,
}

impl IdError {
    fn new(what: &'static str, value: impl Into<String>, rule: &'static str) -> IdError {
        IdError {
            what,
            value: value.into(),
            rule,
        }
    }
}

/// What a [`DeviceUuid`] names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum UnitKind {
    /// A physical GPU: `GPU-<uuid>`.
    Gpu,
    /// A MIG device: `MIG-<uuid>`, or the legacy `MIG-GPU-<uuid>/<gi>/<ci>`.
    Mig,
}

/// The UUID NVML gives a GPU (`GPU-<uuid>`) or a MIG device (`MIG-<uuid>`, or before R470 the
/// legacy `MIG-GPU-<uuid>/<gi>/<ci>`). The part after the prefix is ASCII letters, digits and
/// `-`; no whitespace, control character or `,` (device lists are comma-joined in env vars),
/// at most 95 bytes (NVML's v2 UUID buffer, less its NUL).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct DeviceUuid(String);

const UUID: &str = "device UUID";

impl DeviceUuid {
    pub fn parse(value: impl Into<String>) -> Result<DeviceUuid, IdError> {
        let value = value.into();
        match check_uuid(&value) {
            Ok(_) => Ok(DeviceUuid(value)),
            Err(rule) => Err(IdError::new(UUID, value, rule)),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn kind(&self) -> UnitKind {
        if self.0.starts_with("MIG-") {
            UnitKind::Mig
        } else {
            UnitKind::Gpu
        }
    }

    pub fn is_mig(&self) -> bool {
        self.kind() == UnitKind::Mig
    }
}

fn uuid_body(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

fn check_uuid(v: &str) -> Result<UnitKind, &'static str> {
    common_text(v)?;
    if v.len() > 95 {
        return Err("is longer than 95 bytes");
    }
    if let Some(legacy) = v.strip_prefix("MIG-GPU-") {
        // MIG-GPU-<uuid>/<gpu instance>/<compute instance>
        let parts: Vec<&str> = legacy.split('/').collect();
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        return match parts.as_slice() {
            [body, gi, ci] if uuid_body(body) && digits(gi) && digits(ci) => Ok(UnitKind::Mig),
            [_] if uuid_body(legacy) => Ok(UnitKind::Mig),
            _ => Err("is not MIG-<uuid> or the legacy MIG-GPU-<uuid>/<gi>/<ci>"),
        };
    }
    let (kind, body) = match (v.strip_prefix("GPU-"), v.strip_prefix("MIG-")) {
        (Some(b), _) => (UnitKind::Gpu, b),
        (_, Some(b)) => (UnitKind::Mig, b),
        _ => return Err("does not start with GPU- or MIG-"),
    };
    if uuid_body(body) {
        Ok(kind)
    } else {
        Err("may hold only ASCII letters, digits and `-` after its GPU-/MIG- prefix")
    }
}

/// The rules every identity here shares: something there, nothing a list or a log line could
/// be split on.
fn common_text(v: &str) -> Result<(), &'static str> {
    if v.is_empty() {
        Err("is empty")
    } else if v.chars().any(char::is_whitespace) {
        Err("contains whitespace")
    } else if v.chars().any(char::is_control) {
        Err("contains a control character")
    } else if v.contains(',') {
        Err("contains `,`")
    } else {
        Ok(())
    }
}

/// A MIG profile name as NVML prints it, without its `MIG ` prefix: `[<c>c.]<g>g.<mem>gb`
/// and any attributes (`+me`, `+me.all`, `-me`, `+gfx`): `1g.10gb`, `1g.10gb+me`, `7g.80gb`,
/// `1c.3g.40gb`. At most 59 bytes, so that its resource name `mig-<profile>` fits 63.
/// Every profile is also a valid resource name part once `+` is written `.`
/// ([`ResourceName::mig`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct MigProfile(String);

const PROFILE: &str = "MIG profile";
const PROFILE_RULE: &str = "is not a MIG profile like 1g.10gb, 1g.10gb+me or 1c.3g.40gb";

impl MigProfile {
    pub fn parse(value: impl Into<String>) -> Result<MigProfile, IdError> {
        let value = value.into();
        if let Err(rule) = common_text(&value) {
            return Err(IdError::new(PROFILE, value, rule));
        }
        if value.len() > 59 || !profile_shape(&value) {
            return Err(IdError::new(PROFILE, value, PROFILE_RULE));
        }
        Ok(MigProfile(value))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// `<n>` then `suffix`, returning what follows.
fn count<'a>(s: &'a str, suffix: &str) -> Option<&'a str> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return None;
    }
    s[digits..].strip_prefix(suffix)
}

fn profile_shape(v: &str) -> bool {
    let rest = count(v, "c.").unwrap_or(v);
    let Some(rest) = count(rest, "g.").and_then(|r| count(r, "gb")) else {
        return false;
    };
    // Attributes: `+name` or `-name`, names of lower-case letters, digits and `.`, with a
    // letter or digit at both ends.
    let mut attrs = rest;
    while !attrs.is_empty() {
        let Some(tail) = attrs.strip_prefix(['+', '-']) else {
            return false;
        };
        let len = tail
            .bytes()
            .take_while(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'.')
            .count();
        if len == 0 || tail.as_bytes()[0] == b'.' || tail.as_bytes()[len - 1] == b'.' {
            return false;
        }
        attrs = &tail[len..];
    }
    true
}

/// The resource name whole GPUs (and MIG devices under the `single` strategy) are offered as,
/// NVIDIA's device plugin's, so pod specs keep working.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Prefix of MIG resources under the `mixed` strategy (`nvidia.com/mig-1g.10gb`).
pub const MIG_RESOURCE_PREFIX: &str = "nvidia.com/mig-";
/// Suffix of time-sliced resources renamed by `renameByDefault`.
pub const SHARED_SUFFIX: &str = ".shared";

/// A Kubernetes extended resource name, `<domain>/<name>` as the API server validates it: the
/// domain a DNS subdomain (at most 253 bytes) outside `kubernetes.io`, the name at most 63
/// bytes of letters, digits, `-`, `_` and `.`, alphanumeric at both ends; e.g. `nvidia.com/gpu`,
/// `nvidia.com/mig-1g.10gb`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ResourceName(String);

const RESOURCE: &str = "resource name";

impl ResourceName {
    pub fn parse(value: impl Into<String>) -> Result<ResourceName, IdError> {
        let value = value.into();
        match check_resource(&value) {
            Ok(()) => Ok(ResourceName(value)),
            Err(rule) => Err(IdError::new(RESOURCE, value, rule)),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// `nvidia.com/gpu`, the resource whole GPUs are offered as.
    pub fn gpu() -> ResourceName {
        ResourceName(GPU_RESOURCE.to_string())
    }

    /// `nvidia.com/mig-<profile>` with `+` written as `.`, as NVIDIA's plugin names them. A
    /// [`MigProfile`] is at most 59 bytes of digits, lower-case letters, `.`, `+` and `-`,
    /// starting with a digit and ending with a letter: always a valid name.
    pub fn mig(profile: &MigProfile) -> ResourceName {
        ResourceName(format!(
            "{MIG_RESOURCE_PREFIX}{}",
            profile.replace('+', ".")
        ))
    }

    /// `<self>.shared`, the name a time-sliced resource is advertised under by default.
    pub fn shared(&self) -> Result<ResourceName, IdError> {
        ResourceName::parse(format!("{}{SHARED_SUFFIX}", self.0))
    }

    /// The part after the `/`.
    pub fn name(&self) -> &str {
        self.0.split_once('/').map_or("", |(_, n)| n)
    }

    /// The domain before the `/`.
    pub fn domain(&self) -> &str {
        self.0.split_once('/').map_or("", |(d, _)| d)
    }
}

fn check_resource(v: &str) -> Result<(), &'static str> {
    common_text(v)?;
    let Some((domain, name)) = v.split_once('/') else {
        return Err("has no `<domain>/` prefix");
    };
    if !crate::names::is_dns_subdomain(domain) {
        return Err("has a domain that is not a DNS subdomain (lower-case, at most 253 bytes)");
    }
    if domain == "kubernetes.io" || domain.ends_with(".kubernetes.io") {
        return Err("is in the kubernetes.io domain, which extended resources may not use");
    }
    if name.len() > crate::names::QUALIFIED_NAME_MAX || !crate::names::is_qualified_name_part(name)
    {
        return Err("has a name part that is not a qualified name (at most 63 letters, digits, `-`, `_` or `.`, alphanumeric at both ends)");
    }
    Ok(())
}

/// A device plugin device ID, as this node offers them in ListAndWatch and the kubelet sends
/// them back in Allocate: a unit's UUID or index (`deviceIDStrategy: index`, `<gpu>` or
/// `<gpu>:<mig>`), with `::<replica>` for a time-sliced replica. At most 128 bytes of ASCII
/// letters, digits, `-`, `:` and `/` (a legacy MIG UUID's). Whether this node offers it is
/// Allocate's question; this is only what any of its IDs looks like.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct DeviceId(String);

const DEVICE_ID: &str = "device ID";

impl DeviceId {
    pub fn parse(value: impl Into<String>) -> Result<DeviceId, IdError> {
        let value = value.into();
        let rule = common_text(&value).err().or(if value.len() > 128 {
            Some("is longer than 128 bytes")
        } else if !value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-:/".contains(&b))
        {
            Some("may hold only ASCII letters, digits, `-`, `:` and `/`")
        } else {
            None
        });
        match rule {
            Some(rule) => Err(IdError::new(DEVICE_ID, value, rule)),
            None => Ok(DeviceId(value)),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// A unit's UUID as its device ID: always a valid one (a UUID is at most 95 bytes of the
    /// characters a device ID allows).
    pub fn of_uuid(uuid: &DeviceUuid) -> DeviceId {
        DeviceId(uuid.to_string())
    }

    /// The index form: `<gpu>`, or `<gpu>:<position>` for a MIG device.
    pub fn of_index(gpu: u32, mig_position: Option<usize>) -> DeviceId {
        DeviceId(match mig_position {
            Some(pos) => format!("{gpu}:{pos}"),
            None => gpu.to_string(),
        })
    }

    /// Replica `k` of a time-sliced device: `<id>::<k>`. Still valid: the IDs replicated are
    /// UUIDs or index forms, at most 95 bytes, and the suffix adds at most 12.
    pub fn replica(&self, k: u32) -> DeviceId {
        DeviceId(format!("{}::{k}", self.0))
    }
}

macro_rules! id_newtype {
    ($t:ident) => {
        str_newtype!($t);

        impl TryFrom<String> for $t {
            type Error = IdError;
            fn try_from(v: String) -> Result<$t, IdError> {
                $t::parse(v)
            }
        }

        impl TryFrom<&str> for $t {
            type Error = IdError;
            fn try_from(v: &str) -> Result<$t, IdError> {
                $t::parse(v)
            }
        }

        impl std::str::FromStr for $t {
            type Err = IdError;
            fn from_str(v: &str) -> Result<$t, IdError> {
                $t::parse(v)
            }
        }
    };
}

id_newtype!(DeviceUuid);
id_newtype!(MigProfile);
id_newtype!(ResourceName);
id_newtype!(DeviceId);

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn device_uuids() {
        for (ok, kind) in [
            ("GPU-5b3c8e1a-0000-4000-8000-000000000001", UnitKind::Gpu),
            ("MIG-4a1b2c3d-0000-4000-8000-000000000002", UnitKind::Mig),
            (
                "MIG-GPU-5b3c8e1a-0000-4000-8000-000000000001/1/0",
                UnitKind::Mig,
            ),
            ("GPU-0", UnitKind::Gpu),
        ] {
            let u = DeviceUuid::parse(ok).unwrap();
            assert_eq!(u, ok);
            assert_eq!(u.kind(), kind, "{ok}");
            assert_eq!(u.is_mig(), kind == UnitKind::Mig);
        }
        for (bad, rule) in [
            ("", "is empty"),
            ("GPU-a b", "contains whitespace"),
            ("GPU-a\n", "contains whitespace"),
            ("GPU-a\u{7}", "contains a control character"),
            ("GPU-a,GPU-b", "contains `,`"),
            ("gpu-abc", "does not start with GPU- or MIG-"),
            ("abc", "does not start with GPU- or MIG-"),
            ("GPU-", "may hold only"),
            ("GPU-a/b", "may hold only"),
            ("GPU-a:0", "may hold only"),
            ("MIG-GPU-a/1", "is not MIG-<uuid>"),
            ("MIG-GPU-a/x/0", "is not MIG-<uuid>"),
        ] {
            let e = DeviceUuid::parse(bad).unwrap_err();
            assert_eq!(e.what, "device UUID");
            assert_eq!(e.value, bad);
            assert!(e.rule.starts_with(rule), "{bad}: {}", e.rule);
        }
        let long = format!("GPU-{}", "a".repeat(92));
        assert!(DeviceUuid::parse(long).is_err());
        assert_eq!(
            DeviceUuid::parse("GPU-a,b").unwrap_err().to_string(),
            "invalid device UUID \"GPU-a,b\": contains `,`"
        );
    }

    #[test]
    fn mig_profiles() {
        for ok in [
            "1g.5gb",
            "1g.10gb",
            "1g.10gb+me",
            "1g.18gb",
            "7g.80gb",
            "1c.2g.20gb",
            "1c.3g.40gb",
            "1g.23gb+me.all",
            "1g.12gb-me",
            "1g.10gb+gfx",
        ] {
            assert_eq!(MigProfile::parse(ok).unwrap(), ok);
        }
        for bad in [
            "",
            "MIG 1g.10gb",
            "1g10gb",
            "g.10gb",
            "1g.gb",
            "1g.10gb+",
            "1g.10gb+ME",
            "1g.10gb+.x",
            "1g.10gb+me.",
            "1g.10gb x",
            "1c.1g",
            "1g.10gb,2g.20gb",
            "10gb",
        ] {
            let e = MigProfile::parse(bad).unwrap_err();
            assert_eq!((e.what, e.value.as_str()), ("MIG profile", bad));
        }
    }

    #[test]
    fn resource_names() {
        for ok in [
            "nvidia.com/gpu",
            "nvidia.com/mig-1g.10gb",
            "nvidia.com/mig-1g.10gb.me",
            "nvidia.com/gpu.shared",
            "example.com/A_b",
        ] {
            let r = ResourceName::parse(ok).unwrap();
            assert_eq!(r, ok);
            assert_eq!(format!("{}/{}", r.domain(), r.name()), ok);
        }
        for bad in [
            "",
            "gpu",
            "nvidia.com/",
            "/gpu",
            "Nvidia.com/gpu",
            "nvidia..com/gpu",
            "nvidia.com/-gpu",
            "nvidia.com/gpu.",
            "nvidia.com/mig-1g.10gb+me",
            "nvidia.com/a/b",
            "kubernetes.io/gpu",
            "x.kubernetes.io/gpu",
            "nvidia.com/g pu",
            &format!("nvidia.com/{}", "a".repeat(64)),
        ] {
            let e = ResourceName::parse(bad).unwrap_err();
            assert_eq!((e.what, e.value.as_str()), ("resource name", bad));
        }
        assert!(ResourceName::parse(format!("nvidia.com/{}", "a".repeat(63))).is_ok());
        assert_eq!(ResourceName::gpu(), "nvidia.com/gpu");
        for p in ["1g.10gb+me", "1g.23gb+me.all", "1g.12gb-me", "1c.3g.40gb"] {
            let r = ResourceName::mig(&MigProfile::parse(p).unwrap());
            assert_eq!(ResourceName::parse(r.as_str()), Ok(r));
        }
        let me = ResourceName::mig(&MigProfile::parse("1g.10gb+me").unwrap());
        assert_eq!(me, "nvidia.com/mig-1g.10gb.me");
        let longest = MigProfile::parse(format!("1g.1gb+{}", "a".repeat(52))).unwrap();
        assert_eq!(ResourceName::mig(&longest).name().len(), 63);
        assert!(MigProfile::parse(format!("1g.1gb+{}", "a".repeat(53))).is_err());
        let gpu = ResourceName::gpu();
        assert_eq!(gpu.shared().unwrap(), "nvidia.com/gpu.shared");
    }

    #[test]
    fn device_ids() {
        for ok in [
            "GPU-8f2c",
            "MIG-GPU-8f2c/1/0",
            "3",
            "0:1",
            "GPU-8f2c::2",
            "0:1::3",
        ] {
            assert_eq!(DeviceId::parse(ok).unwrap(), ok);
        }
        let why = |v: &str| DeviceId::parse(v).unwrap_err().to_string();
        assert_eq!(why(""), "invalid device ID \"\": is empty");
        assert!(why("GPU-a b").contains("whitespace"));
        assert!(why("../x").contains("may hold only"), "{}", why("../x"));
        assert!(why(&"7".repeat(129)).contains("longer than 128"));
    }

    #[test]
    fn maps_look_up_by_str_and_serde_validates() {
        let u = DeviceUuid::parse("GPU-abc").unwrap();
        let m: BTreeMap<DeviceUuid, u32> = [(u.clone(), 1)].into();
        assert_eq!(m.get("GPU-abc"), Some(&1));
        assert_eq!(serde_json::to_string(&u).unwrap(), "\"GPU-abc\"");
        let back: DeviceUuid = serde_json::from_str("\"GPU-abc\"").unwrap();
        assert_eq!(back, u);
        let e = serde_json::from_str::<DeviceUuid>("\"GPU-a,b\"").unwrap_err();
        assert!(e.to_string().contains("contains `,`"), "{e}");
        assert!(serde_json::from_str::<MigProfile>("\"1g\"").is_err());
        assert!(serde_json::from_str::<ResourceName>("\"gpu\"").is_err());
        assert_eq!("GPU-abc".to_string(), u);
        assert_eq!(*"GPU-abc", u);
    }
}
