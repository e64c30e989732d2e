//! Which GPUs a config section applies to (`gpus` or `models`), shared by
//! `sharing.consumableCapacity` and `dynamicMig`, and the error a section's field gives. Below
//! the config file's sections: they validate themselves into [`InvalidField`]s and
//! `config` names the file (`ConfigError::Invalid`), so no section depends on the file's reader.

use crate::inventory::Gpu;
use std::collections::BTreeSet;

/// A section's field holds a value out of range or inconsistent: the field's full name
/// (`dynamicMig.gpus`) and why, for the config reader to name its file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{field}`: {reason}")]
pub struct InvalidField {
    pub field: String,
    pub reason: String,
}

impl InvalidField {
    pub fn new(section: &str, field: &str, reason: String) -> Self {
        InvalidField {
            field: format!("{section}.{field}"),
            reason,
        }
    }
}

/// Which GPUs a section applies to: `gpus: all`, `gpus: [indices]` or `models: [product
/// names]`, one of them; neither means all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuSelect {
    All,
    Indices(BTreeSet<u32>),
    /// Product names, as NVML reports them (`NVIDIA A100-SXM4-80GB`).
    Models(BTreeSet<String>),
}

impl GpuSelect {
    pub fn selects(&self, g: &Gpu) -> bool {
        match self {
            GpuSelect::All => true,
            GpuSelect::Indices(i) => i.contains(&g.index),
            GpuSelect::Models(m) => m.contains(&g.product_name),
        }
    }

    /// Reads a section's `gpus` and `models`; errors name `<section>.gpus` or
    /// `<section>.models`. An empty list is refused: `off` says how to select nothing.
    pub(crate) fn parse(
        section: &str,
        gpus: Option<serde_yaml_ng::Value>,
        models: Option<Vec<String>>,
        off: &str,
    ) -> Result<GpuSelect, InvalidField> {
        let bad = |field: &str, reason: String| InvalidField::new(section, field, reason);
        match (gpus, models) {
            (Some(_), Some(_)) => Err(bad("gpus", "set gpus or models, not both".into())),
            (None, None) => Ok(GpuSelect::All),
            (None, Some(m)) if m.is_empty() => Err(bad("models", format!("lists no model; {off}"))),
            (None, Some(m)) => Ok(GpuSelect::Models(m.into_iter().collect())),
            (Some(serde_yaml_ng::Value::String(s)), None) if s == "all" => Ok(GpuSelect::All),
            (Some(v), None) => {
                let list: Vec<u32> = serde_yaml_ng::from_value(v).map_err(|_| {
                    bad(
                        "gpus",
                        "must be `all` or a list of GPU indices like [0, 1]".into(),
                    )
                })?;
                if list.is_empty() {
                    return Err(bad("gpus", format!("lists no GPU; {off}")));
                }
                Ok(GpuSelect::Indices(list.into_iter().collect()))
            }
        }
    }
}
