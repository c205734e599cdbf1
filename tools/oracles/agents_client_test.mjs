// End-to-end test of POST /v1/responses driven by the OpenAI Agents SDK (@openai/agents, npm): one
// agent with a function tool, run against `metrale serve` on the tiny random model, streamed and not.
// The SDK builds its requests (instructions, input items, function tools with their zod schemas,
// model settings), parses the responses and the typed event stream, and ends the run on the model's
// final output: the checks are on that protocol.
//
// The random model never writes its end-of-sequence token, and the SDK rightly fails a run whose
// response is "incomplete" (max_output_tokens reached); so the agent's requests carry metrale's
// `stop` extension (modelSettings.providerData) with a space: the output ends at the first space the
// model writes, with status "completed", as a real model's answer ends.
//
// The random model writes no tool call of its own; a run with modelSettings.toolChoice 'required'
// forces one (constrained decoding makes it a valid call of get_weather), and the agent, set to stop
// on its first tool call, answers with the tool's output.
//
//   node tools/oracles/agents_client_test.mjs --metrale build/bin/metrale [--model models/default]
import assert from 'node:assert/strict';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { Agent, OpenAIProvider, Runner, setTracingDisabled, tool } from '@openai/agents';
import { z } from 'zod';
import { get, startServer } from './metrale_server.mjs';

const args = process.argv.slice(2);
const option = (name, fallback) => {
  const at = args.indexOf(name);
  return at >= 0 ? args[at + 1] : fallback;
};
const metrale = option('--metrale');
const here = path.dirname(fileURLToPath(import.meta.url));
const modelDir = option('--model', path.join(here, '../../models/default'));
if (!metrale) {
  console.error('usage: agents_client_test.mjs --metrale PATH [--model DIR]');
  process.exit(2);
}

setTracingDisabled(true);
const server = await startServer(metrale, ['--model', modelDir, '--threads', '2', '--kv-cache-memory', '256MiB',
  '--max-model-len', '2048']);
const model = (await get(server, '/v1/models')).json.data[0].id;
const provider = new OpenAIProvider({ baseURL: `${server.url}/v1`, apiKey: 'unused', useResponses: true });
const runner = new Runner({ modelProvider: provider, tracingDisabled: true });

const toolCalls = [];
const getWeather = tool({
  name: 'get_weather',
  description: 'The current weather in a city',
  parameters: z.object({ city: z.string() }),
  execute: async ({ city }) => {
    toolCalls.push(city);
    return `It is sunny in ${city}.`;
  },
});
const makeAgent = (modelSettings = {}, agentSettings = {}) => new Agent({
  name: 'Weather agent',
  instructions: 'You answer questions about the weather. Use get_weather.',
  model,
  tools: [getWeather],
  modelSettings: { temperature: 0, maxTokens: 64, providerData: { stop: [' '] }, ...modelSettings },
  ...agentSettings,
});

let failures = 0;
const check = async (name, fn) => {
  const started = Date.now();
  try {
    await fn();
    console.log(`ok   ${name} (${Date.now() - started} ms)`);
  } catch (error) {
    ++failures;
    console.log(`FAIL ${name}: ${error.stack ?? error}`);
  }
};

// What the server kept of the run's last model call: the request as the SDK sent it.
async function storedResponse(result) {
  const last = result.rawResponses.at(-1);
  assert.ok(last && typeof last.responseId === 'string', 'the SDK saw a response id');
  const stored = await get(server, `/v1/responses/${last.responseId}`);
  assert.equal(stored.status, 200, stored.text);
  return stored.json;
}

let plainOutput;
await check('agent run with a function tool', async () => {
  const result = await runner.run(makeAgent(), 'What is the weather in Paris?');
  assert.equal(typeof result.finalOutput, 'string');
  plainOutput = result.finalOutput;
  assert.ok(result.rawResponses.length >= 1);
  const usage = result.rawResponses.at(-1).usage;
  assert.ok(usage.inputTokens > 0 && usage.outputTokens > 0 && usage.totalTokens === usage.inputTokens + usage.outputTokens);
  const stored = await storedResponse(result);
  assert.equal(stored.instructions, 'You answer questions about the weather. Use get_weather.');
  assert.equal(stored.tools.length, 1);
  assert.equal(stored.tools[0].name, 'get_weather');
  assert.equal(stored.tools[0].parameters.properties.city.type, 'string');
  assert.equal(stored.temperature, 0);
  assert.equal(stored.max_output_tokens, 64);
  assert.equal(stored.status, 'completed');
  // The final output is the text of the last message item (empty when the model wrote only reasoning).
  const message = stored.output.find((item) => item.type === 'message');
  assert.equal(result.finalOutput, message ? message.content[0].text : '');
});

await check('streamed agent run gives the same output', async () => {
  const stream = await runner.run(makeAgent(), 'What is the weather in Paris?', { stream: true });
  const eventTypes = new Set();
  for await (const event of stream) {
    eventTypes.add(event.type === 'raw_model_stream_event' ? `raw:${event.data.type}` : event.type);
  }
  await stream.completed;
  assert.equal(stream.finalOutput, plainOutput);
  assert.ok(eventTypes.has('raw:response_started'), [...eventTypes].join(', '));
  assert.ok(eventTypes.has('raw:response_done'), [...eventTypes].join(', '));
});

await check('a second turn continues the first with previousResponseId', async () => {
  const first = await runner.run(makeAgent(), 'What is the weather in Paris?');
  const second = await runner.run(makeAgent(), 'And in Rome?', { previousResponseId: first.lastResponseId });
  const firstStored = await storedResponse(first);
  const secondStored = await storedResponse(second);
  assert.equal(secondStored.previous_response_id, first.lastResponseId);
  assert.equal(secondStored.status, 'completed');
  // The first turn's input and output are in the second prompt.
  assert.ok(secondStored.usage.input_tokens > firstStored.usage.input_tokens + firstStored.usage.output_tokens);
});

await check('a forced tool call runs the tool', async () => {
  const calls = toolCalls.length;
  // No stop string here: a space may belong to the call's JSON.
  const agent = makeAgent({ toolChoice: 'required', maxTokens: 256, providerData: {} },
    { toolUseBehavior: 'stop_on_first_tool' });
  const result = await runner.run(agent, 'Weather in Paris?');
  assert.equal(toolCalls.length, calls + 1, 'get_weather ran once');
  assert.equal(typeof toolCalls.at(-1), 'string');
  assert.equal(result.finalOutput, `It is sunny in ${toolCalls.at(-1)}.`);
  const stored = await storedResponse(result);
  assert.equal(stored.tool_choice, 'required');
  assert.equal(stored.output.filter((item) => item.type === 'function_call').length, 1, JSON.stringify(stored.output));
});

try {
  await server.stop();
} catch (error) {
  ++failures;
  console.log(`FAIL stopping the server: ${error.message}`);
}
console.log(failures ? `${failures} failed` : 'all passed');
process.exit(failures ? 1 : 0);
