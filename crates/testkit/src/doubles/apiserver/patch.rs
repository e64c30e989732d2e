//! PATCH bodies: JSON merge patch (RFC 7386; also used for server-side apply, see
//! `PatchType`) and JSON patch (RFC 6902), applied by the json-patch crate, and strategic
//! merge patch, which merges the lists Kubernetes gives a patch merge key element by element.

use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PatchType {
    /// `application/merge-patch+json`.
    Merge,
    /// `application/strategic-merge-patch+json`: a merge patch, except that the lists with a
    /// patch merge key in the Kubernetes API ([`merge_key`]) are merged by it: a patch element
    /// replaces the fields it names of the element with the same key, or is appended. `$patch`
    /// directives are not understood.
    Strategic,
    /// `application/json-patch+json`.
    Json,
    /// `application/apply-patch+yaml`: a merge patch that creates a missing object. Field
    /// ownership is not tracked, so fields a manager stops applying are not removed.
    Apply,
}

impl PatchType {
    pub fn from_content_type(ct: &str) -> Option<PatchType> {
        let base = ct.split(';').next().unwrap_or("").trim();
        match base {
            "application/merge-patch+json" => Some(PatchType::Merge),
            "application/strategic-merge-patch+json" => Some(PatchType::Strategic),
            "application/json-patch+json" => Some(PatchType::Json),
            "application/apply-patch+yaml" | "application/apply-patch+json" => {
                Some(PatchType::Apply)
            }
            _ => None,
        }
    }
}

/// Parses a patch body: JSON, or (for apply) YAML.
pub(crate) fn parse_body(kind: PatchType, body: &[u8]) -> Result<Value, String> {
    match serde_json::from_slice(body) {
        Ok(v) => Ok(v),
        Err(e) if kind == PatchType::Apply => {
            serde_yaml_ng::from_slice(body).map_err(|y| format!("{e}; as YAML: {y}"))
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Applies `patch` to `target` in place (the json-patch crate: RFC 7386 and RFC 6902).
pub(crate) fn apply(kind: PatchType, target: &mut Value, patch: &Value) -> Result<(), String> {
    match kind {
        PatchType::Json => {
            let ops: json_patch::Patch = serde_json::from_value(patch.clone())
                .map_err(|e| format!("not a JSON patch (an array of operations): {e}"))?;
            json_patch::patch(target, &ops).map_err(|e| e.to_string())
        }
        PatchType::Merge | PatchType::Strategic | PatchType::Apply => {
            if !patch.is_object() {
                return Err("a merge patch must be a JSON object".into());
            }
            if kind == PatchType::Strategic {
                strategic_merge(target, patch);
            } else {
                json_patch::merge(target, patch);
            }
            Ok(())
        }
    }
}

/// The patch merge key of a list field, as the Kubernetes API declares it
/// (`x-kubernetes-patch-merge-key`) for the fields the product and its tests patch: pod and
/// node conditions, containers, volumes and their mounts, environment variables, scheduling
/// gates, resource claims, owner references.
fn merge_key(field: &str) -> Option<&'static str> {
    Some(match field {
        "conditions" => "type",
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "volumes"
        | "env"
        | "schedulingGates"
        | "resourceClaims"
        | "imagePullSecrets" => "name",
        "volumeMounts" => "mountPath",
        "ownerReferences" => "uid",
        _ => return None,
    })
}

fn strategic_merge(target: &mut Value, patch: &Value) {
    let (Value::Object(t), Value::Object(p)) = (&mut *target, patch) else {
        *target = patch.clone();
        return;
    };
    for (k, pv) in p {
        if pv.is_null() {
            t.remove(k);
            continue;
        }
        match (merge_key(k), t.get_mut(k)) {
            (Some(key), Some(Value::Array(items))) if pv.is_array() => {
                for pe in pv.as_array().into_iter().flatten() {
                    let same = pe
                        .get(key)
                        .and_then(|id| items.iter_mut().find(|e| e.get(key) == Some(id)));
                    match same {
                        Some(e) => strategic_merge(e, pe),
                        None => items.push(pe.clone()),
                    }
                }
            }
            (_, Some(tv)) if tv.is_object() && pv.is_object() => strategic_merge(tv, pv),
            _ => {
                t.insert(k.clone(), pv.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_replaces_lists_and_removes_nulls() {
        let mut doc = json!({"a": {"b": 1, "c": [1, 2]}, "d": 1});
        apply(
            PatchType::Merge,
            &mut doc,
            &json!({"a": {"b": null, "c": [3]}, "e": {"f": 1}}),
        )
        .unwrap();
        assert_eq!(doc, json!({"a": {"c": [3]}, "d": 1, "e": {"f": 1}}));
    }

    #[test]
    fn strategic_merge_merges_keyed_lists_by_their_key_and_replaces_the_rest() {
        let mut pod = json!({"status": {"conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"},
            {"type": "QuotaAdmitted", "status": "False", "message": "waiting"},
        ], "phase": "Pending"}, "spec": {"tolerations": [{"key": "a"}]}});
        apply(
            PatchType::Strategic,
            &mut pod,
            &json!({"status": {"conditions": [
                {"type": "QuotaAdmitted", "status": "True", "message": "admitted"},
                {"type": "gpuplane.dev/GPUsAvailable", "status": "False"},
            ]}, "spec": {"tolerations": [{"key": "b"}]}}),
        )
        .unwrap();
        assert_eq!(
            pod,
            json!({"status": {"conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"},
                {"type": "QuotaAdmitted", "status": "True", "message": "admitted"},
                {"type": "gpuplane.dev/GPUsAvailable", "status": "False"},
            ], "phase": "Pending"}, "spec": {"tolerations": [{"key": "b"}]}})
        );
    }

    #[test]
    fn json_patch_supports_the_six_operations() {
        let mut doc = json!({"metadata": {"labels": {"a/b": "1"}}, "list": [1, 2]});
        apply(
            PatchType::Json,
            &mut doc,
            &json!([
                {"op": "test", "path": "/metadata/labels/a~1b", "value": "1"},
                {"op": "add", "path": "/list/-", "value": 3},
                {"op": "replace", "path": "/list/0", "value": 0},
                {"op": "copy", "from": "/list/2", "path": "/x"},
                {"op": "move", "from": "/x", "path": "/y"},
                {"op": "remove", "path": "/list/1"},
            ]),
        )
        .unwrap();
        assert_eq!(
            doc,
            json!({"metadata": {"labels": {"a/b": "1"}}, "list": [0, 3], "y": 3})
        );
        for bad in [
            json!([{"op": "test", "path": "/y", "value": 4}]),
            json!([{"op": "replace", "path": "/nope", "value": 4}]),
            json!([{"op": "remove", "path": "/list/5"}]),
            json!({"op": "add"}),
        ] {
            assert!(apply(PatchType::Json, &mut doc, &bad).is_err(), "{bad}");
        }
        assert!(apply(PatchType::Merge, &mut doc, &json!([1])).is_err());
    }
}
