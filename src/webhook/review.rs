//! AdmissionReview `admission.k8s.io/v1`, decoded strictly (pure).
//!
//! Unknown or duplicate fields in the envelope, a wrong `apiVersion`/`kind`, a missing
//! `request` or an empty `uid` are errors ([`ReviewError`]), answered HTTP 400 by the server:
//! there is no request to answer. Everything after that (a kind or operation we do not handle,
//! an object that does not decode) is answered with an AdmissionReview carrying the request's
//! uid.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::collections::BTreeMap;

pub const API_VERSION: &str = "admission.k8s.io/v1";
pub const KIND: &str = "AdmissionReview";

#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GroupVersionKind {
    #[serde(default)]
    pub group: String,
    pub version: String,
    pub kind: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GroupVersionResource {
    #[serde(default)]
    pub group: String,
    pub version: String,
    pub resource: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UserInfo {
    #[serde(default)]
    pub username: String,
    #[serde(default)]
    pub uid: String,
    #[serde(default)]
    pub groups: Vec<String>,
    #[serde(default)]
    pub extra: BTreeMap<String, Vec<String>>,
}

/// `AdmissionRequest`, every field of admission.k8s.io/v1.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct AdmissionRequest {
    pub uid: String,
    pub kind: GroupVersionKind,
    pub resource: GroupVersionResource,
    #[serde(default)]
    pub sub_resource: Option<String>,
    #[serde(default)]
    pub request_kind: Option<GroupVersionKind>,
    #[serde(default)]
    pub request_resource: Option<GroupVersionResource>,
    #[serde(default)]
    pub request_sub_resource: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub namespace: Option<String>,
    pub operation: String,
    #[serde(default)]
    pub user_info: UserInfo,
    #[serde(default)]
    pub object: Option<Value>,
    #[serde(default)]
    pub old_object: Option<Value>,
    #[serde(default)]
    pub dry_run: Option<bool>,
    #[serde(default)]
    pub options: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Envelope {
    api_version: String,
    kind: String,
    #[serde(default)]
    request: Option<AdmissionRequest>,
    #[serde(default)]
    response: Option<Value>,
}

/// Why a body is not an AdmissionReview request we can answer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReviewError {
    #[error("the body is not a valid AdmissionReview: {0}")]
    Decode(String),
    #[error("expected apiVersion {API_VERSION} and kind {KIND}, got {api_version} {kind}")]
    WrongType { api_version: String, kind: String },
    #[error("the AdmissionReview has no request")]
    NoRequest,
    #[error("the AdmissionReview carries a response; send requests only")]
    HasResponse,
    #[error("the AdmissionReview request has an empty uid")]
    NoUid,
}

/// Decodes an AdmissionReview request body.
pub fn decode(body: &[u8]) -> Result<AdmissionRequest, ReviewError> {
    let env: Envelope =
        serde_json::from_slice(body).map_err(|e| ReviewError::Decode(e.to_string()))?;
    if env.api_version != API_VERSION || env.kind != KIND {
        return Err(ReviewError::WrongType {
            api_version: env.api_version,
            kind: env.kind,
        });
    }
    if env.response.is_some() {
        return Err(ReviewError::HasResponse);
    }
    let req = env.request.ok_or(ReviewError::NoRequest)?;
    if req.uid.trim().is_empty() {
        return Err(ReviewError::NoUid);
    }
    Ok(req)
}

/// A webhook's answer to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub allowed: bool,
    /// HTTP-like code for denials (403 Forbidden, 400 BadRequest, 500 InternalError).
    pub code: u16,
    pub message: String,
    /// JSON patch operations (mutating webhook).
    pub patch: Vec<Value>,
    pub warnings: Vec<String>,
}

impl Verdict {
    pub fn allow() -> Verdict {
        Verdict {
            allowed: true,
            code: 200,
            message: String::new(),
            patch: Vec::new(),
            warnings: Vec::new(),
        }
    }

    pub fn deny(code: u16, message: impl Into<String>) -> Verdict {
        Verdict {
            allowed: false,
            code,
            message: message.into(),
            patch: Vec::new(),
            warnings: Vec::new(),
        }
    }

    pub fn with_patch(mut self, patch: Vec<Value>) -> Verdict {
        self.patch = patch;
        self
    }

    pub fn with_warning(mut self, w: impl Into<String>) -> Verdict {
        self.warnings.push(w.into());
        self
    }
}

fn reason(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        403 => "Forbidden",
        409 => "Conflict",
        429 => "TooManyRequests",
        503 => "ServiceUnavailable",
        _ => "InternalError",
    }
}

/// The AdmissionReview answering request `uid`.
pub fn encode(uid: &str, v: &Verdict) -> Value {
    let mut response = json!({"uid": uid, "allowed": v.allowed});
    if !v.allowed {
        response["status"] = json!({
            "metadata": {},
            "status": "Failure",
            "code": v.code,
            "reason": reason(v.code),
            "message": v.message,
        });
    } else if !v.message.is_empty() {
        response["status"] =
            json!({"metadata": {}, "status": "Success", "code": 200, "message": v.message});
    }
    if v.allowed && !v.patch.is_empty() {
        response["patchType"] = json!("JSONPatch");
        response["patch"] = json!(base64(&serde_json::to_vec(&v.patch).unwrap_or_default()));
    }
    if !v.warnings.is_empty() {
        response["warnings"] = json!(v.warnings);
    }
    json!({"apiVersion": API_VERSION, "kind": KIND, "response": response})
}

/// Standard base64 with padding.
pub fn base64(bytes: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(T[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(request: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({"apiVersion": API_VERSION, "kind": KIND, "request": request}))
            .unwrap()
    }

    fn request() -> Value {
        json!({
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": "p", "namespace": "ns", "operation": "CREATE",
            "userInfo": {"username": "alice", "groups": ["system:authenticated"], "extra": {"k": ["v"]}},
            "object": {"apiVersion": "v1", "kind": "Pod"}, "oldObject": null, "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        })
    }

    #[test]
    fn a_full_request_decodes() {
        let r = decode(&review(request())).unwrap();
        assert_eq!(r.uid, "u-1");
        assert_eq!(r.user_info.username, "alice");
        assert_eq!(r.operation, "CREATE");
    }

    #[test]
    fn malformed_envelopes_are_errors() {
        assert!(matches!(decode(b"not json"), Err(ReviewError::Decode(_))));
        assert!(matches!(decode(b""), Err(ReviewError::Decode(_))));
        let mut r = request();
        r["surprise"] = json!(1);
        assert!(matches!(decode(&review(r)), Err(ReviewError::Decode(_))));
        let mut r = request();
        r["uid"] = json!("");
        assert_eq!(decode(&review(r)), Err(ReviewError::NoUid));
        let mut r = request();
        r.as_object_mut().unwrap().remove("uid");
        assert!(matches!(decode(&review(r)), Err(ReviewError::Decode(_))));
        let body = serde_json::to_vec(
            &json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": KIND, "request": request()}),
        )
        .unwrap();
        assert!(matches!(decode(&body), Err(ReviewError::WrongType { .. })));
        let body = serde_json::to_vec(&json!({"apiVersion": API_VERSION, "kind": KIND})).unwrap();
        assert_eq!(decode(&body), Err(ReviewError::NoRequest));
        let dup =
            br#"{"apiVersion":"admission.k8s.io/v1","apiVersion":"x","kind":"AdmissionReview"}"#;
        assert!(matches!(decode(dup), Err(ReviewError::Decode(_))));
    }

    #[test]
    fn answers_carry_the_uid_status_and_patch() {
        let v = encode("u-1", &Verdict::deny(403, "no"));
        assert_eq!(v["response"]["uid"], "u-1");
        assert_eq!(v["response"]["allowed"], false);
        assert_eq!(v["response"]["status"]["message"], "no");
        assert_eq!(v["response"]["status"]["reason"], "Forbidden");
        let v = encode(
            "u-2",
            &Verdict::allow().with_patch(vec![json!({"op": "add", "path": "/a", "value": 1})]),
        );
        assert_eq!(v["response"]["patchType"], "JSONPatch");
        assert_eq!(
            v["response"]["patch"],
            base64(br#"[{"op":"add","path":"/a","value":1}]"#)
        );
    }

    #[test]
    fn base64_matches_the_standard() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }
}
