//! AdmissionReview `admission.k8s.io/v1`: decoding and answers (pure).
//!
//! Decoded with kube's admission types, which ignore fields they do not know: API conventions
//! let the API server add fields to AdmissionReview, AdmissionRequest, UserInfo and the objects
//! at any release, and a webhook that refused them would block every pod it governs on upgrade
//! day. Checked are only `apiVersion`, `kind`, the presence of `request` and a non-empty
//! `request.uid` ([`ReviewError`], answered HTTP 400 by the server: there is no request to
//! answer). What the decision reads is then carried in [`AdmissionRequest`]; everything after
//! that (a kind or operation we do not handle, an object that does not decode into its type) is
//! answered with an AdmissionReview carrying the request's uid, built as kube's
//! `AdmissionResponse` with the patch as a `json_patch::Patch`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta;
use kube::core::admission::{AdmissionResponse, AdmissionReview};
use kube::core::response::StatusSummary;
use kube::core::{DynamicObject, Status};
use serde_json::{json, Value};

pub const API_VERSION: &str = "admission.k8s.io/v1";
pub const KIND: &str = "AdmissionReview";

pub use kube::core::{GroupVersionKind, GroupVersionResource};

/// Who asked: what the decision reads of `userInfo`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UserInfo {
    pub username: String,
    pub groups: Vec<String>,
}

/// What the decision reads of one AdmissionRequest.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionRequest {
    pub uid: String,
    pub kind: GroupVersionKind,
    pub sub_resource: Option<String>,
    pub name: Option<String>,
    pub namespace: Option<String>,
    /// `CREATE`, `UPDATE`, `DELETE` or `CONNECT`.
    pub operation: String,
    pub user_info: UserInfo,
    pub object: Option<Value>,
    pub old_object: Option<Value>,
    pub dry_run: Option<bool>,
    /// kube's answer to this request (its uid and review version), allowed until a verdict
    /// says otherwise: [`encode`] starts from it.
    pub answer: AdmissionResponse,
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
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_slice(body).map_err(|e| ReviewError::Decode(e.to_string()))?;
    if review.types.api_version != API_VERSION || review.types.kind != KIND {
        return Err(ReviewError::WrongType {
            api_version: review.types.api_version,
            kind: review.types.kind,
        });
    }
    if review.response.is_some() {
        return Err(ReviewError::HasResponse);
    }
    let mut req = review.request.ok_or(ReviewError::NoRequest)?;
    if req.uid.trim().is_empty() {
        return Err(ReviewError::NoUid);
    }
    // The request's type is not serialised inside the review; the answer copies it from here.
    req.types = review.types;
    let answer = AdmissionResponse::from(&req);
    let object = |o: Option<DynamicObject>| -> Result<Option<Value>, ReviewError> {
        o.map(|o| serde_json::to_value(o).map_err(|e| ReviewError::Decode(e.to_string())))
            .transpose()
    };
    let operation = serde_json::to_value(&req.operation)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    Ok(AdmissionRequest {
        uid: req.uid,
        kind: req.kind,
        sub_resource: req.sub_resource,
        name: Some(req.name).filter(|n| !n.is_empty()),
        namespace: req.namespace,
        operation,
        user_info: UserInfo {
            username: req.user_info.username.unwrap_or_default(),
            groups: req.user_info.groups.unwrap_or_default(),
        },
        object: object(req.object)?,
        old_object: object(req.old_object)?,
        dry_run: Some(req.dry_run),
        answer,
    })
}

/// A webhook's answer to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub allowed: bool,
    /// HTTP-like code for denials (403 Forbidden, 400 BadRequest, 500 InternalError).
    pub code: u16,
    pub message: String,
    /// JSON patch operations (mutating webhook).
    pub patch: json_patch::Patch,
    pub warnings: Vec<String>,
}

impl Verdict {
    pub fn allow() -> Verdict {
        Verdict {
            allowed: true,
            code: 200,
            message: String::new(),
            patch: json_patch::Patch::default(),
            warnings: Vec::new(),
        }
    }

    pub fn deny(code: u16, message: impl Into<String>) -> Verdict {
        Verdict {
            allowed: false,
            code,
            message: message.into(),
            patch: json_patch::Patch::default(),
            warnings: Vec::new(),
        }
    }

    pub fn with_patch(mut self, patch: json_patch::Patch) -> Verdict {
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

fn status(summary: StatusSummary, code: u16, reason: &str, message: &str) -> Status {
    Status {
        status: Some(summary),
        code,
        message: message.to_string(),
        metadata: Some(ListMeta::default()),
        reason: reason.to_string(),
        details: None,
    }
}

/// The AdmissionReview answering `req` with verdict `v`.
pub fn encode(req: &AdmissionRequest, v: &Verdict) -> Result<Value, serde_json::Error> {
    let mut answer = req.answer.clone();
    answer.allowed = v.allowed;
    if !v.allowed {
        answer.result = status(StatusSummary::Failure, v.code, reason(v.code), &v.message);
    } else if !v.message.is_empty() {
        answer.result = status(StatusSummary::Success, 200, "", &v.message);
    }
    if v.allowed && !v.patch.0.is_empty() {
        answer = answer
            .with_patch(v.patch.clone())
            .map_err(<serde_json::Error as serde::ser::Error>::custom)?;
    }
    if !v.warnings.is_empty() {
        answer.warnings = Some(v.warnings.clone());
    }
    let patch = answer.patch.clone();
    let mut review = serde_json::to_value(answer.into_review())?;
    // kube serialises the patch bytes as a JSON array of numbers (kube-rs/kube#1781); the API
    // server reads a `[]byte` as standard base64, as Go encodes it.
    if let Some(bytes) = patch {
        review["response"]["patch"] = json!(base64(&bytes));
    }
    Ok(review)
}

/// Standard base64 with padding, as AdmissionReview's `patch` is encoded.
pub fn base64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(bytes)
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
    }

    #[test]
    fn fields_a_later_kubernetes_adds_are_ignored_at_every_level() {
        let mut r = request();
        r["surprise"] = json!(1);
        r["userInfo"]["surprise"] = json!({"nested": true});
        r["object"]["spec"] = json!({"futureField": [1, 2]});
        let body = serde_json::to_vec(&json!({
            "apiVersion": API_VERSION, "kind": KIND, "request": r, "surprise": "x"
        }))
        .unwrap();
        let req = decode(&body).unwrap();
        assert_eq!(req.uid, "u-1");
        assert_eq!(req.user_info.username, "alice");
        assert_eq!(req.object.unwrap()["spec"]["futureField"], json!([1, 2]));
    }

    #[test]
    fn answers_carry_the_uid_status_and_patch() {
        let req = decode(&review(request())).unwrap();
        let v = encode(&req, &Verdict::deny(403, "no")).unwrap();
        assert_eq!(v["response"]["uid"], "u-1");
        assert_eq!(v["response"]["allowed"], false);
        assert_eq!(v["response"]["status"]["message"], "no");
        assert_eq!(v["response"]["status"]["reason"], "Forbidden");
        let patch =
            serde_json::from_value(json!([{"op": "add", "path": "/a", "value": 1}])).unwrap();
        let v = encode(&req, &Verdict::allow().with_patch(patch)).unwrap();
        assert_eq!(
            (v["apiVersion"].as_str(), v["kind"].as_str()),
            (Some(API_VERSION), Some(KIND))
        );
        assert_eq!(v["response"]["uid"], "u-1");
        assert_eq!(v["response"]["patchType"], "JSONPatch");
        assert_eq!(
            v["response"]["patch"],
            base64(br#"[{"op":"add","path":"/a","value":1}]"#)
        );
    }

    #[test]
    fn answers_have_the_wire_shape_the_api_server_reads() {
        let req = decode(&review(request())).unwrap();
        let deny = encode(&req, &Verdict::deny(400, "bad").with_warning("w")).unwrap();
        assert_eq!(
            deny,
            json!({"apiVersion": API_VERSION, "kind": KIND, "response": {
                "uid": "u-1", "allowed": false, "warnings": ["w"],
                "status": {"metadata": {}, "status": "Failure", "code": 400,
                           "reason": "BadRequest", "message": "bad"}}})
        );
        let note = encode(
            &req,
            &Verdict {
                message: "ok".into(),
                ..Verdict::allow()
            },
        )
        .unwrap();
        assert_eq!(
            note["response"]["status"],
            json!({"metadata": {}, "status": "Success", "code": 200, "message": "ok"})
        );
        let plain = encode(&req, &Verdict::allow()).unwrap();
        assert_eq!(
            plain["response"],
            json!({"uid": "u-1", "allowed": true, "status": {}})
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
