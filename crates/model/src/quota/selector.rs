//! A conservative reading of DRA CEL selectors (pure).
//!
//! The webhook has no CEL engine. To charge a claim for the *worst case* among the devices its
//! DeviceClass and selectors may match, it only needs a superset of those devices. This module
//! parses the subset of CEL that device selectors are written in, `device.driver`,
//! `device.attributes['domain'].name`, `device.capacity['domain'].name`, string/int/bool
//! literals, `==`, `!=`, `<`, `<=`, `>`, `>=`, `&&`, `||`, `!`, parentheses, `startsWith`,
//! `endsWith`, `contains`, `quantity('10Gi')` with `compareTo`/`isGreaterThan`/`isLessThan`,
//! and evaluates it in three-valued logic: anything it cannot decide (an unknown function, a
//! missing attribute, a version comparison) is [`Tri::Unknown`], and unknown counts as a match.
//! `false && unknown` is false and `true || unknown` is true, as CEL's own error absorption is.
//! A selector that does not parse at all matches every device. So the set of devices
//! [`Selector::may_match`] accepts always contains the set Kubernetes would allocate from.

use crate::quantity::Quantity;

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

/// What a selector sees of a device: its driver and attributes and capacities by
/// (domain, name). Unqualified attribute names live under the driver's name as domain.
pub trait DeviceView {
    fn driver(&self) -> &str;
    fn attribute(&self, domain: &str, name: &str) -> Option<&AttrValue>;
    fn capacity(&self, domain: &str, name: &str) -> Option<&AttrValue>;
}

/// Three-valued truth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tri {
    True,
    False,
    Unknown,
}

impl Tri {
    fn and(self, o: Tri) -> Tri {
        match (self, o) {
            (Tri::False, _) | (_, Tri::False) => Tri::False,
            (Tri::True, Tri::True) => Tri::True,
            _ => Tri::Unknown,
        }
    }
    fn or(self, o: Tri) -> Tri {
        match (self, o) {
            (Tri::True, _) | (_, Tri::True) => Tri::True,
            (Tri::False, Tri::False) => Tri::False,
            _ => Tri::Unknown,
        }
    }
    fn not(self) -> Tri {
        match self {
            Tri::True => Tri::False,
            Tri::False => Tri::True,
            Tri::Unknown => Tri::Unknown,
        }
    }
}

/// Longest expression parsed; longer ones match everything.
const MAX_LEN: usize = 10 * 1024;
/// Most tokens parsed (bounds the depth of `&&`/`||` chains); longer ones match everything.
const MAX_TOKENS: usize = 1000;
/// Deepest nesting parsed; deeper ones match everything.
const MAX_DEPTH: usize = 32;

/// One parsed CEL selector expression.
#[derive(Debug, Clone)]
pub struct Selector {
    root: Option<Node>,
}

impl Selector {
    /// Parses `expr`; what cannot be parsed becomes a selector that may match anything.
    pub fn parse(expr: &str) -> Selector {
        if expr.len() > MAX_LEN {
            return Selector { root: None };
        }
        let root = tokenize(expr)
            .filter(|t| t.len() <= MAX_TOKENS)
            .and_then(|toks| {
                let mut p = Parser {
                    toks,
                    pos: 0,
                    depth: 0,
                };
                let n = p.or()?;
                (p.pos == p.toks.len()).then_some(n)
            });
        Selector { root }
    }

    /// Whether the expression was understood (for diagnostics).
    pub fn understood(&self) -> bool {
        self.root.is_some()
    }

    pub fn eval(&self, d: &dyn DeviceView) -> Tri {
        match &self.root {
            None => Tri::Unknown,
            Some(n) => truth(&eval(n, d)),
        }
    }

    /// True unless the expression is certainly false for `d`.
    pub fn may_match(&self, d: &dyn DeviceView) -> bool {
        self.eval(d) != Tri::False
    }

    /// The drivers this selector certainly requires (`device.driver == 'x'` as a conjunct at
    /// the top level), if any.
    pub fn required_driver(&self) -> Option<&str> {
        fn find(n: &Node) -> Option<&str> {
            match n {
                Node::And(a, b) => find(a).or_else(|| find(b)),
                Node::Cmp(CmpOp::Eq, l, r) => match (&**l, &**r) {
                    (Node::Driver, Node::Lit(Val::Str(s)))
                    | (Node::Lit(Val::Str(s)), Node::Driver) => Some(s),
                    _ => None,
                },
                _ => None,
            }
        }
        self.root.as_ref().and_then(find)
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    Int(i64),
    Dot,
    LBrack,
    RBrack,
    LParen,
    RParen,
    Comma,
    And,
    Or,
    Not,
    Cmp(CmpOp),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

fn tokenize(s: &str) -> Option<Vec<Tok>> {
    let b: Vec<char> = s.chars().collect();
    let mut i = 0;
    let mut out = Vec::new();
    while i < b.len() {
        let c = b[i];
        if matches!(c, ' ' | '\t' | '\n' | '\r') {
            i += 1;
            continue;
        }
        let (tok, len) = match operator(c, b.get(i + 1).copied()) {
            Some(op) => op,
            None => literal(&b[i..])?,
        };
        out.push(tok);
        i += len;
    }
    Some(out)
}

/// The punctuation or operator token that `c` (then `next`) starts, with its length in chars.
fn operator(c: char, next: Option<char>) -> Option<(Tok, usize)> {
    let tok = match c {
        '.' => (Tok::Dot, 1),
        '[' => (Tok::LBrack, 1),
        ']' => (Tok::RBrack, 1),
        '(' => (Tok::LParen, 1),
        ')' => (Tok::RParen, 1),
        ',' => (Tok::Comma, 1),
        '&' if next == Some('&') => (Tok::And, 2),
        '|' if next == Some('|') => (Tok::Or, 2),
        '=' if next == Some('=') => (Tok::Cmp(CmpOp::Eq), 2),
        '!' if next == Some('=') => (Tok::Cmp(CmpOp::Ne), 2),
        '!' => (Tok::Not, 1),
        '<' | '>' => {
            let eq = next == Some('=');
            let op = match (c, eq) {
                ('<', true) => CmpOp::Le,
                ('<', false) => CmpOp::Lt,
                (_, true) => CmpOp::Ge,
                _ => CmpOp::Gt,
            };
            (Tok::Cmp(op), if eq { 2 } else { 1 })
        }
        _ => return None,
    };
    Some(tok)
}

/// The string, integer or identifier at the start of `b`, with its length in chars; `None`
/// for anything else, an unterminated or escaped string, or an integer that does not fit.
fn literal(b: &[char]) -> Option<(Tok, usize)> {
    let c = *b.first()?;
    // How many chars from the start satisfy `f`.
    let run = |f: fn(&char) -> bool| b.iter().position(|x| !f(x)).unwrap_or(b.len());
    match c {
        '\'' | '"' => {
            let mut j = 1;
            let mut v = String::new();
            loop {
                let ch = *b.get(j)?;
                if ch == c {
                    break;
                }
                if ch == '\\' {
                    // Escapes are rare in selectors; refuse rather than guess.
                    return None;
                }
                v.push(ch);
                j += 1;
            }
            Some((Tok::Str(v), j + 1))
        }
        d if d.is_ascii_digit() => {
            let j = run(char::is_ascii_digit);
            let text: String = b[..j].iter().collect();
            Some((Tok::Int(text.parse().ok()?), j))
        }
        a if a.is_ascii_alphabetic() || a == '_' => {
            let j = run(|x| x.is_ascii_alphanumeric() || *x == '_');
            Some((Tok::Ident(b[..j].iter().collect()), j))
        }
        _ => None,
    }
}

#[derive(Debug, Clone)]
enum Node {
    Lit(Val),
    Driver,
    Attr(String, String),
    Cap(String, String),
    Quantity(Box<Node>),
    Call(Box<Node>, String, Vec<Node>),
    Cmp(CmpOp, Box<Node>, Box<Node>),
    And(Box<Node>, Box<Node>),
    Or(Box<Node>, Box<Node>),
    Not(Box<Node>),
}

struct Parser {
    toks: Vec<Tok>,
    pos: usize,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }
    fn bump(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.pos).cloned();
        self.pos += 1;
        t
    }
    fn eat(&mut self, t: &Tok) -> Option<()> {
        (self.bump()? == *t).then_some(())
    }
    fn enter(&mut self) -> Option<()> {
        self.depth += 1;
        (self.depth <= MAX_DEPTH).then_some(())
    }

    fn or(&mut self) -> Option<Node> {
        self.enter()?;
        let mut n = self.and()?;
        while self.peek() == Some(&Tok::Or) {
            self.pos += 1;
            n = Node::Or(Box::new(n), Box::new(self.and()?));
        }
        self.depth -= 1;
        Some(n)
    }
    fn and(&mut self) -> Option<Node> {
        let mut n = self.unary()?;
        while self.peek() == Some(&Tok::And) {
            self.pos += 1;
            n = Node::And(Box::new(n), Box::new(self.unary()?));
        }
        Some(n)
    }
    fn unary(&mut self) -> Option<Node> {
        if self.peek() == Some(&Tok::Not) {
            self.pos += 1;
            self.enter()?;
            let n = self.unary()?;
            self.depth -= 1;
            return Some(Node::Not(Box::new(n)));
        }
        let l = self.postfix()?;
        if let Some(Tok::Cmp(op)) = self.peek().cloned() {
            self.pos += 1;
            let r = self.postfix()?;
            return Some(Node::Cmp(op, Box::new(l), Box::new(r)));
        }
        Some(l)
    }
    fn postfix(&mut self) -> Option<Node> {
        let mut n = self.primary()?;
        while self.peek() == Some(&Tok::Dot) {
            self.pos += 1;
            let Some(Tok::Ident(name)) = self.bump() else {
                return None;
            };
            if self.peek() != Some(&Tok::LParen) {
                return None;
            }
            let args = self.args()?;
            n = Node::Call(Box::new(n), name, args);
        }
        Some(n)
    }
    fn args(&mut self) -> Option<Vec<Node>> {
        self.eat(&Tok::LParen)?;
        let mut args = Vec::new();
        if self.peek() == Some(&Tok::RParen) {
            self.pos += 1;
            return Some(args);
        }
        loop {
            args.push(self.or()?);
            match self.bump()? {
                Tok::Comma => continue,
                Tok::RParen => return Some(args),
                _ => return None,
            }
        }
    }
    /// `device.attributes['d'].name` or `device.attributes['d']['name']`.
    fn member_name(&mut self) -> Option<String> {
        match self.bump()? {
            Tok::Dot => match self.bump()? {
                Tok::Ident(n) => Some(n),
                _ => None,
            },
            Tok::LBrack => {
                let Tok::Str(n) = self.bump()? else {
                    return None;
                };
                self.eat(&Tok::RBrack)?;
                Some(n)
            }
            _ => None,
        }
    }
    fn primary(&mut self) -> Option<Node> {
        match self.bump()? {
            Tok::Str(s) => Some(Node::Lit(Val::Str(s))),
            Tok::Int(i) => Some(Node::Lit(Val::Int(i128::from(i)))),
            Tok::LParen => {
                let n = self.or()?;
                self.eat(&Tok::RParen)?;
                Some(n)
            }
            Tok::Ident(id) => match id.as_str() {
                "true" => Some(Node::Lit(Val::Bool(true))),
                "false" => Some(Node::Lit(Val::Bool(false))),
                "quantity" => {
                    let mut args = self.args()?;
                    (args.len() == 1).then_some(())?;
                    Some(Node::Quantity(Box::new(args.pop()?)))
                }
                "device" => {
                    self.eat(&Tok::Dot)?;
                    let Tok::Ident(field) = self.bump()? else {
                        return None;
                    };
                    match field.as_str() {
                        "driver" => Some(Node::Driver),
                        "attributes" | "capacity" => {
                            self.eat(&Tok::LBrack)?;
                            let Tok::Str(domain) = self.bump()? else {
                                return None;
                            };
                            self.eat(&Tok::RBrack)?;
                            let name = self.member_name()?;
                            Some(if field == "attributes" {
                                Node::Attr(domain, name)
                            } else {
                                Node::Cap(domain, name)
                            })
                        }
                        _ => None,
                    }
                }
                _ => None,
            },
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Val {
    Bool(bool),
    Int(i128),
    Str(String),
    Quantity(Quantity),
    Unknown,
}

fn truth(v: &Val) -> Tri {
    match v {
        Val::Bool(true) => Tri::True,
        Val::Bool(false) => Tri::False,
        _ => Tri::Unknown,
    }
}

fn from_tri(t: Tri) -> Val {
    match t {
        Tri::True => Val::Bool(true),
        Tri::False => Val::Bool(false),
        Tri::Unknown => Val::Unknown,
    }
}

fn attr_val(v: Option<&AttrValue>) -> Val {
    match v {
        Some(AttrValue::Str(s)) => Val::Str(s.clone()),
        Some(AttrValue::Int(i)) => Val::Int(i128::from(*i)),
        Some(AttrValue::Bool(b)) => Val::Bool(*b),
        Some(AttrValue::Quantity(q)) => Val::Quantity(*q),
        Some(AttrValue::Version(_)) | None => Val::Unknown,
    }
}

fn eval(n: &Node, d: &dyn DeviceView) -> Val {
    match n {
        Node::Lit(v) => v.clone(),
        Node::Driver => Val::Str(d.driver().to_string()),
        Node::Attr(dom, name) => attr_val(d.attribute(dom, name)),
        Node::Cap(dom, name) => attr_val(d.capacity(dom, name)),
        Node::Quantity(arg) => match eval(arg, d) {
            // CEL's quantity() is ParseQuantity: the same grammar, no whitespace.
            Val::Str(s) => Quantity::parse(&s)
                .map(Val::Quantity)
                .unwrap_or(Val::Unknown),
            _ => Val::Unknown,
        },
        Node::And(a, b) => from_tri(truth(&eval(a, d)).and(truth(&eval(b, d)))),
        Node::Or(a, b) => from_tri(truth(&eval(a, d)).or(truth(&eval(b, d)))),
        Node::Not(a) => from_tri(truth(&eval(a, d)).not()),
        Node::Cmp(op, l, r) => compare(*op, &eval(l, d), &eval(r, d)),
        Node::Call(target, name, args) => {
            let t = eval(target, d);
            let args: Vec<Val> = args.iter().map(|a| eval(a, d)).collect();
            match (name.as_str(), &t, args.as_slice()) {
                ("startsWith", Val::Str(s), [Val::Str(p)]) => Val::Bool(s.starts_with(p.as_str())),
                ("endsWith", Val::Str(s), [Val::Str(p)]) => Val::Bool(s.ends_with(p.as_str())),
                ("contains", Val::Str(s), [Val::Str(p)]) => Val::Bool(s.contains(p.as_str())),
                ("compareTo", Val::Quantity(a), [Val::Quantity(b)]) => Val::Int(match a.cmp(b) {
                    std::cmp::Ordering::Less => -1,
                    std::cmp::Ordering::Equal => 0,
                    std::cmp::Ordering::Greater => 1,
                }),
                ("isGreaterThan", Val::Quantity(a), [Val::Quantity(b)]) => Val::Bool(a > b),
                ("isLessThan", Val::Quantity(a), [Val::Quantity(b)]) => Val::Bool(a < b),
                _ => Val::Unknown,
            }
        }
    }
}

fn compare(op: CmpOp, l: &Val, r: &Val) -> Val {
    use std::cmp::Ordering;
    let ord: Option<Ordering> = match (l, r) {
        (Val::Str(a), Val::Str(b)) => Some(a.cmp(b)),
        (Val::Int(a), Val::Int(b)) => Some(a.cmp(b)),
        (Val::Bool(a), Val::Bool(b)) if matches!(op, CmpOp::Eq | CmpOp::Ne) => Some(a.cmp(b)),
        _ => None,
    };
    match ord {
        None => Val::Unknown,
        Some(o) => Val::Bool(match op {
            CmpOp::Eq => o == Ordering::Equal,
            CmpOp::Ne => o != Ordering::Equal,
            CmpOp::Lt => o == Ordering::Less,
            CmpOp::Le => o != Ordering::Greater,
            CmpOp::Gt => o == Ordering::Greater,
            CmpOp::Ge => o != Ordering::Less,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    const D: &str = "gpu.gpuplane.dev";

    /// A device for the tests: driver plus maps keyed by (domain, name).
    #[derive(Debug, Clone, Default)]
    struct SimpleDevice {
        driver: String,
        attributes: BTreeMap<(String, String), AttrValue>,
        capacity: BTreeMap<(String, String), AttrValue>,
    }

    impl DeviceView for SimpleDevice {
        fn driver(&self) -> &str {
            &self.driver
        }
        fn attribute(&self, domain: &str, name: &str) -> Option<&AttrValue> {
            self.attributes.get(&(domain.to_string(), name.to_string()))
        }
        fn capacity(&self, domain: &str, name: &str) -> Option<&AttrValue> {
            self.capacity.get(&(domain.to_string(), name.to_string()))
        }
    }

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
            assert_eq!(s.may_match(&gpu), on_gpu, "{expr}");
            assert_eq!(s.may_match(&mig), on_mig, "{expr}");
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
        assert_eq!(s.eval(&big), Tri::True);
        assert_eq!(s.eval(&small), Tri::False);
        let s = Selector::parse("device.driver == \"nic.example.com\"");
        assert_eq!(s.eval(&big), Tri::False);
        let s = Selector::parse("device.attributes['gpu.gpuplane.dev']['type'] != 'gpu' || device.capacity['gpu.gpuplane.dev'].memory.isLessThan(quantity('50Gi'))");
        assert_eq!((s.eval(&big), s.eval(&small)), (Tri::False, Tri::True));
    }

    #[test]
    fn what_is_not_understood_matches() {
        let gpu = dev("gpu", None, 80 << 30);
        for expr in [
            "device.attributes['gpu.gpuplane.dev'].driverVersion.isGreaterThan(semver('1.0.0'))",
            "has(device.attributes['x'].y)",
            "device.attributes['gpu.gpuplane.dev'].type in ['gpu']",
            "device.attributes['gpu.gpuplane.dev'].profile == 'x'",
            "'unterminated",
            "",
            &"(".repeat(100),
            &format!("{}true{}", "(".repeat(40), ")".repeat(40)),
            &"!".repeat(1000),
        ] {
            assert!(Selector::parse(expr).may_match(&gpu), "{expr}");
        }
        // Unknown absorbed by a certain false.
        let s = Selector::parse("device.driver == 'other' && has(x)");
        assert!(!s.understood());
        let s = Selector::parse("device.driver == 'other' && device.attributes['other'].x == 1");
        assert!(!s.may_match(&gpu));
    }
}
