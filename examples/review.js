export const meta = {
  name: 'review',
  description: 'Review the files of a directory: find issues per file, verify each with independent skeptics',
  whenToUse: 'args: { dir: "path", files?: ["a.rs", ...] }',
  phases: [
    { title: 'Find', detail: 'one reviewer per file' },
    { title: 'Verify', detail: 'three skeptics per finding' },
    { title: 'Report' },
  ],
};

const dir = (args && args.dir) || '.';
const files = (args && args.files) || ['main.rs', 'lib.rs', 'config.rs'];
log(`reviewing ${files.length} files in ${dir}`);

const FINDINGS = {
  type: 'object',
  properties: {
    issues: {
      type: 'array',
      items: {
        type: 'object',
        properties: { where: { type: 'string' }, what: { type: 'string' }, severity: { enum: ['high', 'medium', 'low'] } },
        required: ['where', 'what'],
      },
    },
  },
  required: ['issues'],
};
const VERDICT = {
  type: 'object',
  properties: { refuted: { type: 'boolean' }, reason: { type: 'string' } },
  required: ['refuted'],
};

// Find → verify as a pipeline: a file's findings are verified while other files are still being read.
const perFile = await pipeline(
  files,
  (file) => agent(`Review ${dir}/${file}. List concrete defects with their location.`, {
    label: `find ${file}`, phase: 'Find', schema: FINDINGS,
  }),
  (found, file) => parallel((found ? found.issues : []).map((issue, i) => () =>
    parallel(['correctness', 'security', 'reproduction'].map((lens) => () =>
      agent(`As a ${lens} skeptic, try to refute this finding in ${dir}/${file}: ${issue.what} at ${issue.where}`, {
        label: `verify ${file}#${i} (${lens})`, phase: 'Verify', schema: VERDICT,
      }),
    )).then((votes) => {
      const valid = votes.filter(Boolean);
      const refuted = valid.filter((v) => v.refuted).length;
      return { file, ...issue, votes: valid.length, confirmed: valid.length >= 2 && refuted < 2 };
    }),
  )),
);

phase('Report');
const findings = perFile.filter(Boolean).flat().filter(Boolean);
const confirmed = findings.filter((f) => f.confirmed);
log(`${confirmed.length} of ${findings.length} findings confirmed`);
const summary = await agent(
  `Summarize these confirmed findings for ${dir} in three sentences:\n${JSON.stringify(confirmed)}`,
  { label: 'summary' },
);
return { dir, files: files.length, confirmed, summary };
