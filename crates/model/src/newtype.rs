//! The string newtypes' shared impls: a checked identity (a device UUID, a claim UID, a
//! resource name) reads as the `str` it wraps, compares with strings both ways and turns back
//! into a `String`; only its own `parse` makes one.

/// Implements, for a tuple struct over one `String`, `Deref<Target = str>`, `AsRef<str>`,
/// `Borrow<str>`, `Display`, equality with `str`, `&str` and `String` (both ways) and
/// `From<T> for String`.
macro_rules! str_newtype {
    ($t:ident) => {
        impl std::ops::Deref for $t {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $t {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl std::borrow::Borrow<str> for $t {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl PartialEq<str> for $t {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $t {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<String> for $t {
            fn eq(&self, other: &String) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<$t> for str {
            fn eq(&self, other: &$t) -> bool {
                *self == other.0
            }
        }

        impl PartialEq<$t> for &str {
            fn eq(&self, other: &$t) -> bool {
                **self == other.0
            }
        }

        impl PartialEq<$t> for String {
            fn eq(&self, other: &$t) -> bool {
                *self == other.0
            }
        }

        impl From<$t> for String {
            fn from(v: $t) -> String {
                v.0
            }
        }
    };
}
