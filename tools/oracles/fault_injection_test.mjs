// Failure containment end to end: `metrale serve` on the demo model (it has an MTP head) with
// METRALE_FAULT_INJECT set, one server per fault. For each site (forward, sample, verify, commit,
// mtp; with and without speculative decoding) the request whose step fails gets a clean
// OpenAI-style error (streaming and not), /health stays ok, and new requests, one at a time and
// concurrent, complete with the greedy output a server without faults gives them. A fault in the
// recovery itself leaves a server whose /health says, with the reason, that it cannot serve, and
// which refuses new requests with that reason; it still stops cleanly.
//
// Expected outputs come from servers without faults of the same configuration, never from
// hard-coded text.
//
// Sanitizer builds pass --small: one case per site (the cases marked `small`), each site still
// covered, streaming and not.
//
//   node tools/oracles/fault_injection_test.mjs --metrale build/bin/metrale [--model models/demo] [--only NAME] [--small]
import assert from 'node:assert/strict';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { get, post, sseEvents, startServer } from './metrale_server.mjs';

const args = process.argv.slice(2);
const option = (name, fallback) => {
  const at = args.indexOf(name);
  return at >= 0 ? args[at + 1] : fallback;
};
const metrale = option('--metrale');
const only = option('--only');
const small = args.includes('--small');
const here = path.dirname(fileURLToPath(import.meta.url));
const modelDir = option('--model', path.join(here, '../../models/demo'));
if (!metrale) {
  console.error('usage: fault_injection_test.mjs --metrale PATH [--model DIR] [--only NAME]');
  process.exit(2);
}

const common = ['--served-model-name', 'metrale', '--threads', '2', '--kv-cache-memory', '256MiB', '--max-model-len', '512', '--model', modelDir];
const configs = {
  plain: common,
  mtp: [...common, '--speculative-method', 'mtp', '--num-drafts', '3', '--no-adaptive-speculation'],
};
const prompts = ['Once upon a time there was a little robot who', 'The cat sat on the mat. The cat sat on the'];
const request = (prompt, extra = {}) => ({ model: 'metrale', prompt, max_tokens: 16, temperature: 0, ignore_eos: true, ...extra });

async function completion(server, prompt) {
  const response = await post(server, '/v1/completions', request(prompt));
  assert.equal(response.status, 200, response.text);
  assert.ok(response.json && Array.isArray(response.json.choices), `a completion: ${response.text}`);
  assert.equal(response.json.choices[0].finish_reason, 'length', response.text);
  return response.json.choices[0].text;
}

async function streamedText(server, prompt) {
  const response = await post(server, '/v1/completions', request(prompt, { stream: true }));
  assert.equal(response.status, 200, response.text);
  const events = sseEvents(response.text);
  assert.equal(events.at(-1), '[DONE]');
  assert.ok(!events.some((e) => e !== '[DONE]' && e.error), `no error in ${response.text}`);
  return events.filter((e) => e !== '[DONE]').map((e) => e.choices.map((c) => c.text).join('')).join('');
}

// A clean OpenAI-style server error that shows no internal text (the fault is named in the
// server's log, not to the client).
function expectServerError(server, error, site) {
  assert.ok(error && typeof error === 'object', 'an error object');
  assert.equal(error.type, 'server_error');
  assert.equal(typeof error.message, 'string');
  assert.ok(!error.message.includes('fault injected'), `no internal text in the error: ${error.message}`);
  assert.ok(server.stderr().includes(`fault injected at ${site}`), `the server log names the fault:\n${server.stderr()}`);
}

// The failing request: non-streaming (the status line is out before the failure, so the error
// travels in the body) or streaming (an error event, then [DONE]).
async function failingRequest(server, site, stream) {
  const response = await post(server, '/v1/completions', request(prompts[0], stream ? { stream: true } : {}));
  if (!stream) {
    assert.ok(response.json && response.json.error, `an error body: ${response.text}`);
    expectServerError(server, response.json.error, site);
    return;
  }
  const events = sseEvents(response.text);
  assert.equal(events.at(-1), '[DONE]', response.text);
  const errors = events.filter((e) => e !== '[DONE]' && e.error);
  assert.equal(errors.length, 1, `one error event in ${response.text}`);
  expectServerError(server, errors[0].error, site);
}

async function expectHealthy(server) {
  const health = await get(server, '/health');
  assert.equal(health.status, 200, health.text);
  assert.deepEqual(health.json, { status: 'ok' });
}

const references = {};
async function reference(config) {
  if (!references[config]) {
    const server = await startServer(metrale, configs[config]);
    try {
      references[config] = { texts: [], streamed: null };
      for (const prompt of prompts) references[config].texts.push(await completion(server, prompt));
    } finally {
      await server.stop();
    }
  }
  return references[config];
}

const cases = [
  { site: 'forward', at: 1, config: 'plain', small: true },
  { site: 'forward', at: 3, config: 'plain', stream: true },
  { site: 'sample', at: 2, config: 'plain', small: true },
  { site: 'forward', at: 1, config: 'mtp' },
  { site: 'verify', at: 1, config: 'mtp' },
  { site: 'verify', at: 2, config: 'mtp', stream: true, small: true },
  { site: 'commit', at: 1, config: 'mtp', small: true },
  { site: 'sample', at: 3, config: 'mtp', stream: true },
  { site: 'mtp', at: 1, config: 'mtp' },
  { site: 'mtp', at: 2, config: 'mtp', stream: true, small: true },
].filter((c) => !small || c.small);

let failures = 0;
async function run(name, fn) {
  if (only && !name.includes(only)) return;
  const started = Date.now();
  try {
    await fn();
    console.log(`ok   ${name} (${Date.now() - started} ms)`);
  } catch (error) {
    ++failures;
    console.log(`FAIL ${name}: ${error.stack ?? error}`);
  }
}

for (const { site, at, config, stream } of cases) {
  await run(`${config} ${site}:${at}${stream ? ' streaming' : ''}`, async () => {
    const expected = await reference(config);
    const server = await startServer(metrale, configs[config], { METRALE_FAULT_INJECT: `${site}:${at}` });
    try {
      await expectHealthy(server);
      await failingRequest(server, site, stream);
      await expectHealthy(server);
      const metrics = await get(server, '/metrics');
      const failedSteps = /^metrale_engine_failed_steps_total (\d+)$/m.exec(metrics.text);
      assert.ok(failedSteps && Number(failedSteps[1]) >= 1, `/metrics counts the failed step:\n${metrics.text}`);
      // One at a time, then together (batched), then streamed: the greedy output of a server without faults.
      for (let i = 0; i < prompts.length; ++i) assert.equal(await completion(server, prompts[i]), expected.texts[i]);
      assert.deepEqual(await Promise.all(prompts.map((p) => completion(server, p))), expected.texts);
      assert.equal(await streamedText(server, prompts[1]), expected.texts[1]);
      await expectHealthy(server);
    } finally {
      await server.stop();
    }
  });
}

await run('a failed recovery stops serving, and /health says why', async () => {
  const server = await startServer(metrale, configs.plain, { METRALE_FAULT_INJECT: 'forward:2,recover:1' });
  try {
    await expectHealthy(server);
    const failed = await post(server, '/v1/completions', request(prompts[0]));
    assert.ok(failed.json && failed.json.error, `an error body: ${failed.text}`);
    assert.equal(failed.json.error.type, 'server_error', failed.text);
    assert.ok(server.stderr().includes('can no longer serve'), server.stderr());
    const health = await get(server, '/health');
    assert.equal(health.status, 503, health.text);
    assert.equal(health.json.status, 'error');
    assert.ok(health.json.reason.includes('fault injected at recover'), health.json.reason);
    assert.ok(health.json.reason.includes('fault injected at forward'), health.json.reason);
    const refused = await post(server, '/v1/completions', request(prompts[1]));
    assert.equal(refused.status, 503, refused.text);
    assert.equal(refused.json.error.type, 'service_unavailable');
    assert.ok(refused.json.error.message.includes('can no longer serve'), refused.json.error.message);
  } finally {
    await server.stop();
  }
});

console.log(failures ? `${failures} failed` : 'all passed');
process.exit(failures ? 1 : 0);
