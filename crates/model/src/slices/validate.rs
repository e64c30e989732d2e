//! The API server's validation of a `resource.k8s.io/v1` ResourceSlice, as of Kubernetes 1.34
//! (`pkg/apis/resource/validation/validation.go`, `ValidateResourceSlice`), pure.
//!
//! Used by tests on every rendered slice and by the publisher before it writes, so a bad slice
//! is a test failure or one clear error naming the field, never a 422 loop against the API
//! server. Field paths are spelled like the API server spells them:
//! `spec.devices[3].attributes[foo].string`. Feature-gated fields are checked as if their gate
//! were on; device taint effects are the two a 1.34 server accepts (`NoSchedule`,
//! `NoExecute`; `None` came later).

use super::{
    MAX_ATTRIBUTES_AND_CAPACITIES, MAX_ATTRIBUTE_VALUE_LEN, MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS,
};
use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceTaint, ResourcePool, ResourceSlice,
};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// Longest DNS label (device names, counter names, label-name parts).
const DNS_LABEL_MAX: usize = 63;
/// Longest DNS subdomain (object names, node names, pool-name parts).
const DNS_SUBDOMAIN_MAX: usize = 253;
/// Longest driver name and attribute-name domain.
const DRIVER_NAME_MAX: usize = 63;
/// Longest attribute or capacity name after the domain.
const ID_MAX: usize = 32;
/// Longest qualified attribute name shown untruncated in a path (`domain/id`).
const KEY_PATH_MAX: usize = DRIVER_NAME_MAX + 1 + ID_MAX;
/// Most taints per device (1.34).
const TAINTS_MAX: usize = 4;
/// Most binding (failure) conditions per device.
const BINDING_CONDITIONS_MAX: usize = 4;
/// Most counters over all shared counter sets of a slice.
const SHARED_COUNTERS_MAX: usize = 32;
/// Most counter-consumption entries on one device, and over a whole slice.
const DEVICE_COUNTER_CONSUMPTIONS_MAX: usize = 32;
const SLICE_COUNTER_CONSUMPTIONS_MAX: usize = 1024;
const TAINT_EFFECTS: [&str; 2] = ["NoExecute", "NoSchedule"];

/// One thing the API server would reject, at a field path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {problem}")]
pub struct Violation {
    /// Path of the offending field, e.g. `spec.devices[3].attributes[foo]`.
    pub field: String,
    pub problem: Problem,
}

/// What is wrong with a field, in the API server's categories.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    #[error("Required value: {0}")]
    Required(String),
    #[error("Invalid value: {value:?}: {reason}")]
    Invalid { value: String, reason: String },
    #[error("Too long: may not be more than {max} bytes")]
    TooLong { max: usize },
    #[error("Too many: {count}: must have at most {max} items")]
    TooMany { count: usize, max: usize },
    #[error("Duplicate value: {0:?}")]
    Duplicate(String),
    #[error("Unsupported value: {value:?}: supported values: {supported}")]
    NotSupported { value: String, supported: String },
    #[error("Forbidden: {0}")]
    Forbidden(String),
}

/// Checks a slice the way the API server does on create. `Err` holds every violation found,
/// in a deterministic order.
pub fn validate(slice: &ResourceSlice) -> Result<(), Vec<Violation>> {
    let mut v = Checker::default();
    v.metadata(slice);
    v.spec(slice);
    if v.out.is_empty() {
        Ok(())
    } else {
        Err(v.out)
    }
}

#[derive(Default)]
struct Checker {
    out: Vec<Violation>,
}

fn invalid(value: impl fmt::Display, reason: impl Into<String>) -> Problem {
    Problem::Invalid {
        value: value.to_string(),
        reason: reason.into(),
    }
}

impl Checker {
    fn push(&mut self, field: impl Into<String>, problem: Problem) {
        self.out.push(Violation {
            field: field.into(),
            problem,
        });
    }

    fn metadata(&mut self, slice: &ResourceSlice) {
        match (&slice.metadata.name, &slice.metadata.generate_name) {
            (Some(name), _) if !name.is_empty() => self.dns_subdomain(name, "metadata.name"),
            (_, Some(g)) if !g.is_empty() => {
                // The server appends five characters; the prefix must allow for a valid name.
                let probe = format!("{g}abcde");
                self.dns_subdomain(&probe, "metadata.generateName");
            }
            _ => self.push(
                "metadata.name",
                Problem::Required("name or generateName is required".into()),
            ),
        }
    }

    fn spec(&mut self, slice: &ResourceSlice) {
        let spec = &slice.spec;
        self.driver_name(&spec.driver, "spec.driver");
        self.pool(&spec.pool);

        let mut set = Vec::new();
        if let Some(n) = &spec.node_name {
            if n.is_empty() {
                self.push(
                    "spec.nodeName",
                    invalid("", "must be either unset or set to a non-empty string"),
                );
            } else {
                set.push("`nodeName`");
                self.dns_subdomain(n, "spec.nodeName");
            }
        }
        if let Some(sel) = &spec.node_selector {
            set.push("`nodeSelector`");
            if sel.node_selector_terms.len() != 1 {
                self.push(
                    "spec.nodeSelector.nodeSelectorTerms",
                    invalid(
                        sel.node_selector_terms.len(),
                        "must have exactly one node selector term",
                    ),
                );
            }
        }
        match spec.all_nodes {
            Some(true) => set.push("`allNodes`"),
            Some(false) => self.push(
                "spec.allNodes",
                invalid(false, "must be either unset or set to true"),
            ),
            None => {}
        }
        let per_device = match spec.per_device_node_selection {
            Some(true) => {
                set.push("`perDeviceNodeSelection`");
                true
            }
            Some(false) => {
                self.push(
                    "spec.perDeviceNodeSelection",
                    invalid(false, "must be either unset or set to true"),
                );
                false
            }
            None => false,
        };
        const ONE_OF: &str = "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection` is required";
        match set.len() {
            0 => self.push("spec", Problem::Required(ONE_OF.into())),
            1 => {}
            _ => self.push(
                "spec",
                invalid(
                    format!("{{{}}}", set.join(", ")),
                    format!("{ONE_OF}, but multiple fields are set"),
                ),
            ),
        }

        if spec.shared_counters.is_some() && spec.devices.is_some() {
            self.push(
                "spec",
                invalid("", "only one of `sharedCounters` or `devices` is allowed"),
            );
        }

        let devices = spec.devices.as_deref().unwrap_or_default();
        let tainted_or_counters = devices.iter().any(|d| {
            d.taints.as_ref().is_some_and(|t| !t.is_empty())
                || d.consumes_counters.as_ref().is_some_and(|c| !c.is_empty())
        });
        let max = if tainted_or_counters {
            MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
        } else {
            MAX_DEVICES_PER_SLICE
        };
        if devices.len() > max {
            // Like the server: too many short-circuits the per-device checks.
            self.push(
                "spec.devices",
                Problem::TooMany {
                    count: devices.len(),
                    max,
                },
            );
        } else {
            let mut seen = BTreeSet::new();
            for (i, d) in devices.iter().enumerate() {
                self.device(d, &format!("spec.devices[{i}]"), per_device);
            }
            for (i, d) in devices.iter().enumerate() {
                if !seen.insert(d.name.as_str()) {
                    self.push(
                        format!("spec.devices[{i}]"),
                        Problem::Duplicate(d.name.clone()),
                    );
                }
            }
            let consumptions: usize = devices
                .iter()
                .map(|d| d.consumes_counters.as_ref().map_or(0, Vec::len))
                .sum();
            if consumptions > SLICE_COUNTER_CONSUMPTIONS_MAX {
                self.push(
                    "spec.devices",
                    Problem::TooMany {
                        count: consumptions,
                        max: SLICE_COUNTER_CONSUMPTIONS_MAX,
                    },
                );
            }
        }

        if let Some(sets) = &spec.shared_counters {
            let total: usize = sets.iter().map(|s| s.counters.len()).sum();
            if total > SHARED_COUNTERS_MAX {
                self.push(
                    "spec.sharedCounters",
                    Problem::TooMany {
                        count: total,
                        max: SHARED_COUNTERS_MAX,
                    },
                );
            }
            let mut seen = BTreeSet::new();
            for (i, s) in sets.iter().enumerate() {
                let path = format!("spec.sharedCounters[{i}]");
                self.counter_name(&s.name, &format!("{path}.name"));
                if s.counters.is_empty() {
                    self.push(format!("{path}.counters"), Problem::Required(String::new()));
                }
                for k in s.counters.keys() {
                    self.counter_name(k, &format!("{path}.counters[{k}]"));
                }
                if !seen.insert(s.name.as_str()) {
                    self.push(path, Problem::Duplicate(s.name.clone()));
                }
            }
        }
    }

    fn pool(&mut self, pool: &ResourcePool) {
        let path = "spec.pool.name";
        if pool.name.is_empty() {
            self.push(path, Problem::Required(String::new()));
        } else {
            if pool.name.len() > DNS_SUBDOMAIN_MAX {
                self.push(
                    path,
                    Problem::TooLong {
                        max: DNS_SUBDOMAIN_MAX,
                    },
                );
            }
            for part in pool.name.split('/') {
                self.dns_subdomain(part, path);
            }
        }
        if pool.resource_slice_count <= 0 {
            self.push(
                "spec.pool.resourceSliceCount",
                invalid(pool.resource_slice_count, "must be greater than zero"),
            );
        }
        if pool.generation < 0 {
            self.push(
                "spec.pool.generation",
                invalid(pool.generation, "must be greater than or equal to zero"),
            );
        }
    }

    fn device(&mut self, d: &Device, path: &str, per_device: bool) {
        self.dns_label(&d.name, &format!("{path}.name"));
        let attrs = d.attributes.as_ref();
        let caps = d.capacity.as_ref();
        let total = attrs.map_or(0, BTreeMap::len) + caps.map_or(0, BTreeMap::len);
        if total > MAX_ATTRIBUTES_AND_CAPACITIES {
            self.push(path, invalid(total, format!("the total number of attributes and capacities must not exceed {MAX_ATTRIBUTES_AND_CAPACITIES}")));
        }
        for (name, value) in attrs.into_iter().flatten() {
            let p = format!("{path}.attributes[{}]", truncate_key(name));
            self.qualified_name(name, &p);
            self.attribute(value, &p);
        }
        let multi = d.allow_multiple_allocations == Some(true);
        for (name, c) in caps.into_iter().flatten() {
            let p = format!("{path}.capacity[{}]", truncate_key(name));
            self.qualified_name(name, &p);
            if let Err(e) = crate::quantity::Quantity::parse_trimmed(&c.value.0) {
                self.push(format!("{p}.value"), invalid(&c.value.0, e.to_string()));
            }
            if c.request_policy.is_some() && !multi {
                self.push(
                    format!("{p}.requestPolicy"),
                    Problem::Forbidden("allowMultipleAllocations must be true".into()),
                );
            }
        }
        if let Some(taints) = &d.taints {
            if taints.len() > TAINTS_MAX {
                self.push(
                    format!("{path}.taints"),
                    Problem::TooMany {
                        count: taints.len(),
                        max: TAINTS_MAX,
                    },
                );
            } else {
                for (i, t) in taints.iter().enumerate() {
                    self.taint(t, &format!("{path}.taints[{i}]"));
                }
            }
        }
        if let Some(cc) = &d.consumes_counters {
            if cc.len() > DEVICE_COUNTER_CONSUMPTIONS_MAX {
                self.push(
                    format!("{path}.consumesCounters"),
                    Problem::TooMany {
                        count: cc.len(),
                        max: DEVICE_COUNTER_CONSUMPTIONS_MAX,
                    },
                );
            } else {
                let mut seen = BTreeSet::new();
                for (i, c) in cc.iter().enumerate() {
                    let p = format!("{path}.consumesCounters[{i}]");
                    if c.counter_set.is_empty() {
                        self.push(format!("{p}.counterSet"), Problem::Required(String::new()));
                    } else {
                        self.counter_name(&c.counter_set, &format!("{p}.counterSet"));
                    }
                    if c.counters.is_empty() {
                        self.push(format!("{p}.counters"), Problem::Required(String::new()));
                    }
                    for k in c.counters.keys() {
                        self.counter_name(k, &format!("{p}.counters[{k}]"));
                    }
                    if !seen.insert(c.counter_set.as_str()) {
                        self.push(p, Problem::Duplicate(c.counter_set.clone()));
                    }
                }
            }
        }
        self.node_selection(d, path, per_device);
        self.binding_conditions(d, path);
    }

    fn node_selection(&mut self, d: &Device, path: &str, per_device: bool) {
        if !per_device {
            if d.node_name.is_some() || d.node_selector.is_some() || d.all_nodes.is_some() {
                self.push(path, invalid("null", "`nodeName`, `nodeSelector` and `allNodes` can only be set if `perDeviceNodeSelection` is set to true in the ResourceSlice spec"));
            }
            return;
        }
        let mut set = Vec::new();
        if let Some(n) = &d.node_name {
            if n.is_empty() {
                self.push(format!("{path}.nodeName"), invalid("", "must not be empty"));
            } else {
                set.push("`nodeName`");
                self.dns_subdomain(n, &format!("{path}.nodeName"));
            }
        }
        if d.node_selector.is_some() {
            set.push("`nodeSelector`");
        }
        match d.all_nodes {
            Some(true) => set.push("`allNodes`"),
            Some(false) => self.push(
                format!("{path}.allNodes"),
                invalid(false, "must be either unset or set to true"),
            ),
            None => {}
        }
        const ONE_OF: &str = "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when `perDeviceNodeSelection` is set to true in the ResourceSlice spec";
        match set.len() {
            0 => self.push(path, Problem::Required(ONE_OF.into())),
            1 => {}
            _ => self.push(path, invalid(format!("{{{}}}", set.join(", ")), ONE_OF)),
        }
    }

    fn binding_conditions(&mut self, d: &Device, path: &str) {
        let bc = d.binding_conditions.as_deref().unwrap_or_default();
        let bfc = d.binding_failure_conditions.as_deref().unwrap_or_default();
        for (list, name) in [(bc, "bindingConditions"), (bfc, "bindingFailureConditions")] {
            if list.len() > BINDING_CONDITIONS_MAX {
                self.push(
                    format!("{path}.{name}"),
                    Problem::TooMany {
                        count: list.len(),
                        max: BINDING_CONDITIONS_MAX,
                    },
                );
                continue;
            }
            let mut seen = BTreeSet::new();
            for (i, c) in list.iter().enumerate() {
                self.label_name(c, &format!("{path}.{name}[{i}]"));
                if !seen.insert(c) {
                    self.push(format!("{path}.{name}[{i}]"), Problem::Duplicate(c.clone()));
                }
            }
        }
        for (i, c) in bfc.iter().enumerate() {
            if bc.contains(c) {
                self.push(
                    format!("{path}.bindingFailureConditions[{i}]"),
                    invalid(
                        c,
                        "bindingFailureConditions must not overlap with bindingConditions",
                    ),
                );
            }
        }
        if bc.is_empty() && !bfc.is_empty() {
            self.push(
                format!("{path}.bindingConditions"),
                invalid(
                    "[]",
                    "bindingConditions are required to use bindingFailureConditions",
                ),
            );
        }
        if bfc.is_empty() && !bc.is_empty() {
            self.push(
                format!("{path}.bindingFailureConditions"),
                invalid(
                    "[]",
                    "bindingFailureConditions are required to use bindingConditions",
                ),
            );
        }
    }

    fn attribute(&mut self, a: &DeviceAttribute, path: &str) {
        let n = [
            a.bool.is_some(),
            a.int.is_some(),
            a.string.is_some(),
            a.version.is_some(),
        ]
        .iter()
        .filter(|x| **x)
        .count();
        if let Some(s) = &a.string {
            if s.len() > MAX_ATTRIBUTE_VALUE_LEN {
                self.push(
                    format!("{path}.string"),
                    Problem::TooLong {
                        max: MAX_ATTRIBUTE_VALUE_LEN,
                    },
                );
            }
        }
        if let Some(v) = &a.version {
            if !is_semver(v) {
                self.push(
                    format!("{path}.version"),
                    invalid(v, "must be a string compatible with semver.org spec 2.0.0"),
                );
            }
            if v.len() > MAX_ATTRIBUTE_VALUE_LEN {
                self.push(
                    format!("{path}.version"),
                    Problem::TooLong {
                        max: MAX_ATTRIBUTE_VALUE_LEN,
                    },
                );
            }
        }
        if n != 1 {
            self.push(
                path,
                invalid(
                    if n == 0 {
                        String::new()
                    } else {
                        format!("{n} values")
                    },
                    "exactly one value must be specified",
                ),
            );
        }
    }

    fn taint(&mut self, t: &DeviceTaint, path: &str) {
        self.label_name(&t.key, &format!("{path}.key"));
        if let Some(v) = t.value.as_deref().filter(|v| !v.is_empty()) {
            self.label_value(v, &format!("{path}.value"));
        }
        if t.effect.is_empty() {
            self.push(format!("{path}.effect"), Problem::Required(String::new()));
        } else if !TAINT_EFFECTS.contains(&t.effect.as_str()) {
            self.push(
                format!("{path}.effect"),
                Problem::NotSupported {
                    value: t.effect.clone(),
                    supported: format!("\"{}\"", TAINT_EFFECTS.join("\", \"")),
                },
            );
        }
    }

    /// `validateQualifiedName`: a C identifier of at most 32 bytes, optionally prefixed by a
    /// driver-name-like domain and a slash.
    fn qualified_name(&mut self, name: &str, path: &str) {
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
    fn driver_name(&mut self, name: &str, path: &str) {
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

    fn dns_subdomain(&mut self, name: &str, path: &str) {
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

    fn dns_label(&mut self, name: &str, path: &str) {
        if name.len() > DNS_LABEL_MAX {
            self.push(path, Problem::TooLong { max: DNS_LABEL_MAX });
        }
        if !is_dns_label(name) {
            self.push(path, invalid(name, LABEL_MSG));
        }
    }

    fn counter_name(&mut self, name: &str, path: &str) {
        self.dns_label(name, path);
    }

    /// `ValidateLabelName`: `[prefix/]name`, prefix a DNS subdomain, name a qualified-name part.
    fn label_name(&mut self, key: &str, path: &str) {
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

    fn label_value(&mut self, value: &str, path: &str) {
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
fn truncate_key(key: &str) -> String {
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

pub(crate) fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= DNS_LABEL_MAX
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

pub(crate) fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= DNS_SUBDOMAIN_MAX
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

fn is_qualified_name_part(s: &str) -> bool {
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
