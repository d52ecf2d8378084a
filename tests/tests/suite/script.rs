//! W01–W09: script format, meta, body, globals, module loading, determinism, persistence.

use flotilla_tests::Env;
use serde_json::json;

#[test]
fn w01_typescript_is_a_syntax_error_with_its_line() {
    let env = Env::new();
    let (code, r) = env.run_body("const x: number = 1;\nreturn x;", &[]);
    assert_eq!(code, 2, "{r}");
    assert_eq!(r["status"], "rejected");
    let e = r["error"].as_str().unwrap();
    assert!(e.contains("syntax error at line 2"), "{e}");
}

#[test]
fn w02_meta_is_read_statically_and_reported() {
    let env = Env::new();
    let s = env.file(
        "m.js",
        "// leading comment\nexport const meta = {\n  name: 'triage',\n  description: \"two words\",\n  whenToUse: `args: list`,\n  phases: [{ title: 'A', detail: 'x' }, { title: 'B', model: 'opus' },],\n};\nreturn meta.name;\n",
    );
    let (code, r) = env.run(&s, &[]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["workflow"],
        json!({"name": "triage", "description": "two words"})
    );
    assert_eq!(
        r["result"], "triage",
        "the body reads meta as a local constant"
    );
    let titles: Vec<_> = r["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["title"].clone())
        .collect();
    assert_eq!(
        titles,
        vec![json!("A"), json!("B")],
        "declared phases seed the groups in order"
    );
}

#[test]
fn w03_meta_violations_refuse_the_launch_and_name_the_problem() {
    let env = Env::new();
    let cases = [
        (
            "missing",
            "return 1;\n",
            "must start with `export const meta",
        ),
        (
            "not-first",
            "const a = 1;\nexport const meta = { name: 'x', description: 'y' };\n",
            "found `const a` at line 1",
        ),
        (
            "variable",
            "const n = 'x';\nexport const meta = { name: n, description: 'y' };\n",
            "must start with",
        ),
        (
            "reference",
            "export const meta = { name: n, description: 'y' };\n",
            "variable reference `n` at line 1",
        ),
        (
            "call",
            "export const meta = { name: f(), description: 'y' };\n",
            "function call",
        ),
        (
            "spread",
            "export const meta = {\n ...base, name: 'x', description: 'y' };\n",
            "spread",
        ),
        (
            "computed",
            "export const meta = { [k]: 1, name: 'x', description: 'y' };\n",
            "computed key",
        ),
        (
            "template",
            "export const meta = { name: `a${b}`, description: 'y' };\n",
            "template substitution",
        ),
        (
            "no-name",
            "export const meta = { description: 'y' };\n",
            "meta.name is required",
        ),
        (
            "no-description",
            "export const meta = { name: 'x' };\n",
            "meta.description is required",
        ),
    ];
    for (file, text, expected) in cases {
        let s = env.file(&format!("{file}.js"), text);
        let (code, r) = env.run(&s, &[]);
        assert_eq!(code, 2, "{file}: {r}");
        assert_eq!(r["status"], "rejected", "{file}");
        let e = r["error"].as_str().unwrap();
        assert!(e.contains(expected), "{file}: {e}");
        assert_eq!(r["usage"]["agents"], 0);
    }
    // Nothing was stored for refused launches.
    let runs = env.flotilla(&["runs", "--json"]).json();
    assert_eq!(runs, json!([]));
}

#[test]
fn w04_top_level_await_and_return_and_empty_result() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const a = await agent('one');\nif (a) return { a, n: 2 };\nreturn 0;",
        &[],
    );
    assert_eq!(code, 0);
    assert_eq!(r["result"], json!({"a": "one", "n": 2}));
    let (code, r) = env.run_body("await agent('x');", &[]);
    assert_eq!(code, 0);
    assert_eq!(r["result"], json!(null), "no return is an empty result");
}

#[test]
fn w05_globals_present_and_node_apis_absent() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return {\n\
           present: [typeof agent, typeof parallel, typeof pipeline, typeof phase, typeof log, typeof workflow, typeof budget, typeof JSON, typeof Map, typeof Promise],\n\
           absent: [typeof require, typeof module, typeof process, typeof Buffer, typeof __dirname, typeof fetch, typeof __host],\n\
           dateWithArg: new Date(0).toISOString(),\n\
         };",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"]["present"],
        json!([
            "function", "function", "function", "function", "function", "function", "object",
            "object", "function", "function"
        ])
    );
    assert!(
        r["result"]["absent"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t == "undefined"),
        "{r}"
    );
    assert_eq!(r["result"]["dateWithArg"], "1970-01-01T00:00:00.000Z");
}

#[test]
fn w06_module_loading_refuses_the_launch() {
    let env = Env::new();
    for (name, body) in [
        ("static", "import fs from 'fs';\nreturn 1;"),
        ("dynamic", "const m = await import('fs');\nreturn 1;"),
        ("require", "const fs = require('fs');\nreturn 1;"),
    ] {
        let (code, r) = env.run_body(body, &[]);
        assert_eq!(code, 2, "{name}: {r}");
        let e = r["error"].as_str().unwrap();
        assert!(
            e.contains("not available") && e.contains("line 2"),
            "{name}: {e}"
        );
    }
    // A mention in a string or a property named import is fine.
    let (code, r) = env.run_body(
        "const o = { import: 1, require: 2 };\nreturn 'import x; require(y)' + o.import;",
        &[],
    );
    assert_eq!(code, 0, "{r}");
}

#[test]
fn w07_nondeterministic_calls_throw_or_refuse_and_mentions_are_fine() {
    let env = Env::new();
    // Obvious calls are refused at launch with the line.
    let (code, r) = env.run_body("const t = Date.now();\nreturn t;", &[]);
    assert_eq!(code, 2, "{r}");
    let e = r["error"].as_str().unwrap();
    assert!(e.contains("Date.now()") && e.contains("resume"), "{e}");
    let (code, r) = env.run_body("return Math.random();", &[]);
    assert_eq!(code, 2);
    assert!(r["error"].as_str().unwrap().contains("Math.random()"));
    let (code, _) = env.run_body("return new Date();", &[]);
    assert_eq!(code, 2);
    // Calls the static check cannot see still throw, with a message that says why.
    for body in [
        "const D = Date; return D.now();",
        "const M = Math; return M['ran' + 'dom']();",
        "const D = Date; return new D().getTime();",
    ] {
        let (code, r) = env.run_body(body, &[]);
        assert_eq!(code, 1, "{body}: {r}");
        let e = r["error"].as_str().unwrap();
        assert!(
            e.contains("not allowed in workflow scripts") && e.contains("resume"),
            "{body}: {e}"
        );
    }
    // The script can catch the throw.
    let (code, r) = env.run_body(
        "const D = Date; try { D.now(); } catch (e) { return e.code; }",
        &[],
    );
    assert_eq!(code, 0);
    assert_eq!(r["result"], "NONDETERMINISTIC");
    // Mentions in strings and comments are fine.
    let (code, r) = env.run_body(
        "// Date.now() and Math.random()\nreturn 'new Date() Date.now()';",
        &[],
    );
    assert_eq!(code, 0, "{r}");
}

#[test]
fn w09_script_is_persisted_and_its_path_reported() {
    let env = Env::new();
    let s = env.script("persist", "return 42;");
    let (code, r) = env.run(&s, &[]);
    assert_eq!(code, 0);
    let path = r["script_path"].as_str().unwrap();
    assert_eq!(
        std::fs::read_to_string(path).unwrap(),
        std::fs::read_to_string(&s).unwrap()
    );
}
