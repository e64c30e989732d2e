//! The per-device rules of a ResourceSlice: attributes and capacities, taints, counter
//! consumption, per-device node selection and binding conditions.

use super::name_rules::{is_semver, truncate_key};
use super::{invalid, Checker, Problem};
use crate::slices::{MAX_ATTRIBUTES_AND_CAPACITIES, MAX_ATTRIBUTE_VALUE_LEN};
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute,
    DeviceCounterConsumption, DeviceTaint,
};
use std::collections::{BTreeMap, BTreeSet};

/// Most taints per device (1.34).
const TAINTS_MAX: usize = 4;
/// Most binding (failure) conditions per device.
const BINDING_CONDITIONS_MAX: usize = 4;
/// Most counter-consumption entries on one device
/// (`ResourceSliceMaxDeviceCounterConsumptionsPerDevice`, 1.37).
const DEVICE_COUNTER_CONSUMPTIONS_MAX: usize = 2;
const TAINT_EFFECTS: [&str; 2] = ["NoExecute", "NoSchedule"];

/// A whole-number quantity's value (the integer rules; fractional policies are not checked).
fn whole(q: &str) -> Option<i64> {
    crate::quantity::Quantity::parse_trimmed(q)
        .ok()
        .filter(crate::quantity::Quantity::is_integer)
        .and_then(|q| q.value())
}

impl Checker {
    pub(super) fn device(&mut self, d: &Device, path: &str, per_device: bool) {
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
            match &c.request_policy {
                Some(_) if !multi => self.push(
                    format!("{p}.requestPolicy"),
                    Problem::Forbidden("allowMultipleAllocations must be true".into()),
                ),
                Some(policy) => {
                    self.request_policy(&c.value.0, policy, &format!("{p}.requestPolicy"))
                }
                None => {}
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
            self.counter_consumptions(cc, path);
        }
        self.node_selection(d, path, per_device);
        self.binding_conditions(d, path);
    }

    /// A consumable capacity's request policy, by the API server's rules for whole numbers:
    /// one of `validValues` and `validRange`, a default among them, everything within the
    /// capacity, and `default` and `max` on the grid `min + k*step`.
    fn request_policy(&mut self, capacity: &str, policy: &CapacityRequestPolicy, path: &str) {
        let Some(value) = whole(capacity) else { return };
        if policy.valid_range.is_some() && policy.valid_values.is_some() {
            self.push(path, Problem::Forbidden("exactly one policy can be specified, cannot specify \"validValues\" and \"validRange\" at the same time".into()));
            return;
        }
        let Some(default) = policy.default.as_ref().map(|d| d.0.as_str()) else {
            if policy.valid_range.is_some() || policy.valid_values.is_some() {
                self.push(
                    format!("{path}.default"),
                    Problem::Required("required when validRange or validValues is defined".into()),
                );
            }
            return;
        };
        if let Some(values) = &policy.valid_values {
            for (i, v) in values.iter().enumerate() {
                if whole(&v.0).is_some_and(|v| v > value) {
                    self.push(
                        format!("{path}.validValues[{i}]"),
                        invalid(
                            &v.0,
                            format!("option is larger than capacity value: {capacity}"),
                        ),
                    );
                }
            }
            if !values.iter().any(|v| whole(&v.0) == whole(default)) {
                self.push(
                    format!("{path}.validValues"),
                    invalid(
                        default,
                        "default value is not valid according to the requestPolicy",
                    ),
                );
            }
        }
        if let (Some(range), Some(d)) = (&policy.valid_range, whole(default)) {
            self.valid_range(capacity, value, d, range, &format!("{path}.validRange"));
        }
    }

    fn valid_range(
        &mut self,
        capacity: &str,
        value: i64,
        default: i64,
        range: &CapacityRequestPolicyRange,
        p: &str,
    ) {
        let Some(min) = whole(&range.min.0) else {
            return;
        };
        if min > value {
            self.push(
                format!("{p}.min"),
                invalid(
                    &range.min.0,
                    format!("min is larger than capacity value: {capacity}"),
                ),
            );
        }
        if default < min {
            self.push(
                format!("{p}.default"),
                invalid(default, format!("default is less than min: {min}")),
            );
        }
        let max = range.max.as_ref().and_then(|m| whole(&m.0));
        if let Some(max) = max {
            if min > max || max > value || default > max {
                self.push(
                    format!("{p}.max"),
                    invalid(
                        max,
                        "min <= default <= max <= the capacity value is required",
                    ),
                );
            }
        }
        if let Some(step) = range.step.as_ref().and_then(|s| whole(&s.0)) {
            if step <= 0 || min.saturating_add(step) > value {
                self.push(format!("{p}.step"), invalid(step, format!("must be greater than zero and one step from min must not exceed the capacity value {capacity}")));
                return;
            }
            for v in std::iter::once(default).chain(max) {
                if (v - min) % step != 0 {
                    self.push(
                        format!("{p}.step"),
                        invalid(
                            v,
                            format!(
                                "value is not a multiple of a given step ({step}) from ({min})"
                            ),
                        ),
                    );
                }
            }
        }
    }

    fn counter_consumptions(&mut self, cc: &[DeviceCounterConsumption], path: &str) {
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
                // At most 32 (`ResourceSliceMaxCountersPerDeviceCounterConsumption`).
                self.counters(c.counters.keys(), &format!("{p}.counters"));
                if !seen.insert(c.counter_set.as_str()) {
                    self.push(p, Problem::Duplicate(c.counter_set.clone()));
                }
            }
        }
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
}
