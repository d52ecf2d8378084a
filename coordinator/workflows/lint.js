export const meta = {
  name: 'lint',
  description: 'Check an LLM-maintained wiki: fix structural problems directly, report contradictions, merges and stale facts for a person to decide',
  whenToUse: 'Health check of a wiki directory kept by agents. args: { wiki: "path/to/wiki" } (relative to the workspace), or the path as a string.',
  phases: [{ title: 'Lint', detail: 'one agent in the wiki directory' }],
};

// Copy this file into .flotilla/workflows/ (or .claude/workflows/) to change it.
const input = typeof args === 'string' ? { wiki: args } : (args || {});
const wiki = String(input.wiki || '').replace(/\/+$/, '');
if (!wiki) throw new Error('lint needs the wiki directory: --args \'{"wiki": "wiki"}\'');

// The agent edits files in the wiki (and may list or move them with the shell).
const WIKI_TOOLS = ['Read', 'Write', 'Edit', 'Glob', 'Grep', 'Bash'];

phase('Lint');
const report = await agent(
  `You maintain the wiki in your current working directory (${wiki}/ in the workspace; every path below is relative to it).\n` +
    `Read ./SCHEMA.md (the wiki's conventions), ./index.md (the list of pages) and every page under ./pages/.\n` +
    `Check: contradictions between pages; stale claims; orphan pages that nothing links to; pages the index names that are missing; duplicate pages on one subject; broken or missing cross-references; whether ./index.md matches the pages; pages that drifted from ./SCHEMA.md.\n` +
    `Fix structural problems yourself: broken links, orphans (link them from ./index.md), index entries, schema drift in layout. ` +
    `Do NOT resolve contradictions, merge pages or change facts: report those for a person to decide.\n` +
    `Append one line to ./log.md saying what you fixed. Answer with the JSON summary.`,
  {
    label: 'lint',
    cwd: wiki,
    tools: WIKI_TOOLS,
    schema: {
      type: 'object',
      properties: {
        fixed: {
          type: 'array',
          items: {
            type: 'object',
            properties: { page: { type: 'string' }, problem: { type: 'string' }, fix: { type: 'string' } },
            required: ['page', 'problem', 'fix'],
          },
        },
        forReview: {
          type: 'array',
          items: {
            type: 'object',
            properties: {
              kind: { enum: ['contradiction', 'merge', 'stale'] },
              pages: { type: 'array', items: { type: 'string' } },
              note: { type: 'string' },
            },
            required: ['kind', 'pages', 'note'],
          },
        },
      },
      required: ['fixed', 'forReview'],
    },
  },
);
if (!report) throw new Error('the lint agent failed');
return { wiki, ...report };
