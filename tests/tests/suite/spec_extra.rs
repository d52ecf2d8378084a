//! Extra black-box checks of spec/workflow-api.md (W01–W43, MUST items) and
//! spec/echo-backend.md that the area modules leave open: combinator edge cases, shared limits
//! of `workflow()` children, budget accounting of structured results, `fill(schema)` rules and
//! the counting of the echo backend's control markers.

use flotilla_proto::wire::EXIT_ALL_AGENTS_FAILED;
use flotilla_tests::{Env, agent, agents, failures, max_overlap, usage};
use serde_json::json;

// ---------------------------------------------------------------------------------------------
// Section 1: script format.

#[test]
fn spec_extra_w03_saved_workflow_with_non_literal_meta_is_not_offered() {
    let env = Env::new();
    env.file(
        ".flotilla/workflows/dyn.js",
        "export const meta = { name: 'dyn', description: String('computed') };\nreturn 'ran';\n",
    );
    env.file(
        ".flotilla/workflows/fine.js",
        "export const meta = { name: 'fine', description: 'literal' };\nreturn 'fine ran';\n",
    );
    let (code, r) = env.run_body(
        "const out = [await workflow('fine')];\n\
         try { out.push('offered: ' + await workflow('dyn')); } catch (e) { out.push('not offered'); }\n\
         return out;",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!(["fine ran", "not offered"]));
}

#[test]
fn spec_extra_w05_ecmascript_builtins_are_present() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return {\n\
           types: [typeof Math, typeof Array, typeof Object, typeof String, typeof Number, typeof Set, typeof RegExp, typeof Error, typeof Date],\n\
           use: [Math.max(1, 3), Array.from(new Set([1, 1, 2])).length, new RegExp('a+').test('caa'), Number('7') + 1, String(5), Object.keys({ a: 1 })[0], new Error('m').message, JSON.parse('[1]')[0], new Map([['k', 'v']]).get('k')],\n\
         };",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"]["types"],
        json!([
            "object", "function", "function", "function", "function", "function", "function",
            "function", "function"
        ])
    );
    assert_eq!(
        r["result"]["use"],
        json!([3, 2, true, 8, "5", "a", "m", 1, "v"])
    );
}

#[test]
fn spec_extra_w08_w32_w33_phase_and_log_return_undefined_and_the_script_spends_nothing() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const p = phase('Only');\n\
         const l = log('a line');\n\
         let s = 0;\n\
         for (let i = 0; i < 1000; i++) s += i;\n\
         return { p: p === undefined, l: l === undefined, s, spent: budget.spent() };",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!({"p": true, "l": true, "s": 499500, "spent": 0})
    );
    assert_eq!(r["logs"], json!(["a line"]));
    assert_eq!(usage(&r, "agents"), 0);
    assert_eq!(usage(&r, "attempts"), 0);
    assert_eq!(usage(&r, "input_tokens"), 0);
    assert_eq!(usage(&r, "output_tokens"), 0);
}

// ---------------------------------------------------------------------------------------------
// Section 2: agent().

#[test]
fn spec_extra_w11_w22_null_or_undefined_options_mean_no_options() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return [await agent('a', null), await agent('b', undefined), await agent('c', {})];",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!(["a", "b", "c"]));
    assert_eq!(usage(&r, "agents"), 3);
}

#[test]
fn spec_extra_w18_run_default_model_applies_unless_the_call_names_one() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "await agent('d', { label: 'default' });\n\
         await agent('o', { label: 'named', model: 'opus' });\n\
         await agent('i', { label: 'inherit', model: 'inherit' });\n\
         return null;",
        &["--model", "session-model-x"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(agent(&r, "default")["model"], "session-model-x");
    assert_eq!(agent(&r, "named")["model"], "opus");
    assert_eq!(
        agent(&r, "inherit")["model"],
        "session-model-x",
        "'inherit' is the session model"
    );
}

#[test]
fn spec_extra_w19_every_documented_effort_is_accepted() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const out = [];\n\
         for (const effort of ['low', 'medium', 'high', 'xhigh', 'max']) {\n\
           try { out.push(await agent('e ' + effort, { effort })); } catch (e) { out.push('rejected ' + effort + ': ' + e.message); }\n\
         }\n\
         return out;",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!(["e low", "e medium", "e high", "e xhigh", "e max"])
    );
}

#[test]
fn spec_extra_w21_w24_unknown_agent_type_rejects() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "try { await agent('x', { agentType: 'no-such-agent-type-zz' }); return 'accepted'; }\n\
         catch (e) { return 'rejected: ' + e.message; }",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let out = r["result"].as_str().unwrap();
    assert!(
        out.starts_with("rejected") && out.contains("no-such-agent-type-zz"),
        "an unknown agentType must reject naming the type (W21, W24): {r}"
    );
}

#[test]
fn spec_extra_w23_empty_prompt_gives_an_empty_string_not_null() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const r = await agent('', { label: 'empty' });\nreturn { r, t: typeof r };",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!({"r": "", "t": "string"}));
    assert_eq!(usage(&r, "errors"), 0);
    assert_eq!(usage(&r, "input_tokens"), 0);
    assert_eq!(usage(&r, "output_tokens"), 0);
    assert_eq!(agent(&r, "empty")["status"], "completed");
}

#[test]
fn spec_extra_w24_a_caught_rejection_lets_the_script_continue() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const out = [];\n\
         try { await agent('bad [[invalid]]', { schema: { type: 'object', properties: { a: { type: 'string' } }, required: ['a'] } }); out.push('no throw'); }\n\
         catch (e) { out.push('caught ' + e.code); }\n\
         out.push(await agent('after'));\n\
         return out;",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["status"], "completed");
    assert_eq!(r["result"], json!(["caught SCHEMA_FAILED", "after"]));
    assert_eq!(usage(&r, "errors"), 1);
    assert_eq!(agent(&r, "after")["status"], "completed");
}

#[test]
fn spec_extra_w24_w40_agent_cap_inside_parallel_gives_null_slots_and_failure_lines() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return await parallel(['a', 'b', 'c', 'd'].map(x => () => agent(x)));",
        &["--max-agents", "2"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!(["a", "b", null, null]));
    let f = failures(&r);
    for i in [2, 3] {
        assert!(
            f.iter()
                .any(|l| l.starts_with(&format!("parallel[{i}] failed"))),
            "slot {i}: {f:?}"
        );
    }
    assert_eq!(usage(&r, "agents"), 2);
}

#[test]
fn spec_extra_w24_w29_agent_rejection_inside_pipeline_is_a_null_slot_and_skips_later_stages() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const schema = { type: 'object', properties: { a: { type: 'string' } }, required: ['a'] };\n\
         return await pipeline(['x', 'y', 'z'],\n\
           it => agent('s1 ' + it + (it === 'y' ? ' [[invalid]]' : ''), { schema, label: 's1 ' + it }),\n\
           (prev, it) => agent('s2 ' + it + ' ' + prev.a, { label: 's2 ' + it }));",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!(["s2 x a", null, "s2 z a"]));
    assert!(
        agents(&r).iter().all(|a| a["label"] != "s2 y"),
        "stage 2 of the rejected item must not run: {r}"
    );
    assert_eq!(usage(&r, "agents"), 5);
    let f = failures(&r);
    assert!(
        f.iter().any(|l| l.starts_with("pipeline[1] failed")),
        "{f:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Section 3: parallel, pipeline, workflow, args, budget, start order.

#[test]
fn spec_extra_w28_parallel_never_rejects_on_non_function_entries() {
    let env = Env::new();
    // What a non-function entry yields is not specified; that parallel() never rejects is (W28).
    let (code, r) = env.run_body(
        "const r = await parallel([() => 1, 2, 'x', null, undefined, () => agent('ok')]);\n\
         return { len: r.length, first: r[0], last: r[5] };",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!({"len": 6, "first": 1, "last": "ok"}));
}

#[test]
fn spec_extra_w29_each_stage_gets_prev_result_original_item_and_index() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const items = [{ id: 'a' }, 7, 'z'];\n\
         return await pipeline(items,\n\
           (p, o, i) => ({ s: 1, firstIsItem: p === o, same: o === items[i], i }),\n\
           async (p, o, i) => ({ s: 2, p, same: o === items[i], i }),\n\
           (p, o, i) => ({ prev: p, o, i }));",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let items = [json!({"id": "a"}), json!(7), json!("z")];
    for (i, item) in items.iter().enumerate() {
        assert_eq!(
            r["result"][i],
            json!({
                "prev": {"s": 2, "p": {"s": 1, "firstIsItem": true, "same": true, "i": i}, "same": true, "i": i},
                "o": item,
                "i": i
            }),
            "item {i}"
        );
    }
}

#[test]
fn spec_extra_w29_throwing_or_rejecting_stage_skips_the_remaining_stages() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return await pipeline(['a', 'b', 'c'],\n\
           it => { if (it === 'a') throw new Error('sync no'); if (it === 'b') return Promise.reject(new Error('async no')); return it; },\n\
           (p, o) => agent('s2 ' + o, { label: 's2 ' + o }),\n\
           p => p + '!');",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!([null, null, "s2 c!"]));
    let labels: Vec<_> = agents(&r).iter().map(|a| a["label"].clone()).collect();
    assert_eq!(labels, vec![json!("s2 c")], "skipped items start no agent");
    let f = failures(&r);
    assert!(
        f.iter()
            .any(|l| l.starts_with("pipeline[0] failed") && l.contains("sync no")),
        "{f:?}"
    );
    assert!(
        f.iter()
            .any(|l| l.starts_with("pipeline[1] failed") && l.contains("async no")),
        "{f:?}"
    );
}

#[test]
fn spec_extra_w29_pipeline_with_zero_stages_returns_the_items() {
    let env = Env::new();
    // Inference from W29 (each item's chain starts from the item itself): with no stage the
    // chain's result is the item.
    let (code, r) = env.run_body("return await pipeline([1, 'b', { c: 1 }, null]);", &[]);
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!([1, "b", {"c": 1}, null]));
}

#[test]
fn spec_extra_w30_sizes_zero_and_exactly_4096_are_accepted() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const items = Array.from({ length: 4096 }, (_, i) => i);\n\
         const a = await parallel(items.map(i => () => i * 2));\n\
         const b = await pipeline(items, x => x + 1);\n\
         const e1 = await parallel([]);\n\
         const e2 = await pipeline([], x => agent('never ' + x));\n\
         return [a.length, a[4095], b.length, b[4095], e1, e2];",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!([4096, 8190, 4096, 4096, [], []]));
    assert_eq!(usage(&r, "agents"), 0);
}

#[test]
fn spec_extra_w31_parallel_nested_in_a_pipeline_stage() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return await pipeline(['x', 'y'],\n\
           it => agent('find ' + it),\n\
           (found, it) => parallel([\n\
             () => agent('verify A ' + found),\n\
             () => agent('verify B ' + found + (it === 'y' ? ' [[fail]]' : '')),\n\
           ]),\n\
           votes => votes);",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!([
            ["verify A find x", "verify B find x"],
            ["verify A find y", null]
        ])
    );
    assert_eq!(usage(&r, "agents"), 6);
    assert_eq!(usage(&r, "errors"), 1);
    assert!(
        failures(&r)
            .iter()
            .any(|l| l.contains("verify B find y [[fail]]")),
        "{r}"
    );
}

#[test]
fn spec_extra_w34_scalar_args_arrive_verbatim() {
    let env = Env::new();
    let body = "return { t: typeof args, isNull: args === null, v: args === undefined ? 'undefined' : args };";
    for (flag, t, v) in [
        ("42", "number", json!(42)),
        ("3.5", "number", json!(3.5)),
        ("0", "number", json!(0)),
        ("null", "object", json!(null)),
        ("true", "boolean", json!(true)),
        ("false", "boolean", json!(false)),
        ("\"\"", "string", json!("")),
    ] {
        let (code, r) = env.run_body(body, &["--args", flag]);
        assert_eq!(code, 0, "--args {flag}: {r}");
        assert_eq!(
            r["result"],
            json!({"t": t, "isNull": v.is_null(), "v": v}),
            "--args {flag}"
        );
    }
}

#[test]
fn spec_extra_w35_budget_counts_output_tokens_of_structured_results() {
    let env = Env::new();
    // fill() gives {"word":"word","n":1}: 21 characters of compact JSON; the prompt has 3.
    let (code, r) = env.run_body(
        "const r = await agent('abc', { schema: { type: 'object', properties: { word: { type: 'string' }, n: { type: 'integer' } } } });\n\
         const spent = budget.spent(), remaining = budget.remaining();\n\
         let next = 'dispatched';\n\
         try { await agent('next'); } catch (e) { next = e.code; }\n\
         return { r, spent, remaining, next };",
        &["--budget", "21"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!({"r": {"word": "word", "n": 1}, "spent": 21, "remaining": 0, "next": "BUDGET_EXCEEDED"})
    );
    assert_eq!(usage(&r, "input_tokens"), 3);
    assert_eq!(usage(&r, "output_tokens"), 21);
    assert_eq!(usage(&r, "agents"), 1);
}

#[test]
fn spec_extra_w35_w36_child_workflow_spending_is_one_pool_with_the_parent() {
    let env = Env::new();
    env.file(
        ".flotilla/workflows/spender.js",
        "export const meta = { name: 'spender', description: 'spends' };\n\
         const before = budget.spent();\n\
         const r = await agent(args.p);\n\
         return [before, r, budget.spent()];\n",
    );
    let (code, r) = env.run_body(
        "await agent('xy');\n\
         const child = await workflow('spender', { p: 'abcdef' });\n\
         const afterChild = budget.spent();\n\
         await agent('xyz');\n\
         let last = 'dispatched';\n\
         try { await agent('no'); } catch (e) { last = e.code; }\n\
         return { child, afterChild, spent: budget.spent(), remaining: budget.remaining(), last };",
        &["--budget", "10"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!({"child": [2, "abcdef", 8], "afterChild": 8, "spent": 11, "remaining": 0, "last": "BUDGET_EXCEEDED"})
    );
    assert_eq!(usage(&r, "output_tokens"), 11);
}

#[test]
fn spec_extra_w36_w40_a_child_uses_the_parent_agent_cap() {
    let env = Env::new();
    env.file(
        ".flotilla/workflows/looper.js",
        "export const meta = { name: 'looper', description: 'loops' };\n\
         const got = [];\n\
         for (let i = 0; i < 5; i++) {\n\
           try { got.push(await agent('kid ' + i)); } catch (e) { return { got, code: e.code }; }\n\
         }\n\
         return { got };\n",
    );
    let (code, r) = env.run_body(
        "await agent('p0');\n\
         const k = await workflow('looper');\n\
         let after = 'dispatched';\n\
         try { await agent('p1'); } catch (e) { after = e.code; }\n\
         return { k, after };",
        &["--max-agents", "3"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!({"k": {"got": ["kid 0", "kid 1"], "code": "AGENT_CAP"}, "after": "AGENT_CAP"})
    );
    assert_eq!(usage(&r, "agents"), 3);
}

#[test]
fn spec_extra_w36_w38_a_child_uses_the_parent_concurrency_slots() {
    let env = Env::new();
    env.file(
        ".flotilla/workflows/fan.js",
        "export const meta = { name: 'fan', description: 'fans out' };\n\
         return await parallel([0, 1, 2].map(i => () => agent('kid ' + i + ' [[sleep:150]]')));\n",
    );
    let (code, r) = env.run_body(
        "return await parallel([\n\
           () => agent('p0 [[sleep:150]]'),\n\
           () => agent('p1 [[sleep:150]]'),\n\
           () => workflow('fan'),\n\
         ]);",
        &["--concurrency", "2"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"][2].as_array().unwrap().len(), 3, "{r}");
    assert_eq!(agents(&r).len(), 5);
    let overlap = max_overlap(&r);
    assert!(
        overlap <= 2,
        "parent and child agents share 2 slots, saw {overlap} at once: {r}"
    );
}

#[test]
fn spec_extra_w36_child_args_of_any_json_type_and_unreadable_path_throws() {
    let env = Env::new();
    env.file(
        ".flotilla/workflows/show-args.js",
        "export const meta = { name: 'show-args', description: 'returns its args' };\n\
         return { t: typeof args, v: args === undefined ? 'undefined' : args };\n",
    );
    let (code, r) = env.run_body(
        "const out = [];\n\
         for (const a of [0, null, false, 'str', [1]]) out.push(await workflow('show-args', a));\n\
         out.push(await workflow('show-args'));\n\
         try { await workflow({ scriptPath: 'no/such/missing-child.js' }); out.push('no throw'); }\n\
         catch (e) { out.push('threw: ' + e.message); }\n\
         return out;",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let out = r["result"].as_array().unwrap();
    assert_eq!(
        out[..6],
        [
            json!({"t": "number", "v": 0}),
            json!({"t": "object", "v": null}),
            json!({"t": "boolean", "v": false}),
            json!({"t": "string", "v": "str"}),
            json!({"t": "object", "v": [1]}),
            json!({"t": "undefined", "v": "undefined"}),
        ]
    );
    let last = out[6].as_str().unwrap();
    assert!(
        last.starts_with("threw") && last.contains("missing-child.js"),
        "{last}"
    );
}

#[test]
fn spec_extra_w37_queued_calls_start_in_the_order_the_script_makes_them() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "await agent('first [[sleep:20]]', { label: 'first' });\n\
         await parallel([0, 1, 2, 3, 4].map(i => () => agent('p' + i + ' [[sleep:30]]', { label: 'p' + i })));\n\
         await agent('last');\n\
         return null;",
        &["--concurrency", "1"],
    );
    assert_eq!(code, 0, "{r}");
    let mut by_start: Vec<(u64, String)> = agents(&r)
        .iter()
        .map(|a| {
            (
                a["start_ms"].as_u64().unwrap(),
                a["label"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    by_start.sort();
    let labels: Vec<_> = by_start.into_iter().map(|(_, l)| l).collect();
    assert_eq!(
        labels,
        vec!["first", "p0", "p1", "p2", "p3", "p4", "last"],
        "{r}"
    );
}

// ---------------------------------------------------------------------------------------------
// Section 4: runtime limits.

#[test]
fn spec_extra_w38_default_concurrency_is_at_most_16() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return (await parallel(Array.from({ length: 24 }, (_, i) => () => agent('job ' + i + ' [[sleep:200]]')))).length;",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], 24);
    let overlap = max_overlap(&r);
    assert!(
        (2..=16).contains(&overlap),
        "default cap 16 (never below 2), saw {overlap}"
    );
}

#[test]
fn spec_extra_w40_stall_restarts_do_not_use_up_the_agent_cap() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const a = await agent('a [[stall:1]]');\n\
         const b = await agent('b');\n\
         let c = 'dispatched';\n\
         try { await agent('c'); } catch (e) { c = e.code; }\n\
         return [a, b, c];",
        &["--max-agents", "2", "--stall-timeout", "200ms"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!(["a [[stall:1]]", "b", "AGENT_CAP"]));
    assert_eq!(usage(&r, "agents"), 2);
    assert_eq!(usage(&r, "attempts"), 3);
}

#[test]
fn spec_extra_w38_w43_large_fan_out_completes_with_exact_counts() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const r = await Promise.all(Array.from({ length: 2000 }, (_, i) => agent('a' + i)));\n\
         let extra = 'dispatched';\n\
         try { await agent('extra'); } catch (e) { extra = e.code; }\n\
         return { n: r.length, first: r[0], last: r[1999], distinct: new Set(r).size, inOrder: r.every((x, i) => x === 'a' + i), extra };",
        &["--max-agents", "2000"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!({"n": 2000, "first": "a0", "last": "a1999", "distinct": 2000, "inOrder": true, "extra": "AGENT_CAP"})
    );
    assert_eq!(usage(&r, "agents"), 2000);
    assert_eq!(usage(&r, "dispatched"), 2000);
    assert_eq!(usage(&r, "errors"), 0);
    // 'a' + i for i < 2000: 2000 + 10·1 + 90·2 + 900·3 + 1000·4 characters.
    assert_eq!(usage(&r, "input_tokens"), 8890);
    assert_eq!(usage(&r, "output_tokens"), 8890);
    assert!(agents(&r).iter().all(|a| a["status"] == "completed"));
}

// ---------------------------------------------------------------------------------------------
// The echo backend: fill(schema).

#[test]
fn spec_extra_echo_fill_const_enum_and_type_rules() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return await agent('fill me', { schema: { type: 'object', properties: {\n\
           c: { const: 42 },\n\
           cs: { type: 'string', const: 'fixed' },\n\
           e: { type: 'string', enum: ['red', 'green'] },\n\
           en: { enum: [3, 'x'] },\n\
           multi: { type: ['null', 'integer'] },\n\
           multiStr: { type: ['null', 'string'] },\n\
           implicitObj: { properties: { k: { type: 'string' } } },\n\
           implicitArr: { items: { type: 'integer', minimum: 7 } },\n\
           implicitStr: {},\n\
           nothing: { type: 'null' },\n\
           num: { type: 'number' },\n\
           neg: { type: 'number', minimum: -2.5 },\n\
           flag: { type: 'boolean' },\n\
           echo: { type: 'integer' },\n\
         } } });",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!({
            "c": 42,
            "cs": "fixed",
            "e": "red",
            "en": 3,
            "multi": 1,
            "multiStr": "multiStr",
            "implicitObj": {"k": "implicitObj.k"},
            "implicitArr": [7, 7],
            "implicitStr": "implicitStr",
            "nothing": null,
            "num": 1,
            "neg": -2.5,
            "flag": false,
            "echo": 1,
        })
    );
}

#[test]
fn spec_extra_echo_fill_arrays_and_string_paths() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return await agent('paths [[sleep:1]]', { schema: { type: 'object', properties: {\n\
           bugs: { type: 'array', minItems: 3, items: { type: 'object', properties: { where: { type: 'string' }, line: { type: 'number' } } } },\n\
           few: { type: 'array', maxItems: 1, items: { type: 'string' } },\n\
           none: { type: 'array', maxItems: 0, items: { type: 'string' } },\n\
           grid: { type: 'array', minItems: 1, items: { type: 'array', items: { type: 'string' } } },\n\
           inner: { type: 'object', properties: { echo: { type: 'string' }, deep: { type: 'object', properties: { s: { type: 'string' } } } } },\n\
         }, required: ['bugs'] } });",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!({
            "bugs": [
                {"where": "bugs[0].where", "line": 1},
                {"where": "bugs[1].where", "line": 1},
                {"where": "bugs[2].where", "line": 1}
            ],
            "few": ["few[0]"],
            "none": [],
            "grid": [["grid[0][0]", "grid[0][1]"]],
            "inner": {"echo": "paths [[sleep:1]]", "deep": {"s": "inner.deep.s"}},
        })
    );
}

#[test]
fn spec_extra_echo_fill_keeps_declaration_order() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const r = await agent('o', { schema: { type: 'object', properties: {\n\
           zeta: { type: 'string' }, alpha: { type: 'integer' }, mid: { type: 'object', properties: { y: { type: 'boolean' }, b: { type: 'null' } } },\n\
         } } });\n\
         return [Object.keys(r), Object.keys(r.mid), JSON.stringify(r)];",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    let expected = r#"{"zeta":"zeta","alpha":1,"mid":{"y":false,"b":null}}"#;
    assert_eq!(
        r["result"],
        json!([["zeta", "alpha", "mid"], ["y", "b"], expected])
    );
    assert_eq!(usage(&r, "output_tokens"), expected.chars().count() as u64);
}

#[test]
fn spec_extra_echo_fill_goes_through_schema_validation() {
    let env = Env::new();
    // fill() gives "s" (its path), which minLength 10 refuses on every submission.
    let (code, r) = env.run_body(
        "try { await agent('short', { schema: { type: 'object', properties: { s: { type: 'string', minLength: 10 } }, required: ['s'] } }); return 'accepted'; }\n\
         catch (e) { return e.code + ': ' + e.message; }",
        &[],
    );
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    let out = r["result"].as_str().unwrap();
    assert!(
        out.starts_with("SCHEMA_FAILED") && out.contains("retry cap (5)"),
        "{out}"
    );
}

#[test]
fn spec_extra_echo_schema_usage_counts_prompt_in_and_compact_json_out() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return await agent('héllo', { label: 'h', schema: { type: 'object', properties: { echo: { type: 'string' } } } });",
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!({"echo": "héllo"}));
    // {"echo":"héllo"} is 16 characters.
    assert_eq!(usage(&r, "input_tokens"), 5);
    assert_eq!(usage(&r, "output_tokens"), 16);
    assert_eq!(agent(&r, "h")["input_tokens"], 5);
    assert_eq!(agent(&r, "h")["output_tokens"], 16);
}

// ---------------------------------------------------------------------------------------------
// The echo backend: markers and their counting.

#[test]
fn spec_extra_echo_invalid_marker_counts_submissions() {
    let env = Env::new();
    let schema = "{ type: 'object', properties: { a: { type: 'string' } }, required: ['a'] }";
    let (code, r) = env.run_body(
        &format!(
            "const out = [];\n\
             try {{ out.push(await agent('five [[invalid:5]]', {{ schema: {schema} }})); }} catch (e) {{ out.push(e.code); }}\n\
             out.push(await agent('loose [[invalid]]', {{ schema: {{ type: 'object', properties: {{ a: {{ type: 'string' }} }} }} }}));\n\
             out.push(await agent('text [[invalid]]'));\n\
             return out;"
        ),
        &[],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(
        r["result"],
        json!(["SCHEMA_FAILED", {}, "text [[invalid]]"]),
        "5 invalid submissions exhaust the default cap of 5; {{}} is valid when nothing is required; no schema, no effect"
    );
    let (code, r) = env.run_body(
        &format!("return await agent('one [[invalid:1]]', {{ schema: {schema} }});"),
        &["--schema-attempts", "2"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], json!({"a": "a"}));
}

#[test]
fn spec_extra_echo_fail_marker_with_a_schema_resolves_null() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const r = await agent('[[fail]] first', { label: 'f', schema: { type: 'object', properties: { a: { type: 'string' } }, required: ['a'] } });\n\
         return { r, isNull: r === null };",
        &[],
    );
    assert_eq!(code, EXIT_ALL_AGENTS_FAILED, "{r}");
    assert_eq!(r["result"], json!({"r": null, "isNull": true}));
    assert_eq!(agent(&r, "f")["status"], "failed");
    assert_eq!(usage(&r, "errors"), 1);
}

#[test]
fn spec_extra_echo_stall_counting_is_per_call_and_bounded_by_attempts() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "const a = await agent('same [[stall:1]]', { label: 'one' });\n\
         const b = await agent('same [[stall:1]]', { label: 'two' });\n\
         let c = 'answered';\n\
         try { await agent('twice [[stall:2]]', { label: 'three' }); } catch (e) { c = e.message; }\n\
         return [a, b, c];",
        &["--stall-timeout", "200ms", "--attempts", "2"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"][0], "same [[stall:1]]");
    assert_eq!(r["result"][1], "same [[stall:1]]");
    assert!(
        r["result"][2]
            .as_str()
            .unwrap()
            .contains("stalled on all 2 attempts"),
        "{r}"
    );
    assert_eq!(agent(&r, "one")["attempts"], 2);
    assert_eq!(
        agent(&r, "two")["attempts"],
        2,
        "a second call with the same prompt counts its own attempts"
    );
    assert_eq!(agent(&r, "three")["attempts"], 2);
    assert_eq!(usage(&r, "attempts"), 6);
}

#[test]
fn spec_extra_echo_ratelimit_wait_is_not_a_stall() {
    let env = Env::new();
    let (code, r) = env.run_body(
        "return await agent('rl [[ratelimit:2]]', { label: 'rl' });",
        &["--stall-timeout", "100ms", "--attempts", "1"],
    );
    assert_eq!(code, 0, "{r}");
    assert_eq!(r["result"], "rl [[ratelimit:2]]");
    assert_eq!(agent(&r, "rl")["status"], "completed");
    assert_eq!(agent(&r, "rl")["attempts"], 3);
    assert_eq!(usage(&r, "errors"), 0);
    assert!(
        !r["logs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l.as_str().unwrap().contains("[stall]")),
        "{r}"
    );
}
