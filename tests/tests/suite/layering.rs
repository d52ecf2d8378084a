//! Layers that cannot loop (issue 30): which crate may depend on which, and that no two
//! modules import each other, directly or around a circle.
//!
//! - Crates: each flotilla crate's dependencies on the others are read from its
//!   `Cargo.toml` and checked against [`CRATE_LAYERS`]: a crate depends only on crates of
//!   lower layers (the compiler then keeps every module of a lower crate below the higher).
//! - Modules: within the coordinator and the worker, every `crate::…` and `super::…` path
//!   (in `use` lines and in code; test modules and comments left out), and every `child::…`
//!   of a module the file declares, is an edge from the file that writes it to the file of
//!   the longest module it names (a path through the crate root's re-exports, `crate::Report`,
//!   names the module the root re-exports the item from). A file in a strongly connected set of two or more
//!   is in an import circle, and fails the test: a module split over files shares its items
//!   through a leaf file that names none of its siblings, never through `use super::*` of a
//!   parent that names its children back.
//!
//! To see what ties a circle: `cargo test -p flotilla-tests --test suite layering -- --nocapture`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each crate's layer: a crate may depend only on crates of a lower layer.
const CRATE_LAYERS: &[(&str, &str, u32)] = &[
    ("flotilla-proto", "proto", 0),
    ("flotilla-script", "coordinator/script", 1),
    ("flotilla-lease", "coordinator/lease", 1),
    ("flotilla-local", "coordinator/local", 2),
    ("flotilla-store", "coordinator/store", 2),
    ("flotilla-coordinator", "coordinator", 3),
    ("flotilla-worker", "worker", 3),
    ("flotilla", "cli", 4),
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate sits in the workspace")
        .to_owned()
}

/// The `flotilla*` crates named in the `[dependencies]` table of `manifest` (not dev ones: a
/// test may reach anywhere).
fn flotilla_deps(manifest: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(manifest).unwrap();
    let mut table = String::new();
    let mut deps = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('[') {
            table = line.to_owned();
            continue;
        }
        if table != "[dependencies]" {
            continue;
        }
        if let Some((name, _)) = line.split_once('=') {
            let name = name.trim().trim_end_matches(".workspace").trim();
            if name.starts_with("flotilla") {
                deps.push(name.to_owned());
            }
        }
    }
    deps
}

#[test]
fn layering_every_crate_depends_only_on_lower_layers() {
    let layer = |name: &str| CRATE_LAYERS.iter().find(|(n, ..)| *n == name).map(|c| c.2);
    let mut wrong = Vec::new();
    for (name, dir, own) in CRATE_LAYERS {
        let deps = flotilla_deps(&root().join(dir).join("Cargo.toml"));
        for d in deps {
            match layer(&d) {
                Some(l) if l < *own => {}
                Some(l) => wrong.push(format!("{name} (layer {own}) depends on {d} (layer {l})")),
                None => wrong.push(format!("{name} depends on {d}, which has no layer here")),
            }
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
    // The script runtime stands on nothing of ours: it cannot see runs, storage or the fleet;
    // the lease store only on the wire's error kinds.
    assert_eq!(
        flotilla_deps(&root().join("coordinator/script/Cargo.toml")),
        Vec::<String>::new()
    );
    assert_eq!(
        flotilla_deps(&root().join("coordinator/lease/Cargo.toml")),
        ["flotilla-proto"]
    );
    // What a client shares with the coordinator knows the wire and scripts, not runs.
    let mut local = flotilla_deps(&root().join("coordinator/local/Cargo.toml"));
    local.sort();
    assert_eq!(local, ["flotilla-proto", "flotilla-script"]);
    // Storage and the journal stand on the wire and the lease store (a leader's fence) only.
    let mut store = flotilla_deps(&root().join("coordinator/store/Cargo.toml"));
    store.sort();
    assert_eq!(store, ["flotilla-lease", "flotilla-proto"]);
    // The fault-injecting store is only in test builds: behind `cfg(test)` or the `faults`
    // feature, which no crate turns on outside its dev-dependencies.
    let lib = std::fs::read_to_string(root().join("coordinator/store/src/lib.rs")).unwrap();
    assert!(
        lib.contains("#[cfg(any(test, feature = \"faults\"))]\npub mod faulty;"),
        "the fault store is reachable outside tests"
    );
    for (_, dir, _) in CRATE_LAYERS {
        let manifest = std::fs::read_to_string(root().join(dir).join("Cargo.toml")).unwrap();
        let normal = manifest
            .split("[dev-dependencies]")
            .next()
            .unwrap_or_default();
        assert!(
            !normal.contains("\"faults\"]"),
            "{dir} turns the fault store on outside its dev-dependencies"
        );
    }
}

/// A source file's module path: `run/calls.rs` → `run::calls`, `run/mod.rs` → `run`.
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" && stem != "main" {
        parts.push(stem.to_owned());
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a file without its test modules (`#[cfg(test)]` followed by `mod`) and
/// comments.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]")
            && lines
                .peek()
                .is_some_and(|n| n.trim_start().starts_with("mod ") && n.trim_end().ends_with('{'))
        {
            // Skip the module: count braces from its opening line.
            let mut depth = 0i64;
            for l in lines.by_ref() {
                depth += l.matches('{').count() as i64 - l.matches('}').count() as i64;
                if depth <= 0 && l.contains('}') {
                    break;
                }
            }
            continue;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Every path a file names from its own crate, expanded (`use crate::{a, b::c}` gives `a` and
/// `b::c`), as module paths from the crate root.
fn paths_named(code: &str, here: &[String]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    for start in ["crate::", "super::"] {
        let mut from = 0;
        while let Some(i) = code[from..].find(start) {
            let at = from + i;
            from = at + start.len();
            // A whole word: not `foo_crate::` or `mysuper::`.
            if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
                continue;
            }
            // Resolve the head: `crate` is the root, each `super` goes one up.
            let mut base: Vec<String> = if start == "crate::" {
                Vec::new()
            } else {
                here[..here.len().saturating_sub(1)].to_vec()
            };
            let mut rest = &code[from..];
            while let Some(r) = rest.strip_prefix("super::") {
                base.pop();
                rest = r;
                // The next `super::` of this chain is read here, not as a path of its own.
                from += "super::".len();
            }
            expand(rest, &base, &mut out);
        }
    }
    out
}

/// The paths of one `a::b`, `a::{b, c::d}` or `{a, b}` tail, each appended to `base`.
fn expand(tail: &str, base: &[String], out: &mut Vec<Vec<String>>) {
    let tail = tail.trim_start();
    if let Some(inner) = tail.strip_prefix('{') {
        let mut depth = 0;
        let mut item = String::new();
        for ch in inner.chars() {
            match ch {
                '{' => {
                    depth += 1;
                    item.push(ch);
                }
                '}' if depth == 0 => {
                    expand(&item, base, out);
                    return;
                }
                '}' => {
                    depth -= 1;
                    item.push(ch);
                }
                ',' if depth == 0 => {
                    expand(&item, base, out);
                    item.clear();
                }
                _ => item.push(ch),
            }
        }
        return;
    }
    let mut path = base.to_vec();
    let mut rest = tail;
    loop {
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if end == 0 {
            break;
        }
        path.push(rest[..end].to_owned());
        rest = &rest[end..];
        match rest.strip_prefix("::") {
            Some(r) if r.starts_with('{') => {
                expand(r, &path, out);
                return;
            }
            Some(r) => rest = r,
            None => break,
        }
    }
    out.push(path);
}

/// The modules a file declares (`mod x;`, `pub mod x;`, `pub(crate) mod x;`).
fn children_of(code: &str) -> Vec<String> {
    code.lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l
                .strip_prefix("pub(crate) mod ")
                .or_else(|| l.strip_prefix("pub(super) mod "))
                .or_else(|| l.strip_prefix("pub mod "))
                .or_else(|| l.strip_prefix("mod "))?;
            rest.strip_suffix(';').map(|n| n.trim().to_owned())
        })
        .collect()
}

/// Whether `code` has `word` where it starts a word.
fn mentions(code: &str, word: &str) -> bool {
    let bytes = code.as_bytes();
    code.match_indices(word).any(|(i, _)| {
        i == 0
            || !(bytes[i - 1].is_ascii_alphanumeric()
                || bytes[i - 1] == b'_'
                || bytes[i - 1] == b':')
    })
}

/// Strongly connected sets of two or more files (Tarjan's algorithm).
fn circles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    struct T<'a> {
        edges: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        t.index.insert(v, t.next);
        t.low.insert(v, t.next);
        t.next += 1;
        t.stack.push(v);
        t.on.insert(v);
        if let Some(ws) = t.edges.get(v) {
            for w in ws {
                let w = w.as_str();
                if !t.index.contains_key(w) {
                    visit(t, w);
                    let l = t.low[w].min(t.low[v]);
                    t.low.insert(v, l);
                } else if t.on.contains(w) {
                    let l = t.index[w].min(t.low[v]);
                    t.low.insert(v, l);
                }
            }
        }
        if t.low[v] == t.index[v] {
            let mut set = BTreeSet::new();
            while let Some(w) = t.stack.pop() {
                t.on.remove(w);
                set.insert(w.to_owned());
                if w == v {
                    break;
                }
            }
            if set.len() > 1 {
                t.out.push(set);
            }
        }
    }
    let mut t = T {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

/// The import graph of the crate in `dir` (its `src/`), file to file.
fn graph(dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let src = dir.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut by_module: BTreeMap<Vec<String>, String> = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        by_module.insert(module_of(rel), rel.to_string_lossy().into_owned());
    }
    // What the crate root re-exports (`pub use report::{Report, RunStatus}`): item → its path.
    let mut reexported: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let root = code_of(&std::fs::read_to_string(src.join("lib.rs")).unwrap_or_default());
    for line in root.lines() {
        if let Some(rest) = line.trim().strip_prefix("pub use ") {
            let mut paths = Vec::new();
            expand(rest.trim_end_matches(';'), &[], &mut paths);
            for p in paths {
                if let Some(last) = p.last() {
                    reexported.insert(last.clone(), p.clone());
                }
            }
        }
    }
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let here = module_of(rel);
        let name = rel.to_string_lossy().into_owned();
        let code = code_of(&std::fs::read_to_string(f).unwrap());
        let to = edges.entry(name.clone()).or_default();
        let mut named = paths_named(&code, &here);
        // A child module named by its bare name (`calls::f()` in `run/mod.rs`).
        for child in children_of(&code) {
            if mentions(&code, &format!("{child}::")) {
                let mut p = here.clone();
                p.push(child);
                named.push(p);
            }
        }
        for mut path in named {
            if let Some(via) = path.first().and_then(|head| reexported.get(head))
                && !by_module.contains_key(&path[..1])
            {
                path.splice(..1, via.iter().cloned());
            }
            // The file of the longest module the path names.
            // The crate root only gathers modules and re-exports their items: a path through
            // it is not a dependency on it.
            let target = (1..=path.len())
                .rev()
                .find_map(|n| by_module.get(&path[..n]))
                .filter(|t| **t != name);
            if let Some(t) = target {
                to.insert(t.clone());
            }
        }
    }
    edges
}

#[test]
fn layering_no_module_of_the_coordinator_or_the_worker_is_in_an_import_circle() {
    let mut report = Vec::new();
    for (krate, dir) in [
        ("flotilla-coordinator", "coordinator"),
        ("flotilla-worker", "worker"),
    ] {
        let edges = graph(&root().join(dir));
        assert!(edges.len() > 10, "{krate}: read too few files: {edges:?}");
        for c in circles(&edges) {
            let ties: Vec<String> = c
                .iter()
                .flat_map(|f| {
                    edges[f]
                        .iter()
                        .filter(|t| c.contains(*t))
                        .map(move |t| format!("{f} -> {t}"))
                })
                .collect();
            report.push(format!(
                "{krate}: a circle of {} files: {ties:?} (make the import point down: move what both need to a file that names neither)",
                c.len()
            ));
        }
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
}

#[test]
fn layering_the_reader_sees_every_kind_of_import() {
    let here: Vec<String> = vec!["run".into(), "calls".into()];
    let code = "use crate::{a, b::{c, d::E}};\nuse super::view::X;\nlet y = crate::z::f();\nuse super::super::top;\nlet no = my_crate::q;";
    let mut got = paths_named(code, &here);
    got.sort();
    let want: Vec<Vec<String>> = [
        vec!["a"],
        vec!["b", "c"],
        vec!["b", "d", "E"],
        vec!["run", "view", "X"],
        vec!["top"],
        vec!["z", "f"],
    ]
    .iter()
    .map(|p| p.iter().map(|s| (*s).to_owned()).collect())
    .collect();
    assert_eq!(got, want);
    // A loop of three and a lone file.
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, b) in [("x", "y"), ("y", "z"), ("z", "x"), ("z", "w")] {
        edges.entry(a.into()).or_default().insert(b.into());
    }
    edges.entry("w".into()).or_default();
    let c = circles(&edges);
    assert_eq!(c.len(), 1);
    assert_eq!(c[0].len(), 3);
    // Test modules are not read.
    let code = "use crate::a;\n#[cfg(test)]\nmod tests {\n    use crate::b;\n}\nuse crate::c;\n";
    let got = paths_named(&code_of(code), &[]);
    assert_eq!(got, vec![vec!["a".to_owned()], vec!["c".to_owned()]]);
}

/// The error types of every `Result<…>` `code` names whose error is a bare `String`, with the
/// text of the `Result<…>`.
fn string_errors(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    let bytes = code.as_bytes();
    for (at, _) in code.match_indices("Result<") {
        if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
            continue;
        }
        // Its arguments, split at the commas of depth one.
        let (mut depth, mut last) = (0usize, at + "Result<".len());
        let mut args = Vec::new();
        for (i, ch) in code[at + "Result".len()..].char_indices() {
            let i = at + "Result".len() + i;
            match ch {
                '<' | '(' | '[' => depth += 1,
                '>' | ')' | ']' => {
                    depth -= 1;
                    if depth == 0 {
                        args.push(code[last..i].trim().to_owned());
                        break;
                    }
                }
                ',' if depth == 1 => {
                    args.push(code[last..i].trim().to_owned());
                    last = i + 1;
                }
                _ => {}
            }
        }
        if args.len() == 2 && (args[1] == "String" || args[1] == "std::string::String") {
            found.push(format!("Result<{}, {}>", args[0], args[1]));
        }
    }
    found
}

#[test]
fn layering_no_crate_returns_a_bare_string_error() {
    let mut report = Vec::new();
    for f in workspace_sources() {
        let code = code_of(&std::fs::read_to_string(&f).unwrap());
        for r in string_errors(&code) {
            report.push(format!(
                "{}: {r}",
                f.strip_prefix(root()).unwrap().display()
            ));
        }
    }
    assert!(
        report.is_empty(),
        "errors without a kind (return flotilla_proto::Problem, or a type of the module's own):\n{}",
        report.join("\n")
    );
    // The reader sees one when it is there, nested or not, and not a String elsewhere.
    assert_eq!(
        string_errors(
            "fn f() -> Result<Vec<(u8, String)>, String> {}\nfn g() -> Result<BTreeMap<String, String>, E> {}"
        ),
        ["Result<Vec<(u8, String)>, String>"]
    );
}

/// ARCHITECTURE.md stays a short map, and every test its invariants name exists.
#[test]
fn layering_architecture_md_is_a_short_map_whose_invariants_name_real_tests() {
    let text = std::fs::read_to_string(root().join("ARCHITECTURE.md")).unwrap();
    let lines = text.lines().count();
    assert!(
        lines <= 200,
        "ARCHITECTURE.md is {lines} lines: move detail to docs/ or module docs"
    );
    let start = text.find("## Invariants").expect("an Invariants section");
    let end = text[start + 3..]
        .find("\n## ")
        .map_or(text.len(), |e| start + 3 + e);
    let section = &text[start..end];
    let mut sources = String::new();
    for dir in ["proto", "coordinator", "worker", "cli", "tests"] {
        let mut files = Vec::new();
        rust_files(&root().join(dir), &mut files);
        for f in files {
            if !f.components().any(|c| c.as_os_str() == "target") {
                sources.push_str(&std::fs::read_to_string(f).unwrap_or_default());
            }
        }
    }
    let mut named = 0;
    let mut missing = Vec::new();
    for quoted in section.split('`').skip(1).step_by(2) {
        let Some(name) = quoted.rsplit("::").next() else {
            continue;
        };
        // A test's path: `module::test_name` with words joined by `_`.
        if !quoted.contains("::")
            || !name.contains('_')
            || !name.starts_with(|c: char| c.is_ascii_lowercase())
        {
            continue;
        }
        named += 1;
        if !sources.contains(&format!("fn {name}(")) {
            missing.push(quoted.to_owned());
        }
    }
    assert!(named >= 10, "the invariants name {named} tests");
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names tests that do not exist: {missing:?}"
    );
}

/// The coordinator is told its policy once, when it is built ([`CoordinatorOptions`]): no
/// field of it is set later (a `OnceLock`) and it has no setter, so what a coordinator does
/// never depends on the order its owner called things in.
#[test]
fn layering_the_coordinator_is_built_from_one_options_value() {
    let code =
        code_of(&std::fs::read_to_string(root().join("coordinator/src/coordinator.rs")).unwrap());
    let start = code
        .find("pub struct Coordinator {")
        .expect("the Coordinator struct");
    let fields = &code[start..start + code[start..].find("\n}").unwrap()];
    assert!(
        !fields.contains("OnceLock"),
        "a field of Coordinator is set after it is built:\n{fields}"
    );
    let setters: Vec<&str> = code
        .lines()
        .filter(|l| l.trim_start().starts_with("pub fn set_"))
        .collect();
    assert!(
        setters.is_empty(),
        "setters on the coordinator: {setters:?}"
    );
    assert!(
        code.contains(
            "pub fn build(store: Store, leases: Arc<dyn LeaseStore>, opts: CoordinatorOptions)"
        ),
        "Coordinator::build takes the one options value"
    );
}

/// Every JSON shape a client and the coordinator both read is defined in `flotilla-proto`
/// (the wire contract), never in the coordinator (which re-exports them where its code
/// looks): a client command can read them without the coordinator crate.
#[test]
fn layering_every_client_api_shape_is_defined_in_proto() {
    let defined_in = |dir: &str| {
        let mut files = Vec::new();
        rust_files(&root().join(dir).join("src"), &mut files);
        files
            .iter()
            .map(|f| code_of(&std::fs::read_to_string(f).unwrap()))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let proto = defined_in("proto");
    let coordinator = defined_in("coordinator");
    let mut report = Vec::new();
    for shape in [
        "RunSettings",
        "SourceRef",
        "ReplayMode",
        "Filter",
        "RunSummary",
        "AgentTranscript",
        "ChangeRecord",
        "RunChanges",
        "AgentChange",
        "Report",
        "Summary",
        "SnapshotView",
        "UsageRecord",
        "Price",
    ] {
        let def = |code: &str| {
            code.contains(&format!("pub struct {shape} "))
                || code.contains(&format!("pub struct {shape}{{"))
                || code.contains(&format!("pub enum {shape} "))
        };
        if !def(&proto) {
            report.push(format!("{shape} is not defined in proto"));
        }
        if def(&coordinator) {
            report.push(format!("{shape} is defined in the coordinator"));
        }
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
}

/// Every Rust source file of the workspace's crates (their `src/`).
fn workspace_sources() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in [
        "proto",
        "coordinator/script",
        "coordinator/lease",
        "coordinator/local",
        "coordinator/store",
        "coordinator",
        "worker",
        "cli",
    ] {
        rust_files(&root().join(dir).join("src"), &mut files);
    }
    files
}

/// Names that meant two things (issue 30) mean one: each of these types is declared once in
/// the workspace, and each of these module files exists once in the coordinator and the
/// worker (a `source.rs` is a run's git source everywhere; a script's text is `text.rs`).
#[test]
fn layering_names_that_collided_mean_one_thing() {
    let files = workspace_sources();
    let mut report = Vec::new();
    for name in [
        "Admission",
        "Admitted",
        "Accounts",
        "Fleet",
        "SourceError",
        "ScriptError",
        "Limits",
        "ConnLimits",
    ] {
        let declared: Vec<String> = files
            .iter()
            .filter(|f| {
                let code = code_of(&std::fs::read_to_string(f).unwrap());
                [
                    format!("struct {name} "),
                    format!("struct {name}<"),
                    format!("enum {name} "),
                    format!("trait {name} "),
                ]
                .iter()
                .any(|d| code.contains(d))
            })
            .map(|f| f.strip_prefix(root()).unwrap().display().to_string())
            .collect();
        if declared.len() > 1 {
            report.push(format!("{name} is declared in {declared:?}"));
        }
    }
    for module in [
        "keys.rs",
        "limits.rs",
        "metrics.rs",
        "admission.rs",
        "counters.rs",
    ] {
        let found: Vec<String> = files
            .iter()
            .filter(|f| f.file_name().is_some_and(|n| n == module))
            .filter(|f| {
                let rel = f.strip_prefix(root()).unwrap();
                rel.starts_with("coordinator") || rel.starts_with("worker")
            })
            .map(|f| f.strip_prefix(root()).unwrap().display().to_string())
            .collect();
        if found.len() > 1 {
            report.push(format!("{module} is {found:?}"));
        }
    }
    assert!(report.is_empty(), "{}", report.join("\n"));
}

/// A call is owned once (issue 30, 2): where a live call is (`call::State`: queued, held,
/// waiting, running) is the dispatcher's alone; the run holds `call::Stage` and keeps what
/// its views show of a live call as data from the dispatcher's events.
#[test]
fn layering_only_the_dispatcher_holds_a_call_s_live_state() {
    let mut files = Vec::new();
    rust_files(&root().join("coordinator/src/run"), &mut files);
    let mut report = Vec::new();
    for f in &files {
        let code = code_of(&std::fs::read_to_string(f).unwrap());
        for (i, line) in code.lines().enumerate() {
            let names_state = line.contains("State::Queued")
                || line.contains("State::Held")
                || line.contains("State::Waiting")
                || line.contains("State::Running")
                || line.contains("call::State")
                || (line.contains("use crate::call::") && line.contains(" State"));
            if names_state {
                report.push(format!(
                    "{}:{}: {}",
                    f.strip_prefix(root()).unwrap().display(),
                    i + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(
        report.is_empty(),
        "the run names a live call state (use call::Stage and the view data from CallEvents):\n{}",
        report.join("\n")
    );
    // The dispatcher does hold it: the check reads what it means to.
    let sched =
        code_of(&std::fs::read_to_string(root().join("coordinator/src/sched/mod.rs")).unwrap());
    assert!(
        sched.contains("State::Queued"),
        "the dispatcher's calls start queued"
    );
}

/// `code` with every string, raw string and char literal blanked (their braces are not
/// code) and line comments dropped; lines kept where they were.
fn blank_literals(code: &str) -> String {
    let b = code.as_bytes();
    let mut out = String::with_capacity(code.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        if c == b'r' && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#')) {
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) == Some(&b'"') {
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                j += 1;
                while j < b.len() && !b[j..].starts_with(&close) {
                    if b[j] == b'\n' {
                        out.push('\n');
                    }
                    j += 1;
                }
                out.push_str("\"\"");
                i = j + close.len();
                continue;
            }
        }
        if c == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                if b[j] == b'\\' {
                    j += 1;
                }
                if j < b.len() && b[j] == b'\n' {
                    out.push('\n');
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j + 1;
            continue;
        }
        if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}'); a lifetime ('a) has no closing quote.
            let end = if b.get(i + 1) == Some(&b'\\') {
                b[i + 2..]
                    .iter()
                    .position(|&x| x == b'\'')
                    .map(|p| i + 2 + p)
            } else if b.get(i + 2) == Some(&b'\'') {
                Some(i + 2)
            } else {
                None
            };
            if let Some(e) = end {
                out.push_str("' '");
                i = e + 1;
                continue;
            }
        }
        out.push(c as char);
        i += 1;
    }
    out
}

/// Each function of `code` (literals blanked) with its length in lines.
fn function_lengths(code: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim_start();
        let t = t
            .strip_prefix("pub(crate) ")
            .or_else(|| t.strip_prefix("pub(super) "))
            .or_else(|| t.strip_prefix("pub "))
            .unwrap_or(t);
        let t = t.strip_prefix("async ").unwrap_or(t);
        let Some(rest) = t.strip_prefix("fn ") else {
            i += 1;
            continue;
        };
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let (mut depth, mut opened, mut j) = (0i64, false, i);
        while j < lines.len() {
            if !opened && depth == 0 && lines[j].trim_end().ends_with(';') {
                break;
            }
            for ch in lines[j].chars() {
                match ch {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if opened && depth <= 0 {
                break;
            }
            j += 1;
        }
        if opened {
            out.push((name, j - i + 1));
        }
        i += 1;
    }
    out
}

/// No production function is over about 120 lines (issue 30, 4): split a long one into named
/// steps (a parameter struct rather than tuples or an `allow`). `KNOWN_LONG` lists any that
/// must wait, with their length: each may shrink, none may grow. It is empty.
#[test]
fn layering_no_production_function_is_over_120_lines() {
    const LIMIT: usize = 120;
    const KNOWN_LONG: &[(&str, &str, usize)] = &[];
    let files = workspace_sources();
    let mut report = Vec::new();
    for f in files {
        let rel = f.strip_prefix(root()).unwrap().display().to_string();
        if rel.contains("/tests/") || rel.ends_with("/tests.rs") || rel.contains("/fuzz") {
            continue;
        }
        let code = blank_literals(&code_of(&std::fs::read_to_string(&f).unwrap()));
        for (name, len) in function_lengths(&code) {
            let known = KNOWN_LONG
                .iter()
                .find(|(file, n, _)| *file == rel && *n == name)
                .map(|k| k.2);
            match known {
                Some(was) if len > was => report.push(format!(
                    "{rel} {name}: {len} lines, was {was}: it may not grow"
                )),
                None if len > LIMIT => report.push(format!("{rel} {name}: {len} lines")),
                _ => {}
            }
        }
    }
    assert!(
        report.is_empty(),
        "functions over {LIMIT} lines (split them into named steps):\n{}",
        report.join("\n")
    );
    // The reader counts what it means to.
    let sample = "fn a() {\n    let s = \"}}\";\n    let c = '{';\n}\nfn b();\n";
    assert_eq!(
        function_lengths(&blank_literals(sample)),
        [("a".to_owned(), 4)]
    );
}

/// The field lines of `struct name { … }` in `code` (attributes and comments left out).
fn struct_fields(code: &str, name: &str) -> Option<Vec<String>> {
    let start = code
        .find(&format!("struct {name} {{"))
        .or_else(|| code.find(&format!("struct {name}<")))?;
    let body = &code[start..];
    let open = body.find('{')?;
    let mut depth = 0usize;
    let mut end = open;
    for (i, c) in body[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    end = open + i;
                    break;
                }
            }
            _ => {}
        }
    }
    Some(
        body[open + 1..end]
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with("#[") && !l.starts_with("//"))
            .map(str::to_owned)
            .collect(),
    )
}

/// Types that own state keep it (issue 30, 2): no field of these is visible outside the file
/// that declares it, so other files change them through methods that keep their invariants
/// (the fleet's name index and its workers, a link's takeover).
#[test]
fn layering_types_that_own_state_keep_their_fields_private() {
    let mut report = Vec::new();
    for (file, name) in [
        ("coordinator/src/sched/fleet.rs", "Fleet"),
        ("coordinator/src/sched/affinity.rs", "Affinity"),
        ("coordinator/src/sched/transfers.rs", "SourceServer"),
        ("coordinator/src/run/budgets.rs", "Budgets"),
        ("coordinator/src/run/book.rs", "CallBook"),
        ("coordinator/src/sched/watchdog.rs", "Watchdog"),
        ("coordinator/src/sched/fencing.rs", "Fence"),
        ("coordinator/src/tasks.rs", "Tasks"),
    ] {
        let code = code_of(&std::fs::read_to_string(root().join(file)).unwrap());
        let Some(fields) = struct_fields(&code, name) else {
            report.push(format!("{file} declares no struct {name}"));
            continue;
        };
        assert!(fields.len() >= 2, "{name} has fields: {fields:?}");
        for f in fields.iter().filter(|f| f.starts_with("pub")) {
            report.push(format!("{file}: {name}.{f}"));
        }
    }
    assert!(
        report.is_empty(),
        "fields another file can reach:\n{}",
        report.join("\n")
    );
}

/// The CLI on the wire contract (issue 30, 3): the client commands (`cli/src/client/`) and
/// every other CLI file outside the few that run a coordinator in the process (embedded
/// mode, `serve`, the MCP server, reading a store, the config that builds them, and the
/// benchmarks) name neither the coordinator nor the worker crate: they speak `flotilla-proto`
/// and use the crates below the coordinator (`flotilla-local`, `flotilla-script`).
#[test]
fn layering_client_commands_depend_only_on_the_wire_contract() {
    const RUN_A_COORDINATOR: &[&str] = &[
        "cli/src/main.rs",
        "cli/src/embedded.rs",
        "cli/src/stored.rs",
        "cli/src/config.rs",
        "cli/src/telemetry.rs",
        "cli/src/serve/",
        "cli/src/mcp/",
        "cli/src/bench/",
    ];
    let mut files = Vec::new();
    rust_files(&root().join("cli/src"), &mut files);
    let mut report = Vec::new();
    let mut client_files = 0;
    for f in &files {
        let rel = f.strip_prefix(root()).unwrap().display().to_string();
        if RUN_A_COORDINATOR.iter().any(|p| rel.starts_with(p)) {
            continue;
        }
        if rel.starts_with("cli/src/client/") {
            client_files += 1;
        }
        let code = code_of(&std::fs::read_to_string(f).unwrap());
        for (i, line) in code.lines().enumerate() {
            if line.contains("flotilla_coordinator") || line.contains("flotilla_worker") {
                report.push(format!("{rel}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(
        client_files >= 5,
        "the client commands are in cli/src/client/ ({client_files} files found)"
    );
    assert!(
        report.is_empty(),
        "a client file reaches past the wire contract (put what it needs in flotilla-proto or flotilla-local):\n{}",
        report.join("\n")
    );
}

/// The files that are compiled only for tests: declared `#[cfg(test)] mod name;` by their
/// parent, or inside a directory so declared.
fn test_only_files(sources: &[PathBuf]) -> BTreeSet<PathBuf> {
    let mut dirs = Vec::new();
    let mut files = BTreeSet::new();
    for f in sources {
        let text = std::fs::read_to_string(f).unwrap();
        let here = match f.file_name().and_then(|n| n.to_str()) {
            Some("mod.rs" | "lib.rs" | "main.rs") => f.parent().unwrap().to_path_buf(),
            _ => f.with_extension(""),
        };
        let mut lines = text.lines().map(str::trim).peekable();
        while let Some(line) = lines.next() {
            if line != "#[cfg(test)]" {
                continue;
            }
            let Some(name) = lines
                .peek()
                .and_then(|n| {
                    n.strip_prefix("mod ")
                        .or_else(|| n.strip_prefix("pub mod "))
                })
                .and_then(|n| n.strip_suffix(';'))
            else {
                continue;
            };
            files.insert(here.join(format!("{name}.rs")));
            dirs.push(here.join(name));
        }
    }
    for f in sources {
        // A `tests/` directory under a source tree holds test modules only.
        let in_tests = f
            .strip_prefix(root())
            .is_ok_and(|rel| rel.components().skip(1).any(|c| c.as_os_str() == "tests"));
        if in_tests || dirs.iter().any(|d| f.starts_with(d)) {
            files.insert(f.clone());
        }
    }
    files
}

/// Spawned tasks are tracked (issue 30, 4): a task is started by an owner that keeps it —
/// through a `TaskTracker` (the dispatcher's, the coordinator's runs and quotas in
/// `coordinator/src/tasks.rs`, a serving process's) or through its `JoinHandle` — so shutdown
/// waits for it. A bare `tokio::spawn` whose handle is dropped is allowed only in these files,
/// each for tasks that end with the connection or stream they serve; the list only shrinks.
#[test]
fn layering_spawned_tasks_have_an_owner_that_waits_for_them() {
    const DETACHED: &[&str] = &[
        "coordinator/lease/src/etcd.rs",
        "coordinator/lease/src/memory.rs",
        "worker/src/gateway.rs",
        "worker/src/backend/exec.rs",
        "cli/src/embedded.rs",
        "cli/src/mcp/lines.rs",
        "cli/src/bench/affinity.rs",
    ];
    let mut report = Vec::new();
    let mut kept = 0;
    let sources = workspace_sources();
    let tests_only = test_only_files(&sources);
    for f in sources.iter().filter(|f| !tests_only.contains(*f)) {
        let rel = f.strip_prefix(root()).unwrap().display().to_string();
        let code = code_of(&std::fs::read_to_string(f).unwrap());
        for (i, line) in code.lines().enumerate() {
            if !line.contains("tokio::spawn(") && !line.contains("tokio::task::spawn(") {
                continue;
            }
            let handled = [
                "= tokio::spawn(",
                "push(tokio::spawn(",
                "Some(tokio::spawn(",
                "Ok(tokio::spawn(",
            ]
            .iter()
            .any(|h| line.contains(h));
            if handled {
                kept += 1;
            } else if !DETACHED.contains(&rel.as_str()) {
                report.push(format!("{rel}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(
        kept > 3,
        "the reader found the spawns that keep their handle ({kept})"
    );
    assert!(
        report.is_empty(),
        "a task nobody waits for (spawn it on its owner's TaskTracker or keep its JoinHandle):\n{}",
        report.join("\n")
    );
}

/// A file imports its parent's `*` only where one type's `impl` is still split over files
/// (issue 30, 2: `RunEngine`'s and `Dispatcher`'s): the list only shrinks, and test modules
/// are not counted.
#[test]
fn layering_only_the_split_impls_import_their_parent_s_star() {
    const SPLIT_IMPLS: &[&str] = &[
        "coordinator/src/run/calls.rs",
        "coordinator/src/run/control.rs",
        "coordinator/src/run/finish.rs",
        "coordinator/src/run/view.rs",
        "coordinator/src/sched/outcomes.rs",
        "coordinator/src/sched/place.rs",
    ];
    let sources = workspace_sources();
    let tests_only = test_only_files(&sources);
    let mut found = Vec::new();
    for f in sources.iter().filter(|f| !tests_only.contains(*f)) {
        let code = code_of(&std::fs::read_to_string(f).unwrap());
        if code.lines().any(|l| l.trim() == "use super::*;") {
            found.push(f.strip_prefix(root()).unwrap().display().to_string());
        }
    }
    let stray: Vec<&String> = found
        .iter()
        .filter(|f| !SPLIT_IMPLS.contains(&f.as_str()))
        .collect();
    assert!(
        stray.is_empty(),
        "these import their parent's `*` (name what they use, or make the part a type of its own): {stray:?}"
    );
    assert!(
        !found.is_empty(),
        "no split impl is left: empty SPLIT_IMPLS and say so in ARCHITECTURE.md"
    );
}

/// The processes that host a coordinator (embedded mode, `flotilla coordinator`, the MCP
/// server, the commands that read a store) reach it through one facade, `host` (issue 30,
/// 3): nothing in the CLI names another module of the coordinator, except the benchmarks,
/// which measure its parts alone (a run engine without the coordinator, the dispatcher).
#[test]
fn layering_the_cli_reaches_the_coordinator_through_one_facade() {
    let mut files = Vec::new();
    rust_files(&root().join("cli/src"), &mut files);
    let mut report = Vec::new();
    let mut through_host = 0;
    for f in &files {
        let rel = f.strip_prefix(root()).unwrap().display().to_string();
        if rel.starts_with("cli/src/bench/") {
            continue;
        }
        let code = blank_literals(&code_of(&std::fs::read_to_string(f).unwrap()));
        for (i, line) in code.lines().enumerate() {
            let mut rest = line;
            while let Some(at) = rest.find("flotilla_coordinator") {
                rest = &rest[at + "flotilla_coordinator".len()..];
                if rest.starts_with("::host::")
                    || rest.starts_with("::host;")
                    || rest.starts_with("::host::{")
                {
                    through_host += 1;
                } else {
                    report.push(format!("{rel}:{}: {}", i + 1, line.trim()));
                }
            }
        }
    }
    assert!(
        through_host > 10,
        "the reader found the facade's uses ({through_host})"
    );
    assert!(
        report.is_empty(),
        "the CLI names the coordinator past its facade (add what it needs to coordinator/src/host.rs):\n{}",
        report.join("\n")
    );
}
