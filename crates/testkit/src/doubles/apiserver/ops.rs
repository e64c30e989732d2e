//! The API server's write and read semantics on top of the store: create, replace, patch,
//! delete (with finalizers and preconditions), list with selectors and paging.

use super::patch::{self, PatchType};
use super::resources::{ApiError, ResourceInfo};
use super::selector::{FieldSelector, LabelSelector};
use super::store::{now_rfc3339, Store};
use serde_json::{json, Map, Value};
use std::sync::Arc;

/// Which part of an object a write addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sub {
    Main,
    Status,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct ListOptions {
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    pub limit: Option<usize>,
    pub continue_token: Option<String>,
}

impl ListOptions {
    pub fn matches(&self, object: &Value) -> bool {
        self.labels.matches(object) && self.fields.matches(object)
    }
}

fn rv_of(v: &Value) -> &str {
    v["metadata"]["resourceVersion"].as_str().unwrap_or("")
}

fn name_of(v: &Value) -> &str {
    v["metadata"]["name"].as_str().unwrap_or("")
}

/// `metadata` as a map, made one if missing; None when `v` itself is not an object.
fn meta_mut(v: &mut Value) -> Option<&mut Map<String, Value>> {
    let obj = v.as_object_mut()?;
    let meta = obj.entry("metadata").or_insert_with(|| json!({}));
    if !meta.is_object() {
        *meta = json!({});
    }
    meta.as_object_mut()
}

fn set_meta(v: &mut Value, field: &str, value: Value) {
    if let Some(m) = meta_mut(v) {
        m.insert(field.into(), value);
    }
}

fn remove_meta(v: &mut Value, field: &str) {
    if let Some(m) = meta_mut(v) {
        m.remove(field);
    }
}

fn set_or_remove(obj: &mut Value, field: &str, value: Option<Value>) {
    if let Value::Object(m) = obj {
        match value {
            Some(v) => {
                m.insert(field.into(), v);
            }
            None => {
                m.remove(field);
            }
        }
    }
}

/// The object without `metadata` and `status`: what a generation change is measured on.
fn desired_state(v: &Value) -> Value {
    let mut v = v.clone();
    if let Value::Object(m) = &mut v {
        m.remove("metadata");
        m.remove("status");
        m.remove("apiVersion");
        m.remove("kind");
    }
    v
}

impl Store {
    /// Checks the body's type and namespace against the request and stamps apiVersion/kind.
    fn check_body(&self, info: &ResourceInfo, ns: &str, body: &mut Value) -> Result<(), ApiError> {
        if !body.is_object() {
            return Err(ApiError::bad_request(
                "the request body is not a JSON object",
            ));
        }
        for (field, want) in [
            ("apiVersion", info.api_version()),
            ("kind", info.kind.clone()),
        ] {
            if let Some(got) = body[field].as_str().filter(|s| !s.is_empty()) {
                if got != want {
                    return Err(ApiError::bad_request(format!(
                        "the {field} in the data ({got}) does not match the expected {field} ({want})"
                    )));
                }
            }
            body[field] = json!(want);
        }
        if info.namespaced {
            match body["metadata"]["namespace"].as_str() {
                Some(n) if !n.is_empty() && n != ns => {
                    return Err(ApiError::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                _ => set_meta(body, "namespace", json!(ns)),
            }
        } else {
            remove_meta(body, "namespace");
        }
        Ok(())
    }

    pub fn api_get(&self, info: &ResourceInfo, ns: &str, name: &str) -> Result<Value, ApiError> {
        self.get(info, ns, name)
            .cloned()
            .ok_or_else(|| ApiError::not_found(info, name))
    }

    pub fn api_create(
        &mut self,
        info: &ResourceInfo,
        ns: &str,
        mut body: Value,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        self.check_body(info, ns, &mut body)?;
        if !rv_of(&body).is_empty() {
            return Err(ApiError::new(
                500,
                "resourceVersion should not be set on objects to be created",
            ));
        }
        let mut name = name_of(&body).to_string();
        if name.is_empty() {
            let prefix = body["metadata"]["generateName"]
                .as_str()
                .unwrap_or("")
                .to_string();
            if prefix.is_empty() {
                return Err(ApiError::invalid(
                    info,
                    "",
                    "metadata.name: Required value: name or generateName is required",
                ));
            }
            loop {
                name = format!("{prefix}{}", self.name_suffix());
                if self.get(info, ns, &name).is_none() {
                    break;
                }
            }
        }
        if !gpuplane_model::names::is_dns_subdomain(&name) {
            return Err(ApiError::invalid(
                info,
                &name,
                "metadata.name: Invalid value: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'",
            ));
        }
        if self.get(info, ns, &name).is_some() {
            return Err(ApiError::already_exists(info, &name));
        }
        if info.has_status {
            // As upstream strategies do on create: status is the server's to set.
            let fresh = (info.group.is_empty() && info.plural == "pods")
                .then(|| json!({"phase": "Pending"}));
            set_or_remove(&mut body, "status", fresh);
        }
        let uid = self.new_uid();
        if let Some(meta) = meta_mut(&mut body) {
            meta.insert("name".into(), json!(name));
            meta.insert("uid".into(), json!(uid));
            meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
            meta.insert("generation".into(), json!(1));
            meta.remove("deletionTimestamp");
            meta.remove("deletionGracePeriodSeconds");
        }
        if dry_run {
            return Ok(body);
        }
        Ok(self.commit_put(info, body))
    }

    /// PUT; returns the object and whether it was created.
    pub fn api_replace(
        &mut self,
        info: &ResourceInfo,
        ns: &str,
        name: &str,
        mut body: Value,
        sub: Sub,
        dry_run: bool,
    ) -> Result<(Value, bool), ApiError> {
        self.check_body(info, ns, &mut body)?;
        match name_of(&body) {
            "" => set_meta(&mut body, "name", json!(name)),
            n if n != name => {
                return Err(ApiError::bad_request(format!(
                    "the name of the object ({n}) does not match the name on the URL ({name})"
                )));
            }
            _ => {}
        }
        let Some(old) = self.get_shared(info, ns, name) else {
            if info.create_on_update && sub == Sub::Main {
                remove_meta(&mut body, "resourceVersion");
                return Ok((self.api_create(info, ns, body, dry_run)?, true));
            }
            return Err(ApiError::not_found(info, name));
        };
        let want = rv_of(&body);
        if !want.is_empty() && want != rv_of(&old) {
            return Err(ApiError::conflict(
                info,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            ));
        }
        Ok((self.update(info, old, body, sub, dry_run), false))
    }

    /// PATCH; returns the object and whether it was created (apply only).
    #[allow(clippy::too_many_arguments)]
    pub fn api_patch(
        &mut self,
        info: &ResourceInfo,
        ns: &str,
        name: &str,
        kind: PatchType,
        body: &[u8],
        sub: Sub,
        dry_run: bool,
    ) -> Result<(Value, bool), ApiError> {
        let patch = patch::parse_body(kind, body).map_err(ApiError::bad_request)?;
        let Some(old) = self.get_shared(info, ns, name) else {
            if kind == PatchType::Apply && sub == Sub::Main {
                let mut obj = patch;
                if !obj.is_object() {
                    return Err(ApiError::bad_request(
                        "an applied configuration must be an object",
                    ));
                }
                if name_of(&obj).is_empty() {
                    set_meta(&mut obj, "name", json!(name));
                } else if name_of(&obj) != name {
                    return Err(ApiError::bad_request(format!(
                        "the name of the object ({}) does not match the name on the URL ({name})",
                        name_of(&obj)
                    )));
                }
                return Ok((self.api_create(info, ns, obj, dry_run)?, true));
            }
            return Err(ApiError::not_found(info, name));
        };
        let mut new = (*old).clone();
        patch::apply(kind, &mut new, &patch).map_err(|e| ApiError::invalid(info, name, &e))?;
        if name_of(&new) != name {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({}) does not match the name on the URL ({name})",
                name_of(&new)
            )));
        }
        self.check_body(info, ns, &mut new)?;
        let want = rv_of(&new);
        if !want.is_empty() && want != rv_of(&old) {
            return Err(ApiError::conflict(
                info,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            ));
        }
        Ok((self.update(info, old, new, sub, dry_run), false))
    }

    /// The common tail of PUT and PATCH: keep what the request may not change, bump the
    /// generation on a desired-state change, store unless nothing changed, and finish a
    /// deletion whose last finalizer went away.
    fn update(
        &mut self,
        info: &ResourceInfo,
        old: Arc<Value>,
        mut candidate: Value,
        sub: Sub,
        dry_run: bool,
    ) -> Value {
        let mut new = match sub {
            Sub::Status => {
                // `old` without its status (replaced at once, not worth cloning).
                let mut n = match &*old {
                    Value::Object(m) => Value::Object(
                        m.iter()
                            .filter(|(k, _)| *k != "status")
                            .map(|(k, v)| (k.clone(), v.clone()))
                            .collect(),
                    ),
                    other => other.clone(),
                };
                let status = candidate.as_object_mut().and_then(|m| m.remove("status"));
                set_or_remove(&mut n, "status", status);
                n
            }
            Sub::Main => {
                let mut n = candidate;
                if info.has_status {
                    set_or_remove(&mut n, "status", old.get("status").cloned());
                }
                for f in [
                    "name",
                    "namespace",
                    "uid",
                    "creationTimestamp",
                    "deletionTimestamp",
                    "deletionGracePeriodSeconds",
                    "generation",
                ] {
                    match old["metadata"].get(f) {
                        Some(v) => set_meta(&mut n, f, v.clone()),
                        None => remove_meta(&mut n, f),
                    }
                }
                if desired_state(&old) != desired_state(&n) {
                    let g = old["metadata"]["generation"].as_i64().unwrap_or(0) + 1;
                    set_meta(&mut n, "generation", json!(g));
                }
                n
            }
        };
        set_meta(&mut new, "resourceVersion", json!(rv_of(&old)));
        if new == *old || dry_run {
            // Upstream skips the write for a no-op update: no new resourceVersion, no event.
            return new;
        }
        let stored = self.commit_put(info, new);
        let deleting = !stored["metadata"]["deletionTimestamp"].is_null();
        let finalizers = stored["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if deleting && !finalizers {
            let ns = stored["metadata"]["namespace"]
                .as_str()
                .unwrap_or("")
                .to_string();
            if let Some(gone) = self.commit_delete(info, &ns, name_of(&stored)) {
                return gone;
            }
        }
        stored
    }

    /// DELETE with a `DeleteOptions` body (preconditions, dryRun). Propagation policies are
    /// not modelled (no garbage collector): deletion acts as `Background`.
    pub fn api_delete(
        &mut self,
        info: &ResourceInfo,
        ns: &str,
        name: &str,
        options: &Value,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        let old = self.api_get(info, ns, name)?;
        let pre = &options["preconditions"];
        for (field, path) in [("ResourceVersion", "resourceVersion"), ("UID", "uid")] {
            if let Some(want) = pre[path].as_str() {
                let have = old["metadata"][path].as_str().unwrap_or("");
                if want != have {
                    return Err(ApiError::conflict(
                        info,
                        name,
                        &format!("Precondition failed: {field} in precondition: {want}, {field} in object meta: {have}"),
                    ));
                }
            }
        }
        let finalizers = old["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|f| !f.is_empty());
        if finalizers {
            if !old["metadata"]["deletionTimestamp"].is_null() {
                return Ok(old);
            }
            let mut new = old;
            set_meta(&mut new, "deletionTimestamp", json!(now_rfc3339()));
            set_meta(&mut new, "deletionGracePeriodSeconds", json!(0));
            // Upstream bumps the generation when deletion starts.
            let g = new["metadata"]["generation"].as_i64().unwrap_or(0) + 1;
            set_meta(&mut new, "generation", json!(g));
            if dry_run {
                return Ok(new);
            }
            return Ok(self.commit_put(info, new));
        }
        if dry_run {
            return Ok(old);
        }
        self.commit_delete(info, ns, name)
            .ok_or_else(|| ApiError::not_found(info, name))
    }

    pub fn api_delete_collection(
        &mut self,
        info: &ResourceInfo,
        ns: Option<&str>,
        opts: &ListOptions,
        options: &Value,
        dry_run: bool,
    ) -> Result<Value, ApiError> {
        let keys: Vec<(String, String)> = self
            .iter(info, ns)
            .filter(|(_, v)| opts.matches(v))
            .map(|(k, _)| k.clone())
            .collect();
        let mut items = Vec::new();
        for (n, name) in keys {
            items.push(self.api_delete(info, &n, &name, options, dry_run)?);
        }
        Ok(self.list_value(info, self.rv, items, None))
    }

    fn list_value(
        &self,
        info: &ResourceInfo,
        rv: u64,
        items: Vec<Value>,
        more: Option<(String, usize)>,
    ) -> Value {
        let mut meta = json!({"resourceVersion": rv.to_string()});
        if let Some((token, remaining)) = more {
            meta["continue"] = json!(token);
            meta["remainingItemCount"] = json!(remaining);
        }
        json!({
            "apiVersion": info.api_version(),
            "kind": format!("{}List", info.kind),
            "metadata": meta,
            "items": items,
        })
    }

    /// LIST. `ns` None lists across namespaces. Paging: `continue` tokens carry the first
    /// page's resourceVersion, and expire (410) once history is compacted past it.
    pub fn api_list(
        &self,
        info: &ResourceInfo,
        ns: Option<&str>,
        opts: &ListOptions,
    ) -> Result<Value, ApiError> {
        let (list_rv, after) = match &opts.continue_token {
            Some(token) => {
                let mut parts = token.splitn(3, '/');
                let (Some(rv), Some(n), Some(name)) = (parts.next(), parts.next(), parts.next())
                else {
                    return Err(ApiError::bad_request(format!(
                        "invalid continue token {token:?}"
                    )));
                };
                let rv: u64 = rv.parse().map_err(|_| {
                    ApiError::bad_request(format!("invalid continue token {token:?}"))
                })?;
                if self.too_old(rv).is_some() {
                    return Err(ApiError::gone(
                        "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                    ));
                }
                (rv, Some((n.to_string(), name.to_string())))
            }
            None => (self.rv, None),
        };
        let mut matching = self
            .iter(info, ns)
            .filter(|(k, _)| after.as_ref().is_none_or(|a| *k > a))
            .filter(|(_, v)| opts.matches(v));
        let mut items = Vec::new();
        let mut last = None;
        let limit = opts.limit.filter(|l| *l > 0).unwrap_or(usize::MAX);
        for (k, v) in matching.by_ref().take(limit) {
            items.push(v.clone());
            last = Some(k.clone());
        }
        let remaining = matching.count();
        let more = match last {
            Some((n, name)) if remaining > 0 => Some((format!("{list_rv}/{n}/{name}"), remaining)),
            _ => None,
        };
        Ok(self.list_value(info, list_rv, items, more))
    }

    /// Stores an object as given (a test or demo reaching into etcd): no validation, but a new
    /// resourceVersion, uid and creationTimestamp when missing, and a watch event.
    pub fn raw_put(&mut self, mut object: Value) -> Result<Value, String> {
        if !object.is_object() {
            return Err("an object must be a JSON object".into());
        }
        let api_version = object["apiVersion"].as_str().unwrap_or("").to_string();
        let kind = object["kind"].as_str().unwrap_or("").to_string();
        let info = self
            .resource_by_kind(&api_version, &kind)
            .ok_or_else(|| format!("the double serves no {kind} in {api_version:?}"))?;
        let name = name_of(&object).to_string();
        if name.is_empty() {
            return Err(format!("{kind} without metadata.name"));
        }
        let ns = if info.namespaced {
            let n = object["metadata"]["namespace"]
                .as_str()
                .unwrap_or("default")
                .to_string();
            set_meta(&mut object, "namespace", json!(n));
            n
        } else {
            remove_meta(&mut object, "namespace");
            String::new()
        };
        object["kind"] = json!(info.kind);
        let existing = self.get(&info, &ns, &name).map(|v| v["metadata"].clone());
        let uid = self.new_uid();
        for (field, fresh) in [
            ("uid", json!(uid)),
            ("creationTimestamp", json!(now_rfc3339())),
            ("generation", json!(1)),
        ] {
            if object["metadata"][field].is_null() {
                let keep = existing
                    .as_ref()
                    .map(|m| m[field].clone())
                    .filter(|v| !v.is_null());
                set_meta(&mut object, field, keep.unwrap_or(fresh));
            }
        }
        Ok(self.commit_put(&info, object))
    }
}
