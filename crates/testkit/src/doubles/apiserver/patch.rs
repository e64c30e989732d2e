//! PATCH bodies: JSON merge patch (RFC 7386; also used for strategic merge and server-side
//! apply, see `PatchType`) and JSON patch (RFC 6902), applied by the json-patch crate.

use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PatchType {
    /// `application/merge-patch+json`.
    Merge,
    /// `application/strategic-merge-patch+json`, applied as a merge patch: lists are replaced
    /// whole rather than merged by key, and `$patch` directives are not understood.
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
            json_patch::merge(target, patch);
            Ok(())
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
