//! Kubernetes resource quantities, as far as ResourceSlices need them (pure).
//!
//! [`binary`] writes a byte count or small count in the API server's canonical form (what
//! `resource.NewQuantity(v, resource.BinarySI).String()` prints in Go), so a slice we write
//! reads back byte-for-byte the same. [`parse`] reads the integer forms back into a number,
//! so comparisons never depend on how a server chose to spell a value.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// Why a quantity string is not one this module understands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("quantity {0:?} is empty")]
    Empty(String),
    #[error(
        "quantity {0:?} is not an integer with an optional suffix (Ki..Ei, k..E, or an exponent)"
    )]
    Malformed(String),
    #[error("quantity {0:?} does not fit in 127 bits")]
    Overflow(String),
    #[error("quantity {value:?} has a fractional part")]
    Fractional {
        value: String,
        #[source]
        source: std::num::ParseIntError,
    },
}

const BINARY_SUFFIXES: [&str; 7] = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];

/// The canonical form of an integer quantity in the BinarySI format: the largest power of
/// 1024 that divides the value (`81559Mi`, `80Gi`); values below 1024 are written as decimal
/// SI like Go does (`98`, `1k`).
pub fn binary_string(value: i64) -> String {
    if value.unsigned_abs() < 1024 {
        if value != 0 && value % 1000 == 0 {
            return format!("{}k", value / 1000);
        }
        return value.to_string();
    }
    let mut v = value;
    let mut exp = 0;
    while exp + 1 < BINARY_SUFFIXES.len() && v % 1024 == 0 {
        v /= 1024;
        exp += 1;
    }
    format!("{v}{}", BINARY_SUFFIXES[exp])
}

/// [`binary_string`] as a `Quantity`.
pub fn binary(value: i64) -> Quantity {
    Quantity(binary_string(value))
}

/// A byte count in MiB as a `Quantity` of bytes, saturating instead of overflowing.
pub fn mebibytes(mib: u64) -> Quantity {
    let bytes = i64::try_from(mib)
        .ok()
        .and_then(|m| m.checked_mul(1 << 20))
        .unwrap_or(i64::MAX);
    binary(bytes)
}

/// The integer value of a quantity string: `[+-]digits[suffix]` with a binary (`Ki`..`Ei`) or
/// decimal (`k`, `M`, `G`, `T`, `P`, `E`) suffix or an `e<N>`/`E<N>` exponent. Fractions and
/// milli-units are not integers and are reported as errors.
pub fn parse(text: &str) -> Result<i128, QuantityError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(QuantityError::Empty(text.to_string()));
    }
    let (negative, rest) = match s.as_bytes()[0] {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    let digits_end = rest
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(rest.len());
    let (number, suffix) = rest.split_at(digits_end);
    if number.is_empty() {
        return Err(QuantityError::Malformed(text.to_string()));
    }
    let mantissa: i128 = number.parse().map_err(|source| QuantityError::Fractional {
        value: text.to_string(),
        source,
    })?;
    let factor: i128 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "Ei" => 1 << 60,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "E" => 1_000_000_000_000_000_000,
        exp if exp.starts_with(['e', 'E']) => {
            let n: u32 = exp[1..]
                .parse()
                .map_err(|_| QuantityError::Malformed(text.to_string()))?;
            10i128
                .checked_pow(n)
                .ok_or_else(|| QuantityError::Overflow(text.to_string()))?
        }
        _ => return Err(QuantityError::Malformed(text.to_string())),
    };
    let v = mantissa
        .checked_mul(factor)
        .ok_or_else(|| QuantityError::Overflow(text.to_string()))?;
    Ok(if negative { -v } else { v })
}

/// The form used to compare two quantities: the canonical spelling of the value when it is an
/// integer this module reads, else the text as given.
pub fn normalized(q: &Quantity) -> String {
    match parse(&q.0) {
        Ok(v) => match i64::try_from(v) {
            Ok(v) => binary_string(v),
            Err(_) => v.to_string(),
        },
        Err(_) => q.0.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_forms_match_go() {
        assert_eq!(binary_string(81559 << 20), "81559Mi");
        assert_eq!(binary_string(80 << 30), "80Gi");
        assert_eq!(binary_string(98), "98");
        assert_eq!(binary_string(0), "0");
        assert_eq!(binary_string(1000), "1k");
        assert_eq!(binary_string(1024), "1Ki");
        assert_eq!(binary_string(1536), "1536");
        assert_eq!(mebibytes(10240).0, "10Gi");
    }

    #[test]
    fn parse_reads_every_integer_spelling() {
        assert_eq!(parse("81559Mi"), Ok(81559 << 20));
        assert_eq!(parse("85520809984"), Ok(85_520_809_984));
        assert_eq!(parse("1k"), Ok(1000));
        assert_eq!(parse("2e3"), Ok(2000));
        assert_eq!(parse("-3Ki"), Ok(-3072));
        assert!(parse("1.5Gi").is_err());
        assert!(parse("").is_err());
        assert!(parse("Gi").is_err());
        assert!(parse("5Xi").is_err());
        assert_eq!(
            normalized(&Quantity((81559i64 << 20).to_string())),
            normalized(&Quantity("81559Mi".into()))
        );
    }
}
