//! W28–W37: parallel, pipeline, phase, log, args, budget, workflow, start order.

use flotilla_tests::{Env, agent, agents, usage};
use serde_json::json;

#[test]
fn w28_parallel_keeps_input_order_and_turns_failures_into_null_slots() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return await parallel([\n\
           () => agent('slow [[sleep:150]]'),\n\
           () => agent('fast'),\n\
           () => { throw new Error('sync boom'); },\n\
           () => agent('dead [[fail]]'),\n\
           async () => { await agent('x'); throw new TypeError('async boom'); },\n\
           () => 7,\n\
         ]);",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!(["slow [[sleep:150]]", "fast", null, null, null, 7])
    );
    let failures: Vec<String> = r["failures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_owned())
        .collect();
    assert!(
        failures
            .iter()
            .any(|f| f.starts_with("parallel[2] failed") && f.contains("sync boom")),
        "{failures:?}"
    );
    assert!(
        failures
            .iter()
            .any(|f| f.starts_with("parallel[4] failed") && f.contains("async boom")),
        "{failures:?}"
    );
    assert!(
        failures.iter().any(|f| f.contains("dead [[fail]]")),
        "{failures:?}"
    );
    // Thunks are called in array order: agents start in that order.
    let a = agents(&r);
    assert_eq!(a[0]["label"], "slow [[sleep:150]]");
    assert_eq!(a[1]["label"], "fast");
    assert_eq!(a[2]["label"], "dead [[fail]]");
}

#[test]
fn w29_pipeline_has_no_barrier_and_handles_null_and_throws() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return await pipeline(['a', 'b', 'c'],\n\
           (item, orig, i) => agent(item === 'b' ? 'stage1 b [[sleep:400]]' : item === 'c' ? 'stage1 c [[fail]]' : 'stage1 ' + item, { label: 's1 ' + item }),\n\
           (prev, orig, i) => prev === null ? 'got null at ' + i : agent('stage2 ' + orig, { label: 's2 ' + orig }),\n\
           (prev, orig, i) => { if (orig === 'a') throw new Error('stage3 says no'); return prev + '!'; },\n\
         );",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!([null, "stage2 b!", "got null at 2!"]));
    // No barrier: item a reached stage 2 before item b left stage 1.
    let s2a = agent(&r, "s2 a")["start_ms"].as_u64().unwrap();
    let s1b_end = agent(&r, "s1 b")["end_ms"].as_u64().unwrap();
    assert!(
        s2a < s1b_end,
        "stage 2 of a started at {s2a}, stage 1 of b ended at {s1b_end}"
    );
    let failures = r["failures"].as_array().unwrap();
    assert!(
        failures
            .iter()
            .any(|f| f.as_str().unwrap().starts_with("pipeline[0] failed")
                && f.as_str().unwrap().contains("stage3 says no")),
        "{failures:?}"
    );
}

#[test]
fn w30_more_than_4096_items_is_an_error_before_anything_starts() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const items = Array.from({ length: 4097 }, (_, i) => i);\n\
         const out = [];\n\
         try { await parallel(items.map(i => () => agent('p' + i))); } catch (e) { out.push(e.message); }\n\
         try { await pipeline(items, i => agent('q' + i)); } catch (e) { out.push(e.message); }\n\
         out.push((await parallel(items.slice(0, 3).map(i => () => i))).length);\n\
         return out;",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let out = r["result"].as_array().unwrap();
    assert!(out[0].as_str().unwrap().contains("at most 4096"), "{r}");
    assert!(out[1].as_str().unwrap().contains("at most 4096"), "{r}");
    assert_eq!(out[2], 3);
    assert_eq!(usage(&r, "agents"), 0, "nothing started");
}

#[test]
fn w32_w33_phases_follow_meta_then_first_use_and_logs_are_kept() {
    let env = Env::new();
    let s = env.file(
        "phases.js",
        "export const meta = { name: 'ph', description: 'd', phases: [{ title: 'Plan' }, { title: 'Do' }] };\n\
         phase('Extra');\n\
         log('starting', { n: 2 });\n\
         await agent('e');\n\
         phase('Do');\n\
         await agent('d');\n\
         log('done');\n\
         return null;\n",
    );
    let (code, r) = env.run(&s, &["--stagger", "0"]);
    assert_eq!(code, 0, "{r}");
    let titles: Vec<_> = r["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["title"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(titles, vec!["Plan", "Do", "Extra"]);
    assert_eq!(r["logs"], json!(["starting {\"n\":2}", "done"]));
}

#[test]
fn w34_args_verbatim_and_undefined_when_omitted() {
    let env = Env::new();
    let body = "return { t: typeof args, v: args === undefined ? 'undefined' : args };";
    let (_, r) = env.run_body(body, &[]);
    assert_eq!(r["result"], json!({"t": "undefined", "v": "undefined"}));
    let (_, r) = env.run_body(body, &["--args", "[1,\"two\",{\"x\":null}]"]);
    assert_eq!(
        r["result"],
        json!({"t": "object", "v": [1, "two", {"x": null}]})
    );
    let (_, r) = env.run_body(body, &["--args", "\"[1,2]\""]);
    assert_eq!(
        r["result"],
        json!({"t": "string", "v": "[1,2]"}),
        "a JSON-encoded string stays a string"
    );
    let f = env.file("args.json", "{\"dir\": \"src\"}");
    let (_, r) = env.run_body(body, &["--args-file", f.to_str().unwrap()]);
    assert_eq!(r["result"]["v"], json!({"dir": "src"}));
}

#[test]
fn w35_budget_shape_and_hard_ceiling() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return [budget.total, budget.spent(), budget.remaining() === Infinity];",
        &[],
    );
    assert_eq!(code, 0);
    assert_eq!(r["result"], json!([null, 0, true]));
    // Each prompt is 10 characters, so each agent spends 10 output tokens.
    let (code, r) = env.run_body(
        "const seen = [];\n\
         let i = 0;\n\
         while (budget.remaining() > 0) { await agent('agent ' + String(i++).padStart(4, '0')); seen.push(budget.spent()); }\n\
         let threw = null;\n\
         try { await agent('one more!'); } catch (e) { threw = e.code; }\n\
         const slots = await parallel([() => agent('p1'), () => agent('p2')]);\n\
         return { seen, total: budget.total, remaining: budget.remaining(), threw, slots };",
        &["--budget", "25"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"]["seen"], json!([10, 20, 30]));
    assert_eq!(r["result"]["total"], 25);
    assert_eq!(r["result"]["remaining"], 0);
    assert_eq!(r["result"]["threw"], "BUDGET_EXCEEDED");
    assert_eq!(r["result"]["slots"], json!([null, null]));
    assert!(
        r["logs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l == "2 slots dropped — token budget exceeded"),
        "{r}"
    );
    assert_eq!(usage(&r, "agents"), 3);
    assert_eq!(usage(&r, "output_tokens"), 30);
}

#[test]
fn w36_workflow_runs_a_child_with_shared_limits_one_level_deep() {
    let env = Env::new();
    env.file(
        ".flotilla/workflows/child.js",
        "export const meta = { name: 'summarize', description: 'child' };\n\
         const r = await agent('child says ' + args.topic);\n\
         let nested = 'none';\n\
         try { await workflow('summarize', {}); } catch (e) { nested = e.code; }\n\
         return { r, nested, total: budget.total };\n",
    );
    env.file(
        "other/path.js",
        "export const meta = { name: 'by-path', description: 'child by path' };\nreturn args;\n",
    );
    let (code, r) = env.run_body(
        "const a = await workflow('summarize', { topic: 'x' });\n\
         const b = await workflow({ scriptPath: 'other/path.js' });\n\
         let unknown = null;\n\
         try { await workflow('nope'); } catch (e) { unknown = e.message; }\n\
         return { a, b: b === undefined ? 'undefined' : b, unknown };",
        &["--budget", "1000"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"]["a"],
        json!({"r": "child says x", "nested": "WORKFLOW_NESTED", "total": 1000})
    );
    assert_eq!(
        r["result"]["b"], "undefined",
        "omitted args are undefined in the child"
    );
    assert!(
        r["result"]["unknown"]
            .as_str()
            .unwrap()
            .contains("unknown workflow \"nope\""),
        "{r}"
    );
    assert_eq!(agent(&r, "child says x")["group"], "▸ summarize");
    assert_eq!(
        usage(&r, "agents"),
        1,
        "the child's agents count in the parent run"
    );
}

#[test]
fn w36_child_syntax_error_is_catchable() {
    let env = Env::new();
    env.file(
        ".claude/workflows/broken.js",
        "export const meta = { name: 'broken', description: 'd' };\nconst = 1;\n",
    );
    let (code, r) = env.run_body(
        "try { await workflow('broken'); } catch (e) { return e.message; }",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert!(r["result"].as_str().unwrap().contains("broken"), "{r}");
}
