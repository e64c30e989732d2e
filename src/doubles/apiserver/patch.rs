//! PATCH bodies: JSON merge patch (RFC 7386; also used for strategic merge and server-side
//! apply, see `PatchType`) and JSON patch (RFC 6902).

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

/// Applies `patch` to `target` in place.
pub(crate) fn apply(kind: PatchType, target: &mut Value, patch: &Value) -> Result<(), String> {
    match kind {
        PatchType::Json => json_patch(target, patch),
        PatchType::Merge | PatchType::Strategic | PatchType::Apply => {
            if !patch.is_object() {
                return Err("a merge patch must be a JSON object".into());
            }
            merge_patch(target, patch);
            Ok(())
        }
    }
}

/// RFC 7386.
pub(crate) fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(serde_json::Map::new());
    }
    if let Value::Object(t) = target {
        for (k, v) in p {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    }
}

fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

/// Splits a JSON pointer into (parent pointer, last token).
fn split_pointer(path: &str) -> Result<(&str, String), String> {
    if !path.starts_with('/') {
        return Err(format!("invalid JSON pointer {path:?}"));
    }
    let idx = path.rfind('/').unwrap_or(0);
    Ok((&path[..idx], unescape(&path[idx + 1..])))
}

fn index(token: &str, len: usize, allow_end: bool) -> Result<usize, String> {
    if allow_end && token == "-" {
        return Ok(len);
    }
    let i: usize = token
        .parse()
        .map_err(|_| format!("invalid array index {token:?}"))?;
    let max = if allow_end {
        len
    } else {
        len.saturating_sub(1)
    };
    if i > max || (!allow_end && len == 0) {
        return Err(format!("array index {i} out of bounds"));
    }
    Ok(i)
}

fn add(doc: &mut Value, path: &str, value: Value) -> Result<(), String> {
    if path.is_empty() {
        *doc = value;
        return Ok(());
    }
    let (parent, last) = split_pointer(path)?;
    match doc.pointer_mut(parent) {
        Some(Value::Object(m)) => {
            m.insert(last, value);
            Ok(())
        }
        Some(Value::Array(a)) => {
            let i = index(&last, a.len(), true)?;
            a.insert(i, value);
            Ok(())
        }
        _ => Err(format!("path {path:?} does not exist")),
    }
}

fn remove(doc: &mut Value, path: &str) -> Result<Value, String> {
    let (parent, last) = split_pointer(path)?;
    match doc.pointer_mut(parent) {
        Some(Value::Object(m)) => m
            .remove(&last)
            .ok_or_else(|| format!("path {path:?} does not exist")),
        Some(Value::Array(a)) => {
            let i = index(&last, a.len(), false)?;
            Ok(a.remove(i))
        }
        _ => Err(format!("path {path:?} does not exist")),
    }
}

/// RFC 6902: add, remove, replace, move, copy, test.
pub(crate) fn json_patch(doc: &mut Value, ops: &Value) -> Result<(), String> {
    let Value::Array(ops) = ops else {
        return Err("a JSON patch must be an array of operations".into());
    };
    for op in ops {
        let name = op["op"].as_str().ok_or("operation without \"op\"")?;
        let path = op["path"]
            .as_str()
            .ok_or_else(|| format!("{name} without \"path\""))?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| format!("{name} {path} without \"value\""))
        };
        let from = || {
            op["from"]
                .as_str()
                .ok_or_else(|| format!("{name} {path} without \"from\""))
        };
        match name {
            "add" => add(doc, path, value()?)?,
            "remove" => {
                remove(doc, path)?;
            }
            "replace" => {
                if doc.pointer(path).is_none() {
                    return Err(format!("replace: path {path:?} does not exist"));
                }
                if let Some(slot) = doc.pointer_mut(path) {
                    *slot = value()?;
                }
            }
            "move" => {
                let v = remove(doc, from()?)?;
                add(doc, path, v)?;
            }
            "copy" => {
                let v = doc
                    .pointer(from()?)
                    .cloned()
                    .ok_or_else(|| format!("copy: from {:?} does not exist", op["from"]))?;
                add(doc, path, v)?;
            }
            "test" => {
                if doc.pointer(path) != Some(&value()?) {
                    return Err(format!("test failed at {path:?}"));
                }
            }
            other => return Err(format!("unknown JSON patch operation {other:?}")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_replaces_lists_and_removes_nulls() {
        let mut doc = json!({"a": {"b": 1, "c": [1, 2]}, "d": 1});
        merge_patch(
            &mut doc,
            &json!({"a": {"b": null, "c": [3]}, "e": {"f": 1}}),
        );
        assert_eq!(doc, json!({"a": {"c": [3]}, "d": 1, "e": {"f": 1}}));
    }

    #[test]
    fn json_patch_supports_the_six_operations() {
        let mut doc = json!({"metadata": {"labels": {"a/b": "1"}}, "list": [1, 2]});
        json_patch(
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
        assert!(json_patch(&mut doc, &json!([{"op": "test", "path": "/y", "value": 4}])).is_err());
        assert!(json_patch(
            &mut doc,
            &json!([{"op": "replace", "path": "/nope", "value": 4}])
        )
        .is_err());
        assert!(json_patch(&mut doc, &json!([{"op": "remove", "path": "/list/5"}])).is_err());
    }
}
