//! DRA consumable capacity (KEP-5075) as the scheduler reads it, pure: a device's published
//! capacities and their request policies, and what one allocation consumes of each.
//!
//! What an allocation consumes is what the scheduler computes (k8s.io/dynamic-resource-allocation,
//! `calculateConsumedCapacity` and `violatesPolicy`): a capacity the request names is rounded up
//! by its `requestPolicy` (below `validRange.min` to `min`, else to the next `min + k*step`; with
//! `validValues` to the next listed value); one it omits is consumed at the policy's `default`,
//! or whole. A result above `max`, off the step grid, not a listed value, or above the
//! capacity's value cannot be allocated on that device, and neither can a request naming a
//! capacity the device does not publish.

use crate::quantity::Quantity;
use k8s_openapi::api::resource::v1::DeviceCapacity;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity as ApiQuantity;

/// The capacity a share's GPU memory is taken from.
pub const MEMORY_CAPACITY: &str = "memory";
/// The capacity a share's compute is taken from: percent of the unit's SMs (`"100"` whole).
pub const COMPUTE_CAPACITY: &str = "compute";

/// `requestPolicy.validRange` of a capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValidRange {
    pub min: Quantity,
    pub max: Option<Quantity>,
    pub step: Option<Quantity>,
}

/// `requestPolicy` of a capacity.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestPolicy {
    pub default: Option<Quantity>,
    pub valid_range: Option<ValidRange>,
    pub valid_values: Vec<Quantity>,
}

/// One published capacity as allocation reads it: its value and request policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumableCapacity {
    pub value: Quantity,
    pub policy: Option<RequestPolicy>,
}

impl ConsumableCapacity {
    /// `None` when a quantity in it does not parse (API validation rules that out); the caller
    /// then charges the capacity whole.
    pub fn from_api(c: &DeviceCapacity) -> Option<ConsumableCapacity> {
        let read = |q: &ApiQuantity| Quantity::parse_trimmed(&q.0).ok();
        let read_opt = |q: Option<&ApiQuantity>| q.map(|q| read(q).ok_or(())).transpose().ok();
        let policy = match &c.request_policy {
            None => None,
            Some(p) => Some(RequestPolicy {
                default: read_opt(p.default.as_ref())?,
                valid_range: match &p.valid_range {
                    None => None,
                    Some(r) => Some(ValidRange {
                        min: read(&r.min)?,
                        max: read_opt(r.max.as_ref())?,
                        step: read_opt(r.step.as_ref())?,
                    }),
                },
                valid_values: p
                    .valid_values
                    .iter()
                    .flatten()
                    .map(read)
                    .collect::<Option<_>>()?,
            }),
        };
        Some(ConsumableCapacity {
            value: read(&c.value)?,
            policy,
        })
    }

    /// What one allocation consumes of this capacity when the request asks `requested` (`None`:
    /// it does not name it); `None` when the device cannot grant that.
    pub fn consumed(&self, requested: Option<&Quantity>) -> Option<Quantity> {
        let c = match (requested, &self.policy) {
            (
                None,
                Some(RequestPolicy {
                    default: Some(d), ..
                }),
            ) => *d,
            (None, _) => self.value,
            (Some(r), None) => *r,
            (Some(r), Some(p)) => p.round_up(r)?,
        };
        let breaks_policy = self.policy.as_ref().is_some_and(|p| p.violated_by(&c));
        (!c.is_negative() && c <= self.value && !breaks_policy).then_some(c)
    }
}

impl RequestPolicy {
    /// `calculateConsumedCapacity`'s rounding; `None` where the grid cannot be computed.
    fn round_up(&self, r: &Quantity) -> Option<Quantity> {
        if let Some(range) = &self.valid_range {
            if *r < range.min {
                return Some(range.min);
            }
            return match &range.step {
                None => Some(*r),
                Some(step) => Grid::new(&range.min, step)?.round_up(r),
            };
        }
        // Past the largest valid value the request stays as asked, which then breaks the policy.
        Some(
            self.valid_values
                .iter()
                .find(|v| r <= v)
                .copied()
                .unwrap_or(*r),
        )
    }

    /// `violatesPolicy`: the default is always allowed.
    fn violated_by(&self, c: &Quantity) -> bool {
        if self.default.as_ref() == Some(c) {
            return false;
        }
        if let Some(range) = &self.valid_range {
            if range.max.is_some_and(|m| *c > m) {
                return true;
            }
            return match &range.step {
                None => false,
                Some(step) => Grid::new(&range.min, step).is_none_or(|g| !g.holds(c)),
            };
        }
        !self.valid_values.is_empty() && !self.valid_values.contains(c)
    }
}

/// The values `min + k*step`, counted in whole units when both are integers (the scheduler's
/// integer path) and in thousandths otherwise (its fractional path).
struct Grid {
    min: i64,
    step: i64,
    milli: bool,
    step_quantity: Quantity,
}

impl Grid {
    fn new(min: &Quantity, step: &Quantity) -> Option<Grid> {
        let milli = !(min.is_integer() && step.is_integer());
        let scaled = |q: &Quantity| if milli { q.milli_value() } else { q.value() };
        let g = Grid {
            min: scaled(min)?,
            step: scaled(step)?,
            milli,
            step_quantity: *step,
        };
        (g.step > 0).then_some(g)
    }

    /// `q` in the grid's unit, rounded up as the scheduler reads it (`Value()`/`MilliValue()`).
    fn scaled(&self, q: &Quantity) -> Option<i64> {
        if self.milli {
            q.milli_value()
        } else {
            q.value()
        }
    }

    /// The smallest grid value not below `r` (`r >= min`).
    fn round_up(&self, r: &Quantity) -> Option<Quantity> {
        let above = u64::try_from(self.scaled(r)?.checked_sub(self.min)?).ok()?;
        let steps = i64::try_from(above.div_ceil(self.step.unsigned_abs())).ok()?;
        let v = self.min.checked_add(steps.checked_mul(self.step)?)?;
        let format = self.step_quantity.format();
        Some(if self.milli {
            Quantity::new_milli(v, format)
        } else {
            Quantity::new(v, format)
        })
    }

    fn holds(&self, c: &Quantity) -> bool {
        self.scaled(c)
            .and_then(|v| v.checked_sub(self.min))
            .is_some_and(|d| d % self.step == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    fn capacity(value: &str, policy: RequestPolicy) -> ConsumableCapacity {
        ConsumableCapacity {
            value: q(value),
            policy: Some(policy),
        }
    }

    #[test]
    fn valid_values_round_up_to_the_next_listed_value() {
        let c = capacity(
            "100",
            RequestPolicy {
                default: Some(q("100")),
                valid_range: None,
                valid_values: vec![q("25"), q("50"), q("100")],
            },
        );
        assert_eq!(c.consumed(Some(&q("30"))), Some(q("50")));
        assert_eq!(c.consumed(Some(&q("25"))), Some(q("25")));
        assert_eq!(c.consumed(None), Some(q("100")));
        assert_eq!(c.consumed(Some(&q("101"))), None);
    }

    #[test]
    fn a_fractional_step_is_counted_in_thousandths() {
        let c = capacity(
            "1",
            RequestPolicy {
                default: None,
                valid_range: Some(ValidRange {
                    min: q("0.1"),
                    max: Some(q("1")),
                    step: Some(q("0.25")),
                }),
                valid_values: vec![],
            },
        );
        assert_eq!(c.consumed(Some(&q("0.2"))), Some(q("0.35")));
        assert_eq!(c.consumed(Some(&q("0.05"))), Some(q("0.1")));
        // 1 is off the grid 0.1 + k x 0.25 and there is no default to fall back on.
        assert_eq!(c.consumed(None), None);
        assert_eq!(c.consumed(Some(&q("0.9"))), None);
    }

    #[test]
    fn no_policy_consumes_what_is_asked_within_the_value() {
        let c = ConsumableCapacity {
            value: q("80Gi"),
            policy: None,
        };
        assert_eq!(c.consumed(Some(&q("15Gi"))), Some(q("15Gi")));
        assert_eq!(c.consumed(None), Some(q("80Gi")));
        assert_eq!(c.consumed(Some(&q("81Gi"))), None);
        assert_eq!(c.consumed(Some(&q("-1"))), None);
    }
}
