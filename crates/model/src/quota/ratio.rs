//! Exact whole-GPU equivalents: a non-negative fraction, always reduced (pure).
//!
//! A whole GPU is 1, a MIG device its share of its GPU's compute slices (`1g.10gb` on an H100 is
//! 1/7), a time-sliced replica 1/replicas. Sums stay exact; no floats anywhere. Numerator and
//! denominator are `u64`, products are taken in `u128`, and a result that does not fit is an
//! error ([`QuotaMathError::Overflow`]), which callers treat as "does not fit" (fail closed).

use std::cmp::Ordering;
use std::fmt;

/// Why an exact computation could not be done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaMathError {
    #[error("quota arithmetic overflowed")]
    Overflow,
    #[error(
        "{0:?} is not a GPU amount: write an integer (2), a decimal (0.5) or a fraction (3/7)"
    )]
    Malformed(String),
    #[error("{0:?} has a zero denominator")]
    ZeroDenominator(String),
}

/// A non-negative rational number of whole-GPU equivalents, kept reduced (`den >= 1`,
/// `gcd(num, den) == 1`). Written as `3` or `17/7` (see [`fmt::Display`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Gpus {
    num: u64,
    den: u64,
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Default for Gpus {
    fn default() -> Self {
        Gpus::ZERO
    }
}

impl Gpus {
    pub const ZERO: Gpus = Gpus { num: 0, den: 1 };
    pub const ONE: Gpus = Gpus { num: 1, den: 1 };

    /// `n` whole GPUs.
    pub const fn whole(n: u64) -> Gpus {
        Gpus { num: n, den: 1 }
    }

    /// `num/den`, reduced; `None` when `den` is 0.
    pub fn new(num: u64, den: u64) -> Option<Gpus> {
        Self::from_u128(u128::from(num), u128::from(den)).ok()
    }

    fn from_u128(num: u128, den: u128) -> Result<Gpus, QuotaMathError> {
        if den == 0 {
            return Err(QuotaMathError::Overflow);
        }
        let g = gcd(num, den).max(1);
        let (n, d) = (num / g, den / g);
        match (u64::try_from(n), u64::try_from(d)) {
            (Ok(num), Ok(den)) => Ok(Gpus { num, den }),
            _ => Err(QuotaMathError::Overflow),
        }
    }

    pub fn numer(&self) -> u64 {
        self.num
    }

    pub fn denom(&self) -> u64 {
        self.den
    }

    pub fn is_zero(&self) -> bool {
        self.num == 0
    }

    pub fn is_integer(&self) -> bool {
        self.den == 1
    }

    pub fn checked_add(self, other: Gpus) -> Result<Gpus, QuotaMathError> {
        let a = u128::from(self.num) * u128::from(other.den);
        let b = u128::from(other.num) * u128::from(self.den);
        let num = a.checked_add(b).ok_or(QuotaMathError::Overflow)?;
        Self::from_u128(num, u128::from(self.den) * u128::from(other.den))
    }

    /// `self - other`, or zero when `other` is larger.
    pub fn saturating_sub(self, other: Gpus) -> Result<Gpus, QuotaMathError> {
        let a = u128::from(self.num) * u128::from(other.den);
        let b = u128::from(other.num) * u128::from(self.den);
        Self::from_u128(
            a.saturating_sub(b),
            u128::from(self.den) * u128::from(other.den),
        )
    }

    pub fn checked_mul_int(self, k: u64) -> Result<Gpus, QuotaMathError> {
        Self::from_u128(u128::from(self.num) * u128::from(k), u128::from(self.den))
    }

    /// `self / k`; `k == 0` is an error.
    pub fn checked_div_int(self, k: u64) -> Result<Gpus, QuotaMathError> {
        if k == 0 {
            return Err(QuotaMathError::Overflow);
        }
        Self::from_u128(u128::from(self.num), u128::from(self.den) * u128::from(k))
    }

    /// Reads `3`, `0.25`, `3/7` (surrounding spaces allowed).
    pub fn parse(text: &str) -> Result<Gpus, QuotaMathError> {
        let s = text.trim();
        let bad = || QuotaMathError::Malformed(text.to_string());
        let digits =
            |t: &str| !t.is_empty() && t.len() <= 19 && t.bytes().all(|b| b.is_ascii_digit());
        if let Some((n, d)) = s.split_once('/') {
            let (n, d) = (n.trim(), d.trim());
            if !digits(n) || !digits(d) {
                return Err(bad());
            }
            let num: u64 = n.parse().map_err(|_| bad())?;
            let den: u64 = d.parse().map_err(|_| bad())?;
            if den == 0 {
                return Err(QuotaMathError::ZeroDenominator(text.to_string()));
            }
            return Self::from_u128(u128::from(num), u128::from(den));
        }
        let (int, frac) = s.split_once('.').unwrap_or((s, ""));
        if !digits(int) || (s.contains('.') && !digits(frac)) {
            return Err(bad());
        }
        let num: u128 = format!("{int}{frac}").parse().map_err(|_| bad())?;
        let den = 10u128
            .checked_pow(u32::try_from(frac.len()).map_err(|_| bad())?)
            .ok_or_else(bad)?;
        Self::from_u128(num, den)
    }
}

impl Ord for Gpus {
    fn cmp(&self, other: &Self) -> Ordering {
        (u128::from(self.num) * u128::from(other.den))
            .cmp(&(u128::from(other.num) * u128::from(self.den)))
    }
}

impl PartialOrd for Gpus {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl fmt::Display for Gpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.den == 1 {
            write!(f, "{}", self.num)
        } else {
            write!(f, "{}/{}", self.num, self.den)
        }
    }
}

impl std::str::FromStr for Gpus {
    type Err = QuotaMathError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Gpus::parse(s)
    }
}

impl serde::Serialize for Gpus {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> serde::Deserialize<'de> for Gpus {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Gpus;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a GPU amount: an integer, a decimal string or a fraction string")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Gpus, E> {
                Ok(Gpus::whole(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Gpus, E> {
                u64::try_from(v)
                    .map(Gpus::whole)
                    .map_err(|_| E::custom(format!("GPU amount {v} is negative")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Gpus, E> {
                Gpus::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

impl schemars::JsonSchema for Gpus {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Gpus".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "Whole-GPU equivalents: an integer (2), a decimal (0.5) or a fraction (3/7).",
            "x-kubernetes-int-or-string": true,
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?$|^[0-9]+/[0-9]*[1-9][0-9]*$"}
            ]
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(s: &str) -> Gpus {
        Gpus::parse(s).unwrap()
    }

    #[test]
    fn seven_sevenths_make_a_whole_gpu() {
        let seventh = Gpus::new(1, 7).unwrap();
        let mut sum = Gpus::ZERO;
        for _ in 0..7 {
            sum = sum.checked_add(seventh).unwrap();
        }
        assert_eq!(sum, Gpus::ONE);
        assert_eq!(sum.to_string(), "1");
        assert_eq!(seventh.checked_mul_int(3).unwrap().to_string(), "3/7");
    }

    #[test]
    fn sums_of_mixed_denominators_are_exact() {
        // 1/7 + 1/4 + 1/3 = 12/84 + 21/84 + 28/84 = 61/84
        let s = g("1/7")
            .checked_add(g("1/4"))
            .unwrap()
            .checked_add(g("1/3"))
            .unwrap();
        assert_eq!(s, Gpus::new(61, 84).unwrap());
        assert!(s < Gpus::ONE);
        assert_eq!(
            g("2").saturating_sub(s).unwrap(),
            Gpus::new(107, 84).unwrap()
        );
        assert_eq!(g("1/7").saturating_sub(g("1")).unwrap(), Gpus::ZERO);
    }

    #[test]
    fn parses_integers_decimals_and_fractions() {
        assert_eq!(g("3"), Gpus::whole(3));
        assert_eq!(g("0.5"), Gpus::new(1, 2).unwrap());
        assert_eq!(g(" 6/14 "), Gpus::new(3, 7).unwrap());
        assert_eq!(g("2.25").to_string(), "9/4");
        for bad in [
            "",
            "-1",
            "1/0",
            "a",
            "1.",
            ".5",
            "1/2/3",
            "1e3",
            "99999999999999999999",
        ] {
            assert!(Gpus::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn overflow_is_an_error_not_a_wrap() {
        let big = Gpus::whole(u64::MAX);
        assert_eq!(big.checked_add(Gpus::ONE), Err(QuotaMathError::Overflow));
        let a = Gpus::new(1, 4_294_967_291).unwrap();
        let b = Gpus::new(1, 4_294_967_279).unwrap();
        let c = Gpus::new(1, 4_294_967_231).unwrap();
        assert!(a.checked_add(b).unwrap().checked_add(c).is_err());
    }

    #[test]
    fn serde_reads_ints_and_strings_and_writes_strings() {
        let v: Gpus = serde_json::from_str("4").unwrap();
        assert_eq!(v, Gpus::whole(4));
        let v: Gpus = serde_json::from_str("\"1/7\"").unwrap();
        assert_eq!(serde_json::to_string(&v).unwrap(), "\"1/7\"");
        assert!(serde_json::from_str::<Gpus>("-3").is_err());
        assert!(serde_json::from_str::<Gpus>("1.5").is_err());
    }
}
