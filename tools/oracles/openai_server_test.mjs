// End-to-end test of `metrale serve` driven by the official OpenAI client (openai@6, npm): the
// server runs the bundled tiny default model on a free port and must behave like an OpenAI
// endpoint for completions and chat, streaming and not, n > 1, stop strings, logprobs and seeds;
// serve 64 concurrent streams with the outputs the same requests give one at a time; answer every
// bad input with the right status and an OpenAI-style error body while it keeps serving; and
// cancel the request of a client that leaves, freeing its cache blocks.
//
// Expected values come from the server itself under other conditions (alone vs batched, stream vs
// not, with vs without a stop string), never from hard-coded outputs.
//
//   node tools/oracles/openai_server_test.mjs --metrale build/bin/metrale [--model models/default] [--only NAME]
import { spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import os from 'node:os';
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import OpenAI from 'openai';

const args = process.argv.slice(2);
const option = (name, fallback) => {
  const at = args.indexOf(name);
  return at >= 0 ? args[at + 1] : fallback;
};
const metrale = option('--metrale');
const only = option('--only');
const here = path.dirname(fileURLToPath(import.meta.url));
// The tiny random Qwen3 with the real Qwen3 tokenizer (not the bundled demo model): fast, and
// every path of the real tokenizer and chat template.
const modelDir = option('--model', path.join(here, '../../models/default'));
const vocabSize = JSON.parse(readFileSync(path.join(modelDir, 'config.json'), 'utf8')).vocab_size;
if (!metrale) {
  console.error('usage: openai_server_test.mjs --metrale PATH [--model DIR] [--only NAME]');
  process.exit(2);
}

// ---------------------------------------------------------------------------------------------
// The server process.

async function startServer(extraArgs = []) {
  const serveArgs = ['serve', '--port', '0', '--threads', '2', '--kv-cache-memory', '256MiB', ...extraArgs];
  serveArgs.push('--model', modelDir);
  const child = spawn(metrale, serveArgs, { stdio: ['ignore', 'pipe', 'pipe'] });
  let stderr = '';
  child.stderr.on('data', (data) => { stderr += data; });
  const url = await new Promise((resolve, reject) => {
    let stdout = '';
    const timer = setTimeout(() => reject(new Error(`server did not start in 60 s\n${stderr}`)), 60000);
    child.stdout.on('data', (data) => {
      stdout += data;
      const match = stdout.match(/on (http:\/\/[^\s]+)/);
      if (match) {
        clearTimeout(timer);
        resolve(match[1]);
      }
    });
    child.on('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`server exited with ${code} before serving\n${stderr}`));
    });
  });
  return {
    url,
    child,
    stderr: () => stderr,
    async stop() {
      const exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));
      child.kill('SIGTERM');
      const timeout = new Promise((resolve) => setTimeout(() => resolve(null), 20000));
      const result = await Promise.race([exited, timeout]);
      if (result === null) {
        child.kill('SIGKILL');
        throw new Error('server did not stop within 20 s of SIGTERM');
      }
      assert.equal(result.code, 0, `server exit code (signal ${result.signal})\n${stderr}`);
    },
  };
}

function clientFor(server, apiKey = 'unused') {
  return new OpenAI({ baseURL: `${server.url}/v1`, apiKey, maxRetries: 0, timeout: 120000 });
}

async function post(server, path, body, headers = {}) {
  const response = await fetch(`${server.url}${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json', ...headers },
    body: typeof body === 'string' ? body : JSON.stringify(body),
  });
  const text = await response.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* checked by the caller */ }
  return { status: response.status, json, text };
}

async function metrics(server) {
  const text = await (await fetch(`${server.url}/metrics`)).text();
  const values = {};
  for (const line of text.split('\n')) {
    if (line.startsWith('#') || !line.trim()) continue;
    const space = line.lastIndexOf(' ');
    values[line.slice(0, space)] = Number(line.slice(space + 1));
  }
  return values;
}

async function waitFor(what, predicate, timeoutMs = 15000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    if (await predicate()) return;
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

function expectError(response, status, type, param) {
  assert.equal(response.status, status, `status for ${response.text}`);
  assert.ok(response.json && typeof response.json.error === 'object', `error body: ${response.text}`);
  const error = response.json.error;
  assert.equal(typeof error.message, 'string');
  assert.ok(error.message.length > 0);
  assert.ok('type' in error && 'param' in error && 'code' in error, `error fields: ${response.text}`);
  if (type) assert.equal(error.type, type);
  if (param !== undefined) assert.equal(error.param, param);
}

async function collectCompletionStream(stream) {
  const texts = {};
  const finish = {};
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices) {
      texts[choice.index] = (texts[choice.index] ?? '') + choice.text;
      if (choice.finish_reason) finish[choice.index] = choice.finish_reason;
    }
  }
  return { texts, finish, usage };
}

async function collectChatStream(stream) {
  const texts = {};
  const finish = {};
  const roles = {};
  let usage = null;
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices) {
      if (choice.delta.role) roles[choice.index] = choice.delta.role;
      texts[choice.index] = (texts[choice.index] ?? '') + (choice.delta.content ?? '');
      if (choice.finish_reason) finish[choice.index] = choice.finish_reason;
    }
  }
  return { texts, finish, roles, usage };
}

// ---------------------------------------------------------------------------------------------
// Tests on the main server (greedy unless said otherwise; ignore_eos so lengths are exact).

const tests = [];
const test = (name, fn, server = 'main') => tests.push({ name, fn, server });

test('models', async ({ client, model }) => {
  const page = await client.models.list();
  assert.equal(page.data.length, 1);
  assert.equal(page.data[0].id, model);
  assert.equal(page.data[0].object, 'model');
});

test('health and metrics', async ({ server }) => {
  assert.equal((await fetch(`${server.url}/health`)).status, 200);
  const values = await metrics(server);
  for (const name of ['metrale_num_requests_running', 'metrale_num_requests_waiting', 'metrale_kv_cache_usage_perc',
    'metrale_prefix_cache_hit_rate', 'metrale_prompt_tokens_total', 'metrale_generation_tokens_total',
    'metrale_time_to_first_token_seconds_count', 'metrale_time_per_output_token_seconds_count',
    'metrale_request_success_total{finished_reason="stop"}', 'metrale_hybrid_state_restores_total']) {
    assert.ok(name in values, `metrics lack ${name}`);
  }
});

test('completion, streaming equals non-streaming', async ({ client, model }) => {
  const request = { model, prompt: 'The capital of France is', max_tokens: 12, temperature: 0, ignore_eos: true };
  const whole = await client.completions.create(request);
  assert.equal(whole.object, 'text_completion');
  assert.equal(whole.choices.length, 1);
  assert.equal(whole.choices[0].finish_reason, 'length');
  assert.equal(whole.usage.completion_tokens, 12);
  assert.ok(whole.usage.prompt_tokens > 0);
  assert.equal(whole.usage.total_tokens, whole.usage.prompt_tokens + 12);
  assert.ok(whole.choices[0].text.length > 0);
  const streamed = await collectCompletionStream(
    await client.completions.create({ ...request, stream: true, stream_options: { include_usage: true } }));
  assert.equal(streamed.texts[0], whole.choices[0].text);
  assert.equal(streamed.finish[0], 'length');
  assert.deepEqual(streamed.usage, whole.usage);
});

test('chat, streaming equals non-streaming', async ({ client, model }) => {
  const request = {
    model, max_completion_tokens: 10, temperature: 0, ignore_eos: true,
    messages: [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Say hello.' }],
  };
  const whole = await client.chat.completions.create(request);
  assert.equal(whole.object, 'chat.completion');
  assert.equal(whole.choices[0].message.role, 'assistant');
  assert.equal(whole.choices[0].finish_reason, 'length');
  assert.equal(whole.usage.completion_tokens, 10);
  const streamed = await collectChatStream(
    await client.chat.completions.create({ ...request, stream: true, stream_options: { include_usage: true } }));
  assert.equal(streamed.roles[0], 'assistant');
  // Reasoning (if the random model opens <think>) goes to reasoning_content; content must match.
  assert.equal(streamed.texts[0], whole.choices[0].message.content ?? '');
  assert.equal(streamed.finish[0], 'length');
  assert.deepEqual(streamed.usage, whole.usage);
});

test('chat content parts and tools pass through', async ({ client, model }) => {
  const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather of a city',
    parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } }];
  const parts = await client.chat.completions.create({
    model, max_tokens: 4, temperature: 0, ignore_eos: true, tools,
    messages: [{ role: 'user', content: [{ type: 'text', text: 'Weather in ' }, { type: 'text', text: 'Paris?' }] }],
  });
  const plain = await client.chat.completions.create({
    model, max_tokens: 4, temperature: 0, ignore_eos: true, tools,
    messages: [{ role: 'user', content: 'Weather in Paris?' }],
  });
  assert.equal(parts.usage.prompt_tokens, plain.usage.prompt_tokens);
  assert.equal(parts.choices[0].message.content, plain.choices[0].message.content);
  const noTools = await client.chat.completions.create({
    model, max_tokens: 1, temperature: 0, messages: [{ role: 'user', content: 'Weather in Paris?' }],
  });
  assert.ok(plain.usage.prompt_tokens > noTools.usage.prompt_tokens + 20, 'tools reach the template');
  const thinkingOff = await client.chat.completions.create({
    model, max_tokens: 1, temperature: 0, messages: [{ role: 'user', content: 'Weather in Paris?' }],
    chat_template_kwargs: { enable_thinking: false },
  });
  assert.ok(thinkingOff.usage.prompt_tokens > noTools.usage.prompt_tokens, 'chat_template_kwargs reach the template');
});

test('prompt forms: list of strings x n, token ids, echo', async ({ client, model }) => {
  const single = async (prompt) => (await client.completions.create({
    model, prompt, max_tokens: 5, temperature: 0, ignore_eos: true })).choices[0].text;
  const a = await single('One two three');
  const b = await single('Red green blue');
  const both = await client.completions.create({
    model, prompt: ['One two three', 'Red green blue'], n: 2, max_tokens: 5, temperature: 0, ignore_eos: true });
  assert.deepEqual(both.choices.map((c) => c.index), [0, 1, 2, 3]);
  assert.deepEqual(both.choices.map((c) => c.text), [a, a, b, b]);
  assert.equal(both.usage.completion_tokens, 20);

  const ids = await client.completions.create({ model, prompt: [9707, 11, 847, 5562], max_tokens: 3, temperature: 0 });
  assert.equal(ids.usage.prompt_tokens, 4);
  const idLists = await client.completions.create({ model, prompt: [[9707, 11], [847, 5562, 374]], max_tokens: 3,
    temperature: 0 });
  assert.equal(idLists.choices.length, 2);
  assert.equal(idLists.usage.prompt_tokens, 5);

  const echoed = await client.completions.create({ model, prompt: 'Echo me', echo: true, max_tokens: 4,
    temperature: 0, ignore_eos: true });
  const plain = await client.completions.create({ model, prompt: 'Echo me', max_tokens: 4, temperature: 0,
    ignore_eos: true });
  assert.equal(echoed.choices[0].text, 'Echo me' + plain.choices[0].text);
  const echoStream = await collectCompletionStream(await client.completions.create({
    model, prompt: 'Echo me', echo: true, max_tokens: 4, temperature: 0, ignore_eos: true, stream: true }));
  assert.equal(echoStream.texts[0], echoed.choices[0].text);
});

test('n > 1 with a seed: distinct choices, reproducible', async ({ client, model }) => {
  const request = { model, prompt: 'Once upon a time', n: 3, max_tokens: 12, temperature: 1.0, seed: 1234,
    ignore_eos: true };
  const first = await client.completions.create(request);
  const second = await client.completions.create(request);
  assert.equal(first.choices.length, 3);
  assert.deepEqual(first.choices.map((c) => c.text), second.choices.map((c) => c.text));
  assert.equal(new Set(first.choices.map((c) => c.text)).size, 3, 'n choices differ');
  const other = await client.completions.create({ ...request, seed: 99 });
  assert.notDeepEqual(other.choices.map((c) => c.text), first.choices.map((c) => c.text));
  const streamed = await collectChatStream(await client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'Tell a story' }], n: 2, max_tokens: 8, temperature: 1.0, seed: 7,
    ignore_eos: true, stream: true }));
  const whole = await client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'Tell a story' }], n: 2, max_tokens: 8, temperature: 1.0, seed: 7,
    ignore_eos: true });
  assert.deepEqual([streamed.texts[0], streamed.texts[1]], whole.choices.map((c) => c.message.content));
  assert.deepEqual(streamed.finish, { 0: 'length', 1: 'length' });
});

test('seeded sampling is reproducible and seed-dependent', async ({ client, model }) => {
  const request = { model, messages: [{ role: 'user', content: 'Pick a word' }], max_tokens: 16, temperature: 1.0,
    top_p: 0.95, top_k: 50, seed: 42, ignore_eos: true };
  const a = await client.chat.completions.create(request);
  const b = await client.chat.completions.create(request);
  const c = await client.chat.completions.create({ ...request, seed: 43 });
  assert.equal(a.choices[0].message.content, b.choices[0].message.content);
  assert.notEqual(a.choices[0].message.content, c.choices[0].message.content);
});

test('stop strings cut the text and end the choice', async ({ client, model }) => {
  const base = { model, prompt: 'List some words:', max_tokens: 24, temperature: 0, ignore_eos: true };
  const full = (await client.completions.create(base)).choices[0].text;
  const chars = Array.from(full);
  assert.ok(chars.length >= 8, `greedy text long enough: ${JSON.stringify(full)}`);
  const stop = chars.slice(Math.floor(chars.length / 2), Math.floor(chars.length / 2) + 2).join('');
  const expected = full.slice(0, full.indexOf(stop));
  const cut = await client.completions.create({ ...base, stop: [stop, '\u0000never'] });
  assert.equal(cut.choices[0].text, expected);
  assert.equal(cut.choices[0].finish_reason, 'stop');
  assert.ok(cut.usage.completion_tokens < 24);
  const streamed = await collectCompletionStream(await client.completions.create({ ...base, stop, stream: true }));
  assert.equal(streamed.texts[0], expected);
  assert.equal(streamed.finish[0], 'stop');
  // A stop string that never appears changes nothing.
  const untouched = await client.completions.create({ ...base, stop: 'qqqqqqqqqqqq' });
  assert.equal(untouched.choices[0].text, full);
  assert.equal(untouched.choices[0].finish_reason, 'length');
});

test('stop token ids', async ({ client, model }) => {
  // Find the id of the first greedy token by bisection: it stops the request at once exactly when
  // it is in stop_token_ids.
  const base = { model, prompt: [9707, 11, 847], max_tokens: 6, temperature: 0, ignore_eos: true };
  const full = await client.completions.create(base);
  assert.equal(full.usage.completion_tokens, 6);
  const stopsAtOnce = async (lo, hi) => {
    const ids = Array.from({ length: hi - lo }, (_, i) => lo + i);
    const result = await client.completions.create({ ...base, max_tokens: 2, stop_token_ids: ids });
    return result.usage.completion_tokens === 1 && result.choices[0].finish_reason === 'stop';
  };
  let lo = 0;
  let hi = vocabSize;
  assert.ok(await stopsAtOnce(lo, hi), 'a stop list of every id stops at the first token');
  while (hi - lo > 1) {
    const mid = Math.floor((lo + hi) / 2);
    if (await stopsAtOnce(lo, mid)) hi = mid; else lo = mid;
  }
  const stopped = await client.completions.create({ ...base, stop_token_ids: [lo] });
  assert.equal(stopped.choices[0].finish_reason, 'stop');
  assert.equal(stopped.usage.completion_tokens, 1);
  assert.equal(stopped.choices[0].text, '', 'the stop token is not part of the text');
  const other = await client.completions.create({ ...base, stop_token_ids: [lo === 0 ? 1 : lo - 1] });
  assert.equal(other.choices[0].text, full.choices[0].text);
});

test('return_token_ids: the prompt and output ids, streamed and whole, continue exactly', async ({ client, model }) => {
  const prompt = [9707, 11, 847, 1879];
  const base = { model, prompt, max_tokens: 6, temperature: 0, ignore_eos: true, return_token_ids: true };
  const whole = await client.completions.create(base);
  assert.deepEqual(whole.choices[0].prompt_token_ids, prompt);
  const ids = whole.choices[0].token_ids;
  assert.equal(ids.length, 6);
  assert.ok(ids.every((id) => Number.isInteger(id) && id >= 0 && id < vocabSize), `ids ${ids}`);
  const streamed = [];
  let promptIds = null;
  for await (const chunk of await client.completions.create({ ...base, stream: true })) {
    for (const choice of chunk.choices) {
      if (choice.prompt_token_ids) promptIds = choice.prompt_token_ids;
      streamed.push(...(choice.token_ids ?? []));
    }
  }
  assert.deepEqual(promptIds, prompt);
  assert.deepEqual(streamed, ids);
  // The ids are the tokens the model produced: greedy from the prompt plus the first three gives the last three.
  const next = await client.completions.create({ ...base, prompt: [...prompt, ...ids.slice(0, 3)], max_tokens: 3 });
  assert.deepEqual(next.choices[0].token_ids, ids.slice(3));
  const plain = await client.completions.create({ model, prompt, max_tokens: 2, temperature: 0 });
  assert.ok(!('token_ids' in plain.choices[0]), 'no token ids unless asked for');
  const chat = await client.chat.completions.create({
    model, messages: [{ role: 'user', content: 'Hello' }], max_tokens: 4, temperature: 0, return_token_ids: true,
  });
  assert.ok(Array.isArray(chat.prompt_token_ids) && chat.prompt_token_ids.length > 0);
  assert.equal(chat.choices[0].token_ids.length, chat.usage.completion_tokens);
});

test('completion logprobs', async ({ client, model }) => {
  const result = await client.completions.create({ model, prompt: 'The quick brown fox', max_tokens: 8,
    temperature: 0, ignore_eos: true, logprobs: 3 });
  const { logprobs, text } = result.choices[0];
  assert.equal(logprobs.tokens.length, 8);
  assert.equal(logprobs.token_logprobs.length, 8);
  assert.equal(logprobs.top_logprobs.length, 8);
  assert.equal(logprobs.text_offset.length, 8);
  for (let i = 0; i < 8; ++i) {
    assert.ok(logprobs.token_logprobs[i] <= 0);
    const alternatives = Object.entries(logprobs.top_logprobs[i]);
    assert.ok(alternatives.length >= 1 && alternatives.length <= 3);
    const best = Math.max(...alternatives.map(([, lp]) => lp));
    // Greedy: the chosen token is the most likely one.
    assert.ok(Math.abs(best - logprobs.token_logprobs[i]) < 1e-5, `token ${i} is the argmax`);
    if (i > 0) assert.ok(logprobs.text_offset[i] >= logprobs.text_offset[i - 1]);
  }
  assert.equal(logprobs.text_offset[0], 0);
  // Tokens that are whole characters concatenate to the text.
  if (!logprobs.tokens.some((t) => t.includes('\ufffd'))) assert.equal(logprobs.tokens.join(''), text);
  const streamed = [];
  for await (const chunk of await client.completions.create({ model, prompt: 'The quick brown fox', max_tokens: 8,
    temperature: 0, ignore_eos: true, logprobs: 3, stream: true })) {
    for (const choice of chunk.choices) if (choice.logprobs) streamed.push(...choice.logprobs.token_logprobs);
  }
  assert.deepEqual(streamed, logprobs.token_logprobs);
});

test('chat logprobs', async ({ client, model }) => {
  const result = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'Hi' }],
    max_tokens: 6, temperature: 0, ignore_eos: true, logprobs: true, top_logprobs: 2 });
  const content = result.choices[0].logprobs.content;
  assert.equal(content.length, 6);
  const bytes = [];
  for (const entry of content) {
    assert.equal(typeof entry.token, 'string');
    assert.ok(entry.logprob <= 0);
    assert.ok(Array.isArray(entry.bytes));
    bytes.push(...entry.bytes);
    assert.equal(entry.top_logprobs.length, 2);
    assert.ok(entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob);
    assert.ok(Math.abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-5);
  }
  const message = result.choices[0].message;
  const text = (message.reasoning_content ?? '') + (message.content ?? '');
  if (!text.includes('<think>') && !text.includes('</think>')) {
    assert.equal(Buffer.from(bytes).toString('utf8'), text);
  }
  const none = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'Hi' }],
    max_tokens: 2, temperature: 0 });
  assert.equal(none.choices[0].logprobs, null);
});

test('64 concurrent streams equal the same requests one at a time', async ({ client, model, server }) => {
  const requests = Array.from({ length: 64 }, (_, i) => ({
    model, prompt: `Request ${i}: ${'abcdefghij'.slice(0, (i % 10) + 1)} ${i * 7919}`, max_tokens: 12,
    temperature: 0, ignore_eos: true }));
  const alone = [];
  for (const request of requests) alone.push((await client.completions.create(request)).choices[0].text);
  let peak = 0;
  let open = 0;
  const streamed = await Promise.all(requests.map(async (request) => {
    const stream = await client.completions.create({ ...request, stream: true });
    peak = Math.max(peak, ++open);
    const { texts, finish } = await collectCompletionStream(stream);
    --open;
    assert.equal(finish[0], 'length');
    return texts[0];
  }));
  assert.ok(peak >= 32, `streams were open at once (peak ${peak})`);
  for (let i = 0; i < requests.length; ++i) assert.equal(streamed[i], alone[i], `request ${i}`);
  const values = await metrics(server);
  assert.equal(values.metrale_num_requests_running, 0);
});

test('bad inputs get OpenAI errors and the server keeps serving', async ({ server, model, client }) => {
  expectError(await post(server, '/v1/completions', '{"prompt": "x", '), 400, 'invalid_request_error');
  expectError(await post(server, '/v1/chat/completions', '[1, 2]'), 400, 'invalid_request_error');
  expectError(await post(server, '/v1/completions', { prompt: 'x', max_tokens: 'ten' }), 400, 'invalid_request_error',
    'max_tokens');
  expectError(await post(server, '/v1/completions', { prompt: 'x', temperature: 'hot' }), 400, undefined,
    'temperature');
  expectError(await post(server, '/v1/completions', { prompt: 'x', stream: 'yes' }), 400, undefined, 'stream');
  expectError(await post(server, '/v1/completions', { prompt: 42 }), 400, undefined, 'prompt');
  expectError(await post(server, '/v1/completions', { max_tokens: 3 }), 400, undefined, 'prompt');
  expectError(await post(server, '/v1/chat/completions', { messages: 'hi' }), 400, undefined, 'messages');
  expectError(await post(server, '/v1/chat/completions', { messages: [] }), 400, undefined, 'messages');
  expectError(await post(server, '/v1/chat/completions', { messages: [{ content: 'no role' }] }), 400);
  expectError(await post(server, '/v1/completions', { prompt: 'x', top_p: 1.5 }), 400, undefined, 'top_p');
  expectError(await post(server, '/v1/completions', { prompt: 'x', logprobs: 50 }), 400, undefined, 'logprobs');
  expectError(await post(server, '/v1/completions', { prompt: [1, -5] }), 400, undefined, 'prompt');
  expectError(await post(server, '/v1/completions', { prompt: [99999999] }), 400);  // outside the vocabulary
  const unknown = await post(server, '/v1/completions', { model: 'no-such-model', prompt: 'x' });
  expectError(unknown, 404, undefined, 'model');
  assert.equal(unknown.json.error.code, 'model_not_found');
  await assert.rejects(client.completions.create({ model: 'gpt-4', prompt: 'x' }), (e) => e.status === 404);

  const context = (await client.models.list()).data[0].max_model_len;
  const tooLong = await post(server, '/v1/completions', { prompt: Array(context + 10).fill(9707), max_tokens: 1 });
  expectError(tooLong, 400, 'invalid_request_error', 'prompt');
  assert.equal(tooLong.json.error.code, 'context_length_exceeded');
  expectError(await post(server, '/v1/chat/completions',
    { messages: [{ role: 'user', content: 'word '.repeat(context) }] }), 400, undefined, 'messages');
  expectError(await post(server, '/v1/completions', { prompt: 'x', max_tokens: 0 }), 400, undefined, 'max_tokens');
  expectError(await post(server, '/v1/completions', { prompt: 'x', max_tokens: -3 }), 400, undefined, 'max_tokens');
  expectError(await post(server, '/v1/completions', { prompt: 'x', max_tokens: context }), 400, undefined,
    'max_tokens');
  expectError(await post(server, '/v1/chat/completions',
    { messages: [{ role: 'user', content: 'x' }], max_completion_tokens: context * 2 }), 400, undefined,
  'max_completion_tokens');
  expectError(await post(server, '/v1/completions', { prompt: 'x', n: 100000 }), 400, undefined, 'n');
  expectError(await post(server, '/v1/completions', { prompt: 'x', n: 0 }), 400, undefined, 'n');
  await assert.rejects(client.completions.create({ model, prompt: 'x', n: 5000 }), (e) => e.status === 400 &&
    e.param === 'n');

  const missing = await fetch(`${server.url}/v1/nothing-here`);
  assert.equal(missing.status, 404);
  assert.equal(typeof (await missing.json()).error.message, 'string');

  const after = await client.completions.create({ model, prompt: 'still alive?', max_tokens: 3, temperature: 0 });
  assert.equal(after.choices.length, 1);
});

test('a client that disconnects mid-stream has its request cancelled', async ({ client, model, server }) => {
  const before = await metrics(server);
  const stream = await client.completions.create({ model, prompt: 'Go on forever', max_tokens: 800,
    temperature: 0, ignore_eos: true, stream: true });
  let chunks = 0;
  for await (const chunk of stream) {
    if (chunk.choices.length && ++chunks === 3) break;  // leaving the loop aborts the HTTP request
  }
  await waitFor('the abort to be counted', async () => {
    const values = await metrics(server);
    return values['metrale_engine_requests_total{status="abort"}'] > before['metrale_engine_requests_total{status="abort"}'];
  });
  await waitFor('the engine to be idle with no KV blocks held', async () => {
    const values = await metrics(server);
    return values.metrale_num_requests_running === 0 && values.metrale_kv_cache_blocks_used === 0 &&
      values.metrale_kv_cache_usage_perc === 0;
  });
  const after = await metrics(server);
  assert.ok(after['metrale_request_success_total{finished_reason="abort"}'] >
    before['metrale_request_success_total{finished_reason="abort"}']);
  assert.ok(after.metrale_generation_tokens_total - before.metrale_generation_tokens_total < 800);

  // The same for a non-streaming request whose client gives up.
  const controller = new AbortController();
  const pending = client.completions.create({ model, prompt: 'Go on forever', max_tokens: 800, temperature: 0,
    ignore_eos: true }, { signal: controller.signal });
  await waitFor('the request to run', async () => (await metrics(server)).metrale_num_requests_running === 1);
  controller.abort();
  await assert.rejects(pending);
  await waitFor('the engine to be idle after the abandoned request', async () => {
    const values = await metrics(server);
    return values.metrale_num_requests_running === 0 && values.metrale_kv_cache_blocks_used === 0 &&
      values['metrale_engine_requests_total{status="abort"}'] >= after['metrale_engine_requests_total{status="abort"}'] + 1;
  });
});

test('bench-serve against the server', async ({ server }) => {
  const dir = mkdtempSync(path.join(os.tmpdir(), 'metrale-bench-serve-'));
  try {
    const resultFile = path.join(dir, 'result.json');
    const tokenizer = ['--tokenizer', modelDir];
    const run = spawnSync(metrale, ['bench-serve', '--url', server.url, '--num-prompts', '8', '--concurrency', '4',
      '--input-len', '16', '--output-len', '6', '--result-file', resultFile, ...tokenizer],
    { encoding: 'utf8', timeout: 60000 });
    assert.equal(run.status, 0, run.stderr + run.stdout);
    assert.match(run.stdout, /Output token throughput \(tok\/s\):/);
    assert.match(run.stdout, /P99 TTFT \(ms\):/);
    const result = JSON.parse(readFileSync(resultFile, 'utf8'));
    assert.equal(result.completed, 8);
    assert.equal(result.failed, 0);
    assert.equal(result.total_output_tokens, 48);
    assert.ok(result.total_input_tokens > 0);
    assert.ok(result.ttft_ms.mean > 0 && result.tpot_ms.mean > 0 && result.itl_ms.p99 >= result.itl_ms.median);
    const ids = spawnSync(metrale, ['bench-serve', '--url', server.url, '--num-prompts', '3', '--request-rate', '20',
      '--input-len', '10', '--output-len', '4', '--random-tokens', '--result-file', resultFile, ...tokenizer],
    { encoding: 'utf8', timeout: 60000 });
    assert.equal(ids.status, 0, ids.stderr + ids.stdout);
    const exact = JSON.parse(readFileSync(resultFile, 'utf8'));
    assert.equal(exact.total_input_tokens, 30, 'token-id prompts have exact lengths');
    assert.equal(exact.total_output_tokens, 12);
    // Conversations: every follow-up resends the history (prompt + output ids) plus 5 new tokens.
    const turns = spawnSync(metrale, ['bench-serve', '--url', server.url, '--num-prompts', '2', '--concurrency', '2',
      '--turns', '3', '--input-len', '8', '--turn-input-len', '5', '--output-len', '3', '--random-tokens',
      '--result-file', resultFile, ...tokenizer], { encoding: 'utf8', timeout: 60000 });
    assert.equal(turns.status, 0, turns.stderr + turns.stdout);
    assert.match(turns.stdout, /Conversations x turns:\s+2 x 3/);
    assert.match(turns.stdout, /Median follow-up TTFT \(ms\):/);
    const talk = JSON.parse(readFileSync(resultFile, 'utf8'));
    assert.equal(talk.completed, 6);
    assert.equal(talk.total_input_tokens, 2 * (8 + 16 + 24), 'turn prompts: 8, 8 + 3 + 5, 16 + 3 + 5');
    assert.equal(talk.total_output_tokens, 18);
    assert.ok(talk.ttft_first_turn_ms.mean > 0 && talk.ttft_follow_up_ms.mean > 0);
    const textTurns = spawnSync(metrale, ['bench-serve', '--url', server.url, '--turns', '2', ...tokenizer],
      { encoding: 'utf8', timeout: 60000 });
    assert.notEqual(textTurns.status, 0);
    assert.match(textTurns.stderr, /--turns 2 needs --random-tokens/);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

test('metrale chat over a pipe', async () => {
  const chatArgs = ['chat', '--max-tokens', '6', '--temperature', '0', '--max-model-len', '512', '--kv-cache-memory',
    '64MiB', '--threads', '2'];
  chatArgs.push('--model', modelDir);
  const chat = (input) => {
    const run = spawnSync(metrale, chatArgs, { input, encoding: 'utf8', timeout: 60000 });
    assert.equal(run.status, 0, run.stderr);
    return run.stdout;
  };
  const once = chat('Hello there\n');
  const twice = chat('Hello there\n\nHow are you?\n/reset\nHello there\n/exit\nignored\n');
  assert.ok(once.length > 1 && once.endsWith('\n'), JSON.stringify(once));
  // Greedy: the first turn after /reset repeats the first turn; the second turn differs from it.
  assert.ok(twice.startsWith(once), JSON.stringify(twice));
  assert.ok(twice.endsWith('(conversation reset)\n' + once), JSON.stringify(twice));
  assert.equal(twice.includes('\x1b['), false, 'no colours when stdout is not a terminal');
}, 'main');

// ---------------------------------------------------------------------------------------------
// A second server: API key, one running slot and a queue of one.

const kKey = 'sk-test-key';

test('API key required on /v1', async ({ server, model }) => {
  expectError(await post(server, '/v1/completions', { model, prompt: 'x', max_tokens: 1 }), 401,
    'authentication_error');
  expectError(await post(server, '/v1/completions', { model, prompt: 'x', max_tokens: 1 },
    { authorization: 'Bearer wrong' }), 401, 'authentication_error');
  await assert.rejects(clientFor(server, 'wrong').models.list(), (e) => e.status === 401);
  const ok = await post(server, '/v1/completions', { model, prompt: 'x', max_tokens: 1 },
    { authorization: `Bearer ${kKey}` });
  assert.equal(ok.status, 200);
  assert.equal((await fetch(`${server.url}/health`)).status, 200);  // health and metrics stay open
}, 'limited');

test('a full queue answers 429 and the server recovers', async ({ server, model }) => {
  const client = clientFor(server, kKey);
  const long = { model, prompt: 'Keep going', max_tokens: 2000, temperature: 0, ignore_eos: true, stream: true };
  const running = await client.completions.create(long);
  const runningIterator = running[Symbol.asyncIterator]();
  await runningIterator.next();  // the first request runs
  const waiting = await client.completions.create(long);  // the second waits for the only slot
  await waitFor('one waiting request', async () => (await metrics(server)).metrale_num_requests_waiting === 1);
  await assert.rejects(client.completions.create({ ...long, stream: false, max_tokens: 1 }), (e) => {
    assert.equal(e.status, 429);
    assert.equal(e.type, 'rate_limit_error');
    return true;
  });
  const raw = await post(server, '/v1/completions', { model, prompt: 'x', max_tokens: 1 },
    { authorization: `Bearer ${kKey}` });
  expectError(raw, 429, 'rate_limit_error');
  running.controller.abort();
  waiting.controller.abort();
  await waitFor('the engine to drain', async () => {
    const values = await metrics(server);
    return values.metrale_num_requests_running === 0 && values.metrale_num_requests_waiting === 0;
  });
  const after = await client.completions.create({ model, prompt: 'x', max_tokens: 2, temperature: 0 });
  assert.equal(after.usage.completion_tokens, 2);
  assert.ok((await metrics(server)).metrale_queue_full_total >= 2);
}, 'limited');

// ---------------------------------------------------------------------------------------------

const servers = {
  main: ['--max-model-len', '1024', '--max-num-seqs', '64'],
  limited: ['--max-model-len', '4096', '--max-num-seqs', '1', '--max-queued-requests', '1', '--api-key', kKey],
};
let failures = 0;
for (const [serverName, serverArgs] of Object.entries(servers)) {
  const selected = tests.filter((t) => t.server === serverName && (!only || t.name.includes(only)));
  if (!selected.length) continue;
  let started = Date.now();
  const server = await startServer(serverArgs);
  console.log(`---- ${serverName} server up in ${Date.now() - started} ms`);
  const client = clientFor(server, serverName === 'limited' ? kKey : 'unused');
  const model = (await client.models.list()).data[0].id;
  for (const { name, fn } of selected) {
    const started = Date.now();
    try {
      await fn({ server, client, model });
      console.log(`ok   ${name} (${Date.now() - started} ms)`);
    } catch (error) {
      ++failures;
      console.log(`FAIL ${name}: ${error.stack ?? error}`);
    }
  }
  try {
    started = Date.now();
    await server.stop();
    console.log(`---- ${serverName} server stopped in ${Date.now() - started} ms`);
  } catch (error) {
    ++failures;
    console.log(`FAIL stopping the ${serverName} server: ${error.message}`);
  }
}
console.log(failures ? `${failures} failed` : 'all passed');
process.exit(failures ? 1 : 0);
