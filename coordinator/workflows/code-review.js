export const meta = {
  name: 'code-review',
  description: 'Find issues file by file, have skeptics with different lenses try to refute each one, and report the confirmed findings with locations',
  whenToUse: 'Reviewing a change or a code base. args: { files: ["src/a.rs", ...], focus?: "what matters most" } or a list of paths. The agents read the files from their working directory.',
  phases: [
    { title: 'Find', detail: 'one reviewer per file or module' },
    { title: 'Verify', detail: 'perspective-diverse skeptics per finding' },
    { title: 'Report' },
  ],
};

// Copy this file into .flotilla/workflows/ (or .claude/workflows/) to change it.
const input = Array.isArray(args) ? { files: args } : (args || {});
const files = (input.files || []).map(String).filter(Boolean);
if (files.length === 0) {
  throw new Error('code-review needs files to review: pass --args \'{"files": ["src/main.rs"]}\'');
}
const focus = input.focus ? `\nFocus on: ${input.focus}` : '';
const LENSES = ['correctness', 'security', 'performance', 'reproduction: can you make it happen?'];
const VOTERS = input.voters || 3;
// Reviewers read code; they never change it.
const READ = ['Read', 'Grep', 'Glob'];

phase('Find');
const found = await pipeline(files, (file, _item, i) =>
  agent(
    `Review ${file} for real defects (bugs, security holes, data loss, races, wrong error handling). Report only problems you can point at: a line, what goes wrong, and why. No style remarks.${focus}`,
    {
      label: `find ${file}`.slice(0, 60),
      tools: READ,
      schema: {
        type: 'object',
        properties: {
          findings: {
            type: 'array',
            items: {
              type: 'object',
              properties: {
                title: { type: 'string' },
                line: { type: 'integer', minimum: 1 },
                severity: { enum: ['high', 'medium', 'low'] },
                explanation: { type: 'string' },
              },
              required: ['title', 'line', 'severity', 'explanation'],
            },
          },
        },
        required: ['findings'],
      },
    },
  ),
);

const findings = [];
found.forEach((r, i) => {
  if (r === null) { log(`the reviewer of ${files[i]} failed; that file is not covered`); return; }
  for (const f of r.findings || []) findings.push({ ...f, file: files[i] });
});
// The same problem reported twice for one place is checked once.
const unique = [];
const keys = new Set();
for (const f of findings) {
  const key = `${f.file}:${f.line}:${String(f.title).toLowerCase()}`;
  if (keys.has(key)) continue;
  keys.add(key);
  unique.push(f);
}
if (unique.length < findings.length) log(`merged ${findings.length - unique.length} duplicate finding(s)`);

phase('Verify');
const checked = await pipeline(unique, async (f, _item, i) => {
  const votes = await parallel(
    Array.from({ length: VOTERS }, (_, v) => () =>
      agent(
        `A reviewer claims this defect in ${f.file} at line ${f.line}: "${f.title}" — ${f.explanation}\nCheck it through the lens of ${LENSES[v % LENSES.length]}. Try to show it is NOT a real problem. Answer confirmed: true only if it holds up.`,
        {
          label: `verify ${i + 1}.${v + 1}`,
          tools: READ,
          schema: {
            type: 'object',
            properties: { confirmed: { type: 'boolean' }, reason: { type: 'string' } },
            required: ['confirmed', 'reason'],
          },
        },
      ),
    ),
  );
  // A null vote abstains, never confirms; a majority of the valid votes must confirm.
  const valid = votes.filter((v) => v && typeof v.confirmed === 'boolean');
  const yes = valid.filter((v) => v.confirmed).length;
  return { ...f, votes: valid.length, confirmations: yes, confirmed: valid.length > 0 && yes * 2 > valid.length, reasons: valid.map((v) => v.reason) };
});

phase('Report');
const confirmed = checked.filter((f) => f && f.confirmed);
const rejected = checked.filter((f) => f && !f.confirmed);
if (rejected.length) log(`${rejected.length} finding(s) did not survive verification`);
const order = { high: 0, medium: 1, low: 2 };
confirmed.sort((a, b) => (order[a.severity] ?? 3) - (order[b.severity] ?? 3) || a.file.localeCompare(b.file) || a.line - b.line);

return {
  findings: confirmed.map((f) => ({
    location: `${f.file}:${f.line}`,
    severity: f.severity,
    title: f.title,
    explanation: f.explanation,
    confirmations: `${f.confirmations}/${f.votes}`,
  })),
  rejected: rejected.map((f) => ({ location: `${f.file}:${f.line}`, title: f.title, reasons: f.reasons })),
  counts: { files: files.length, found: findings.length, checked: unique.length, confirmed: confirmed.length, rejected: rejected.length },
};
