#!/usr/bin/env node
// Tokenizer throughput: metrale (bench/metrale_tokenizer_bench) against Hugging Face tokenizers
// (npm `tokenizers`, the Rust library) on the same deterministic corpus, one document per encode
// call, one thread each, measured in process CPU time. Prints both and the ratio; --markdown
// prints a docs/perf.md section.
//
// Usage: node bench_tokenizer.mjs --bench PATH/metrale_tokenizer_bench
//                                 [--tokenizer qwen3|deepseek_v3|all] [--megabytes N] [--repeat N]
//                                 [--seed N] [--markdown]
import { execFileSync, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { buildBenchCorpus } from './corpus.mjs';
import { loadHfTokenizers, TOKENIZERS } from './tokenizer_oracle.mjs';

function parseArgs(argv) {
  const args = { bench: null, tokenizer: 'all', megabytes: 4, repeat: 5, seed: 7, markdown: false };
  for (let i = 0; i < argv.length; i++) {
    const key = argv[i].replace(/^--/, '');
    if (!(key in args)) throw new Error(`unknown option ${argv[i]}`);
    args[key] = key === 'markdown' ? true : argv[++i];
  }
  if (!args.bench) throw new Error('--bench PATH is required');
  for (const key of ['megabytes', 'repeat', 'seed']) args[key] = Number(args[key]);
  return args;
}

// Splits the corpus into documents of 2-16 KiB at paragraph boundaries (a chat request's size).
function documentsOf(text) {
  const documents = [];
  let current = '';
  let limit = 2048;
  for (const paragraph of text.split('\n\n')) {
    current += (current ? '\n\n' : '') + paragraph;
    if (Buffer.byteLength(current) >= limit) {
      documents.push(current);
      current = '';
      limit = 2048 << (documents.length % 4);
    }
  }
  if (current) documents.push(current);
  return documents;
}

async function benchHf(Tokenizer, dir, documents, repeat) {
  const tokenizer = Tokenizer.fromFile(path.join(dir, 'tokenizer.json'));
  const encodeAll = async () => {
    let tokens = 0;
    for (const document of documents) tokens += (await tokenizer.encode(document, null, { addSpecialTokens: false })).getIds().length;
    return tokens;
  };
  const tokens = await encodeAll();  // warm-up (fills HF's BPE cache)
  // CPU time of the whole process (user + system): the encode runs on one libuv worker thread
  // while the main thread waits, so this is the cost of the encodes plus the binding's overhead,
  // and unlike wall time it hardly moves when the machine is busy.
  let best = Infinity;
  let bestWall = Infinity;
  for (let pass = 0; pass < repeat; pass++) {
    const cpu = process.cpuUsage();
    const start = process.hrtime.bigint();
    await encodeAll();
    const used = process.cpuUsage(cpu);
    best = Math.min(best, (used.user + used.system) / 1e6);
    bestWall = Math.min(bestWall, Number(process.hrtime.bigint() - start) / 1e9);
  }
  return { tokens, seconds: best, wallSeconds: bestWall };
}

function benchMetrale(binary, dir, corpusFile, repeat) {
  const run = spawnSync(binary, ['--model', dir, '--corpus', corpusFile, '--repeat', String(repeat)], { encoding: 'utf8' });
  if (run.status !== 0) throw new Error(`${binary} exited ${run.status}: ${run.stderr}`);
  return JSON.parse(run.stdout.trim().split('\n').at(-1));
}

function cpuModel() {
  return os.cpus()[0]?.model?.trim() ?? 'unknown CPU';
}

function gitCommit() {
  try {
    return execFileSync('git', ['rev-parse', '--short', 'HEAD'], { cwd: path.dirname(new URL(import.meta.url).pathname) })
      .toString().trim();
  } catch {
    return 'uncommitted';
  }
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  // One thread for the reference too (the Rust library parallelises only batches, but be sure).
  process.env.RAYON_NUM_THREADS = '1';
  process.env.TOKENIZERS_PARALLELISM = 'false';
  const Tokenizer = await loadHfTokenizers();
  const text = buildBenchCorpus(args.seed, args.megabytes * 1e6);
  const documents = documentsOf(text);
  const bytes = documents.reduce((sum, document) => sum + Buffer.byteLength(document), 0);
  const work = fs.mkdtempSync(path.join(os.tmpdir(), 'metrale-bench-'));
  const corpusFile = path.join(work, 'corpus.jsonl');
  fs.writeFileSync(corpusFile, documents.map((document) => JSON.stringify(document)).join('\n') + '\n');

  const names = args.tokenizer === 'all' ? Object.keys(TOKENIZERS) : [args.tokenizer];
  const rows = [];
  for (const name of names) {
    const dir = TOKENIZERS[name];
    const hf = await benchHf(Tokenizer, dir, documents, args.repeat);
    const ours = benchMetrale(args.bench, dir, corpusFile, args.repeat);
    if (ours.tokens !== hf.tokens) console.error(`warning: ${name}: token counts differ (HF ${hf.tokens}, metrale ${ours.tokens})`);
    const mb = bytes / 1e6;
    rows.push({
      name, tokens: hf.tokens,
      hfMbs: mb / hf.seconds, hfTps: hf.tokens / hf.seconds,
      ourMbs: mb / ours.encode_seconds, ourTps: ours.tokens / ours.encode_seconds,
      ratio: hf.seconds / ours.encode_seconds, decodeMbs: ours.decode_mb_per_s, load: ours.load_seconds,
    });
  }
  fs.rmSync(work, { recursive: true, force: true });

  const fmt = (x, digits = 1) => x.toFixed(digits);
  const corpus = `${documents.length} documents, ${fmt(bytes / 1e6, 2)} MB (seed ${args.seed}: English-like prose, ` +
    'source code, CJK, mixed scripts, numbers and emoji)';
  if (args.markdown) {
    console.log('## Tokenizer\n');
    console.log(`Encode throughput of \`metrale::Tokenizer\` against Hugging Face \`tokenizers\` 0.23.2 (npm, the Rust ` +
      'library), one thread each, one encode call per document, best of ' +
      `${args.repeat} passes after a warm-up pass, in process CPU time (user + system; for HF this includes ` +
      'the node binding, which creates an Encoding object with offsets per call).\n');
    console.log(`- corpus: ${corpus}`);
    console.log(`- machine: ${cpuModel()}, ${os.cpus().length} cores (shared with other work)`);
    console.log(`- command: \`node tools/oracles/bench_tokenizer.mjs --bench build/bin/metrale_tokenizer_bench --megabytes ${args.megabytes} --repeat ${args.repeat} --markdown\``);
    console.log(`- commit: ${gitCommit()}, date: ${new Date().toISOString().slice(0, 10)}\n`);
    console.log('| tokenizer | tokens | HF MB/s | HF tokens/s | metrale MB/s | metrale tokens/s | metrale / HF | metrale decode MB/s |');
    console.log('|---|---|---|---|---|---|---|---|');
    for (const r of rows) {
      console.log(`| ${r.name} | ${r.tokens} | ${fmt(r.hfMbs)} | ${fmt(r.hfTps / 1e6, 2)} M | ${fmt(r.ourMbs)} | ` +
        `${fmt(r.ourTps / 1e6, 2)} M | ${fmt(r.ratio, 2)}x | ${fmt(r.decodeMbs, 0)} |`);
    }
  } else {
    console.log(`corpus: ${corpus}`);
    for (const r of rows) {
      console.log(`${r.name}: ${r.tokens} tokens; HF ${fmt(r.hfMbs)} MB/s (${fmt(r.hfTps / 1e6, 2)} M tokens/s), ` +
        `metrale ${fmt(r.ourMbs)} MB/s (${fmt(r.ourTps / 1e6, 2)} M tokens/s): ${fmt(r.ratio, 2)}x HF; ` +
        `metrale decode ${fmt(r.decodeMbs, 0)} MB/s, load ${fmt(r.load, 2)} s`);
    }
  }
}

await main();
