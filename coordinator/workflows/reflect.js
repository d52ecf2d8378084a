export const meta = {
  name: 'reflect',
  description: 'Turn a coding session transcript into a diary and checked, typed updates to a playbook of rules',
  whenToUse: 'After a coding session, to keep an agent memory playbook current. args: { transcript: "...", playbook: [{ id, rule, helpful, harmful }], dryRun?: false, window?: 20000 }.',
  phases: [
    { title: 'Diary', detail: 'what happened in the session' },
    { title: 'Reflect', detail: 'typed deltas against the playbook, one transcript window at a time' },
    { title: 'Validate', detail: 'accept, refine or reject each addition' },
    { title: 'Curate', detail: 'merge into the playbook in plain code' },
  ],
};

// Copy this file into .flotilla/workflows/ (or .claude/workflows/) to change it.
const input = args || {};
const transcript = String(input.transcript || '');
if (!transcript.trim()) throw new Error('reflect needs a session transcript: --args \'{"transcript": "...", "playbook": []}\'');
const playbook = (Array.isArray(input.playbook) ? input.playbook : []).map((r) => ({
  id: String(r.id), rule: String(r.rule || ''), helpful: r.helpful | 0, harmful: r.harmful | 0,
}));
const WINDOW = input.window || 20000;           // transcript characters one reflector sees
const DIARY_CHARS = input.diaryChars || 40000;  // transcript characters the diary agent sees
const MAX_RULES = input.maxRules || 60;          // playbook rules shown to the reflector
const MAX_RULE_CHARS = 500;

const norm = (s) => String(s || '').trim().replace(/\s+/g, ' ').toLowerCase();

phase('Diary');
if (transcript.length > DIARY_CHARS) log(`the diary agent sees the first ${DIARY_CHARS} of ${transcript.length} transcript characters`);
const diary = await agent(
  `Read this coding session transcript and write its diary.\n\n<transcript>\n${transcript.slice(0, DIARY_CHARS)}\n</transcript>`,
  {
    label: 'diary',
    schema: {
      type: 'object',
      properties: {
        status: { enum: ['success', 'partial', 'failure'] },
        accomplishments: { type: 'array', items: { type: 'string' } },
        decisions: { type: 'array', items: { type: 'string' } },
        challenges: { type: 'array', items: { type: 'string' } },
        preferences: { type: 'array', items: { type: 'string' } },
        keyLearnings: { type: 'array', items: { type: 'string' } },
      },
      required: ['status', 'accomplishments', 'decisions', 'challenges', 'preferences', 'keyLearnings'],
    },
  },
);
if (!diary) throw new Error('the diary agent failed; nothing to reflect on');

phase('Reflect');
// Bounded context: the most used rules only, and one transcript window per iteration.
const shown = [...playbook].sort((a, b) => (b.helpful + b.harmful) - (a.helpful + a.harmful)).slice(0, MAX_RULES);
if (shown.length < playbook.length) log(`the reflector sees ${shown.length} of ${playbook.length} rules (the most used)`);
const windows = [];
for (let at = 0; at < transcript.length; at += WINDOW) windows.push(transcript.slice(at, at + WINDOW));
const deltaSchema = {
  type: 'object',
  properties: {
    deltas: {
      type: 'array',
      items: {
        type: 'object',
        properties: {
          type: { enum: ['add', 'helpful', 'harmful', 'replace', 'deprecate'] },
          ruleId: { type: 'string' },
          content: { type: 'string' },
          reason: { type: 'string' },
        },
        required: ['type', 'reason'],
      },
    },
  },
  required: ['deltas'],
};
const proposals = [];
for (let i = 0; i < windows.length; i++) {
  const r = await agent(
    `You maintain a playbook of rules for a coding agent. From this session, propose typed deltas:\n` +
      `- add {content}: a new, specific, reusable rule;\n- helpful / harmful {ruleId}: a rule that helped or hurt in this session;\n` +
      `- replace {ruleId, content}: a better wording of a rule;\n- deprecate {ruleId}: a rule that is wrong or obsolete.\n` +
      `Give a reason for each. Do not repeat deltas already proposed.\n\n` +
      `Diary: ${JSON.stringify(diary)}\n\nPlaybook: ${JSON.stringify(shown)}\n\nAlready proposed: ${JSON.stringify(proposals)}\n\n` +
      `Transcript part ${i + 1} of ${windows.length}:\n<transcript>\n${windows[i]}\n</transcript>`,
    { label: `reflect ${i + 1}/${windows.length}`, schema: deltaSchema },
  ).catch(() => null);
  if (!r) {
    log(`reflector ${i + 1}/${windows.length} failed; keeping the proposals of the ${i} completed iteration(s)`);
    break;
  }
  proposals.push(...(r.deltas || []));
}

if (input.dryRun) {
  return { dryRun: true, proposals, diary };
}

phase('Validate');
const accepted = [];
const rejected = [];
const warnings = [];
const additions = proposals.filter((d) => d && (d.type === 'add' || d.type === 'replace'));
const verdicts = await pipeline(additions, (d, _item, i) =>
  agent(
    `Judge this proposed playbook rule. Accept it if it is specific, correct and reusable; refine it if it is right but badly worded (give the refined text); reject it otherwise. Give a reason.\n\n` +
      `Proposed (${d.type}${d.ruleId ? ' of ' + d.ruleId : ''}): ${d.content}\nWhy: ${d.reason}\n\nDiary: ${JSON.stringify(diary)}`,
    {
      label: `validate ${i + 1}`,
      schema: {
        type: 'object',
        properties: {
          verdict: { enum: ['accept', 'refine', 'reject'] },
          refined: { type: 'string' },
          reason: { type: 'string' },
        },
        required: ['verdict', 'reason'],
      },
    },
  ),
);
const verdictOf = new Map(additions.map((d, i) => [d, verdicts[i]]));

phase('Curate');
const next = playbook.map((r) => ({ ...r }));
const find = (id) => next.find((r) => r.id === id);
let added = 0;
const touched = new Map();
for (const d of proposals) {
  if (!d || typeof d !== 'object') { rejected.push({ delta: d, reason: 'malformed delta' }); continue; }
  if (d.ruleId && ['helpful', 'harmful', 'replace', 'deprecate'].includes(d.type)) {
    const kinds = touched.get(d.ruleId) || new Set();
    kinds.add(d.type);
    touched.set(d.ruleId, kinds);
  }
  if (d.type === 'add' || d.type === 'replace') {
    const content = String(d.content || '').trim();
    if (!content || content.length > MAX_RULE_CHARS) {
      rejected.push({ delta: d, reason: content ? `longer than ${MAX_RULE_CHARS} characters` : 'no content' });
      continue;
    }
    const v = verdictOf.get(d);
    if (!v) { rejected.push({ delta: d, reason: 'its validator failed' }); continue; }
    if (v.verdict === 'reject') { rejected.push({ delta: d, reason: v.reason }); continue; }
    const text = v.verdict === 'refine' && v.refined ? v.refined.trim() : content;
    if (d.type === 'replace') {
      const rule = find(d.ruleId);
      if (!rule) { rejected.push({ delta: d, reason: `no rule ${d.ruleId}` }); continue; }
      rule.rule = text;
      accepted.push({ delta: { ...d, content: text }, reason: v.reason });
      continue;
    }
    // An exact duplicate reinforces the existing rule instead of adding another.
    const same = next.find((r) => norm(r.rule) === norm(text));
    if (same) {
      same.helpful += 1;
      accepted.push({ delta: { type: 'helpful', ruleId: same.id, reason: `duplicate of ${same.id}: reinforced` }, reason: v.reason });
      continue;
    }
    added += 1;
    const id = `r${playbook.length + added}`;
    next.push({ id, rule: text, helpful: 0, harmful: 0 });
    accepted.push({ delta: { ...d, ruleId: id, content: text }, reason: v.reason });
    continue;
  }
  if (d.type === 'helpful' || d.type === 'harmful' || d.type === 'deprecate') {
    const rule = find(d.ruleId);
    if (!rule) { rejected.push({ delta: d, reason: `no rule ${d.ruleId}` }); continue; }
    if (d.type === 'deprecate') rule.deprecated = true;
    else rule[d.type] += 1;
    accepted.push({ delta: d, reason: d.reason });
    continue;
  }
  rejected.push({ delta: d, reason: `unknown delta type ${JSON.stringify(d.type)}` });
}
for (const [id, kinds] of touched) {
  if ((kinds.has('helpful') && kinds.has('harmful')) || (kinds.has('deprecate') && kinds.size > 1)) {
    warnings.push(`conflicting deltas for ${id}: ${[...kinds].join(', ')}`);
  }
}
for (const w of warnings) log(w);

return {
  playbook: next.filter((r) => !r.deprecated),
  deprecated: next.filter((r) => r.deprecated).map((r) => r.id),
  accepted,
  rejected,
  warnings,
  diary,
};
