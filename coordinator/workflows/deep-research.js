export const meta = {
  name: 'deep-research',
  description: 'Research a question from several search angles, check every claim with independent refuters, and write a sourced report',
  whenToUse: 'A question that needs sources and checked claims. args: the question as a string (or { question, maxSources, maxClaims }). If the question is vague, ask 2-3 clarifying questions before launching.',
  phases: [
    { title: 'Scope', detail: 'turn the question into search angles' },
    { title: 'Search', detail: 'one searcher per angle' },
    { title: 'Fetch', detail: 'extract falsifiable claims with quotes' },
    { title: 'Verify', detail: 'three independent refuters per claim' },
    { title: 'Synthesize', detail: 'one sourced report' },
  ],
};

// Copy this file into .flotilla/workflows/ (or .claude/workflows/) to change it.
const input = typeof args === 'string' ? { question: args } : (args || {});
const question = String(input.question || '').trim();
if (!question) {
  throw new Error('deep-research needs a question: pass it as args, e.g. --args \'"How do tides work?"\'');
}
const MAX_SOURCES = input.maxSources || 15;
const MAX_CLAIMS = input.maxClaims || 25;
const VOTERS = 3;
// The searchers, readers and verifiers need the web; nothing else.
const WEB = ['WebSearch', 'WebFetch'];

phase('Scope');
const scope = await agent(
  `Turn this research question into 3 to 6 distinct web search angles (usually 5). Each angle should find different sources.\n\nQuestion: ${question}`,
  {
    label: 'scope',
    schema: {
      type: 'object',
      properties: {
        angles: { type: 'array', items: { type: 'string' }, maxItems: 6 },
      },
      required: ['angles'],
    },
  },
);
const angles = (scope && scope.angles) || [];
if (angles.length === 0) throw new Error('the scope agent found no search angle');

phase('Search');
const searches = await pipeline(angles, (angle, _item, i) =>
  agent(
    `Search the web for: ${angle}\nThis is one angle of the question: ${question}\nReturn the most relevant sources you found (URL and title), best first.`,
    {
      label: `search ${i + 1}`,
      tools: WEB,
      schema: {
        type: 'object',
        properties: {
          sources: {
            type: 'array',
            items: {
              type: 'object',
              properties: { url: { type: 'string' }, title: { type: 'string' } },
              required: ['url'],
            },
          },
        },
        required: ['sources'],
      },
    },
  ),
);

// Dedupe sources across searchers in plain code: the same URL is fetched once.
const seen = new Set();
const sources = [];
let duplicates = 0;
for (const s of searches) {
  for (const src of (s && s.sources) || []) {
    const key = String(src.url || '').trim().replace(/[#?].*$/, '').replace(/\/+$/, '').toLowerCase();
    if (!key) continue;
    if (seen.has(key)) { duplicates++; continue; }
    seen.add(key);
    sources.push({ url: src.url, title: src.title || src.url });
  }
}
if (duplicates > 0) log(`dropped ${duplicates} duplicate source(s) found by more than one searcher`);
const failedSearches = searches.filter((s) => s === null).length;
if (failedSearches > 0) log(`${failedSearches} searcher(s) failed; their angles are not covered`);
if (sources.length > MAX_SOURCES) {
  log(`fetching the first ${MAX_SOURCES} of ${sources.length} sources; ${sources.length - MAX_SOURCES} dropped`);
}
const fetched = sources.slice(0, MAX_SOURCES);

phase('Fetch');
const extracts = await pipeline(fetched, (src, _item, i) =>
  agent(
    `Read ${src.url} (${src.title}). Extract up to 5 falsifiable claims that bear on the question, each with a short verbatim quote that supports it. Grade the source's quality from 1 (weak) to 5 (primary, authoritative).\n\nQuestion: ${question}`,
    {
      label: `fetch ${i + 1}`,
      tools: WEB,
      schema: {
        type: 'object',
        properties: {
          quality: { type: 'integer', minimum: 1, maximum: 5 },
          claims: {
            type: 'array',
            maxItems: 5,
            items: {
              type: 'object',
              properties: {
                claim: { type: 'string' },
                quote: { type: 'string' },
                importance: { type: 'integer', minimum: 1, maximum: 5 },
              },
              required: ['claim', 'quote'],
            },
          },
        },
        required: ['quality', 'claims'],
      },
    },
  ),
);

// A deliberate barrier: rank every claim by importance, then source quality.
const claims = [];
extracts.forEach((e, i) => {
  if (!e) return;
  for (const c of e.claims || []) {
    claims.push({ ...c, importance: c.importance || 1, source: fetched[i].url, quality: e.quality || 1 });
  }
});
claims.sort((a, b) => b.importance - a.importance || b.quality - a.quality);
if (claims.length > MAX_CLAIMS) log(`verifying the top ${MAX_CLAIMS} of ${claims.length} claims; ${claims.length - MAX_CLAIMS} dropped`);
const ranked = claims.slice(0, MAX_CLAIMS);

phase('Verify');
const lenses = ['the evidence in the quote', 'other sources that contradict it', 'whether it is stated too broadly'];
const verdicts = await pipeline(ranked, async (c, _item, i) => {
  const votes = await parallel(
    lenses.slice(0, VOTERS).map((lens, v) => () =>
      agent(
        `Try to refute this claim, focusing on ${lens}. If you are unsure, answer refuted: true.\n\nClaim: ${c.claim}\nQuote: "${c.quote}"\nSource: ${c.source}`,
        {
          label: `verify ${i + 1}.${v + 1}`,
          tools: WEB,
          schema: {
            type: 'object',
            properties: { refuted: { type: 'boolean' }, reason: { type: 'string' } },
            required: ['refuted', 'reason'],
          },
        },
      ),
    ),
  );
  // A null vote abstains; two refutations kill; without a quorum the claim is unverified.
  const valid = votes.filter((v) => v && typeof v.refuted === 'boolean');
  const refutations = valid.filter((v) => v.refuted);
  let status;
  if (refutations.length >= 2) status = 'refuted';
  else if (valid.length < 2) status = 'unverified';
  else status = 'supported';
  return { ...c, status, votes: valid.length, refutations: refutations.length, reasons: refutations.map((v) => v.reason) };
});

const supported = verdicts.filter((v) => v && v.status === 'supported');
const refuted = verdicts.filter((v) => v && v.status === 'refuted');
const unverified = verdicts.filter((v) => v && v.status === 'unverified');
if (refuted.length) log(`${refuted.length} claim(s) refuted and left out of the report`);
if (unverified.length) log(`${unverified.length} claim(s) could not be checked and are reported as unverified`);

phase('Synthesize');
const report = await agent(
  `Write a research report answering: ${question}\n\nUse only these verified claims (merge duplicates, give each conclusion a confidence of high, medium or low, and cite the source URLs):\n${JSON.stringify(supported.map((c) => ({ claim: c.claim, quote: c.quote, source: c.source, quality: c.quality })), null, 1)}\n\nThese claims could not be checked; mention them only as open questions:\n${JSON.stringify(unverified.map((c) => c.claim))}`,
  {
    label: 'synthesize',
    schema: {
      type: 'object',
      properties: {
        summary: { type: 'string' },
        findings: {
          type: 'array',
          items: {
            type: 'object',
            properties: {
              finding: { type: 'string' },
              confidence: { enum: ['high', 'medium', 'low'] },
              sources: { type: 'array', items: { type: 'string' } },
            },
            required: ['finding', 'confidence', 'sources'],
          },
        },
        caveats: { type: 'array', items: { type: 'string' } },
        openQuestions: { type: 'array', items: { type: 'string' } },
      },
      required: ['summary', 'findings'],
    },
  },
);

return {
  question,
  report,
  sources: fetched,
  refuted: refuted.map((c) => ({ claim: c.claim, source: c.source, reasons: c.reasons })),
  unverified: unverified.map((c) => ({ claim: c.claim, source: c.source })),
  counts: {
    angles: angles.length,
    sources: fetched.length,
    duplicateSources: duplicates,
    claims: claims.length,
    verified: ranked.length,
    supported: supported.length,
    refuted: refuted.length,
    unverified: unverified.length,
  },
};
