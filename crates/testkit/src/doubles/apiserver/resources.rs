//! The resources the double serves and the API server's error shape (`Status`).

use serde_json::{json, Value};

/// One resource the double serves, as discovery would describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceInfo {
    /// API group; `""` for the core group (`/api/v1`).
    pub group: String,
    pub version: String,
    /// Lower-case plural used in paths, e.g. `resourceslices`.
    pub plural: String,
    /// Kind of one object, e.g. `ResourceSlice`; lists are `{kind}List`.
    pub kind: String,
    pub namespaced: bool,
    /// Whether the resource has a `status` subresource (main-resource writes then leave
    /// `status` alone and `/status` writes change nothing else).
    pub has_status: bool,
    /// Whether PUT on a missing object creates it (true for leases and events upstream).
    pub create_on_update: bool,
}

impl ResourceInfo {
    pub fn new(group: &str, version: &str, plural: &str, kind: &str, namespaced: bool) -> Self {
        ResourceInfo {
            group: group.into(),
            version: version.into(),
            plural: plural.into(),
            kind: kind.into(),
            namespaced,
            has_status: false,
            create_on_update: false,
        }
    }

    /// With a `status` subresource.
    pub fn with_status(mut self) -> Self {
        self.has_status = true;
        self
    }

    fn creating_on_update(mut self) -> Self {
        self.create_on_update = true;
        self
    }

    /// `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// `plural.group` (just `plural` for core), as the API server names resources in messages.
    pub fn qualified(&self) -> String {
        if self.group.is_empty() {
            self.plural.clone()
        } else {
            format!("{}.{}", self.plural, self.group)
        }
    }
}

/// The resources known from the start; more can be added with `ApiServerDouble::register`.
pub(crate) fn builtin() -> Vec<ResourceInfo> {
    let r = ResourceInfo::new;
    vec![
        r("", "v1", "pods", "Pod", true).with_status(),
        r("", "v1", "nodes", "Node", false).with_status(),
        r("", "v1", "namespaces", "Namespace", false).with_status(),
        r("", "v1", "events", "Event", true).creating_on_update(),
        r("", "v1", "configmaps", "ConfigMap", true),
        r("", "v1", "secrets", "Secret", true),
        r("", "v1", "serviceaccounts", "ServiceAccount", true),
        r("events.k8s.io", "v1", "events", "Event", true).creating_on_update(),
        r("coordination.k8s.io", "v1", "leases", "Lease", true).creating_on_update(),
        r(
            "resource.k8s.io",
            "v1",
            "resourceslices",
            "ResourceSlice",
            false,
        ),
        r(
            "resource.k8s.io",
            "v1",
            "resourceclaims",
            "ResourceClaim",
            true,
        )
        .with_status(),
        r(
            "resource.k8s.io",
            "v1",
            "resourceclaimtemplates",
            "ResourceClaimTemplate",
            true,
        ),
        r(
            "resource.k8s.io",
            "v1",
            "deviceclasses",
            "DeviceClass",
            false,
        ),
        r(
            "quota.gpuplane.dev",
            "v1alpha1",
            "gpuquotas",
            "GpuQuota",
            true,
        )
        .with_status(),
    ]
}

/// An API error, answered as a `Status` object the kube client turns into `kube::Error::Api`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    pub code: u16,
    pub message: String,
    /// (name, group, kind-or-plural) for `details`.
    pub details: Option<(String, String, String)>,
    /// Seconds for `Retry-After` and `details.retryAfterSeconds`.
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(code: u16, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            details: None,
            retry_after: None,
        }
    }

    pub fn about(mut self, info: &ResourceInfo, name: &str) -> Self {
        self.details = Some((name.into(), info.group.clone(), info.plural.clone()));
        self
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(400, message)
    }

    pub fn not_found(info: &ResourceInfo, name: &str) -> Self {
        ApiError::new(404, format!("{} \"{name}\" not found", info.qualified())).about(info, name)
    }

    pub fn no_such_path() -> Self {
        ApiError::new(404, "the server could not find the requested resource")
    }

    pub fn already_exists(info: &ResourceInfo, name: &str) -> Self {
        ApiError::new(
            409,
            format!("{} \"{name}\" already exists", info.qualified()),
        )
        .about(info, name)
    }

    pub fn conflict(info: &ResourceInfo, name: &str, why: &str) -> Self {
        ApiError::new(
            409,
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                info.qualified()
            ),
        )
        .about(info, name)
    }

    pub fn invalid(info: &ResourceInfo, name: &str, why: &str) -> Self {
        ApiError::new(422, format!("{} \"{name}\" is invalid: {why}", info.kind)).about(info, name)
    }

    pub fn gone(message: impl Into<String>) -> Self {
        ApiError::new(410, message)
    }

    pub fn reason(&self) -> &'static str {
        match self.code {
            400 => "BadRequest",
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "NotFound",
            405 => "MethodNotAllowed",
            // AlreadyExists shares 409 with Conflict; the message tells them apart.
            409 if self.message.ends_with("already exists") => "AlreadyExists",
            409 => "Conflict",
            410 => "Expired",
            413 => "RequestEntityTooLarge",
            415 => "UnsupportedMediaType",
            422 => "Invalid",
            429 => "TooManyRequests",
            500 => "InternalError",
            503 => "ServiceUnavailable",
            504 => "Timeout",
            _ => "Unknown",
        }
    }

    /// The `Status` object.
    pub fn to_status(&self) -> Value {
        let mut s = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason(),
            "code": self.code,
        });
        let mut details = serde_json::Map::new();
        if let Some((name, group, kind)) = &self.details {
            details.insert("name".into(), json!(name));
            if !group.is_empty() {
                details.insert("group".into(), json!(group));
            }
            details.insert("kind".into(), json!(kind));
        }
        if let Some(secs) = self.retry_after {
            details.insert("retryAfterSeconds".into(), json!(secs));
        }
        if !details.is_empty() {
            s["details"] = Value::Object(details);
        }
        s
    }
}
