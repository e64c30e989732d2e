//! What a pod or claim costs and what a quota allows, in the three dimensions of a GpuQuota
//! (pure): whole-GPU equivalents, GPU memory, and device counts by resource or class name.

use super::ratio::{Gpus, QuotaMathError};
use crate::quantity::{Format, Quantity, QuantityError};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// Bytes of GPU memory. Read from any Kubernetes quantity spelling (`20Gi`, `1.5Gi`,
/// `21474836480`, `20G`; a fraction of a byte rounds up, see [`Memory::parse`]); written in the
/// API server's canonical binary form (`20Gi`, `15360Mi`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Memory(pub u64);

impl Memory {
    pub const ZERO: Memory = Memory(0);

    pub fn bytes(self) -> u64 {
        self.0
    }

    pub fn is_zero(&self) -> bool {
        self.0 == 0
    }

    pub fn checked_add(self, o: Memory) -> Result<Memory, QuotaMathError> {
        self.0
            .checked_add(o.0)
            .map(Memory)
            .ok_or(QuotaMathError::Overflow)
    }

    pub fn saturating_sub(self, o: Memory) -> Memory {
        Memory(self.0.saturating_sub(o.0))
    }

    pub fn checked_mul_int(self, k: u64) -> Result<Memory, QuotaMathError> {
        self.0
            .checked_mul(k)
            .map(Memory)
            .ok_or(QuotaMathError::Overflow)
    }

    /// `ceil(self / k)`; `k == 0` is an error.
    pub fn div_ceil_int(self, k: u64) -> Result<Memory, QuotaMathError> {
        if k == 0 {
            return Err(QuotaMathError::Overflow);
        }
        Ok(Memory(self.0.div_ceil(k)))
    }

    /// A quantity of bytes, read as Kubernetes reads any quantity ([`Quantity`]): a fraction
    /// of a byte rounds up, as `Value()` rounds (`0.1` and `100m` are 1 byte), and binary
    /// values above 2^63-1 are capped there (`9Ei`). Negative amounts are refused, and so are
    /// decimal ones past 2^63-1 (`1e19`), which `Value()` cannot return.
    pub fn parse(text: &str) -> Result<Memory, MemoryError> {
        let q = Quantity::parse_trimmed(text).map_err(|reason| MemoryError::NotAQuantity {
            text: text.to_string(),
            reason,
        })?;
        if q.is_negative() {
            return Err(MemoryError::Negative(text.to_string()));
        }
        Memory::from_quantity(&q).ok_or_else(|| MemoryError::TooLarge(text.to_string()))
    }

    /// Bytes of a quantity, rounded up as `Value()` rounds; `None` when negative or past
    /// 2^63-1 (published capacities and consumed shares are read so, like `gpuMemory`).
    pub fn from_quantity(q: &Quantity) -> Option<Memory> {
        q.value().and_then(|v| u64::try_from(v).ok()).map(Memory)
    }
}

/// Why a value is not an amount of GPU memory. Memory is only ever the `gpuMemory` field
/// (of `hard`, `borrowingLimit` and the status amounts), so the messages name it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    #[error("gpuMemory: `{text}` is not a quantity: {reason}")]
    NotAQuantity { text: String, reason: QuantityError },
    #[error("gpuMemory: `{0}` is negative")]
    Negative(String),
    #[error("gpuMemory: `{0}` is more bytes than a Kubernetes quantity counts (2^63-1)")]
    TooLarge(String),
}

impl fmt::Display for Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Quantity::from_u64(self.0, Format::BinarySI).fmt(f)
    }
}

impl Serialize for Memory {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Memory {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Memory;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a memory quantity such as 20Gi")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Memory, E> {
                Ok(Memory(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Memory, E> {
                u64::try_from(v)
                    .map(Memory)
                    .map_err(|_| E::custom(MemoryError::Negative(v.to_string())))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Memory, E> {
                Memory::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// `devices`: counts by name. schemars calls a `u64` `format: uint64`, a format the API server
/// does not know and warns about on every apply; `int64` with a minimum of 0 is its name for it.
fn device_counts_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "additionalProperties": {"type": "integer", "format": "int64", "minimum": 0}
    })
}

/// A limit's device counts: bounded, so the API server can price the CRD's validation rules
/// over them (a quota naming more than 64 device kinds is not one anyone writes).
fn device_limits_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "maxProperties": 64,
        "additionalProperties": {"type": "integer", "format": "int64", "minimum": 0}
    })
}

impl JsonSchema for Memory {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Memory".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "Bytes of GPU memory as a Kubernetes quantity, e.g. 20Gi.",
            "x-kubernetes-int-or-string": true,
            "anyOf": [
                {"type": "integer", "minimum": 0},
                // Kubernetes' quantity grammar without a minus sign ([`Memory::parse`]).
                {"type": "string", "pattern": "^\\+?([0-9]+(\\.[0-9]*)?|\\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"}
            ]
        })
    }
}

/// One of the three things a GpuQuota limits.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dimension {
    Gpus,
    GpuMemory,
    /// A device-plugin resource name or a DeviceClass name.
    Devices(String),
}

impl fmt::Display for Dimension {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dimension::Gpus => f.write_str("gpus"),
            Dimension::GpuMemory => f.write_str("gpuMemory"),
            Dimension::Devices(n) => write!(f, "devices[{n}]"),
        }
    }
}

/// An amount in every dimension: what something costs, or what a quota has used.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    /// Whole-GPU equivalents.
    #[serde(default)]
    pub gpus: Gpus,
    /// Bytes of GPU memory.
    #[serde(default)]
    pub gpu_memory: Memory,
    /// Devices by device-plugin resource name or DeviceClass name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "device_counts_schema")]
    pub devices: BTreeMap<String, u64>,
}

impl Usage {
    pub fn is_zero(&self) -> bool {
        self.gpus.is_zero() && self.gpu_memory.is_zero() && self.devices.values().all(|v| *v == 0)
    }

    pub fn checked_add(&self, o: &Usage) -> Result<Usage, QuotaMathError> {
        let mut out = self.clone();
        out.add_assign(o)?;
        Ok(out)
    }

    pub fn add_assign(&mut self, o: &Usage) -> Result<(), QuotaMathError> {
        self.gpus = self.gpus.checked_add(o.gpus)?;
        self.gpu_memory = self.gpu_memory.checked_add(o.gpu_memory)?;
        for (k, v) in &o.devices {
            let e = self.devices.entry(k.clone()).or_insert(0);
            *e = e.checked_add(*v).ok_or(QuotaMathError::Overflow)?;
        }
        Ok(())
    }

    /// Dimension-wise `self - o`, floored at zero; zero device entries are dropped.
    pub fn saturating_sub(&self, o: &Usage) -> Result<Usage, QuotaMathError> {
        let mut devices = self.devices.clone();
        for (k, v) in &o.devices {
            if let Some(e) = devices.get_mut(k) {
                *e = e.saturating_sub(*v);
            }
        }
        devices.retain(|_, v| *v != 0);
        Ok(Usage {
            gpus: self.gpus.saturating_sub(o.gpus)?,
            gpu_memory: self.gpu_memory.saturating_sub(o.gpu_memory),
            devices,
        })
    }

    /// Dimension-wise maximum (the worst case of two alternatives).
    pub fn max(&self, o: &Usage) -> Usage {
        let mut devices = self.devices.clone();
        for (k, v) in &o.devices {
            let e = devices.entry(k.clone()).or_insert(0);
            *e = (*e).max(*v);
        }
        Usage {
            gpus: self.gpus.max(o.gpus),
            gpu_memory: self.gpu_memory.max(o.gpu_memory),
            devices,
        }
    }

    /// Dimension-wise minimum (what two budgets both cover); a device count only one of them
    /// has is zero.
    pub fn min(&self, o: &Usage) -> Usage {
        let devices = self
            .devices
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), (*v).min(*o.devices.get(k)?))))
            .filter(|(_, v)| *v != 0)
            .collect();
        Usage {
            gpus: self.gpus.min(o.gpus),
            gpu_memory: self.gpu_memory.min(o.gpu_memory),
            devices,
        }
    }

    pub fn checked_mul_int(&self, k: u64) -> Result<Usage, QuotaMathError> {
        let mut devices = BTreeMap::new();
        for (n, v) in &self.devices {
            devices.insert(n.clone(), v.checked_mul(k).ok_or(QuotaMathError::Overflow)?);
        }
        Ok(Usage {
            gpus: self.gpus.checked_mul_int(k)?,
            gpu_memory: self.gpu_memory.checked_mul_int(k)?,
            devices,
        })
    }

    /// The amount in one dimension, as a [`Amount`].
    pub fn get(&self, d: &Dimension) -> Amount {
        match d {
            Dimension::Gpus => Amount::Gpus(self.gpus),
            Dimension::GpuMemory => Amount::Memory(self.gpu_memory),
            Dimension::Devices(n) => Amount::Count(self.devices.get(n).copied().unwrap_or(0)),
        }
    }

    /// Sums an iterator of usages.
    pub fn sum<'a>(items: impl IntoIterator<Item = &'a Usage>) -> Result<Usage, QuotaMathError> {
        let mut total = Usage::default();
        for u in items {
            total.add_assign(u)?;
        }
        Ok(total)
    }
}

impl fmt::Display for Usage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "gpus {}, gpuMemory {}", self.gpus, self.gpu_memory)?;
        for (k, v) in &self.devices {
            write!(f, ", {k} {v}")?;
        }
        Ok(())
    }
}

/// An amount in one dimension, comparable and printable in that dimension's units.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Amount {
    Gpus(Gpus),
    Memory(Memory),
    Count(u64),
}

impl fmt::Display for Amount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Amount::Gpus(g) => g.fmt(f),
            Amount::Memory(m) => m.fmt(f),
            Amount::Count(c) => c.fmt(f),
        }
    }
}

impl Amount {
    pub fn checked_add(self, o: Amount) -> Result<Amount, QuotaMathError> {
        match (self, o) {
            (Amount::Gpus(a), Amount::Gpus(b)) => Ok(Amount::Gpus(a.checked_add(b)?)),
            (Amount::Memory(a), Amount::Memory(b)) => Ok(Amount::Memory(a.checked_add(b)?)),
            (Amount::Count(a), Amount::Count(b)) => a
                .checked_add(b)
                .map(Amount::Count)
                .ok_or(QuotaMathError::Overflow),
            _ => Err(QuotaMathError::Overflow),
        }
    }

    pub fn saturating_sub(self, o: Amount) -> Result<Amount, QuotaMathError> {
        match (self, o) {
            (Amount::Gpus(a), Amount::Gpus(b)) => Ok(Amount::Gpus(a.saturating_sub(b)?)),
            (Amount::Memory(a), Amount::Memory(b)) => Ok(Amount::Memory(a.saturating_sub(b))),
            (Amount::Count(a), Amount::Count(b)) => Ok(Amount::Count(a.saturating_sub(b))),
            _ => Err(QuotaMathError::Overflow),
        }
    }

    pub fn is_zero(&self) -> bool {
        match self {
            Amount::Gpus(g) => g.is_zero(),
            Amount::Memory(m) => m.is_zero(),
            Amount::Count(c) => *c == 0,
        }
    }
}

/// Upper bounds: `spec.hard` and `spec.borrowingLimit`. A dimension left out is not limited.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Limits {
    /// Whole-GPU equivalents: a whole GPU is 1, a MIG device its share of its GPU's compute
    /// slices (1g.10gb on an H100 is 1/7), a time-sliced replica 1/replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<Gpus>,
    /// GPU memory of the devices, as published in ResourceSlices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<Memory>,
    /// Device counts by device-plugin resource name (`nvidia.com/gpu`,
    /// `nvidia.com/mig-1g.10gb`) or DeviceClass name (`gpu.gpuplane.dev`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "device_limits_schema")]
    pub devices: BTreeMap<String, u64>,
}

impl Limits {
    /// Every limited dimension with its bound, gpus first, then gpuMemory, then devices.
    pub fn bounds(&self) -> Vec<(Dimension, Amount)> {
        let mut out = Vec::new();
        if let Some(g) = self.gpus {
            out.push((Dimension::Gpus, Amount::Gpus(g)));
        }
        if let Some(m) = self.gpu_memory {
            out.push((Dimension::GpuMemory, Amount::Memory(m)));
        }
        for (k, v) in &self.devices {
            out.push((Dimension::Devices(k.clone()), Amount::Count(*v)));
        }
        out
    }

    pub fn get(&self, d: &Dimension) -> Option<Amount> {
        match d {
            Dimension::Gpus => self.gpus.map(Amount::Gpus),
            Dimension::GpuMemory => self.gpu_memory.map(Amount::Memory),
            Dimension::Devices(n) => self.devices.get(n).copied().map(Amount::Count),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.gpus.is_none() && self.gpu_memory.is_none() && self.devices.is_empty()
    }
}

/// A dimension whose cost could not be determined, and why. A quota that limits that
/// dimension denies (fail closed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownCharge {
    pub dimension: Dimension,
    pub why: String,
}

/// What something costs: a usage plus the dimensions that could not be priced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Charge {
    pub usage: Usage,
    pub unknown: Vec<UnknownCharge>,
}

impl Charge {
    /// Nothing known of it: GPUs and GPU memory both unpriced, for `why`.
    pub fn unknown_gpus(why: String) -> Charge {
        Charge {
            usage: Usage::default(),
            unknown: [Dimension::Gpus, Dimension::GpuMemory]
                .into_iter()
                .map(|dimension| UnknownCharge {
                    dimension,
                    why: why.clone(),
                })
                .collect(),
        }
    }

    /// `n` whole GPUs and nothing else (no memory, no device count): a charge in one
    /// dimension, as tests and benches state one.
    pub fn whole_gpus(n: u64) -> Charge {
        Charge {
            usage: Usage {
                gpus: Gpus::whole(n),
                ..Usage::default()
            },
            unknown: Vec::new(),
        }
    }

    /// Nothing GPU-related at all: no quota applies.
    pub fn is_empty(&self) -> bool {
        self.usage.is_zero() && self.usage.devices.is_empty() && self.unknown.is_empty()
    }

    pub fn add_assign(&mut self, o: &Charge) -> Result<(), QuotaMathError> {
        self.usage.add_assign(&o.usage)?;
        for u in &o.unknown {
            if !self.unknown.contains(u) {
                self.unknown.push(u.clone());
            }
        }
        Ok(())
    }

    /// Dimension-wise worst case of two alternatives.
    pub fn max(&self, o: &Charge) -> Charge {
        let mut out = Charge {
            usage: self.usage.max(&o.usage),
            unknown: self.unknown.clone(),
        };
        for u in &o.unknown {
            if !out.unknown.contains(u) {
                out.unknown.push(u.clone());
            }
        }
        out
    }

    pub fn checked_mul_int(&self, k: u64) -> Result<Charge, QuotaMathError> {
        Ok(Charge {
            usage: self.usage.checked_mul_int(k)?,
            unknown: self.unknown.clone(),
        })
    }

    /// The first unknown in `d`, if any.
    pub fn unknown_in(&self, d: &Dimension) -> Option<&UnknownCharge> {
        self.unknown.iter().find(|u| &u.dimension == d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn min_is_what_both_cover() {
        let a = Usage {
            gpus: Gpus::ONE,
            gpu_memory: Memory(10),
            devices: BTreeMap::from([("a".to_string(), 3), ("b".to_string(), 1)]),
        };
        let b = Usage {
            gpus: Gpus::ZERO,
            gpu_memory: Memory(20),
            devices: BTreeMap::from([("a".to_string(), 2), ("c".to_string(), 5)]),
        };
        let m = a.min(&b);
        assert_eq!(m.gpus, Gpus::ZERO);
        assert_eq!(m.gpu_memory, Memory(10));
        assert_eq!(m.devices, BTreeMap::from([("a".to_string(), 2)]));
        assert_eq!(m, b.min(&a));
    }

    #[test]
    fn memory_reads_every_spelling_and_writes_canonical() {
        assert_eq!(Memory::parse("20Gi").unwrap(), Memory(20 << 30));
        assert_eq!(Memory::parse("1.5Gi").unwrap(), Memory(3 << 29));
        assert_eq!(Memory::parse("20G").unwrap(), Memory(20_000_000_000));
        assert_eq!(Memory::parse("2e3").unwrap(), Memory(2000));
        assert_eq!(Memory::parse("0.1").unwrap(), Memory(1));
        // Kubernetes' reading: fractions of a byte round up, binary values cap at 2^63-1.
        assert_eq!(Memory::parse("100m").unwrap(), Memory(1));
        assert_eq!(Memory::parse("1.Gi").unwrap(), Memory(1 << 30));
        assert_eq!(
            Memory::parse("99999999999Ei").unwrap(),
            Memory(i64::MAX as u64)
        );
        assert_eq!(Memory(15 << 30).to_string(), "15Gi");
        assert_eq!(Memory(9984 << 20).to_string(), "9984Mi");
        assert_eq!(Memory(u64::MAX).to_string(), "18446744073709551615");
        let bad = |s: &str| Memory::parse(s).unwrap_err().to_string();
        assert_eq!(bad("-1Gi"), "gpuMemory: `-1Gi` is negative");
        assert_eq!(
            bad("1e999"),
            "gpuMemory: `1e999` is more bytes than a Kubernetes quantity counts (2^63-1)"
        );
        for s in ["", "5Xi", "10GB", "1 Gi", "lots"] {
            assert!(
                bad(s).starts_with(&format!("gpuMemory: `{s}` is not a quantity: ")),
                "{s}"
            );
        }
    }

    #[test]
    fn usages_add_subtract_and_take_maxima_per_dimension() {
        let a = Usage {
            gpus: Gpus::new(1, 7).unwrap(),
            gpu_memory: Memory(10),
            devices: [("x".to_string(), 2)].into(),
        };
        let b = Usage {
            gpus: Gpus::ONE,
            gpu_memory: Memory(5),
            devices: [("y".to_string(), 1)].into(),
        };
        let s = a.checked_add(&b).unwrap();
        assert_eq!(s.gpus, Gpus::new(8, 7).unwrap());
        assert_eq!(s.devices.len(), 2);
        assert_eq!(s.saturating_sub(&a).unwrap(), b);
        let m = a.max(&b);
        assert_eq!(
            (m.gpus, m.gpu_memory, m.devices.len()),
            (Gpus::ONE, Memory(10), 2)
        );
        let json = serde_json::to_value(&a).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"gpus": "1/7", "gpuMemory": "10", "devices": {"x": 2}})
        );
    }
}
