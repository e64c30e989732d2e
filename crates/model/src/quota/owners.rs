//! Owners (`spec.requireLabels`, pure): label keys a GpuQuota requires on every GPU pod of its
//! namespace, each with a non-empty value, so that what runs has an owner to account it to (the
//! GPU-hours report books by such labels). An empty value counts as missing: it names no owner.
//!
//! The webhook asks [`owner_refusal`] on a pod's creation, before anything is charged, in Reject
//! and Queue mode alike (a pod refused here is never queued). A pod asking for no GPU is not
//! the quota's business. The CRD's schema (`label_keys_schema`) refuses a key that is no label
//! key when the quota is written; one that got past it (an older CRD) refuses every GPU pod,
//! naming the key, since no pod can carry it.

use super::crd::GpuQuota;
use super::usage::Charge;
use crate::names::{is_dns_subdomain, is_qualified_name_part, QUALIFIED_NAME_MAX};
use std::collections::BTreeMap;

/// The most keys one GpuQuota may require (the CRD's `maxItems`).
pub const MAX_REQUIRED_LABELS: usize = 16;

/// A label key's grammar, as the CRD states it (see [`is_label_key`]).
const LABEL_KEY_PATTERN: &str = "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$";

/// Whether `key` is a Kubernetes label key: an optional DNS-subdomain prefix and `/`, then a
/// name of at most 63 characters of `[A-Za-z0-9_.-]`, alphanumeric at both ends.
pub fn is_label_key(key: &str) -> bool {
    let name_ok = |n: &str| n.len() <= QUALIFIED_NAME_MAX && is_qualified_name_part(n);
    match key.split_once('/') {
        Some((prefix, name)) => is_dns_subdomain(prefix) && name_ok(name),
        None => name_ok(key),
    }
}

/// The schema of `spec.requireLabels`: at most [`MAX_REQUIRED_LABELS`] label keys, so that a
/// misspelt key is refused when the GpuQuota is written rather than refusing every GPU pod later.
/// The pattern cannot bound the prefix's length (253); a CEL rule does.
pub(super) fn label_keys_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "array",
        "maxItems": MAX_REQUIRED_LABELS,
        "items": {
            "type": "string",
            "maxLength": 317,
            "pattern": LABEL_KEY_PATTERN,
            "x-kubernetes-validations": [{
                "rule": "self.indexOf('/') <= 253",
                "message": "a label key's prefix (before the `/`) is at most 253 characters"
            }]
        }
    })
}

/// Why the pod `pod` (`namespace/name`) with `labels` may not be created under `quotas` (those
/// of its namespace), or None. `charge`: the pod's price; None while it cannot be priced
/// because its ResourceClaimTemplates are not created yet: it is taken for a GPU pod then (it
/// waits gated, and its labels are what they will be once priced). A pod charged nothing is
/// never refused. Every quota that refuses is named, each with its own keys.
pub fn owner_refusal<'a>(
    quotas: impl IntoIterator<Item = &'a GpuQuota>,
    pod: &str,
    labels: Option<&BTreeMap<String, String>>,
    charge: Option<&Charge>,
) -> Option<String> {
    if charge.is_some_and(Charge::is_empty) {
        return None;
    }
    let reasons: Vec<String> = quotas
        .into_iter()
        .filter_map(|q| quota_refusal(q, labels))
        .collect();
    let (first, rest) = reasons.split_first()?;
    let mut out = format!("pod {pod} is refused by {first}");
    for r in rest {
        out.push_str(&format!(". It is also refused by {r}"));
    }
    Some(out)
}

/// `GpuQuota ns/name: <why>` when `quota` refuses a GPU pod with `labels`.
fn quota_refusal(quota: &GpuQuota, labels: Option<&BTreeMap<String, String>>) -> Option<String> {
    let keys = &quota.spec.require_labels;
    let id = quota.id();
    let bad: Vec<&str> = keys
        .iter()
        .filter(|k| !is_label_key(k))
        .map(String::as_str)
        .collect();
    if !bad.is_empty() {
        return Some(format!(
            "GpuQuota {id}: its spec.requireLabels names {}, which no pod can carry (a label key \
             is an optional DNS-subdomain prefix and `/`, then at most 63 of [A-Za-z0-9_.-], \
             alphanumeric at both ends); fix the GpuQuota's requireLabels",
            bad.iter()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let value = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
    let missing: Vec<(&str, bool)> = keys
        .iter()
        .filter_map(|k| match value(k) {
            None => Some((k.as_str(), false)),
            Some("") => Some((k.as_str(), true)),
            Some(_) => None,
        })
        .collect();
    if missing.is_empty() {
        return None;
    }
    let list: Vec<String> = missing
        .iter()
        .map(|(k, empty)| {
            if *empty {
                format!("{k} (empty)")
            } else {
                k.to_string()
            }
        })
        .collect();
    let empty = missing.iter().any(|(_, e)| *e);
    Some(format!(
        "GpuQuota {id}: it lacks the label(s) {} that this quota requires on every GPU pod{}; \
         add them{} to the pod (or its template)",
        list.join(", "),
        if empty {
            " (an empty value names no owner)"
        } else {
            ""
        },
        if empty { " with a value" } else { "" },
    ))
}
