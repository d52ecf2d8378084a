export const meta = {
  name: 'ingest',
  description: 'Fold new source files into an LLM-maintained wiki, one source at a time, and lint the wiki every N sources',
  whenToUse: 'Keeping a wiki current from new documents. args: { wiki: "wiki", sources: ["inbox/a.md", ...], lintEvery?: 10 }, paths relative to the workspace.',
  phases: [
    { title: 'Ingest', detail: 'one agent per source, working in the wiki' },
    { title: 'Lint', detail: 'every N sources, and at the end' },
  ],
};

// Copy this file into .flotilla/workflows/ (or .claude/workflows/) to change it.
const input = args || {};
const wiki = String(input.wiki || '').replace(/\/+$/, '');
const sources = (input.sources || []).map(String).filter(Boolean);
const lintEvery = input.lintEvery || 10;
if (!wiki || sources.length === 0) {
  throw new Error('ingest needs a wiki and sources: --args \'{"wiki": "wiki", "sources": ["inbox/a.md"]}\'');
}

// The agent works inside the wiki, so a source is named by its path from there.
const parts = (p) => p.split('/').filter((x) => x && x !== '.');
function fromWiki(path) {
  const w = parts(wiki);
  const s = parts(path);
  let common = 0;
  while (common < w.length && common < s.length && w[common] === s[common]) common++;
  return [...w.slice(common).map(() => '..'), ...s.slice(common)].join('/') || '.';
}

const summarySchema = {
  type: 'object',
  properties: {
    operations: {
      type: 'array',
      items: {
        type: 'object',
        properties: {
          op: { enum: ['create', 'update', 'link', 'index', 'log'] },
          page: { type: 'string' },
          reason: { type: 'string' },
        },
        required: ['op', 'page', 'reason'],
      },
    },
  },
  required: ['operations'],
};

// Lint runs as the bundled (or your saved) `lint` workflow. When ingest itself was started by
// workflow(), nesting stops there: lint is skipped, and the log says so.
async function lint(after) {
  try {
    lints.push({ after, report: await workflow('lint', { wiki }) });
  } catch (e) {
    log(`lint after ${after} source(s) did not run: ${e && e.message ? e.message : e}`);
  }
}

// The agent edits files in the wiki (and may list or move them with the shell).
const WIKI_TOOLS = ['Read', 'Write', 'Edit', 'Glob', 'Grep', 'Bash'];

const ingested = [];
const failed = [];
const lints = [];
// Sources go one at a time: each agent edits the shared index and log.
for (let i = 0; i < sources.length; i++) {
  phase('Ingest');
  const src = fromWiki(sources[i]);
  const r = await agent(
    `You maintain the wiki in your current working directory (${wiki}/ in the workspace; every path below is relative to it).\n` +
      `First read ./SCHEMA.md (the wiki's conventions) and ./index.md.\n` +
      `Then read the new source at ${src} and fold what it says into the wiki: update the pages it touches and create pages under ./pages/ for new subjects, following ./SCHEMA.md. ` +
      `Repair links between the pages you touched, add every new page to ./index.md, and append one line to ./log.md naming the source and what changed.\n` +
      `Answer with the JSON summary of the operations you made, each with its reason.`,
    { label: `ingest ${sources[i]}`.slice(0, 60), cwd: wiki, tools: WIKI_TOOLS, schema: summarySchema },
  );
  if (r) ingested.push({ source: sources[i], operations: r.operations || [] });
  else { failed.push(sources[i]); log(`ingesting ${sources[i]} failed; the wiki is unchanged by it`); }
  const done = i + 1;
  if (done % lintEvery === 0 && done < sources.length) {
    phase('Lint');
    await lint(done);
  }
}
phase('Lint');
await lint(sources.length);

return {
  wiki,
  ingested,
  failed,
  lints,
  counts: {
    sources: sources.length,
    ingested: ingested.length,
    failed: failed.length,
    operations: ingested.reduce((n, s) => n + s.operations.length, 0),
    lintRuns: lints.length,
  },
};
