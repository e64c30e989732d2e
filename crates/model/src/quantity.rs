//! Kubernetes resource quantities (`resource.Quantity` of k8s.io/apimachinery), pure.
//!
//! The one reading of a quantity string in gpuplane: the quota webhook's `gpuMemory`, the
//! capacities of the ResourceSlices we write and read, and the memory limits of opaque DRA
//! configs all go through [`Quantity`], so the node and the webhook never disagree about a
//! string. Grammar and meaning follow apimachinery's `ParseQuantity` and `String()`:
//!
//! - `<sign>?<number><suffix>`; the number is digits with at most one `.` (`1`, `1.5`, `.5`,
//!   `1.`); the suffix is binary (`Ki`..`Ei`), decimal SI (`n u m "" k M G T P E`) or a decimal
//!   exponent (`e`/`E` and a signed integer). Like upstream, the degenerate spellings `.`, `+`,
//!   `-` and a bare suffix (`Gi`) read as zero, and surrounding whitespace is an error (the
//!   serde form trims it, as `UnmarshalJSON` does).
//! - The value is an exact decimal, never a float, rounded away from zero to a multiple of 1n
//!   at parse (`0.1n` is `1n`). A binary-suffixed value is capped at 2^63-1 in magnitude, as
//!   upstream caps it; decimal forms are not capped.
//! - The suffix kind (its [`Format`]) is remembered and decides the canonical string:
//!   `1.5Gi` is `1536Mi`, `0.1` is `100m`, `1e3` stays `1e3`, `1024Ki` is `1Mi`. As upstream,
//!   a binary integer that is no multiple of 1Ki is written bare (`1536`) and reads back as
//!   decimal, so its string may shorten once more (`93370321728000` -> `93370321728k`).
//!
//! Where upstream is arbitrary precision we hold at most 36 significant digits and an `i32`
//! exponent: more digits, or an exponent past `i32`, are errors here, where upstream keeps the
//! digits or silently wraps the exponent. A decimal-SI value above the `E` suffix is written
//! with an exponent (`1e21`), as kubernetes PR #140459 fixed upstream (before it, `1000E`
//! printed as `1`).

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

/// How a quantity is written; kept from the suffix it was parsed with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// `12e6`.
    DecimalExponent,
    /// `12Mi` (12 * 2^20).
    BinarySI,
    /// `12M` (12 * 10^6).
    DecimalSI,
}

/// Why a string is not a Kubernetes quantity. The text itself is left to the caller, which
/// names the field it came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("the string is empty")]
    Empty,
    #[error("unexpected `{found}` at byte {at} (want a number such as 1, 1.5 or .5 and a suffix)")]
    Malformed { at: usize, found: char },
    #[error("unknown suffix `{0}` (want Ki, Mi, Gi, Ti, Pi, Ei, n, u, m, k, M, G, T, P, E, or e and an integer)")]
    Suffix(String),
    #[error("more than {MAX_DIGITS} significant digits")]
    TooPrecise,
    #[error("the exponent is out of range (at most 2^31-1)")]
    Exponent,
}

/// Significant digits we keep: canonical forms multiply the mantissa by up to 100 and
/// comparisons align mantissas, both of which must stay inside `i128`.
const MAX_DIGITS: usize = 36;
/// Values are rounded to a multiple of 10^NANO.
const NANO: i32 = -9;
/// The binary-suffix cap, 2^63-1.
const MAX_BINARY: i128 = i64::MAX as i128;

/// An exact quantity: `mantissa * 10^exponent`, remembered with its [`Format`].
///
/// Kept normalized (no trailing zeros in the mantissa, zero is `0e0`, `exponent >= -9`,
/// at most 36 digits), so equality and hashing compare values. Like upstream's `Cmp`, the
/// format takes no part in comparisons: `1Ki == 1024`.
#[derive(Debug, Clone, Copy)]
pub struct Quantity {
    mantissa: i128,
    exponent: i32,
    format: Format,
}

impl Quantity {
    pub const ZERO: Quantity = Quantity {
        mantissa: 0,
        exponent: 0,
        format: Format::DecimalSI,
    };

    /// An integer in the given format (`NewQuantity`).
    pub fn new(value: i64, format: Format) -> Quantity {
        Quantity::normalized(i128::from(value), 0, format)
    }

    /// An unsigned integer (a byte count) in the given format.
    pub fn from_u64(value: u64, format: Format) -> Quantity {
        Quantity::normalized(i128::from(value), 0, format)
    }

    /// `value / 1000` in the given format (`NewMilliQuantity`).
    pub fn new_milli(value: i64, format: Format) -> Quantity {
        Quantity::normalized(i128::from(value), -3, format)
    }

    /// A byte count given in MiB, in BinarySI; saturates at 2^63-1 bytes rather than
    /// overflowing, as no Kubernetes quantity counts further.
    pub fn mebibytes(mib: u64) -> Quantity {
        let bytes = i64::try_from(mib)
            .ok()
            .and_then(|m| m.checked_mul(1 << 20))
            .unwrap_or(i64::MAX);
        Quantity::new(bytes, Format::BinarySI)
    }

    /// Reads a quantity as `ParseQuantity` does: no surrounding whitespace allowed.
    pub fn parse(text: &str) -> Result<Quantity, QuantityError> {
        parse(text)
    }

    /// Reads a quantity as `UnmarshalJSON` does: surrounding whitespace is ignored.
    pub fn parse_trimmed(text: &str) -> Result<Quantity, QuantityError> {
        parse(text.trim())
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// The same value, written in another format.
    pub fn with_format(self, format: Format) -> Quantity {
        Quantity { format, ..self }
    }

    pub fn is_zero(&self) -> bool {
        self.mantissa == 0
    }

    pub fn is_negative(&self) -> bool {
        self.mantissa < 0
    }

    /// Whether the value is a whole number (`1000m` is, `1500m` is not).
    pub fn is_integer(&self) -> bool {
        self.exponent >= 0
    }

    /// The value rounded up, away from zero, to an integer (`Value()`); `None` where that does
    /// not fit an `i64` (upstream overflows silently).
    pub fn value(&self) -> Option<i64> {
        self.scaled_ceil(0)
    }

    /// `ceil(value * 1000)`, away from zero (`MilliValue()`); `None` where it does not fit.
    pub fn milli_value(&self) -> Option<i64> {
        self.scaled_ceil(-3)
    }

    /// The canonical string (`String()`).
    pub fn canonical(&self) -> String {
        self.to_string()
    }

    /// `value / 10^scale`, rounded away from zero.
    fn scaled_ceil(&self, scale: i32) -> Option<i64> {
        if self.mantissa == 0 {
            return Some(0);
        }
        let e = i64::from(self.exponent) - i64::from(scale);
        let v = if e >= 0 {
            let f = pow10(u32::try_from(e).ok()?)?;
            self.mantissa.checked_mul(f)?
        } else {
            // e >= NANO - scale, a small power.
            let d = pow10(u32::try_from(-e).ok()?)?;
            let (q, r) = (self.mantissa / d, self.mantissa % d);
            if r == 0 {
                q
            } else {
                q + self.mantissa.signum()
            }
        };
        i64::try_from(v).ok()
    }

    /// Builds a normalized quantity from a mantissa that fits [`MAX_DIGITS`] and an exponent
    /// of at least [`NANO`] (the constructors above only make such values).
    fn normalized(mut mantissa: i128, mut exponent: i32, format: Format) -> Quantity {
        if mantissa == 0 {
            return Quantity {
                mantissa: 0,
                exponent: 0,
                format,
            };
        }
        while mantissa % 10 == 0 {
            mantissa /= 10;
            exponent += 1;
        }
        Quantity {
            mantissa,
            exponent,
            format,
        }
    }

    /// The canonical number and suffix, as `CanonicalizeBytes` splits them.
    fn canonical_parts(&self) -> (i128, String) {
        if self.mantissa == 0 {
            return (0, String::new());
        }
        let format = match self.format {
            Format::BinarySI => {
                let limit = |v| Quantity::new(v, Format::BinarySI);
                let small = limit(-1024) < *self && *self < limit(1024);
                // Below 1Ki, or with a fraction, binary suffixes would round: write decimal.
                match self.integer_value() {
                    Some(v) if !small => return binary_parts(v),
                    _ => Format::DecimalSI,
                }
            }
            f => f,
        };
        let (mut m, mut e) = (self.mantissa, self.exponent);
        while e.rem_euclid(3) != 0 {
            m *= 10;
            e -= 1;
        }
        if format == Format::DecimalSI {
            if let Some(s) = decimal_suffix(e) {
                return (m, s.to_string());
            }
            // Past `E`: upstream (after PR #140459) falls back to the exponent form.
        }
        if e == 0 {
            (m, String::new())
        } else {
            (m, format!("e{e}"))
        }
    }

    /// The value as an integer when it is one and fits `i128`.
    fn integer_value(&self) -> Option<i128> {
        if self.exponent < 0 {
            return None;
        }
        let f = pow10(u32::try_from(self.exponent).ok()?)?;
        self.mantissa.checked_mul(f)
    }
}

fn pow10(e: u32) -> Option<i128> {
    10i128.checked_pow(e)
}

/// An integer in base 1024: the largest `Ki`..`Ei` suffix that divides it.
fn binary_parts(v: i128) -> (i128, String) {
    const SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
    let (mut m, mut k) = (v, 0);
    while k + 1 < SUFFIXES.len() && m % 1024 == 0 {
        m /= 1024;
        k += 1;
    }
    (m, SUFFIXES[k].to_string())
}

fn decimal_suffix(e: i32) -> Option<&'static str> {
    Some(match e {
        -9 => "n",
        -6 => "u",
        -3 => "m",
        0 => "",
        3 => "k",
        6 => "M",
        9 => "G",
        12 => "T",
        15 => "P",
        18 => "E",
        _ => return None,
    })
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (number, suffix) = self.canonical_parts();
        write!(f, "{number}{suffix}")
    }
}

impl FromStr for Quantity {
    type Err = QuantityError;
    fn from_str(s: &str) -> Result<Quantity, QuantityError> {
        parse(s)
    }
}

impl PartialEq for Quantity {
    fn eq(&self, o: &Quantity) -> bool {
        self.mantissa == o.mantissa && self.exponent == o.exponent
    }
}

impl Eq for Quantity {}

impl std::hash::Hash for Quantity {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (self.mantissa, self.exponent).hash(h);
    }
}

impl PartialOrd for Quantity {
    fn partial_cmp(&self, o: &Quantity) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

impl Ord for Quantity {
    fn cmp(&self, o: &Quantity) -> Ordering {
        let (a, b) = (self.mantissa.signum(), o.mantissa.signum());
        if a != b || a == 0 {
            return a.cmp(&b);
        }
        let mag = cmp_magnitude(
            (self.mantissa.unsigned_abs(), self.exponent),
            (o.mantissa.unsigned_abs(), o.exponent),
        );
        if a < 0 {
            mag.reverse()
        } else {
            mag
        }
    }
}

/// Compares two non-zero magnitudes `m * 10^e` by their order, then aligned.
fn cmp_magnitude((am, ae): (u128, i32), (bm, be): (u128, i32)) -> Ordering {
    let order = |m: u128, e: i32| i64::from(m.ilog10()) + i64::from(e);
    match order(am, ae).cmp(&order(bm, be)) {
        Ordering::Equal => {}
        other => return other,
    }
    // Same order of magnitude: the exponents differ by fewer digits than a mantissa has, so
    // the scaled mantissa stays within MAX_DIGITS.
    let scale = |m: u128, by: i32| m * 10u128.pow(by.unsigned_abs());
    if ae >= be {
        scale(am, ae - be).cmp(&bm)
    } else {
        am.cmp(&scale(bm, be - ae))
    }
}

/// What a quantity string is made of, as upstream's scanner splits it.
struct Parts<'a> {
    negative: bool,
    int: &'a [u8],
    frac: &'a [u8],
    suffix: &'a str,
}

/// Letters a suffix may start with; anything else after the number is a format error, while
/// a wrong combination of these letters is a suffix error (as upstream tells them apart).
const SUFFIX_LETTERS: &[u8] = b"eEinumkKMGTP";

fn scan(text: &str) -> Result<Parts<'_>, QuantityError> {
    let b = text.as_bytes();
    let mut pos = 0;
    let negative = match b.first() {
        Some(b'-') => {
            pos += 1;
            true
        }
        Some(b'+') => {
            pos += 1;
            false
        }
        _ => false,
    };
    let digits = |from: usize| from + b[from..].iter().take_while(|c| c.is_ascii_digit()).count();
    let int_end = digits(pos);
    let int = &b[pos..int_end];
    pos = int_end;
    let mut frac: &[u8] = &[];
    if b.get(pos) == Some(&b'.') {
        let end = digits(pos + 1);
        frac = &b[pos + 1..end];
        pos = end;
    }
    let suffix_start = pos;
    pos += b[pos..]
        .iter()
        .take_while(|c| SUFFIX_LETTERS.contains(c))
        .count();
    if matches!(b.get(pos), Some(b'+' | b'-')) {
        pos += 1;
    }
    pos = digits(pos);
    if pos < b.len() {
        // Every byte before `pos` is ASCII, so `pos` is a char boundary.
        let found = text[pos..].chars().next().unwrap_or('?');
        return Err(QuantityError::Malformed { at: pos, found });
    }
    Ok(Parts {
        negative,
        int,
        frac,
        suffix: &text[suffix_start..],
    })
}

/// A suffix's base and exponent, and the format it implies.
fn interpret(suffix: &str) -> Result<(u32, i64, Format), QuantityError> {
    let dec = |e| Ok((10, e, Format::DecimalSI));
    let bin = |e| Ok((2, e, Format::BinarySI));
    match suffix {
        "" => dec(0),
        "n" => dec(-9),
        "u" => dec(-6),
        "m" => dec(-3),
        "k" => dec(3),
        "M" => dec(6),
        "G" => dec(9),
        "T" => dec(12),
        "P" => dec(15),
        "E" => dec(18),
        "Ki" => bin(10),
        "Mi" => bin(20),
        "Gi" => bin(30),
        "Ti" => bin(40),
        "Pi" => bin(50),
        "Ei" => bin(60),
        s if s.len() > 1 && s.starts_with(['e', 'E']) => {
            let e: i64 = s[1..]
                .parse()
                .map_err(|_| QuantityError::Suffix(s.to_string()))?;
            if i32::try_from(e).is_err() {
                return Err(QuantityError::Exponent);
            }
            Ok((10, e, Format::DecimalExponent))
        }
        s => Err(QuantityError::Suffix(s.to_string())),
    }
}

fn parse(text: &str) -> Result<Quantity, QuantityError> {
    if text.is_empty() {
        return Err(QuantityError::Empty);
    }
    let parts = scan(text)?;
    let (base, exp, mut format) = interpret(parts.suffix)?;
    let mut digits: Vec<u8> = parts
        .int
        .iter()
        .chain(parts.frac)
        .map(|c| c - b'0')
        .collect();
    let frac_len = i64::try_from(parts.frac.len()).map_err(|_| QuantityError::TooPrecise)?;
    let mut exp10 = -frac_len;
    if base == 10 {
        exp10 += exp;
    } else {
        // exp is 10..=60: multiply exactly, in steps that keep the carry in a u64.
        let mut bits = u32::try_from(exp).map_err(|_| QuantityError::Exponent)?;
        while bits > 0 {
            let step = bits.min(30);
            mul_small(&mut digits, 1 << step);
            bits -= step;
        }
    }
    let capped = base == 2 && exceeds_binary_cap(&digits, parts.frac.len());
    let mut q = if capped {
        Quantity::normalized(MAX_BINARY, 0, format)
    } else {
        round_to_nano(&digits, exp10, format)?
    };
    if parts.negative {
        q.mantissa = -q.mantissa;
    }
    // A binary value between 0 and 1 has no binary spelling: upstream switches it to decimal.
    if format == Format::BinarySI && q.mantissa != 0 && q.exponent < 0 {
        let below_one = q.mantissa.unsigned_abs() < 10u128.pow(q.exponent.unsigned_abs());
        if below_one {
            format = Format::DecimalSI;
        }
    }
    q.format = format;
    Ok(q)
}

/// `digits *= k` on a most-significant-first decimal digit vector.
fn mul_small(digits: &mut Vec<u8>, k: u64) {
    let mut carry = 0u64;
    for d in digits.iter_mut().rev() {
        let v = u64::from(*d) * k + carry;
        *d = (v % 10) as u8;
        carry = v / 10;
    }
    let mut front = Vec::new();
    while carry > 0 {
        front.push((carry % 10) as u8);
        carry /= 10;
    }
    front.reverse();
    digits.splice(0..0, front);
}

/// Whether `digits * 10^-frac_len` is above 2^63-1.
fn exceeds_binary_cap(digits: &[u8], frac_len: usize) -> bool {
    let int_len = digits.len().saturating_sub(frac_len);
    let int = &digits[..int_len];
    let frac = &digits[int_len..];
    let sig = &int[int.iter().take_while(|d| **d == 0).count()..];
    if sig.len() > 19 {
        return true;
    }
    let v = sig.iter().fold(0i128, |v, d| v * 10 + i128::from(*d));
    v > MAX_BINARY || (v == MAX_BINARY && frac.iter().any(|d| *d != 0))
}

/// `digits * 10^exp10`, rounded away from zero to a multiple of 1n, normalized.
fn round_to_nano(digits: &[u8], mut exp10: i64, format: Format) -> Result<Quantity, QuantityError> {
    let start = digits.iter().take_while(|d| **d == 0).count();
    let mut sig = &digits[start..];
    let zeros = sig.iter().rev().take_while(|d| **d == 0).count();
    sig = &sig[..sig.len() - zeros];
    if sig.is_empty() {
        return Ok(Quantity::normalized(0, 0, format));
    }
    exp10 += i64::try_from(zeros).map_err(|_| QuantityError::TooPrecise)?;
    let mut round_up = false;
    if exp10 < i64::from(NANO) {
        // Everything below 1n is cut; it ends in a non-zero digit, so the rest rounds up.
        let cut = usize::try_from(i64::from(NANO) - exp10).unwrap_or(usize::MAX);
        sig = &sig[..sig.len().saturating_sub(cut)];
        exp10 = i64::from(NANO);
        round_up = true;
    }
    if sig.len() > MAX_DIGITS {
        return Err(QuantityError::TooPrecise);
    }
    let mut m = sig.iter().fold(0i128, |v, d| v * 10 + i128::from(*d));
    if round_up {
        m += 1;
    }
    let e = i32::try_from(exp10).map_err(|_| QuantityError::Exponent)?;
    let q = Quantity::normalized(m, e, format);
    // `999…9 + 1` may have grown a digit; normalizing strips it again unless it is real.
    if q.mantissa.unsigned_abs() >= 10u128.pow(MAX_DIGITS as u32) {
        return Err(QuantityError::TooPrecise);
    }
    Ok(q)
}

impl serde::Serialize for Quantity {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> serde::Deserialize<'de> for Quantity {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Quantity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a Kubernetes quantity such as 1.5Gi, 100m or 1e3")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Quantity, E> {
                Quantity::parse_trimmed(v)
                    .map_err(|e| E::custom(format!("`{v}` is not a quantity: {e}")))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Quantity, E> {
                Ok(Quantity::from_u64(v, Format::DecimalSI))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Quantity, E> {
                Ok(Quantity::new(v, Format::DecimalSI))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Quantity, E> {
                // Upstream reads a JSON number by its text; Rust's shortest form is that text.
                self.visit_str(&v.to_string())
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests;
