//! No blocking call on the runtime's workers, also through a sync helper: the guard walks the
//! product's async code (async fns and blocks, and the closures they run in place) for file
//! I/O and std locks, and for calls of the product's own sync functions that do such work,
//! however deep (`StateLock::acquire` takes a flock and sleeps between tries).

use crate::security::product_sources;
use std::collections::{BTreeMap, BTreeSet};

/// Blocking calls on a runtime worker stall every RPC the agent serves (Allocate once waited
/// on the node CDI spec's fsync). In async code (async fns and blocks, and the closures they
/// run in place) the product neither calls `std::fs` nor takes a `std::sync::Mutex`; file I/O
/// and locks a blocking task may hold go through `spawn_blocking` or a thread, whose closures
/// are not async code. An awaited call (`tokio::fs`, a tokio lock) is fine. The node state's
/// `RwLock` is allowed: its writers never do I/O under it (the guard above keeps the device
/// source from under it). Unit tests are not the product.
/// Every product source, parsed, with its module's name (a `mod.rs` is its directory's).
fn product_files() -> Vec<(String, String, syn::File)> {
    product_sources()
        .into_iter()
        .filter(|(path, _)| !path.to_string_lossy().ends_with("tests.rs"))
        .map(|(path, text)| {
            let rel = path.to_string_lossy().to_string();
            let stem = path.file_stem().map(|s| s.to_string_lossy().to_string());
            let module = match stem.as_deref() {
                Some("mod") | Some("lib") | Some("main") => path
                    .parent()
                    .and_then(|p| p.file_name())
                    .map(|d| d.to_string_lossy().to_string()),
                other => other.map(str::to_string),
            }
            .unwrap_or_default();
            let file = syn::parse_file(&text).unwrap_or_else(|e| panic!("{rel}: {e}"));
            (rel, module, file)
        })
        .collect()
}

#[test]
fn async_code_does_no_blocking_file_io_or_locking() {
    let files = product_files();
    let helpers = blocking::helpers(&files);
    assert!(
        helpers.contains_key("StateLock::acquire"),
        "the helpers were not followed: {helpers:#?}"
    );
    let mut found = Vec::new();
    for (rel, module, file) in &files {
        let mut scan = blocking::Scan::new(module, &helpers);
        syn::visit::Visit::visit_file(&mut scan, file);
        found.extend(scan.found.into_iter().map(|f| format!("{rel}: {f}")));
    }
    assert!(
        found.is_empty(),
        "blocking calls in async code; move them to spawn_blocking or the task that owns \
         the file: {found:#?}"
    );
}

mod blocking {
    use super::{BTreeMap, BTreeSet};
    use syn::visit::{self, Visit};

    /// The product's sync functions that block, directly (file I/O, a std lock) or through
    /// another such function, by `Owner::name` (`StateLock::acquire`, `fsutil::write_atomic`),
    /// with the first blocking call found. Matched by name: a call is taken for the function of
    /// that name in the type or module it names.
    pub fn helpers(files: &[(String, String, syn::File)]) -> BTreeMap<String, String> {
        let mut fns: Vec<(String, Vec<String>, BTreeSet<String>)> = Vec::new();
        let none = BTreeMap::new();
        for (_, module, file) in files {
            let mut collect = SyncFns {
                module: module.clone(),
                owner: None,
                out: Vec::new(),
            };
            collect.visit_file(file);
            for (key, body) in collect.out {
                let mut scan = Scan::new(module, &none);
                scan.within.push(format!("fn {key}"));
                scan.visit_block(body);
                fns.push((key, scan.found, scan.calls));
            }
        }
        // Followed: file I/O. A helper that only takes a std lock is not (its critical sections
        // hold no I/O and no await, the short lock tokio's docs allow); nor a crash point, which
        // writes its marker only in a test build, armed, as the process stops for good.
        let mut blocking: BTreeMap<String, String> = fns
            .iter()
            .filter(|(key, _, _)| !key.starts_with("crashpoint::"))
            .filter_map(|(key, found, _)| {
                let why = found
                    .iter()
                    .filter_map(|f| f.split_once(": "))
                    .map(|(_, why)| why)
                    .find(|why| *why != ".lock()")?;
                Some((key.clone(), why.to_string()))
            })
            .collect();
        loop {
            let more: Vec<(String, String)> = fns
                .iter()
                .filter(|(key, _, _)| !blocking.contains_key(key))
                .filter_map(|(key, _, calls)| {
                    let via = calls.iter().find(|c| blocking.contains_key(*c))?;
                    Some((key.clone(), format!("{via}(..)")))
                })
                .collect();
            if more.is_empty() {
                return blocking;
            }
            blocking.extend(more);
        }
    }

    /// The sync functions of a file (free and in impls, not in test modules), by `Owner::name`.
    struct SyncFns<'ast> {
        module: String,
        owner: Option<String>,
        out: Vec<(String, &'ast syn::Block)>,
    }

    impl<'ast> Visit<'ast> for SyncFns<'ast> {
        fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
            if f.sig.asyncness.is_none() {
                let key = format!("{}::{}", self.module, f.sig.ident);
                self.out.push((key, &f.block));
            }
        }

        fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
            if let syn::Type::Path(t) = &*i.self_ty {
                self.owner = t.path.segments.last().map(|s| s.ident.to_string());
                visit::visit_item_impl(self, i);
                self.owner = None;
            }
        }

        fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
            if let (None, Some(owner)) = (&f.sig.asyncness, &self.owner) {
                self.out
                    .push((format!("{owner}::{}", f.sig.ident), &f.block));
            }
        }

        fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
            if !m.ident.to_string().contains("test") {
                visit::visit_item_mod(self, m);
            }
        }
    }

    /// Path calls that block: the file system (`std::fs::write`, `File::open`, ...), a flock,
    /// a thread's sleep.
    fn blocks(path: &syn::Path) -> bool {
        let segs: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        let first = segs.first().map(String::as_str);
        let tail: Vec<&str> = segs
            .iter()
            .rev()
            .take(2)
            .rev()
            .map(String::as_str)
            .collect();
        first != Some("tokio")
            && (matches!(
                tail.as_slice(),
                ["thread", "sleep"] | [_, "flock"] | ["flock"]
            ) || segs.len() >= 2
                && (segs[segs.len() - 2] == "fs"
                    || ["File", "OpenOptions"].contains(&segs[segs.len() - 2].as_str())))
    }

    /// Methods that block when not awaited: a std mutex, fsyncs, directory reads.
    const BLOCKING_METHODS: &[&str] = &["lock", "sync_all", "sync_data", "read_dir"];

    pub struct Scan<'h> {
        /// The module (file) being walked, which names its own free functions bare.
        module: String,
        /// The product's sync functions that block, by `Owner::name`, with why.
        helpers: &'h BTreeMap<String, String>,
        /// The async fn (or `async` block) being walked, innermost first; empty outside.
        within: Vec<String>,
        /// The next expression is awaited.
        awaited: bool,
        /// Sync functions this walk saw called by path (`Owner::name`), wherever.
        pub calls: BTreeSet<String>,
        pub found: Vec<String>,
    }

    impl<'h> Scan<'h> {
        pub fn new(module: &str, helpers: &'h BTreeMap<String, String>) -> Scan<'h> {
            Scan {
                module: module.to_string(),
                helpers,
                within: Vec::new(),
                awaited: false,
                calls: BTreeSet::new(),
                found: Vec::new(),
            }
        }

        /// `Owner::name` of a path call: its type or module and its name (a bare name is this
        /// module's own function).
        fn key(&self, path: &syn::Path) -> String {
            let segs: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
            match segs.as_slice() {
                [name] => format!("{}::{name}", self.module),
                [.., owner, name] => format!("{owner}::{name}"),
                [] => String::new(),
            }
        }

        fn in_async(&self) -> bool {
            self.within.last().is_some_and(|w| !w.is_empty())
        }

        fn report(&mut self, what: String) {
            if self.in_async() && !self.awaited {
                let at = self.within.last().cloned().unwrap_or_default();
                self.found.push(format!("{at}: {what}"));
            }
        }

        fn with(&mut self, context: String, f: impl FnOnce(&mut Self)) {
            self.within.push(context);
            f(self);
            self.within.pop();
        }

        /// A closure handed to a blocking pool or a thread runs off the runtime.
        fn runs_off_the_runtime(callee: &str, arg: &syn::Expr) -> bool {
            matches!(arg, syn::Expr::Closure(c) if c.asyncness.is_none())
                // `blocking`: the MPS daemon's own spawn_blocking with its error type.
                && ["spawn_blocking", "spawn", "block_in_place", "blocking"].contains(&callee)
        }

        fn visit_args<'a>(&mut self, callee: &str, args: impl Iterator<Item = &'a syn::Expr>) {
            for arg in args {
                if Self::runs_off_the_runtime(callee, arg) {
                    self.with(String::new(), |s| s.visit_expr(arg));
                } else {
                    self.visit_expr(arg);
                }
            }
        }
    }

    impl<'ast> Visit<'ast> for Scan<'_> {
        fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
            let ctx = f
                .sig
                .asyncness
                .as_ref()
                .map(|_| format!("async fn {}", f.sig.ident));
            self.with(ctx.unwrap_or_default(), |s| visit::visit_item_fn(s, f));
        }

        fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
            let ctx = f
                .sig
                .asyncness
                .as_ref()
                .map(|_| format!("async fn {}", f.sig.ident));
            self.with(ctx.unwrap_or_default(), |s| visit::visit_impl_item_fn(s, f));
        }

        fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
            let is_test = m.attrs.iter().any(|a| a.path().is_ident("cfg"))
                && m.ident.to_string().contains("test");
            if !is_test {
                visit::visit_item_mod(self, m);
            }
        }

        fn visit_expr_async(&mut self, b: &'ast syn::ExprAsync) {
            let ctx = match self.within.last() {
                Some(w) if !w.is_empty() => w.clone(),
                _ => "async block".to_string(),
            };
            self.with(ctx, |s| visit::visit_expr_async(s, b));
        }

        fn visit_expr_await(&mut self, e: &'ast syn::ExprAwait) {
            self.awaited = true;
            self.visit_expr(&e.base);
            self.awaited = false;
        }

        fn visit_expr_call(&mut self, c: &'ast syn::ExprCall) {
            let awaited = std::mem::take(&mut self.awaited);
            let mut callee = String::new();
            if let syn::Expr::Path(p) = &*c.func {
                callee = p
                    .path
                    .segments
                    .last()
                    .map(|s| s.ident.to_string())
                    .unwrap_or_default();
                if blocks(&p.path) {
                    self.awaited = awaited;
                    let name: Vec<String> = p
                        .path
                        .segments
                        .iter()
                        .map(|s| s.ident.to_string())
                        .collect();
                    self.report(format!("{}(..)", name.join("::")));
                    self.awaited = false;
                } else {
                    let key = self.key(&p.path);
                    if let Some(why) = self.helpers.get(&key) {
                        self.report(format!("{key}(..), which blocks: {why}"));
                    }
                    self.calls.insert(key);
                }
            }
            self.visit_expr(&c.func);
            self.visit_args(&callee, c.args.iter());
        }

        fn visit_expr_method_call(&mut self, m: &'ast syn::ExprMethodCall) {
            let awaited = std::mem::take(&mut self.awaited);
            let method = m.method.to_string();
            if BLOCKING_METHODS.contains(&method.as_str()) {
                self.awaited = awaited;
                self.report(format!(".{method}()"));
                self.awaited = false;
            }
            self.visit_expr(&m.receiver);
            self.visit_args(&method, m.args.iter());
        }

        fn visit_expr(&mut self, e: &'ast syn::Expr) {
            // `awaited` applies to the expression directly under `.await` only.
            match e {
                syn::Expr::Call(_) | syn::Expr::MethodCall(_) | syn::Expr::Await(_) => {}
                _ => self.awaited = false,
            }
            visit::visit_expr(self, e);
        }
    }
}

/// The guard above can fail: it finds what it looks for, and only in async code on the runtime.
#[test]
fn the_blocking_call_guard_finds_blocking_calls_in_async_code_only() {
    let scan = |code: &str| {
        let file = syn::parse_file(code).unwrap();
        let files = vec![("t.rs".to_string(), "t".to_string(), file)];
        let helpers = blocking::helpers(&files);
        let mut scan = blocking::Scan::new("t", &helpers);
        syn::visit::Visit::visit_file(&mut scan, &files[0].2);
        scan.found
    };
    let found = scan(
        "async fn f(m: &std::sync::Mutex<u8>) { std::fs::write(\"a\", \"b\").ok(); \
         let _g = m.lock(); async { fs::read_dir(\".\") }; let f = File::open(\"x\"); }",
    );
    assert_eq!(
        found,
        [
            "async fn f: std::fs::write(..)",
            "async fn f: .lock()",
            "async fn f: fs::read_dir(..)",
            "async fn f: File::open(..)",
        ]
    );
    let fine = "fn sync_io() { std::fs::write(\"a\", \"b\").ok(); } \
         async fn g(m: &tokio::sync::Mutex<u8>) { tokio::fs::write(\"a\", \"b\").await.ok(); \
         let _g = m.lock().await; tokio::task::spawn_blocking(move || std::fs::read(\"a\")); \
         std::thread::spawn(|| { let _ = std::fs::read(\"a\"); }); fn nested() { std::fs::read(\"a\").ok(); } }";
    assert_eq!(scan(fine), Vec::<String>::new());
    // Through the product's own sync helpers, however deep; not where they run off the runtime.
    let helpers = "struct StateLock; impl StateLock { fn acquire() { flock(3); \
         std::thread::sleep(PAUSE); } } fn take() { StateLock::acquire(); } \
         fn keep() { std::fs::write(\"a\", \"b\").ok(); } \
         async fn run() { take(); keep(); tokio::task::spawn_blocking(|| take()); }";
    assert_eq!(
        scan(helpers),
        [
            "async fn run: t::take(..), which blocks: StateLock::acquire(..)",
            "async fn run: t::keep(..), which blocks: std::fs::write(..)",
        ]
    );
}
