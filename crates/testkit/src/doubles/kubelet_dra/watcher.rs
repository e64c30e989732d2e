//! The plugin watcher: scans `plugins_registry/` for registration sockets, registers each new
//! one as the kubelet's DRA registration handler does (GetInfo, its checks, the version in the
//! kubelet's order of preference, NotifyRegistrationStatus), and deregisters a driver whose
//! socket vanished or was replaced.

use super::health::start_health;
use super::{
    lock, DraPluginView, DraVersion, HealthVersion, Inner, KubeletDraOptions, Plugin,
    RegistrationEvent,
};
use crate::doubles::dial;
use gpuplane_node::grpc;
use gpuplane_node::proto::pluginregistration_v1 as reg_pb;
use reg_pb::registration_client::RegistrationClient;
use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::Channel;
use tonic::Status;

/// How long the watcher waits for a registration socket to answer.
const REGISTRATION_TIMEOUT: Duration = Duration::from_secs(5);

const PLUGIN_TYPE: &str = "DRAPlugin";

#[derive(Debug, thiserror::Error)]
enum RegisterError {
    #[error(transparent)]
    Socket(#[from] grpc::SocketError),
    #[error("{call}: {status}")]
    Call { call: &'static str, status: Status },
    #[error("{0} did not answer within {REGISTRATION_TIMEOUT:?}")]
    Timeout(&'static str),
}

/// A socket file's identity; inode numbers are reused at once on some file systems, so the
/// modification time (set when the socket is bound) is part of it.
pub(super) type FileId = (u64, u64, i64, i64);

/// The sockets in `dir` now, by path, with their identity.
fn sockets(dir: &Path) -> BTreeMap<PathBuf, FileId> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return BTreeMap::new();
    };
    entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            !name.starts_with('.') && name.ends_with(".sock")
        })
        .filter_map(|e| {
            let m = std::fs::symlink_metadata(e.path()).ok()?;
            m.file_type()
                .is_socket()
                .then(|| (e.path(), (m.dev(), m.ino(), m.mtime(), m.mtime_nsec())))
        })
        .collect()
}

/// One pass of the plugin watcher over `dir`: deregisters what vanished or was replaced,
/// registers what is new.
pub(super) async fn scan(inner: &Arc<Inner>, dir: &Path) {
    let now = sockets(dir);
    // Sockets that vanished or were replaced: deregister what came from them.
    lock(&inner.seen).retain(|path, id| now.get(path) == Some(id));
    let mut gone = Vec::new();
    lock(&inner.plugins).retain(|driver, p| {
        let keep = now.get(&p.view.registration_socket) == Some(&p.socket_id);
        if !keep {
            p.stop_health();
            tracing::info!(driver = %driver, socket = %p.view.registration_socket.display(), "kubelet DRA double: plugin deregistered");
            gone.push(driver.clone());
        }
        keep
    });
    if !gone.is_empty() {
        let mut health = lock(&inner.health);
        for d in &gone {
            if let Some(h) = health.get_mut(d) {
                h.open = false;
            }
        }
        drop(health);
        inner.bump();
    }
    for (path, id) in now {
        if lock(&inner.seen).get(&path) == Some(&id) {
            continue;
        }
        match register(inner, &path, id).await {
            Ok(()) => {
                lock(&inner.seen).insert(path, id);
            }
            Err(e) => {
                tracing::debug!(socket = %path.display(), error = %e, "kubelet DRA double: registration attempt failed; retrying");
            }
        }
    }
}

/// One plugin watcher registration. `Ok` once the plugin got a verdict (registered or refused);
/// `Err` for transport failures, which are retried.
async fn register(
    inner: &Arc<Inner>,
    socket: &Path,
    socket_id: FileId,
) -> Result<(), RegisterError> {
    let (mut client, info) = get_info(socket).await?;
    let verdict = accept(&inner.options, &info).await;
    let status = reg_pb::RegistrationStatus {
        plugin_registered: verdict.is_ok(),
        error: verdict.as_ref().err().cloned().unwrap_or_default(),
    };
    // Like the kubelet: the plugin is in the store before it hears the verdict.
    record(inner, socket, socket_id, &info, verdict);
    tokio::time::timeout(
        REGISTRATION_TIMEOUT,
        client.notify_registration_status(status),
    )
    .await
    .map_err(|_| RegisterError::Timeout("NotifyRegistrationStatus"))?
    .map_err(|status| RegisterError::Call {
        call: "NotifyRegistrationStatus",
        status,
    })?;
    Ok(())
}

/// Dials the registration socket and asks `GetInfo`.
async fn get_info(
    socket: &Path,
) -> Result<(RegistrationClient<Channel>, reg_pb::PluginInfo), RegisterError> {
    // As the real plugin watcher dials: a bare path target, so grpc-go sends the percent-encoded
    // socket path as `:authority`.
    let channel = tokio::time::timeout(
        REGISTRATION_TIMEOUT,
        dial::connect(socket, dial::Authority::EncodedPath),
    )
    .await
    .map_err(|_| RegisterError::Timeout("registration socket"))??;
    let mut client = RegistrationClient::new(channel);
    let info = tokio::time::timeout(
        REGISTRATION_TIMEOUT,
        client.get_info(reg_pb::InfoRequest {}),
    )
    .await
    .map_err(|_| RegisterError::Timeout("GetInfo"))?
    .map_err(|status| RegisterError::Call {
        call: "GetInfo",
        status,
    })?
    .into_inner();
    Ok((client, info))
}

/// What a plugin that passed [`validate`] registers with.
struct Accepted {
    version: DraVersion,
    health: Option<HealthVersion>,
    endpoint: PathBuf,
    channel: Channel,
}

/// The kubelet's verdict on `info`: its checks, then a connection to the DRA endpoint; the
/// reason it refuses, as NotifyRegistrationStatus sends it.
async fn accept(
    options: &KubeletDraOptions,
    info: &reg_pb::PluginInfo,
) -> Result<Accepted, String> {
    let (version, health) = validate(options, info)?;
    let endpoint = PathBuf::from(&info.endpoint);
    match tokio::time::timeout(REGISTRATION_TIMEOUT, grpc::connect(&endpoint)).await {
        Ok(Ok(channel)) => Ok(Accepted {
            version,
            health,
            endpoint,
            channel,
        }),
        Ok(Err(e)) => Err(format!("cannot dial DRA endpoint: {e}")),
        Err(_) => Err(format!(
            "DRA endpoint {} did not answer within {REGISTRATION_TIMEOUT:?}",
            endpoint.display()
        )),
    }
}

/// Stores an accepted plugin (replacing the driver's previous one, and opening its health
/// stream if one was asked for) and records the attempt's outcome.
fn record(
    inner: &Arc<Inner>,
    socket: &Path,
    socket_id: FileId,
    info: &reg_pb::PluginInfo,
    verdict: Result<Accepted, String>,
) {
    let outcome = match verdict {
        Ok(Accepted {
            version,
            health,
            endpoint,
            channel,
        }) => {
            let view = DraPluginView {
                registration_socket: socket.to_path_buf(),
                info: info.clone(),
                endpoint,
                version,
                health,
            };
            let mut plugin = Plugin {
                view,
                socket_id,
                channel,
                health_task: None,
            };
            if health.is_some() && lock(&inner.health_wanted).contains(&info.name) {
                start_health(inner, &info.name, &mut plugin);
            }
            if let Some(mut old) = lock(&inner.plugins).insert(info.name.clone(), plugin) {
                old.stop_health();
            }
            tracing::info!(driver = %info.name, version = version.service(), "kubelet DRA double: plugin registered");
            Ok(version)
        }
        Err(e) => {
            tracing::warn!(driver = %info.name, socket = %socket.display(), error = %e, "kubelet DRA double: plugin refused");
            Err(e)
        }
    };
    lock(&inner.events).push(RegistrationEvent {
        socket: socket.to_path_buf(),
        driver: info.name.clone(),
        outcome,
    });
    inner.bump();
}

/// The kubelet's checks on `GetInfo`: the DRA version to use and the health version, if any.
/// Both are picked in the kubelet's own order of preference, not the plugin's.
fn validate(
    options: &KubeletDraOptions,
    info: &reg_pb::PluginInfo,
) -> Result<(DraVersion, Option<HealthVersion>), String> {
    if info.r#type != PLUGIN_TYPE {
        return Err(format!(
            "plugin type {:?} is not {PLUGIN_TYPE}",
            info.r#type
        ));
    }
    if info.name.is_empty() {
        return Err("plugin name is empty".into());
    }
    if !Path::new(&info.endpoint).is_absolute() {
        return Err(format!(
            "endpoint {:?} is not an absolute path",
            info.endpoint
        ));
    }
    let version = options
        .versions
        .iter()
        .copied()
        .find(|v| info.supported_versions.iter().any(|s| s == v.service()))
        .ok_or_else(|| {
            let ours: Vec<&str> = options.versions.iter().map(|v| v.service()).collect();
            format!(
                "none of the offered services {:?} is supported (kubelet speaks {ours:?})",
                info.supported_versions
            )
        })?;
    let health = options
        .health_versions
        .iter()
        .copied()
        .find(|v| info.supported_versions.iter().any(|s| s == v.service()));
    Ok((version, health))
}
