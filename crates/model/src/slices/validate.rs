//! The API server's validation of a `resource.k8s.io/v1` ResourceSlice, as of Kubernetes 1.34
//! (`pkg/apis/resource/validation/validation.go`, `ValidateResourceSlice`), pure; the counter
//! rules (partitionable devices) as of 1.37, whose limits replaced 1.34's (`types.go`:
//! `ResourceSliceMaxCounterSets` 8, `ResourceSliceMaxCountersPerCounterSet` 32,
//! `ResourceSliceMaxDeviceCounterConsumptionsPerDevice` 2,
//! `ResourceSliceMaxCountersPerDeviceCounterConsumption` 32; no slice-wide totals).
//!
//! Used by tests on every rendered slice and by the publisher before it writes, so a bad slice
//! is a test failure or one clear error naming the field, never a 422 loop against the API
//! server. Field paths are spelled like the API server spells them:
//! `spec.devices[3].attributes[foo].string`. Feature-gated fields are checked as if their gate
//! were on; device taint effects are the two a 1.34 server accepts (`NoSchedule`,
//! `NoExecute`; `None` came later). What only a whole pool shows (counter sets and devices
//! across slices, as the scheduler reads them) is [`validate_pool`].

mod device;
mod name_rules;
mod pool;

pub use pool::validate_pool;

pub use name_rules::is_semver;

use super::{
    MAX_COUNTERS_PER_SET, MAX_COUNTER_SETS_PER_SLICE, MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS,
};
use k8s_openapi::api::resource::v1::{
    CounterSet, Device, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use name_rules::DNS_SUBDOMAIN_MAX;
use std::collections::BTreeSet;
use std::fmt;

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
        let per_device = self.node_scope(spec);
        if spec.shared_counters.is_some() && spec.devices.is_some() {
            self.push(
                "spec",
                invalid("", "only one of `sharedCounters` or `devices` is allowed"),
            );
        }
        self.devices(spec.devices.as_deref().unwrap_or_default(), per_device);
        if let Some(sets) = &spec.shared_counters {
            self.shared_counters(sets);
        }
    }

    /// Which nodes the slice is for: exactly one of `nodeName`, `nodeSelector`, `allNodes`
    /// and `perDeviceNodeSelection`. Returns whether devices choose their own nodes.
    fn node_scope(&mut self, spec: &ResourceSliceSpec) -> bool {
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
        per_device
    }

    fn devices(&mut self, devices: &[Device], per_device: bool) {
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
        }
    }

    /// At most 8 counter sets (too many short-circuits the rest, as the server's
    /// `validateSet` does), each named by a DNS label, unique, with 1 to 32 counters named by
    /// DNS labels.
    fn shared_counters(&mut self, sets: &[CounterSet]) {
        if sets.len() > MAX_COUNTER_SETS_PER_SLICE {
            self.push(
                "spec.sharedCounters",
                Problem::TooMany {
                    count: sets.len(),
                    max: MAX_COUNTER_SETS_PER_SLICE,
                },
            );
            return;
        }
        let mut seen = BTreeSet::new();
        for (i, s) in sets.iter().enumerate() {
            let path = format!("spec.sharedCounters[{i}]");
            if s.name.is_empty() {
                self.push(format!("{path}.name"), Problem::Required(String::new()));
            } else {
                self.counter_name(&s.name, &format!("{path}.name"));
            }
            self.counters(s.counters.keys(), &format!("{path}.counters"));
            if !seen.insert(s.name.as_str()) {
                self.push(path, Problem::Duplicate(s.name.clone()));
            }
        }
    }

    /// A counter map of a set or a consumption: 1 to 32 counters (too many short-circuits
    /// the names, as the server's `validateMap` does), named by DNS labels.
    fn counters<'k>(&mut self, names: impl ExactSizeIterator<Item = &'k String>, path: &str) {
        match names.len() {
            0 => self.push(path, Problem::Required(String::new())),
            n if n > MAX_COUNTERS_PER_SET => self.push(
                path,
                Problem::TooMany {
                    count: n,
                    max: MAX_COUNTERS_PER_SET,
                },
            ),
            _ => {
                for k in names {
                    self.counter_name(k, &format!("{path}[{k}]"));
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
}
