//! DRA CEL selectors, evaluated as the scheduler evaluates them (pure).
//!
//! To charge a claim for the *worst case* among the devices its DeviceClass and selectors may
//! match, quota must find the devices the scheduler may allocate from. Expressions run on a
//! real CEL engine (the `cel` crate with kube-cel's Kubernetes libraries: `quantity`,
//! `semver`, strings, lists, regex, ...) in the environment of Kubernetes' DRA selectors: a
//! `device` with `driver`, `attributes[domain][name]` (strings, ints, bools, semver versions)
//! and `capacity[domain][name]` (quantities); an unqualified name lives under the driver's
//! domain. Only the outcome is read conservatively: an expression that does not compile, or
//! whose evaluation fails on a device (a missing attribute, a function CEL lacks here), is
//! [`Tri::Unknown`] for it, and unknown counts as a match, so the set of devices
//! [`Selector::may_match`] accepts always contains the set Kubernetes would allocate from (the
//! scheduler refuses to allocate on such an error). Written by hand here: only this adapter;
//! the language is the engine's.

use crate::quantity::Quantity;
use kube_cel::cel::common::ast::{operators, Expr, LiteralValue};
use kube_cel::cel::objects::Map;
use kube_cel::cel::{Context, IdedExpr, Program, Value};
use kube_cel::KubeCelExt;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

/// A value a device carries under one attribute or capacity name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttrValue {
    Str(String),
    Int(i64),
    Bool(bool),
    Version(String),
    /// A capacity (bytes for memory).
    Quantity(Quantity),
}

/// Three-valued truth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tri {
    True,
    False,
    Unknown,
}

/// Longest expression compiled (the API server's limit for a selector); longer ones match
/// everything.
const MAX_LEN: usize = 10 * 1024;
/// Deepest bracket nesting compiled: the parser recurses per level, so deeper ones match
/// everything instead of risking the webhook's stack.
const MAX_DEPTH: usize = 32;
/// Longest run of unary operators compiled, for the same reason.
const MAX_UNARY_RUN: usize = 32;

/// Built-in CEL functions plus Kubernetes' libraries, shared by every evaluation.
static ROOT: LazyLock<Context<'static>> = LazyLock::new(|| Context::default().with_all());

/// `quantity(v)` and `semver(v)`, to turn a device's values into the types CEL compares.
static CONSTRUCTORS: LazyLock<Option<(Program, Program)>> = LazyLock::new(|| {
    Some((
        Program::compile("quantity(v)").ok()?,
        Program::compile("semver(v)").ok()?,
    ))
});

/// A device as a selector sees it: the `device` variable, built once.
#[derive(Debug, Clone)]
pub struct CelDevice {
    value: Value,
}

impl CelDevice {
    /// `device` for a device of `driver` with these attributes and capacities as (domain,
    /// name, value). A value CEL cannot hold (a version that is not semver) is left out: an
    /// expression reading it is then unknown for this device, so it may match.
    pub fn new(
        driver: &str,
        attributes: &[(&str, &str, &AttrValue)],
        capacity: &[(&str, &str, &AttrValue)],
    ) -> CelDevice {
        let mut device = HashMap::new();
        device.insert("driver".to_string(), Value::String(Arc::new(driver.into())));
        device.insert("attributes".to_string(), by_domain(attributes));
        device.insert("capacity".to_string(), by_domain(capacity));
        CelDevice {
            value: Value::Map(Map::from(device)),
        }
    }
}

/// `{domain: {name: value}}` from (domain, name, value).
fn by_domain(values: &[(&str, &str, &AttrValue)]) -> Value {
    let mut domains: HashMap<String, HashMap<String, Value>> = HashMap::new();
    for (domain, name, v) in values {
        if let Some(v) = to_cel(v) {
            domains
                .entry(domain.to_string())
                .or_default()
                .insert(name.to_string(), v);
        }
    }
    let domains: HashMap<String, Value> = domains
        .into_iter()
        .map(|(d, names)| (d, Value::Map(Map::from(names))))
        .collect();
    Value::Map(Map::from(domains))
}

fn to_cel(v: &AttrValue) -> Option<Value> {
    let construct = |program: &Program, text: String| {
        let mut ctx = ROOT.new_inner_scope();
        ctx.add_variable_from_value("v", text);
        program.execute(&ctx).ok()
    };
    let (quantity, semver) = CONSTRUCTORS.as_ref()?;
    match v {
        AttrValue::Str(s) => Some(Value::String(Arc::new(s.clone()))),
        AttrValue::Int(i) => Some(Value::Int(*i)),
        AttrValue::Bool(b) => Some(Value::Bool(*b)),
        AttrValue::Version(s) => construct(semver, s.clone()),
        AttrValue::Quantity(q) => construct(quantity, q.to_string()),
    }
}

/// One compiled CEL selector expression.
#[derive(Debug, Clone)]
pub struct Selector {
    /// The expression as written: what a catalog remembers its verdicts by.
    source: Arc<str>,
    program: Option<Arc<Program>>,
    required_driver: Option<String>,
}

impl Selector {
    /// Compiles `expr`; what does not compile becomes a selector that may match anything.
    pub fn parse(expr: &str) -> Selector {
        let program = (expr.len() <= MAX_LEN && shallow(expr))
            .then(|| Program::compile(expr).ok())
            .flatten();
        let required_driver = program
            .as_ref()
            .and_then(|p| required_driver(p.expression()));
        Selector {
            source: expr.into(),
            program: program.map(Arc::new),
            required_driver,
        }
    }

    /// The expression as written.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the expression compiled (for diagnostics).
    pub fn understood(&self) -> bool {
        self.program.is_some()
    }

    /// The expression's value for `d`: unknown when it does not compile, fails or is not a
    /// bool.
    pub fn eval(&self, d: &CelDevice) -> Tri {
        let Some(program) = &self.program else {
            return Tri::Unknown;
        };
        let mut ctx = ROOT.new_inner_scope();
        ctx.add_variable_from_value("device", d.value.clone());
        match program.execute(&ctx) {
            Ok(Value::Bool(true)) => Tri::True,
            Ok(Value::Bool(false)) => Tri::False,
            _ => Tri::Unknown,
        }
    }

    /// True unless the expression is certainly false for `d`.
    pub fn may_match(&self, d: &CelDevice) -> bool {
        self.eval(d) != Tri::False
    }

    /// The driver this selector certainly requires (`device.driver == 'x'` as a conjunct at
    /// the top level), if any.
    pub fn required_driver(&self) -> Option<&str> {
        self.required_driver.as_deref()
    }
}

/// Whether `expr` nests brackets and unary operators shallowly enough to compile safely.
/// Counts outside string literals only roughly (quotes toggle), which errs towards refusing.
fn shallow(expr: &str) -> bool {
    let (mut depth, mut unary, mut quote) = (0usize, 0usize, None);
    for c in expr.chars() {
        if let Some(q) = quote {
            if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '\'' | '"' => quote = Some(c),
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        unary = if c == '!' || c == '-' {
            unary + 1
        } else if c.is_whitespace() {
            unary
        } else {
            0
        };
        if depth > MAX_DEPTH || unary > MAX_UNARY_RUN {
            return false;
        }
    }
    true
}

/// `x` in a top-level conjunct `device.driver == 'x'` (either side).
fn required_driver(e: &IdedExpr) -> Option<String> {
    let Expr::Call(call) = &e.expr else {
        return None;
    };
    match (call.func_name.as_str(), call.args.as_slice()) {
        (operators::LOGICAL_AND, [a, b]) => required_driver(a).or_else(|| required_driver(b)),
        (operators::EQUALS, [a, b]) => match (&a.expr, &b.expr) {
            (l, Expr::Literal(LiteralValue::String(s)))
            | (Expr::Literal(LiteralValue::String(s)), l)
                if is_device_driver(l) =>
            {
                Some(s.inner().to_string())
            }
            _ => None,
        },
        _ => None,
    }
}

fn is_device_driver(e: &Expr) -> bool {
    matches!(e, Expr::Select(s) if s.field == "driver"
        && matches!(&s.operand.expr, Expr::Ident(i) if i == "device"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A device in tests and simple callers: driver plus maps keyed by (domain, name).
    #[derive(Debug, Clone, Default)]
    struct SimpleDevice {
        driver: String,
        attributes: BTreeMap<(String, String), AttrValue>,
        capacity: BTreeMap<(String, String), AttrValue>,
    }

    impl SimpleDevice {
        /// The device as a selector sees it.
        fn cel(&self) -> CelDevice {
            CelDevice::new(
                &self.driver,
                &values(&self.attributes),
                &values(&self.capacity),
            )
        }
    }

    fn values(m: &BTreeMap<(String, String), AttrValue>) -> Vec<(&str, &str, &AttrValue)> {
        m.iter()
            .map(|((d, n), v)| (d.as_str(), n.as_str(), v))
            .collect()
    }

    const D: &str = "gpu.gpuplane.dev";

    fn dev(kind: &str, profile: Option<&str>, mem: i64) -> SimpleDevice {
        let mut d = SimpleDevice {
            driver: D.into(),
            ..Default::default()
        };
        d.attributes
            .insert((D.into(), "type".into()), AttrValue::Str(kind.into()));
        if let Some(p) = profile {
            d.attributes
                .insert((D.into(), "profile".into()), AttrValue::Str(p.into()));
        }
        d.capacity.insert(
            (D.into(), "memory".into()),
            AttrValue::Quantity(Quantity::new(mem, crate::quantity::Format::BinarySI)),
        );
        d
    }

    #[test]
    fn the_shipped_device_classes_are_understood() {
        let gpu = dev("gpu", None, 80 << 30);
        let mig = dev("mig", Some("1g.10gb"), 10 << 30);
        let classes = [
            ("device.driver == 'gpu.gpuplane.dev' && device.attributes['gpu.gpuplane.dev'].type == 'gpu'", true, false),
            ("device.driver == 'gpu.gpuplane.dev' && device.attributes['gpu.gpuplane.dev'].type == 'mig'", false, true),
            ("device.driver == 'gpu.gpuplane.dev' &&\n device.attributes['gpu.gpuplane.dev'].type == 'mig' && device.attributes['gpu.gpuplane.dev'].profile.startsWith('1g.')", false, true),
            ("device.driver == 'gpu.gpuplane.dev' && device.attributes['gpu.gpuplane.dev'].type == 'mig' && device.attributes['gpu.gpuplane.dev'].profile.startsWith('2g.')", false, false),
        ];
        for (expr, on_gpu, on_mig) in classes {
            let s = Selector::parse(expr);
            assert!(s.understood(), "{expr}");
            assert_eq!(s.may_match(&gpu.cel()), on_gpu, "{expr}");
            assert_eq!(s.may_match(&mig.cel()), on_mig, "{expr}");
            assert_eq!(s.required_driver(), Some(D));
        }
    }

    #[test]
    fn capacity_comparisons_and_other_drivers_decide() {
        let big = dev("gpu", None, 80 << 30);
        let small = dev("gpu", None, 40 << 30);
        let s = Selector::parse(
            "device.capacity['gpu.gpuplane.dev'].memory.compareTo(quantity('48Gi')) >= 0",
        );
        assert_eq!(s.eval(&big.cel()), Tri::True);
        assert_eq!(s.eval(&small.cel()), Tri::False);
        let s = Selector::parse("device.driver == \"nic.example.com\"");
        assert_eq!(s.eval(&big.cel()), Tri::False);
        let s = Selector::parse("device.attributes['gpu.gpuplane.dev']['type'] != 'gpu' || device.capacity['gpu.gpuplane.dev'].memory.isLessThan(quantity('50Gi'))");
        assert_eq!(
            (s.eval(&big.cel()), s.eval(&small.cel())),
            (Tri::False, Tri::True)
        );
    }

    #[test]
    fn the_whole_language_decides_and_errors_are_unknown() {
        let mut gpu = dev("gpu", None, 80 << 30);
        gpu.attributes.insert(
            (D.into(), "driverVersion".into()),
            AttrValue::Version("535.183.1".into()),
        );
        let a = "device.attributes['gpu.gpuplane.dev']";
        for (expr, want) in [
            (
                format!("{a}.driverVersion.isGreaterThan(semver('535.0.0'))"),
                Tri::True,
            ),
            (
                format!("{a}.driverVersion.isLessThan(semver('500.0.0'))"),
                Tri::False,
            ),
            (format!("{a}.type in ['mig', 'vgpu']"), Tri::False),
            (format!("has({a}.profile)"), Tri::False),
            (format!("{a}.type.matches('^g.u$')"), Tri::True),
            (
                "device.capacity['gpu.gpuplane.dev'].memory.isGreaterThan(quantity('79Gi'))".into(),
                Tri::True,
            ),
            // A missing attribute or domain fails evaluation: unknown, so it may match.
            (format!("{a}.profile == '1g.10gb'"), Tri::Unknown),
            (
                "device.attributes['other.example.com'].x == 1".into(),
                Tri::Unknown,
            ),
            // Not a bool.
            ("device.driver".into(), Tri::Unknown),
        ] {
            assert_eq!(Selector::parse(&expr).eval(&gpu.cel()), want, "{expr}");
        }
        let s =
            Selector::parse("device.attributes['x'].y == 1 && device.driver == 'nic.example.com'");
        assert_eq!(s.required_driver(), Some("nic.example.com"));
        assert_eq!(
            Selector::parse("device.driver != 'x'").required_driver(),
            None
        );
    }

    #[test]
    fn what_is_not_understood_matches() {
        let gpu = dev("gpu", None, 80 << 30);
        for expr in [
            "device.attributes['gpu.gpuplane.dev'].driverVersion.isGreaterThan(semver('1.0.0'))",
            "has(device.attributes['x'].y)",
            "device.attributes['gpu.gpuplane.dev'].profile == 'x'",
            "no_such_function(device)",
            "'unterminated",
            "",
            &"(".repeat(100),
            &format!("{}true{}", "(".repeat(40), ")".repeat(40)),
            &"!".repeat(1000),
        ] {
            assert!(Selector::parse(expr).may_match(&gpu.cel()), "{expr}");
        }
        // Unknown absorbed by a certain false.
        let s = Selector::parse("device.driver == 'other' && has(x)");
        assert!(!s.understood());
        let s = Selector::parse("device.driver == 'other' && device.attributes['other'].x == 1");
        assert!(!s.may_match(&gpu.cel()));
    }
}
