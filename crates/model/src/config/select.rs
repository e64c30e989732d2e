//! Which GPUs a config section applies to (`gpus` or `models`), shared by
//! `sharing.consumableCapacity` and `dynamicMig`, and the rule between those two sections.

use super::{invalid, ConfigError};
use crate::inventory::Gpu;
use std::collections::BTreeSet;

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
        path: &str,
        section: &str,
        gpus: Option<serde_yaml_ng::Value>,
        models: Option<Vec<String>>,
        off: &str,
    ) -> Result<GpuSelect, ConfigError> {
        let bad =
            |field: &str, reason: String| invalid(path, &format!("{section}.{field}"), reason);
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

/// A GPU is either shared whole (consumable capacity) or partitioned by dynamic MIG, never
/// both. Where both sections name the same GPU index, or the same model, explicitly, the file
/// contradicts itself and is refused. Any other overlap (`all` in either, an index in one and
/// a model in the other, the node label turning sharing on) is settled by the rule that
/// dynamic MIG wins: a GPU that takes part in it is published as partitionable devices, and
/// sharing only ever sees the others ([`crate::sharing::shared_units`] reads
/// [`crate::inventory::Inventory::dra_devices`], which leaves dynamic GPUs out).
pub fn check_shared_and_dynamic(
    path: &str,
    shares: Option<&crate::sharing::ShareConfig>,
    dynamic: &crate::dynamic_mig::DynamicMigConfig,
) -> Result<(), ConfigError> {
    let Some(shares) = shares else { return Ok(()) };
    let (field, both) = match (&shares.select, &dynamic.select) {
        (GpuSelect::Indices(a), GpuSelect::Indices(b)) => (
            "gpus",
            a.intersection(b)
                .map(|i| format!("GPU {i}"))
                .collect::<Vec<_>>(),
        ),
        (GpuSelect::Models(a), GpuSelect::Models(b)) => (
            "models",
            a.intersection(b).map(|m| format!("`{m}`")).collect(),
        ),
        _ => return Ok(()),
    };
    if both.is_empty() {
        return Ok(());
    }
    Err(invalid(
        path,
        &format!("{}.{field}", crate::dynamic_mig::SECTION),
        format!(
            "{} {} also in sharing.consumableCapacity.{field}: a GPU is shared whole or \
             partitioned by dynamic MIG, not both; remove it from one of the two lists",
            both.join(", "),
            if both.len() == 1 { "is" } else { "are" }
        ),
    ))
}
