// What `metrale serve` tells the user while it starts, with stderr a pipe (not a terminal): one
// plain line per stage (tokenizer, weights loading and loaded with tensors and bytes, the engine's
// plan), no progress redraws, the URL on stdout once it serves; and with --log-format json every
// stderr line a JSON record, the stages as events in order, the last one "ready" with the URL.
//
//   node tools/oracles/startup_lines_test.mjs --metrale build/bin/metrale [--model models/default]
import assert from 'node:assert/strict';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { startServer } from './metrale_server.mjs';

const args = process.argv.slice(2);
const option = (name, fallback) => {
  const at = args.indexOf(name);
  return at >= 0 ? args[at + 1] : fallback;
};
const metrale = option('--metrale');
const here = path.dirname(fileURLToPath(import.meta.url));
const modelDir = option('--model', path.join(here, '../../models/default'));
if (!metrale) {
  console.error('usage: startup_lines_test.mjs --metrale PATH [--model DIR]');
  process.exit(2);
}
const serveArgs = ['--model', modelDir, '--threads', '2', '--kv-cache-memory', '64MiB', '--max-model-len', '1536'];

let failures = 0;
const check = async (name, fn) => {
  try {
    await fn();
    console.log(`ok   ${name}`);
  } catch (error) {
    ++failures;
    console.log(`FAIL ${name}: ${error.stack ?? error}`);
  }
};

await check('text lines', async () => {
  const server = await startServer(metrale, serveArgs);
  await server.stop();
  const stderr = server.stderr();
  assert.ok(!stderr.includes('\r') && !stderr.includes('\x1b['), `no redraws off a terminal:\n${stderr}`);
  const lines = stderr.split('\n').filter((line) => line.startsWith('[metrale] '));
  const find = (pattern) => {
    const index = lines.findIndex((line) => pattern.test(line));
    assert.ok(index >= 0, `no line matches ${pattern}:\n${stderr}`);
    return { index, match: lines[index].match(pattern) };
  };
  const tokenizer = find(/^\[metrale\] loading the tokenizer from /);
  const loading = find(/^\[metrale\] loading weights of \S+ from .+ on cpu: (\d+) tensors, ([\d.]+ \S?i?B)$/);
  const loaded = find(/^\[metrale\] loaded weights: (\d+) tensors, ([\d.]+ \S?i?B) in [\d.]+ s \(.+\/s\)$/);
  const planning = find(/^\[metrale\] planning memory and building the engine$/);
  const plan = find(/^\[metrale\] engine ready in [\d.]+ s: KV cache: \d+ blocks of 16 tokens .*max model length 1536/);
  assert.ok(tokenizer.index < loading.index && loading.index < loaded.index && loaded.index < planning.index &&
    planning.index < plan.index, `stages out of order:\n${stderr}`);
  assert.ok(Number(loaded.match[1]) > 0 && Number(loaded.match[1]) <= Number(loading.match[1]));
});

await check('json records', async () => {
  const server = await startServer(metrale, [...serveArgs, '--log-format', 'json']);
  const url = server.url;
  await server.stop();
  const lines = server.stderr().split('\n').filter((line) => line.length > 0);
  const records = lines.map((line) => {
    try {
      return JSON.parse(line);
    } catch {
      throw new Error(`a stderr line is not JSON: ${JSON.stringify(line)}`);
    }
  });
  for (const record of records) {
    assert.match(record.ts, /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/);
    assert.ok(['debug', 'info', 'warn', 'error'].includes(record.level));
    assert.equal(typeof record.msg, 'string');
  }
  const events = records.filter((record) => record.event).map((record) => record.event);
  assert.deepEqual(events, ['tokenizer', 'weights_start', 'weights_done', 'engine_start', 'engine_done', 'ready']);
  const byEvent = Object.fromEntries(records.filter((record) => record.event).map((record) => [record.event, record]));
  assert.ok(byEvent.weights_start.tensors_total > 0 && byEvent.weights_start.bytes_total > 0);
  assert.ok(byEvent.weights_done.tensors > 0 && byEvent.weights_done.tensors <= byEvent.weights_start.tensors_total);
  assert.ok(byEvent.weights_done.bytes > 0 && byEvent.weights_done.bytes <= byEvent.weights_start.bytes_total);
  assert.ok(byEvent.weights_done.seconds >= 0);
  assert.equal(byEvent.engine_done.max_model_len, 1536);
  assert.equal(byEvent.engine_done.block_size, 16);
  assert.ok(byEvent.engine_done.num_kv_blocks > 0);
  assert.equal(byEvent.ready.url, url);
  assert.equal(byEvent.ready.max_model_len, 1536);
});

console.log(failures ? `${failures} failed` : 'all passed');
process.exit(failures ? 1 : 0);
