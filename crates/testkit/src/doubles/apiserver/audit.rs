//! The request log read as the API server's authorizer reads requests: each HTTP request as
//! an RBAC attribute set (verb, API group, resource, subresource, namespace, name), following
//! upstream's `RequestInfoFactory`, so tests can compare what a component calls with what its
//! ClusterRole grants.

use super::ApiServerDouble;

/// One request, as RBAC sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ApiCall {
    /// A call on a resource (`/api/v1/...`, `/apis/<group>/<version>/...`).
    Resource(ResourceCall),
    /// Anything else (`/version`, discovery, `/healthz`): RBAC's non-resource URLs, whose verb
    /// is the lower-case HTTP method.
    NonResource { verb: String, path: String },
}

/// The attributes RBAC rules match for a resource request.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResourceCall {
    /// get, list, watch, create, update, patch, delete or deletecollection.
    pub verb: String,
    /// `""` for the core group.
    pub group: String,
    pub resource: String,
    /// `""` when the call is on the resource itself.
    pub subresource: String,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

/// Namespace subresources: `/api/v1/namespaces/<ns>/<these>` is not a namespaced resource.
const NAMESPACE_SUBRESOURCES: [&str; 2] = ["status", "finalize"];

impl ApiCall {
    /// Classifies one request as upstream's authorizer does: GET on a name is `get`, on a
    /// collection `list` (`watch` with `watch=true` or the legacy `/watch/` prefix); POST
    /// `create`; PUT `update`; PATCH `patch`; DELETE on a name `delete`, on a collection
    /// `deletecollection`.
    pub fn classify(method: &str, path_and_query: &str) -> ApiCall {
        let (path, query) = path_and_query
            .split_once('?')
            .unwrap_or((path_and_query, ""));
        let non_resource = || ApiCall::NonResource {
            verb: method.to_ascii_lowercase(),
            path: path.to_string(),
        };
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (group, mut rest) = match parts.as_slice() {
            ["api", _version, rest @ ..] if !rest.is_empty() => ("", rest),
            ["apis", group, _version, rest @ ..] if !rest.is_empty() => (*group, rest),
            _ => return non_resource(),
        };
        let mut verb = match method.to_ascii_uppercase().as_str() {
            "GET" | "HEAD" => "get",
            "POST" => "create",
            "PUT" => "update",
            "PATCH" => "patch",
            "DELETE" => "delete",
            _ => return non_resource(),
        };
        let legacy_watch = rest.first() == Some(&"watch");
        if legacy_watch {
            rest = &rest[1..];
        }
        let mut namespace = None;
        if rest.first() == Some(&"namespaces") && rest.len() > 1 {
            namespace = Some(rest[1].to_string());
            if rest.len() > 2 && !NAMESPACE_SUBRESOURCES.contains(&rest[2]) {
                rest = &rest[2..];
            }
        }
        let resource = rest.first().map(|s| s.to_string()).unwrap_or_default();
        let name = rest.get(1).map(|s| s.to_string());
        let subresource = rest.get(2).map(|s| s.to_string()).unwrap_or_default();
        let watch_query = query
            .split('&')
            .any(|kv| kv == "watch=true" || kv == "watch=1");
        if name.is_none() {
            verb = match verb {
                "get" if legacy_watch || watch_query => "watch",
                "get" => "list",
                "delete" => "deletecollection",
                v => v,
            };
        } else if legacy_watch {
            verb = "watch";
        }
        ApiCall::Resource(ResourceCall {
            verb: verb.to_string(),
            group: group.to_string(),
            resource,
            subresource,
            namespace,
            name,
        })
    }
}

impl ApiServerDouble {
    /// Every request so far, oldest first, as RBAC attributes.
    pub fn api_calls(&self) -> Vec<ApiCall> {
        self.requests()
            .iter()
            .map(|(method, path)| ApiCall::classify(method, path))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(method: &str, path: &str) -> (String, String, String, String) {
        match ApiCall::classify(method, path) {
            ApiCall::Resource(r) => (r.verb, r.group, r.resource, r.subresource),
            ApiCall::NonResource { verb, path } => (verb, "-".into(), path, String::new()),
        }
    }

    fn t(a: &str, b: &str, c: &str, d: &str) -> (String, String, String, String) {
        (a.into(), b.into(), c.into(), d.into())
    }

    #[test]
    fn requests_map_to_rbac_verbs_as_upstream_does() {
        let rs = "/apis/resource.k8s.io/v1/resourceslices";
        assert_eq!(
            call("GET", &format!("{rs}?fieldSelector=spec.nodeName%3Dn")),
            t("list", "resource.k8s.io", "resourceslices", "")
        );
        assert_eq!(
            call("GET", &format!("{rs}?watch=true&resourceVersion=5")),
            t("watch", "resource.k8s.io", "resourceslices", "")
        );
        assert_eq!(
            call("GET", &format!("{rs}/s")),
            t("get", "resource.k8s.io", "resourceslices", "")
        );
        assert_eq!(
            call("POST", rs),
            t("create", "resource.k8s.io", "resourceslices", "")
        );
        assert_eq!(
            call("PUT", &format!("{rs}/s")),
            t("update", "resource.k8s.io", "resourceslices", "")
        );
        assert_eq!(
            call("DELETE", &format!("{rs}/s")),
            t("delete", "resource.k8s.io", "resourceslices", "")
        );
        assert_eq!(
            call("DELETE", rs),
            t("deletecollection", "resource.k8s.io", "resourceslices", "")
        );
        assert_eq!(
            call("PATCH", "/api/v1/namespaces/a/pods/p/status"),
            t("patch", "", "pods", "status")
        );
        assert_eq!(call("GET", "/api/v1/pods"), t("list", "", "pods", ""));
        assert_eq!(
            call("GET", "/api/v1/watch/namespaces/a/pods"),
            t("watch", "", "pods", "")
        );
    }

    #[test]
    fn namespaces_themselves_and_non_resource_paths_are_told_apart() {
        assert_eq!(
            call("GET", "/api/v1/namespaces/a"),
            t("get", "", "namespaces", "")
        );
        assert_eq!(
            call("PUT", "/api/v1/namespaces/a/finalize"),
            t("update", "", "namespaces", "finalize")
        );
        assert_eq!(call("GET", "/version"), t("get", "-", "/version", ""));
        assert_eq!(call("GET", "/apis"), t("get", "-", "/apis", ""));
        let ApiCall::Resource(r) =
            ApiCall::classify("POST", "/apis/events.k8s.io/v1/namespaces/team-a/events")
        else {
            panic!("a resource request");
        };
        assert_eq!(r.namespace.as_deref(), Some("team-a"));
        assert_eq!(r.name, None);
    }
}
