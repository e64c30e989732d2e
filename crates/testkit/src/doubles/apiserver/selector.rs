//! Label and field selectors as the API server parses them from `labelSelector` and
//! `fieldSelector` query parameters.
//!
//! Labels: `a=b`, `a==b`, `a!=b`, `a`, `!a`, `a in (x,y)`, `a notin (x,y)`, comma-joined (all
//! must hold). `a!=b` and `notin` also match objects without the label, as upstream.
//! Fields: `path=value`, `path==value`, `path!=value`, comma-joined, where `path` is
//! `metadata.name`, `metadata.namespace` or any dotted path into the object (`spec.nodeName`,
//! `spec.driver`); a missing field reads as the empty string. Upstream accepts only the field
//! labels each resource registers; the double accepts any path.

use serde_json::Value;
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SelectorError(pub String);

impl fmt::Display for SelectorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SelectorError {}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LabelRequirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
}

/// A parsed label selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(pub Vec<LabelRequirement>);

/// Splits at commas outside parentheses.
fn split_top(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn key(s: &str, whole: &str) -> Result<String, SelectorError> {
    let k = s.trim();
    let ok = !k.is_empty()
        && k.len() <= 316
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
    if ok {
        Ok(k.to_string())
    } else {
        Err(SelectorError(format!(
            "unable to parse requirement: invalid label key {k:?} in {whole:?}"
        )))
    }
}

fn value(s: &str, whole: &str) -> Result<String, SelectorError> {
    let v = s.trim();
    let ok = v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(v.to_string())
    } else {
        Err(SelectorError(format!(
            "unable to parse requirement: invalid label value {v:?} in {whole:?}"
        )))
    }
}

fn requirement(part: &str, whole: &str) -> Result<LabelRequirement, SelectorError> {
    let part = part.trim();
    if let Some(open) = part.find('(') {
        let Some(inner) = part[open + 1..].strip_suffix(')') else {
            return Err(SelectorError(format!("unclosed '(' in {whole:?}")));
        };
        let head: Vec<&str> = part[..open].split_whitespace().collect();
        let [k, op] = head.as_slice() else {
            return Err(SelectorError(format!(
                "expected `key in (...)` or `key notin (...)` in {whole:?}"
            )));
        };
        let values = inner
            .split(',')
            .map(|v| value(v, whole))
            .collect::<Result<Vec<_>, _>>()?;
        return match *op {
            "in" => Ok(LabelRequirement::In(key(k, whole)?, values)),
            "notin" => Ok(LabelRequirement::NotIn(key(k, whole)?, values)),
            other => Err(SelectorError(format!(
                "unknown operator {other:?} in {whole:?}"
            ))),
        };
    }
    if let Some(k) = part.strip_prefix('!') {
        return Ok(LabelRequirement::DoesNotExist(key(k, whole)?));
    }
    if let Some((k, v)) = part.split_once("!=") {
        return Ok(LabelRequirement::NotEquals(
            key(k, whole)?,
            value(v, whole)?,
        ));
    }
    if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
        return Ok(LabelRequirement::Equals(key(k, whole)?, value(v, whole)?));
    }
    if part.contains(['<', '>']) {
        return Err(SelectorError(format!(
            "the double does not support `<`/`>` label selectors: {whole:?}"
        )));
    }
    Ok(LabelRequirement::Exists(key(part, whole)?))
}

impl LabelSelector {
    pub fn parse(s: &str) -> Result<Self, SelectorError> {
        if s.trim().is_empty() {
            return Ok(LabelSelector::default());
        }
        split_top(s)
            .into_iter()
            .map(|p| requirement(p, s))
            .collect::<Result<Vec<_>, _>>()
            .map(LabelSelector)
    }

    /// Whether an object (its `metadata.labels`) is selected.
    pub fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        let get = |k: &str| labels.get(k).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            LabelRequirement::Equals(k, v) => get(k) == Some(v.as_str()),
            LabelRequirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            LabelRequirement::In(k, vs) => get(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelRequirement::NotIn(k, vs) => get(k).is_none_or(|l| vs.iter().all(|v| v != l)),
            LabelRequirement::Exists(k) => get(k).is_some(),
            LabelRequirement::DoesNotExist(k) => get(k).is_none(),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldRequirement {
    /// Dotted path, e.g. `spec.nodeName`.
    pub path: String,
    pub value: String,
    pub negated: bool,
}

/// A parsed field selector; the empty selector matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(pub Vec<FieldRequirement>);

impl FieldSelector {
    pub fn parse(s: &str) -> Result<Self, SelectorError> {
        if s.trim().is_empty() {
            return Ok(FieldSelector::default());
        }
        s.split(',')
            .map(|part| {
                let (path, value, negated) = if let Some((p, v)) = part.split_once("!=") {
                    (p, v, true)
                } else if let Some((p, v)) = part.split_once("==").or_else(|| part.split_once('='))
                {
                    (p, v, false)
                } else {
                    return Err(SelectorError(format!(
                        "invalid selector: {part:?}; expected field=value or field!=value"
                    )));
                };
                let path = path.trim();
                if path.is_empty() || path.split('.').any(str::is_empty) {
                    return Err(SelectorError(format!(
                        "invalid field path {path:?} in {s:?}"
                    )));
                }
                Ok(FieldRequirement {
                    path: path.to_string(),
                    value: value.trim().to_string(),
                    negated,
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(FieldSelector)
    }

    /// Whether `object` is selected.
    pub fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|r| {
            let found = field_text(object, &r.path);
            (found == r.value) != r.negated
        })
    }
}

/// The text of a dotted field; missing and null read as "".
fn field_text(object: &Value, path: &str) -> String {
    let mut v = object;
    for part in path.split('.') {
        match v.get(part) {
            Some(next) => v = next,
            None => return String::new(),
        }
    }
    match v {
        Value::Null => String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labels(pairs: &[(&str, &str)]) -> Value {
        let map: serde_json::Map<String, Value> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        json!({"metadata": {"labels": map}})
    }

    #[test]
    fn equality_inequality_and_existence_parse_comma_joined() {
        let s = LabelSelector::parse("app=gpu, tier!=web,ready,!old,x==y").unwrap();
        use LabelRequirement::*;
        assert_eq!(
            s.0,
            vec![
                Equals("app".into(), "gpu".into()),
                NotEquals("tier".into(), "web".into()),
                Exists("ready".into()),
                DoesNotExist("old".into()),
                Equals("x".into(), "y".into()),
            ]
        );
    }

    #[test]
    fn set_based_requirements_keep_their_commas() {
        let s = LabelSelector::parse("env in (a, b),zone notin (c),gpuplane.dev/node=n1").unwrap();
        use LabelRequirement::*;
        assert_eq!(
            s.0,
            vec![
                In("env".into(), vec!["a".into(), "b".into()]),
                NotIn("zone".into(), vec!["c".into()]),
                Equals("gpuplane.dev/node".into(), "n1".into()),
            ]
        );
    }

    #[test]
    fn inequality_and_notin_match_objects_without_the_label() {
        let none = labels(&[]);
        assert!(LabelSelector::parse("a!=b").unwrap().matches(&none));
        assert!(LabelSelector::parse("a notin (b)").unwrap().matches(&none));
        assert!(!LabelSelector::parse("a").unwrap().matches(&none));
        let ab = labels(&[("a", "b")]);
        assert!(!LabelSelector::parse("a!=b").unwrap().matches(&ab));
        assert!(LabelSelector::parse("a=b,a in (x,b)").unwrap().matches(&ab));
        assert!(LabelSelector::parse("").unwrap().matches(&ab));
    }

    #[test]
    fn malformed_label_selectors_are_rejected() {
        assert!(LabelSelector::parse("a in (b").is_err());
        assert!(LabelSelector::parse("a b (c)").is_err());
        assert!(LabelSelector::parse("=b").is_err());
        assert!(LabelSelector::parse("a=b c").is_err());
        assert!(LabelSelector::parse("a>3").is_err());
    }

    #[test]
    fn field_selectors_follow_dotted_paths_and_missing_reads_empty() {
        let pod = json!({"metadata": {"name": "p", "namespace": "ns"},
                         "spec": {"nodeName": "node-a", "priority": 5}});
        let sel = |s: &str| FieldSelector::parse(s).unwrap().matches(&pod);
        assert!(sel("spec.nodeName=node-a"));
        assert!(sel("metadata.name==p,metadata.namespace=ns"));
        assert!(sel("spec.nodeName!=node-b"));
        assert!(!sel("spec.nodeName=node-b"));
        assert!(sel("spec.priority=5"));
        assert!(sel("spec.driver="));
        assert!(!sel("spec.driver!="));
    }

    #[test]
    fn malformed_field_selectors_are_rejected() {
        assert!(FieldSelector::parse("spec.nodeName").is_err());
        assert!(FieldSelector::parse("spec..x=1").is_err());
        assert!(FieldSelector::parse("=1").is_err());
        assert_eq!(FieldSelector::parse(" ").unwrap(), FieldSelector::default());
    }
}
