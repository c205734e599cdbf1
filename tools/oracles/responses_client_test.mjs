// End-to-end test of POST /v1/responses driven by the official OpenAI client (openai@6, npm):
// responses.create and responses.stream on text, the typed event sequence the client accumulates,
// stored responses (retrieve, delete, previous_response_id), a function tool round trip continued
// with previous_response_id and the same conversation replayed with store: false, reasoning items,
// max_output_tokens, and the 400s for what the server does not implement.
//
// The tiny random model writes meaningless words, so the checks are on the protocol. Expected values
// come from the server itself under other conditions (streamed vs not, stored vs replayed), never
// from hard-coded outputs. The model's own tool calls are not exercised here: it writes none
// (tests/server/response_events_test.cpp feeds real tool-call text through the event builder).
//
//   node tools/oracles/responses_client_test.mjs --metrale build/bin/metrale [--model models/default] [--only NAME]
import assert from 'node:assert/strict';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import OpenAI from 'openai';
import { post, startServer } from './metrale_server.mjs';

const args = process.argv.slice(2);
const option = (name, fallback) => {
  const at = args.indexOf(name);
  return at >= 0 ? args[at + 1] : fallback;
};
const metrale = option('--metrale');
const only = option('--only');
const here = path.dirname(fileURLToPath(import.meta.url));
const modelDir = option('--model', path.join(here, '../../models/default'));
if (!metrale) {
  console.error('usage: responses_client_test.mjs --metrale PATH [--model DIR] [--only NAME]');
  process.exit(2);
}

const weatherTool = {
  type: 'function',
  name: 'get_weather',
  description: 'The current weather in a city',
  parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'], additionalProperties: false },
  strict: true,
};

// Checks what every response object carries.
function checkResponse(response, model) {
  assert.match(response.id, /^resp_[0-9a-f]{24}$/);
  assert.equal(response.object, 'response');
  assert.equal(response.model, model);
  assert.ok(['completed', 'incomplete'].includes(response.status), `status ${response.status}`);
  assert.equal(response.error, null);
  assert.ok(Number.isInteger(response.created_at));
  const usage = response.usage;
  assert.ok(usage.input_tokens > 0);
  assert.equal(usage.total_tokens, usage.input_tokens + usage.output_tokens);
  if (response.status === 'incomplete') {
    assert.deepEqual(response.incomplete_details, { reason: 'max_output_tokens' });
    assert.equal(usage.output_tokens, response.max_output_tokens);
  }
  for (const item of response.output) {
    assert.ok(['message', 'reasoning', 'function_call'].includes(item.type), `item type ${item.type}`);
    assert.ok(typeof item.id === 'string' && item.id.length > 3);
  }
}

const tests = [];
const test = (name, fn) => tests.push({ name, fn });

test('create: text input and instructions', async ({ client, model }) => {
  const request = { model, input: 'Say hello.', instructions: 'Answer in one word.', max_output_tokens: 8, temperature: 0 };
  const response = await client.responses.create(request);
  checkResponse(response, model);
  assert.equal(response.instructions, 'Answer in one word.');
  assert.equal(response.max_output_tokens, 8);
  assert.equal(response.temperature, 0);
  assert.ok(response.output_text.length > 0, 'the client derives output_text from the message item');
  assert.equal(response.output.filter((item) => item.type === 'message').length, 1);
  // Greedy: the same request gives the same answer.
  const again = await client.responses.create(request);
  assert.equal(again.output_text, response.output_text);
  assert.notEqual(again.id, response.id);
  // The instructions reach the prompt.
  const without = await client.responses.create({ ...request, instructions: undefined });
  assert.ok(without.usage.input_tokens < response.usage.input_tokens);
});

test('create: message items input', async ({ client, model }) => {
  const response = await client.responses.create({
    model,
    input: [
      { role: 'developer', content: 'Be terse.' },
      { type: 'message', role: 'user', content: [{ type: 'input_text', text: 'Hi' }, { type: 'input_text', text: ' there' }] },
    ],
    max_output_tokens: 4,
    temperature: 0,
  });
  checkResponse(response, model);
});

test('stream: typed events, the same answer as create', async ({ client, model }) => {
  const request = { model, input: 'Count to five.', max_output_tokens: 10, temperature: 0 };
  const whole = await client.responses.create(request);
  const stream = client.responses.stream(request);
  const events = [];
  let deltas = '';
  stream.on('response.output_text.delta', (event) => {
    deltas += event.delta;
    assert.equal(event.snapshot, deltas, 'the client snapshot is the deltas so far');
  });
  for await (const event of stream) events.push(event);
  const final = await stream.finalResponse();
  checkResponse(final, model);
  assert.equal(final.output_text, whole.output_text);
  assert.equal(deltas, whole.output_text);
  assert.deepEqual(final.output.map((item) => item.type), whole.output.map((item) => item.type));
  assert.deepEqual(final.usage, whole.usage);
  events.forEach((event, i) => assert.equal(event.sequence_number, i, `sequence_number of ${event.type}`));
  const types = events.map((event) => event.type);
  assert.deepEqual(types.slice(0, 4),
    ['response.created', 'response.in_progress', 'response.output_item.added', 'response.content_part.added']);
  assert.deepEqual(types.slice(-4),
    ['response.output_text.done', 'response.content_part.done', 'response.output_item.done',
      final.status === 'completed' ? 'response.completed' : 'response.incomplete']);
  assert.ok(types.includes('response.output_text.delta'));
  assert.equal(events[0].response.status, 'in_progress');
  assert.equal(events.at(-1).response.id, events[0].response.id);
});

test('stream: raw create({stream: true}) events', async ({ client, model }) => {
  const stream = await client.responses.create({ model, input: 'Hi', max_output_tokens: 3, temperature: 0, stream: true });
  const types = [];
  for await (const event of stream) types.push(event.type);
  assert.equal(types[0], 'response.created');
  assert.equal(types.at(-1), 'response.incomplete');
  assert.equal(types.filter((type) => type === 'response.output_text.delta').length >= 1, true);
});

test('max_output_tokens: incomplete with the reason', async ({ client, model }) => {
  const response = await client.responses.create({ model, input: 'Write a long story.', max_output_tokens: 2, temperature: 0 });
  checkResponse(response, model);
  assert.equal(response.status, 'incomplete');
  assert.equal(response.usage.output_tokens, 2);
});

test('stop (a metrale extension) ends the output, completed', async ({ client, model }) => {
  const request = { model, input: 'Say a few words.', max_output_tokens: 40, temperature: 0 };
  const whole = await client.responses.create(request);
  // A stop string from the middle of the unstopped answer: the stopped answer is what precedes it.
  const characters = Array.from(whole.output_text);
  const middle = Math.floor(characters.length / 2);
  const stop = characters.slice(middle, middle + 2).join('');
  const stopped = await client.responses.create({ ...request, stop: [stop] });
  assert.equal(stopped.status, 'completed');
  assert.equal(stopped.output_text, whole.output_text.slice(0, whole.output_text.indexOf(stop)));
  assert.ok(stopped.usage.output_tokens < 40);
});

test('top_p and temperature sampling', async ({ client, model }) => {
  const response = await client.responses.create({ model, input: 'Hi', max_output_tokens: 4, temperature: 0.7, top_p: 0.9 });
  checkResponse(response, model);
  assert.equal(response.top_p, 0.9);
  assert.equal(response.temperature, 0.7);
});

test('stored responses: retrieve and delete', async ({ client, model }) => {
  const created = await client.responses.create({ model, input: 'Hi', max_output_tokens: 3, temperature: 0 });
  assert.equal(created.store, true);
  const retrieved = await client.responses.retrieve(created.id);
  assert.equal(retrieved.id, created.id);
  assert.deepEqual(retrieved.output, created.output);
  assert.deepEqual(retrieved.usage, created.usage);
  await client.responses.delete(created.id);
  await assert.rejects(client.responses.retrieve(created.id), (e) => e.status === 404);
});

test('function tool round trip: previous_response_id, then replayed with store: false', async ({ client, model }) => {
  // The conversation holds the model's call (as a client replays one) and the tool's result comes
  // back in a function_call_output item.
  const call = { type: 'function_call', call_id: 'call_test_weather', name: 'get_weather', arguments: '{"city":"Paris"}' };
  const firstInput = [{ role: 'user', content: 'What is the weather in Paris?' }, call];
  const first = await client.responses.create({
    model, input: firstInput, tools: [weatherTool], max_output_tokens: 6, temperature: 0,
  });
  checkResponse(first, model);
  assert.equal(first.tools.length, 1);
  assert.equal(first.tools[0].name, 'get_weather');
  const output = { type: 'function_call_output', call_id: call.call_id, output: '{"temperature_c": 21}' };
  const continued = await client.responses.create({
    model, previous_response_id: first.id, input: [output], tools: [weatherTool], max_output_tokens: 6, temperature: 0,
  });
  checkResponse(continued, model);
  assert.equal(continued.previous_response_id, first.id);
  // The whole first turn (its input and its output) is in the continued prompt.
  assert.ok(continued.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens,
    `${continued.usage.input_tokens} input tokens after ${first.usage.input_tokens} + ${first.usage.output_tokens}`);

  // Stateless: the client sends the whole conversation; greedy decoding gives the same answer.
  const replayed = await client.responses.create({
    model, store: false, input: [...firstInput, ...first.output, output], tools: [weatherTool],
    max_output_tokens: 6, temperature: 0,
  });
  checkResponse(replayed, model);
  assert.equal(replayed.store, false);
  assert.equal(replayed.usage.input_tokens, continued.usage.input_tokens);
  assert.equal(replayed.output_text, continued.output_text);
  await assert.rejects(client.responses.retrieve(replayed.id), (e) => e.status === 404);
  await assert.rejects(
    client.responses.create({ model, previous_response_id: replayed.id, input: 'more' }),
    (e) => e.status === 400 && e.param === 'previous_response_id');

  // The same round trip streamed.
  const stream = client.responses.stream({
    model, previous_response_id: first.id, input: [output], tools: [weatherTool], max_output_tokens: 6, temperature: 0,
  });
  const streamed = await stream.finalResponse();
  assert.equal(streamed.output_text, continued.output_text);
});

test('input items of a stored response', async ({ client, model }) => {
  const call = { type: 'function_call', call_id: 'call_items', name: 'get_weather', arguments: '{}' };
  const input = [{ role: 'user', content: 'First' }, call,
    { type: 'function_call_output', call_id: 'call_items', output: 'done', id: 'fco_given' }];
  const response = await client.responses.create({ model, input, tools: [weatherTool], max_output_tokens: 2 });
  const ascending = await client.responses.inputItems.list(response.id, { order: 'asc' });
  assert.deepEqual(ascending.data.map((item) => item.type), ['message', 'function_call', 'function_call_output']);
  assert.equal(ascending.data[2].id, 'fco_given');
  assert.ok(ascending.data.every((item) => typeof item.id === 'string' && item.id.length > 3));
  assert.equal(new Set(ascending.data.map((item) => item.id)).size, 3);
  assert.equal(ascending.data[0].content[0].text, 'First');
  assert.equal(ascending.has_more, false);
  // Newest first by default; pages of one follow the cursor.
  const descending = await client.responses.inputItems.list(response.id);
  assert.deepEqual(descending.data.map((item) => item.id), ascending.data.map((item) => item.id).reverse());
  const ids = [];
  for await (const item of client.responses.inputItems.list(response.id, { order: 'asc', limit: 1 })) ids.push(item.id);
  assert.deepEqual(ids, ascending.data.map((item) => item.id));
  await assert.rejects(client.responses.inputItems.list('resp_000000000000000000000000'), (e) => e.status === 404);
});

test('reasoning items reach the prompt', async ({ client, model }) => {
  const base = [{ role: 'user', content: 'Why?' }];
  const answer = { type: 'message', role: 'assistant', content: [{ type: 'output_text', text: 'Because.', annotations: [] }] };
  const reasoning = {
    type: 'reasoning', id: 'rs_test', summary: [],
    content: [{ type: 'reasoning_text', text: 'The user asks why; a short answer will do.' }],
  };
  const follow = { role: 'user', content: 'And then?' };
  const plain = await client.responses.create({ model, input: [...base, answer, follow], max_output_tokens: 2 });
  const withReasoning = await client.responses.create({ model, input: [...base, reasoning, answer, follow], max_output_tokens: 2 });
  checkResponse(withReasoning, model);
  // Qwen3's template keeps reasoning only after the last user message; here it precedes the last
  // turn, so the prompt may drop it: the item is accepted either way, and never shrinks the prompt.
  assert.ok(withReasoning.usage.input_tokens >= plain.usage.input_tokens);
  const latest = await client.responses.create({ model, input: [...base, follow, reasoning], max_output_tokens: 2 });
  const latestPlain = await client.responses.create({ model, input: [...base, follow], max_output_tokens: 2 });
  assert.ok(latest.usage.input_tokens > latestPlain.usage.input_tokens, 'reasoning after the last user turn is in the prompt');
});

test('text.format json_schema: the answer is JSON of the schema', async ({ client, model }) => {
  const schema = { type: 'object', properties: { city: { type: 'string' }, days: { type: 'integer' } },
    required: ['city', 'days'], additionalProperties: false };
  const response = await client.responses.create({ model, input: 'Plan a trip.', max_output_tokens: 96,
    temperature: 0, text: { format: { type: 'json_schema', name: 'trip', schema, strict: true } } });
  checkResponse(response, model);
  assert.equal(response.status, 'completed', JSON.stringify(response));
  const value = JSON.parse(response.output_text);
  assert.deepEqual(Object.keys(value).sort(), ['city', 'days']);
  assert.equal(typeof value.city, 'string');
  assert.ok(Number.isInteger(value.days), response.output_text);
  // Streamed: the same text in the deltas.
  const stream = client.responses.stream({ model, input: 'Plan a trip.', max_output_tokens: 96, temperature: 0,
    text: { format: { type: 'json_schema', name: 'trip', schema, strict: true } } });
  let deltas = '';
  for await (const event of stream) if (event.type === 'response.output_text.delta') deltas += event.delta;
  assert.equal(deltas, response.output_text);
  const json = await client.responses.create({ model, input: 'Anything.', max_output_tokens: 64, temperature: 0,
    text: { format: { type: 'json_object' } } });
  assert.equal(typeof JSON.parse(json.output_text), 'object', json.output_text);
});

test('tool_choice required: a valid function call whatever the model says', async ({ client, model }) => {
  for (const tool_choice of ['required', { type: 'function', name: 'get_weather' }]) {
    const response = await client.responses.create({ model, input: 'Weather in Paris?', tools: [weatherTool],
      tool_choice, max_output_tokens: 96, temperature: 0 });
    checkResponse(response, model);
    const calls = response.output.filter((item) => item.type === 'function_call');
    assert.equal(calls.length, 1, JSON.stringify(response.output));
    assert.equal(calls[0].name, 'get_weather');
    const args = JSON.parse(calls[0].arguments);
    assert.deepEqual(Object.keys(args), ['city']);
    assert.equal(typeof args.city, 'string');
  }
});

test('tool_choice none leaves the tools out of the prompt', async ({ client, model }) => {
  const input = 'Weather in Paris?';
  const plain = await client.responses.create({ model, input, max_output_tokens: 4, temperature: 0 });
  const none = await client.responses.create({ model, input, tools: [weatherTool], tool_choice: 'none',
    max_output_tokens: 4, temperature: 0 });
  const auto = await client.responses.create({ model, input, tools: [weatherTool], max_output_tokens: 4, temperature: 0 });
  assert.equal(none.usage.input_tokens, plain.usage.input_tokens);
  assert.ok(auto.usage.input_tokens > plain.usage.input_tokens);
  assert.equal(none.output.filter((item) => item.type === 'function_call').length, 0);
});

test('parallel_tool_calls false: exactly one function call', async ({ client, model }) => {
  const timeTool = { type: 'function', name: 'get_time', description: 'Time in a zone', strict: true,
    parameters: { type: 'object', properties: { zone: { type: 'string', enum: ['CET', 'UTC'] } }, required: ['zone'],
                  additionalProperties: false } };
  for (let round = 0; round < 3; ++round) {  // unseeded: three different outputs, most likely
    const request = { model, input: 'Weather and time?', tools: [weatherTool, timeTool], tool_choice: 'required',
      parallel_tool_calls: false, max_output_tokens: 160, temperature: 1 };
    const response = await client.responses.create(request);
    checkResponse(response, model);
    assert.equal(response.parallel_tool_calls, false);
    assert.equal(response.output.filter((item) => item.type === 'function_call').length, 1, JSON.stringify(response.output));
    const streamed = await client.responses.stream(request).finalResponse();
    assert.equal(streamed.output.filter((item) => item.type === 'function_call').length, 1);
  }
});

test('errors name the field', async ({ client, model, server }) => {
  const rejects = async (body, param) => {
    await assert.rejects(client.responses.create({ model, ...body }), (e) => {
      assert.equal(e.status, 400, `${JSON.stringify(body)}: ${e.message}`);
      assert.equal(e.param, param, `${JSON.stringify(body)}: ${e.message}`);
      return true;
    });
  };
  await rejects({ input: 'x', tools: [{ type: 'web_search' }] }, 'tools[0].type');
  await rejects({ input: 'x', background: true }, 'background');
  await rejects({ input: 'x', include: ['reasoning.encrypted_content'] }, 'include');
  await rejects({ input: [{ role: 'user', content: [{ type: 'input_image', image_url: 'https://x/y.png' }] }] },
    'input[0].content[0]');
  await rejects({ input: 'x', previous_response_id: 'resp_000000000000000000000000' }, 'previous_response_id');
  await rejects({ input: 'x', temperature: 5 }, 'temperature');
  await rejects({ input: 'x', tools: [weatherTool], tool_choice: { type: 'function', name: 'no_such_tool' } },
    'tool_choice.name');
  await assert.rejects(client.responses.create({ model: 'other', input: 'x' }), (e) => e.status === 404);
  const wrongMethod = await fetch(`${server.url}/v1/responses`);
  assert.equal(wrongMethod.status, 405);
  const malformed = await post(server, '/v1/responses', '{');
  assert.equal(malformed.status, 400);
  // The server still serves.
  checkResponse(await client.responses.create({ model, input: 'x', max_output_tokens: 1 }), model);
});

// ---------------------------------------------------------------------------------------------

const server = await startServer(metrale, ['--model', modelDir, '--threads', '2', '--kv-cache-memory', '256MiB',
  '--max-model-len', '2048', '--response-store-size', '64']);
const client = new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60000 });
const model = (await client.models.list()).data[0].id;
let failures = 0;
for (const { name, fn } of tests.filter((t) => !only || t.name.includes(only))) {
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
  await server.stop();
} catch (error) {
  ++failures;
  console.log(`FAIL stopping the server: ${error.message}`);
}
console.log(failures ? `${failures} failed` : 'all passed');
process.exit(failures ? 1 : 0);
