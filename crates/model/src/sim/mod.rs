//! Simulation profiles: a machine described as a YAML file, turned into an [`Inventory`].
//!
//! The bundled profiles are ordinary files under `src/sim/profiles/`, embedded at build time; a
//! user copies one and passes its path to `--simulate`. The fake NVML library in hack/ serves
//! these same files, so this loader is the single definition of what a profile means.
//! A profile that is malformed or inconsistent is rejected naming the file, the field and why.

pub mod instances;
mod profile;
pub mod telemetry;

use crate::inventory::Inventory;
use crate::report::chain;
pub use profile::{ProfileFile, BRANDS};
use std::path::Path;

/// Profiles embedded in the binary, by name.
const BUNDLED: &[(&str, &str)] = &[
    ("dgx-a100", include_str!("profiles/dgx-a100.yaml")),
    ("dgx-h100", include_str!("profiles/dgx-h100.yaml")),
    ("dgx1-v100", include_str!("profiles/dgx1-v100.yaml")),
    ("pcie-l4x4", include_str!("profiles/pcie-l4x4.yaml")),
    (
        "a100-mig-mixed",
        include_str!("profiles/a100-mig-mixed.yaml"),
    ),
    (
        "h100-mig-single",
        include_str!("profiles/h100-mig-single.yaml"),
    ),
    (
        "dynamic-mig-mixed",
        include_str!("profiles/dynamic-mig-mixed.yaml"),
    ),
];

/// Why a profile could not be turned into an inventory.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// The argument is neither a bundled profile name nor a readable file.
    #[error("simulation profile `{name}` is neither a bundled profile ({bundled}) nor a readable file: {}", chain(.cause))]
    NotFound {
        name: String,
        bundled: String,
        cause: std::io::Error,
    },
    /// The file is not valid YAML for the profile schema.
    #[error("simulation profile {file}: {}", chain(.cause))]
    Parse {
        file: String,
        cause: serde_yaml_ng::Error,
    },
    /// The file parses but describes an impossible machine.
    #[error("simulation profile {file}: field `{field}`: {reason}")]
    Invalid {
        file: String,
        field: String,
        reason: String,
    },
}

/// Names of the bundled profiles.
pub fn bundled_names() -> Vec<&'static str> {
    BUNDLED.iter().map(|(n, _)| *n).collect()
}

/// The text of a bundled profile, for users who want a starting point to edit.
pub fn bundled_text(name: &str) -> Option<&'static str> {
    BUNDLED.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// Loads `spec`: a bundled profile name, or else a path to a profile file.
pub fn load(spec: &str) -> Result<Inventory, ProfileError> {
    if let Some(text) = bundled_text(spec) {
        return from_str(spec, spec, text);
    }
    let path = Path::new(spec);
    let text = std::fs::read_to_string(path).map_err(|source| ProfileError::NotFound {
        name: spec.to_string(),
        bundled: bundled_names().join(", "),
        cause: source,
    })?;
    let label = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("profile");
    from_str(&path.display().to_string(), label, &text)
}

/// Parses and validates profile text. `file` names it in errors; `label` seeds generated UUIDs.
pub fn from_str(file: &str, label: &str, text: &str) -> Result<Inventory, ProfileError> {
    let parsed: ProfileFile =
        serde_yaml_ng::from_str(text).map_err(|source| ProfileError::Parse {
            file: file.to_string(),
            cause: source,
        })?;
    parsed
        .into_inventory(label)
        .map_err(|(field, reason)| ProfileError::Invalid {
            file: file.to_string(),
            field,
            reason,
        })
}

#[cfg(test)]
mod tests;
