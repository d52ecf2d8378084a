// The JavaScript half of the workflow globals. It runs once per run, before the script, in a
// bare QuickJS realm that has no I/O. `__host` is installed by the Rust side (runtime.rs) and
// is removed from the global object here, so scripts cannot reach it.
//
// What lives here: argument checking of agent(), the combinators parallel() and pipeline()
// (pure promise code: W28–W30), phase(), log(), budget, args, workflow() (W36), and the
// determinism guard (W07). What the host does: everything that touches run state.
(function (host) {
  'use strict';
  // Every code a call rejects with (reject.rs is the list).
  const CODES = host.codes;
  const MAX_ITEMS = 4096;
  const RealDate = Date;
  const realEval = eval;
  const JSONstringify = JSON.stringify;
  const JSONparse = JSON.parse;

  function describe(e) {
    if (e instanceof Error) return e.message ? e.name + ': ' + e.message : e.name;
    if (e === null) return 'null';
    if (e === undefined) return 'undefined';
    if (typeof e === 'object') {
      try { return JSONstringify(e); } catch (_) { return String(e); }
    }
    return String(e);
  }

  function shortDescribe(e) {
    if (e instanceof Error && e.message) return e.message;
    return describe(e);
  }

  function typeError(message, code) {
    const e = new TypeError(message);
    e.code = code;
    return e;
  }

  function makeError(message, code) {
    const e = new Error(message);
    if (code) e.code = code;
    return e;
  }
  host.setErrorFactory(makeError);

  function text(args) {
    return Array.prototype.map.call(args, function (m) {
      if (typeof m === 'string') return m;
      if (m === undefined) return 'undefined';
      if (typeof m === 'object' && m !== null) {
        try { return JSONstringify(m); } catch (_) { return String(m); }
      }
      return String(m);
    }).join(' ');
  }

  function isBudgetError(e) {
    return e instanceof Error && e.code === CODES.BUDGET_EXCEEDED;
  }

  // --- combinators -------------------------------------------------------------------------

  function parallel(thunks) {
    if (!Array.isArray(thunks)) {
      throw typeError('parallel() takes an array of functions, e.g. parallel(items.map(x => () => agent(...))); got ' + (thunks === null ? 'null' : typeof thunks), CODES.INVALID_ARGUMENT);
    }
    if (thunks.length > MAX_ITEMS) {
      const e = new RangeError('parallel() accepts at most ' + MAX_ITEMS + ' items, got ' + thunks.length + '; split the list into batches');
      e.code = CODES.TOO_MANY_ITEMS;
      throw e;
    }
    let dropped = 0;
    const slots = thunks.map(function (t, i) {
      const fail = function (e) {
        if (isBudgetError(e)) dropped++;
        host.failure('parallel[' + i + '] failed: ' + shortDescribe(e));
        return null;
      };
      let p;
      try {
        p = typeof t === 'function' ? t() : t;
      } catch (e) {
        return fail(e);
      }
      return Promise.resolve(p).then(undefined, fail);
    });
    return Promise.all(slots).then(function (results) {
      if (dropped > 0) host.log(dropped + (dropped === 1 ? ' slot' : ' slots') + ' dropped — token budget exceeded');
      return results;
    });
  }

  function pipeline(items) {
    const stages = Array.prototype.slice.call(arguments, 1);
    if (!Array.isArray(items)) {
      throw typeError('pipeline() takes an array of items as its first argument, then one function per stage; got ' + (items === null ? 'null' : typeof items), CODES.INVALID_ARGUMENT);
    }
    if (items.length > MAX_ITEMS) {
      const e = new RangeError('pipeline() accepts at most ' + MAX_ITEMS + ' items, got ' + items.length + '; split the list into batches');
      e.code = CODES.TOO_MANY_ITEMS;
      throw e;
    }
    for (let s = 0; s < stages.length; s++) {
      if (typeof stages[s] !== 'function') {
        throw typeError('pipeline() stage ' + (s + 1) + ' is not a function (got ' + typeof stages[s] + ')', CODES.INVALID_ARGUMENT);
      }
    }
    let dropped = 0;
    async function chain(item, i) {
      let prev = item;
      for (let s = 0; s < stages.length; s++) {
        try {
          prev = await stages[s](prev, item, i);
        } catch (e) {
          if (isBudgetError(e)) dropped++;
          host.failure('pipeline[' + i + '] failed at stage ' + (s + 1) + ': ' + shortDescribe(e));
          return null;
        }
      }
      return prev;
    }
    const chains = [];
    for (let i = 0; i < items.length; i++) chains.push(chain(items[i], i));
    return Promise.all(chains).then(function (results) {
      if (dropped > 0) host.log(dropped + (dropped === 1 ? ' slot' : ' slots') + ' dropped — token budget exceeded');
      return results;
    });
  }

  // --- per-workflow globals ----------------------------------------------------------------

  // One scope per workflow: the top-level script, or a child started by workflow().
  function makeScope(child) {
    const scope = { phase: '' };

    function agent(prompt, opts) {
      if (typeof prompt !== 'string') {
        return Promise.reject(typeError('agent() needs a prompt string as its first argument, got ' + (prompt === null ? 'null' : typeof prompt), CODES.INVALID_PROMPT));
      }
      let optsJson = '{}';
      if (opts !== undefined && opts !== null) {
        if (typeof opts !== 'object' || Array.isArray(opts)) {
          return Promise.reject(typeError('agent() options must be an object, got ' + (Array.isArray(opts) ? 'an array' : typeof opts), CODES.INVALID_OPTION));
        }
        try {
          optsJson = JSONstringify(opts);
        } catch (e) {
          return Promise.reject(typeError('agent() options must be plain data (JSON): ' + shortDescribe(e), CODES.INVALID_OPTION));
        }
      }
      let group;
      if (child !== null) group = '▸ ' + child;
      else if (opts && typeof opts.phase === 'string') group = opts.phase;
      else group = scope.phase;
      return host.agent(prompt, optsJson, group, child === null ? '' : child);
    }

    function phase(title) {
      scope.phase = String(title);
      if (child === null) host.phase(scope.phase);
    }

    function log() {
      host.log(text(arguments));
    }

    return { agent: agent, phase: phase, log: log };
  }

  const budgetTotal = host.budgetTotal() == null ? null : host.budgetTotal();
  const budget = Object.freeze({
    total: budgetTotal,
    spent: function () { return host.spent(); },
    remaining: function () {
      if (budgetTotal === null) return Infinity;
      return Math.max(0, budgetTotal - host.spent());
    },
  });

  const top = makeScope(null);

  function workflow(nameOrRef, childArgs) {
    let ref;
    if (typeof nameOrRef === 'string') ref = nameOrRef;
    else if (nameOrRef && typeof nameOrRef === 'object' && typeof nameOrRef.scriptPath === 'string') ref = { scriptPath: nameOrRef.scriptPath };
    else return Promise.reject(typeError('workflow() takes a saved workflow name or { scriptPath }', CODES.INVALID_ARGUMENT));
    return host.resolveWorkflow(JSONstringify(ref)).then(function (found) {
      const scope = makeScope(found.name);
      let fn;
      try {
        fn = realEval('(async function (agent, parallel, pipeline, phase, log, workflow, args, budget) {' + found.body + '\n})');
      } catch (e) {
        throw makeError('workflow "' + found.name + '" has a syntax error: ' + shortDescribe(e), CODES.WORKFLOW_SYNTAX);
      }
      const nested = function () {
        return Promise.reject(makeError('workflow() cannot be nested: "' + found.name + '" was started by workflow(), so it cannot start another workflow', CODES.WORKFLOW_NESTED));
      };
      return fn(scope.agent, parallel, pipeline, scope.phase, scope.log, nested, childArgs, budget);
    });
  }

  // --- ask() (an extension: a person's answer, awaited durably) ---------------------------

  const MAX_QUESTION = 16384;
  // A timeout: milliseconds as a number, or a duration such as '90s', '30m', '2h', '1d'.
  function timeoutMs(t) {
    if (typeof t === 'number' && isFinite(t) && t > 0) return Math.ceil(t);
    if (typeof t === 'string') {
      const m = /^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)\s*$/.exec(t);
      if (m) {
        const unit = { ms: 1, s: 1000, m: 60000, h: 3600000, d: 86400000 }[m[2]];
        const ms = Math.ceil(Number(m[1]) * unit);
        if (ms > 0) return ms;
      }
    }
    throw typeError('ask() timeout must be a positive number of milliseconds or a duration such as "30m", "2h" or "1d"; got ' + describe(t), CODES.INVALID_OPTION);
  }

  function ask(question, opts) {
    if (typeof question !== 'string' || question.trim() === '') {
      return Promise.reject(typeError('ask() needs the question as a non-empty string, got ' + (question === null ? 'null' : typeof question), CODES.INVALID_PROMPT));
    }
    if (question.length > MAX_QUESTION) {
      return Promise.reject(typeError('ask() takes a question of at most ' + MAX_QUESTION + ' characters, got ' + question.length + '; link to the details instead', CODES.TOO_LARGE));
    }
    const o = {};
    if (opts !== undefined && opts !== null) {
      if (typeof opts !== 'object' || Array.isArray(opts)) {
        return Promise.reject(typeError('ask() options must be an object ({ schema, timeout, label }), got ' + (Array.isArray(opts) ? 'an array' : typeof opts), CODES.INVALID_OPTION));
      }
      try {
        if (opts.schema !== undefined && opts.schema !== null) {
          if (typeof opts.schema !== 'object' || Array.isArray(opts.schema)) throw typeError('ask() schema must be a JSON Schema object', CODES.INVALID_OPTION);
          o.schema = JSONparse(JSONstringify(opts.schema));
        }
        if (opts.timeout !== undefined && opts.timeout !== null) o.timeoutMs = timeoutMs(opts.timeout);
        if (opts.label !== undefined && opts.label !== null) {
          if (typeof opts.label !== 'string') throw typeError('ask() label must be a string', CODES.INVALID_OPTION);
          o.label = opts.label;
        }
      } catch (e) {
        if (e && e.code) return Promise.reject(e);
        return Promise.reject(typeError('ask() options must be plain data (JSON): ' + shortDescribe(e), CODES.INVALID_OPTION));
      }
    }
    return host.ask(question, JSONstringify(o));
  }

  // --- determinism guard (W07) -------------------------------------------------------------

  function refuse(what, hint) {
    throw makeError(what + ' is not allowed in workflow scripts: it would break resume, because a relaunched run must repeat the same agent() calls; ' + hint, CODES.NONDETERMINISTIC);
  }
  function GuardedDate() {
    if (!new.target) refuse('Date()', 'pass timestamps in through args');
    if (arguments.length === 0) refuse('new Date() without an argument', 'pass timestamps in through args (new Date(x) with an argument works)');
    return Reflect.construct(RealDate, Array.prototype.slice.call(arguments), new.target);
  }
  GuardedDate.prototype = RealDate.prototype;
  GuardedDate.UTC = RealDate.UTC;
  GuardedDate.parse = RealDate.parse;
  GuardedDate.now = function now() { refuse('Date.now()', 'pass timestamps in through args'); };
  Object.defineProperty(RealDate.prototype, 'constructor', { value: GuardedDate, writable: true, configurable: true });
  Object.defineProperty(globalThis, 'Date', { value: GuardedDate, writable: true, configurable: true });
  Math.random = function random() { refuse('Math.random()', 'derive variety from the item index instead'); };
  // QuickJS adds a `performance` clock; the realm must have none (its reading would differ on
  // every replay), so every member of it refuses.
  const noClock = function () { refuse('performance.now()', 'pass timestamps in through args'); };
  const performance = {};
  Object.defineProperty(performance, 'now', { value: noClock, enumerable: true });
  Object.defineProperty(performance, 'timeOrigin', { get: noClock, enumerable: true });
  Object.defineProperty(globalThis, 'performance', { value: Object.freeze(performance), writable: true, configurable: true });
  // Atomics.wait blocks the script thread with a timeout (a clock of sorts, and a way to hang
  // outside the CPU limit); nothing in a workflow needs it.
  const noWait = function () { refuse('Atomics.wait()', 'a workflow script cannot block; await agent() calls instead'); };
  if (typeof Atomics === 'object') {
    Object.defineProperty(Atomics, 'wait', { value: noWait, writable: true, configurable: true });
    if ('waitAsync' in Atomics) Object.defineProperty(Atomics, 'waitAsync', { value: noWait, writable: true, configurable: true });
  }

  // --- install -----------------------------------------------------------------------------

  const argsJson = host.argsJson();
  const globals = {
    agent: top.agent,
    parallel: parallel,
    pipeline: pipeline,
    phase: top.phase,
    log: top.log,
    workflow: workflow,
    args: argsJson == null ? undefined : JSONparse(argsJson),
    budget: budget,
    ask: ask,
  };
  for (const name in globals) {
    Object.defineProperty(globalThis, name, { value: globals[name], writable: true, configurable: true, enumerable: false });
  }
  delete globalThis.__host;
})(globalThis.__host);
