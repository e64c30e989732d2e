//! The namespace label `quota.gpuplane.dev/queue: "true"` (pure): wanted on every namespace
//! with at least one Queue-mode GpuQuota, and on no other. The mutating gate webhook's
//! namespaceSelector requires it, so the API server calls that webhook only where it can act.
//! The shell's `controller::labeler` applies the patch decided here.
//!
//! The key is the controller's: it is set and removed whatever put it there, and no other
//! label is ever touched. A namespace without the label is still governed, only not gated:
//! its GPU pods are checked and reserved by the validating webhook as in Reject mode.

use crate::quota::{GpuQuota, QuotaMode};
use serde_json::{json, Value};
use std::collections::BTreeMap;

/// The label the mutating webhook's namespaceSelector requires.
pub const QUEUE_LABEL: &str = "quota.gpuplane.dev/queue";
/// Its only value.
pub const QUEUE_LABEL_VALUE: &str = "true";

/// Whether `namespace` should carry the label: one of `quotas` (any namespace) is a Queue-mode
/// GpuQuota of it.
pub fn wants_queue_label<'a>(
    namespace: &str,
    quotas: impl IntoIterator<Item = &'a GpuQuota>,
) -> bool {
    quotas.into_iter().any(|q| {
        q.metadata.namespace.as_deref() == Some(namespace) && q.spec.mode == QuotaMode::Queue
    })
}

/// The JSON merge patch that brings the label of `namespace`, whose labels are `labels`, in
/// step with `quotas`; `None` when it already is. Only [`QUEUE_LABEL`] appears in it.
pub fn queue_label_patch<'a>(
    namespace: &str,
    labels: &BTreeMap<String, String>,
    quotas: impl IntoIterator<Item = &'a GpuQuota>,
) -> Option<Value> {
    let value = match (
        wants_queue_label(namespace, quotas),
        labels.get(QUEUE_LABEL).map(String::as_str),
    ) {
        (true, Some(QUEUE_LABEL_VALUE)) | (false, None) => return None,
        (true, _) => json!(QUEUE_LABEL_VALUE),
        // Merge patch: null removes the key.
        (false, Some(_)) => Value::Null,
    };
    Some(json!({"metadata": {"labels": {QUEUE_LABEL: value}}}))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::GpuQuotaSpec;

    fn quota(ns: &str, name: &str, mode: QuotaMode) -> GpuQuota {
        let mut q = GpuQuota::new(
            name,
            GpuQuotaSpec {
                mode,
                ..GpuQuotaSpec::default()
            },
        );
        q.metadata.namespace = Some(ns.into());
        q
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_queue_quota_adds_the_label_and_leaves_other_labels_out_of_the_patch() {
        let qs = [
            quota("team-a", "reject", QuotaMode::Reject),
            quota("team-a", "queue", QuotaMode::Queue),
        ];
        let p = queue_label_patch("team-a", &labels(&[("team", "a")]), &qs);
        assert_eq!(
            p,
            Some(json!({"metadata": {"labels": {"quota.gpuplane.dev/queue": "true"}}}))
        );
        let set = labels(&[("team", "a"), (QUEUE_LABEL, "true")]);
        assert_eq!(queue_label_patch("team-a", &set, &qs), None);
    }

    #[test]
    fn a_wrong_value_is_corrected_and_another_namespaces_quota_does_not_count() {
        let qs = [quota("team-b", "queue", QuotaMode::Queue)];
        let wrong = labels(&[(QUEUE_LABEL, "false")]);
        assert_eq!(
            queue_label_patch("team-b", &wrong, &qs),
            Some(json!({"metadata": {"labels": {"quota.gpuplane.dev/queue": "true"}}}))
        );
        assert_eq!(
            queue_label_patch("team-a", &wrong, &qs),
            Some(json!({"metadata": {"labels": {"quota.gpuplane.dev/queue": null}}}))
        );
        assert_eq!(queue_label_patch("team-a", &labels(&[]), &qs), None);
    }

    #[test]
    fn without_a_queue_quota_the_label_is_removed_whoever_set_it() {
        let set = labels(&[(QUEUE_LABEL, "true"), ("team", "a")]);
        let reject = [quota("team-a", "q", QuotaMode::Reject)];
        let none: [GpuQuota; 0] = [];
        for qs in [&reject[..], &none[..]] {
            assert_eq!(
                queue_label_patch("team-a", &set, qs),
                Some(json!({"metadata": {"labels": {"quota.gpuplane.dev/queue": null}}}))
            );
        }
    }
}
