// Tool calling and structured outputs of `metrale serve`, driven by the clients people use: the
// official `openai` client, the Vercel AI SDK (`ai` + `@ai-sdk/openai-compatible`) and LangChain JS
// (`@langchain/openai`), all pinned in package.json. The server runs the bundled tiny random Qwen3
// (models/default, real Qwen3 tokenizer and chat template, hermes tool calls), whose words mean
// nothing: the tests check the protocol, and constrained decoding makes every structured output and
// every forced tool call valid against its schema whatever the model says.
//
//   node tools/oracles/clients_test.mjs --metrale build/bin/metrale --client openai|ai-sdk|langchain [--model DIR]
import assert from 'node:assert/strict';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import OpenAI from 'openai';
import { z } from 'zod';
import { startServer, post } from './metrale_server.mjs';

const args = process.argv.slice(2);
const option = (name, fallback) => {
  const at = args.indexOf(name);
  return at >= 0 ? args[at + 1] : fallback;
};
const metrale = option('--metrale');
const client = option('--client');
const here = path.dirname(fileURLToPath(import.meta.url));
const modelDir = option('--model', path.join(here, '../../models/default'));
if (!metrale || !client) {
  console.error('usage: clients_test.mjs --metrale PATH --client openai|ai-sdk|langchain [--model DIR]');
  process.exit(2);
}

// The schemas every client uses, as JSON Schema and as zod (the validator of what comes back).
const weatherParameters = {
  type: 'object',
  properties: { city: { type: 'string', maxLength: 12 }, days: { type: 'integer', minimum: 1, maximum: 7 } },
  required: ['city', 'days'],
  additionalProperties: false,
};
const WeatherArgs = z.object({ city: z.string().max(12), days: z.number().int().min(1).max(7) }).strict();
const weatherTool = {
  type: 'function',
  function: { name: 'get_weather', description: 'Weather for a city', parameters: weatherParameters },
};
const timeTool = {
  type: 'function',
  function: {
    name: 'get_time',
    description: 'Time in a zone',
    parameters: { type: 'object', properties: { zone: { type: 'string', enum: ['CET', 'UTC'] } }, required: ['zone'] },
  },
};
const Person = z.object({
  name: z.string().max(16),
  age: z.number().int().min(0).max(150),
  tags: z.array(z.enum(['a', 'b', 'c'])).max(3),
});
const personSchema = {
  type: 'object',
  properties: {
    name: { type: 'string', maxLength: 16 },
    age: { type: 'integer', minimum: 0, maximum: 150 },
    tags: { type: 'array', items: { type: 'string', enum: ['a', 'b', 'c'] }, maxItems: 3 },
  },
  required: ['name', 'age', 'tags'],
  additionalProperties: false,
};

const tests = [];
const test = (name, fn) => tests.push({ name, fn });

// ---------------------------------------------------------------------------------------------
// The official openai client.

function openaiTests() {
  const openai = (server) => new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
  const messages = [{ role: 'user', content: 'What is the weather in Paris?' }];

  test('forced tool call (required), streamed and not', async (server) => {
    const api = openai(server);
    const request = { model: 'default', messages, tools: [weatherTool, timeTool], tool_choice: 'required',
                      max_tokens: 120, temperature: 0, seed: 3 };
    const whole = await api.chat.completions.create(request);
    const choice = whole.choices[0];
    assert.equal(choice.finish_reason, 'tool_calls');
    assert.ok(choice.message.tool_calls.length >= 1);
    for (const call of choice.message.tool_calls) {
      assert.equal(call.type, 'function');
      assert.match(call.id, /^call_/);
      const parsed = JSON.parse(call.function.arguments);
      if (call.function.name === 'get_weather') WeatherArgs.parse(parsed);
      else assert.ok(['CET', 'UTC'].includes(parsed.zone), call.function.arguments);
    }
    // The stream helper merges the deltas; the calls equal the non-streaming ones (ids are per request).
    const stream = api.chat.completions.stream({ ...request, stream: true });
    const streamed = await stream.finalChatCompletion();
    const strip = (calls) => calls.map((call) => [call.function.name, call.function.arguments]);
    assert.deepEqual(strip(streamed.choices[0].message.tool_calls), strip(choice.message.tool_calls));
    assert.equal(streamed.choices[0].finish_reason, 'tool_calls');
  });

  test('named function, n = 2, and the next turn with the tool result', async (server) => {
    const api = openai(server);
    const whole = await api.chat.completions.create({
      model: 'default', messages, tools: [weatherTool, timeTool], n: 2, max_tokens: 120, temperature: 1, seed: 5,
      tool_choice: { type: 'function', function: { name: 'get_weather' } }, parallel_tool_calls: false,
    });
    assert.equal(whole.choices.length, 2);
    for (const choice of whole.choices) {
      assert.equal(choice.message.tool_calls.length, 1);
      assert.equal(choice.message.tool_calls[0].function.name, 'get_weather');
      WeatherArgs.parse(JSON.parse(choice.message.tool_calls[0].function.arguments));
    }
    const call = whole.choices[0].message.tool_calls[0];
    const next = await api.chat.completions.create({
      model: 'default', max_tokens: 8, tools: [weatherTool],
      messages: [...messages, whole.choices[0].message, { role: 'tool', tool_call_id: call.id, content: '{"temp": 21}' }],
    });
    assert.equal(typeof next.choices[0].message.content, 'string');
  });

  test('tool_choice auto and none answer with text or calls', async (server) => {
    const api = openai(server);
    const promptTokens = {};
    for (const tool_choice of ['auto', 'none', undefined]) {
      const whole = await api.chat.completions.create({ model: 'default', messages, max_tokens: 12,
                                                        ...(tool_choice ? { tools: [weatherTool], tool_choice } : {}) });
      const choice = whole.choices[0];
      assert.ok(['stop', 'length', 'tool_calls'].includes(choice.finish_reason));
      if (tool_choice === 'none') assert.equal(choice.message.tool_calls, undefined);
      promptTokens[tool_choice ?? 'no tools'] = whole.usage.prompt_tokens;
    }
    // "none" leaves the tools out of the chat template: the prompt is the one without tools.
    assert.equal(promptTokens.none, promptTokens['no tools'], JSON.stringify(promptTokens));
    assert.ok(promptTokens.auto > promptTokens['no tools'], JSON.stringify(promptTokens));
    // /tokenize renders the same prompt.
    const tokenize = async (body) => (await post(server, '/tokenize', { messages, ...body })).json.tokens;
    assert.deepEqual(await tokenize({ tools: [weatherTool], tool_choice: 'none' }), await tokenize({}));
  });

  test('parallel_tool_calls false: one call, "required" and named, streamed and not', async (server) => {
    const api = openai(server);
    for (const tool_choice of ['required', { type: 'function', function: { name: 'get_time' } }]) {
      for (const seed of [1, 2, 3]) {
        const request = { model: 'default', messages, tools: [weatherTool, timeTool], tool_choice, max_tokens: 160,
                          temperature: 1, seed, parallel_tool_calls: false };
        const whole = await api.chat.completions.create(request);
        assert.equal(whole.choices[0].finish_reason, 'tool_calls');
        assert.equal(whole.choices[0].message.tool_calls.length, 1, JSON.stringify(whole.choices[0].message));
        const streamed = await api.chat.completions.stream({ ...request, stream: true }).finalChatCompletion();
        assert.equal(streamed.choices[0].message.tool_calls.length, 1);
      }
    }
  });

  test('structured output: json_schema, streamed and not; json_object', async (server) => {
    const api = openai(server);
    const request = { model: 'default', max_tokens: 150, seed: 9, messages: [{ role: 'user', content: 'A person' }],
                      response_format: { type: 'json_schema',
                                         json_schema: { name: 'person', schema: personSchema, strict: true } } };
    const whole = await api.chat.completions.create(request);
    assert.equal(whole.choices[0].finish_reason, 'stop');
    Person.parse(JSON.parse(whole.choices[0].message.content));
    let streamed = '';
    for await (const chunk of await api.chat.completions.create({ ...request, stream: true })) {
      streamed += chunk.choices[0]?.delta?.content ?? '';
    }
    assert.equal(streamed, whole.choices[0].message.content);
    const object = await api.chat.completions.create({ model: 'default', max_tokens: 100, messages,
                                                       response_format: { type: 'json_object' } });
    const value = JSON.parse(object.choices[0].message.content);
    assert.equal(typeof value, 'object');
    assert.ok(value !== null && !Array.isArray(value));
    // /v1/completions takes response_format too.
    const completion = await api.completions.create({ model: 'default', prompt: 'A person:', max_tokens: 150,
                                                      response_format: { type: 'json_schema',
                                                                         json_schema: { name: 'person', schema: personSchema } } });
    Person.parse(JSON.parse(completion.choices[0].text));
  });

  test('an unsupported schema keyword is a 400 naming it', async (server) => {
    const { status, json } = await post(server, '/v1/chat/completions', {
      messages, max_tokens: 4,
      response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'object', not: { required: ['a'] } } } },
    });
    assert.equal(status, 400);
    assert.match(json.error.message, /'not'/);
    const bad = await post(server, '/v1/chat/completions', { messages, tools: [weatherTool], max_tokens: 4,
                                                              tool_choice: { type: 'function', function: { name: 'nope' } } });
    assert.equal(bad.status, 400);
    assert.equal(bad.json.error.param, 'tool_choice');
  });

  test('logit_bias', async (server) => {
    const api = openai(server);
    const token = 9707;  // any id of the vocabulary
    const whole = await api.completions.create({ model: 'default', prompt: 'Hello', max_tokens: 4, logprobs: 0,
                                                 logit_bias: { [token]: 100 } });
    const tokens = whole.choices[0].logprobs.tokens;
    assert.equal(tokens.length, 4);
    assert.ok(tokens.every((text) => text === tokens[0]), JSON.stringify(tokens));
    const bad = await post(server, '/v1/completions', { prompt: 'x', logit_bias: { 5: 300 } });
    assert.equal(bad.status, 400);
  });

  test('structured output and forced calls with n-gram speculative decoding', async () => {
    // A server that drafts from the prompt: the JSON in the prompt gives the drafter something to
    // propose, and the grammar must check (and roll back) what it proposes.
    const speculative = await startServer(metrale, ['--threads', '2', '--kv-cache-memory', '256MiB', '--model', modelDir,
                                                    '--served-model-name', 'default', '--speculative-method', 'ngram',
                                                    '--no-adaptive-speculation']);
    try {
      const api = openai(speculative);
      const example = '{"name": "Ada", "age": 36, "tags": ["a", "b"]}';
      const content = `Repeat: ${example} ${example} ${example}`;
      for (const temperature of [0, 1]) {
        const whole = await api.chat.completions.create({
          model: 'default', max_tokens: 80, temperature, seed: 4, n: 2, messages: [{ role: 'user', content }],
          response_format: { type: 'json_schema', json_schema: { name: 'person', schema: personSchema } } });
        for (const choice of whole.choices) Person.parse(JSON.parse(choice.message.content));
        const call = await api.chat.completions.create({ model: 'default', max_tokens: 120, temperature, n: 2,
                                                         messages: [{ role: 'user', content }], tools: [weatherTool],
                                                         tool_choice: 'required' });
        for (const choice of call.choices) {
          assert.equal(choice.finish_reason, 'tool_calls');
          WeatherArgs.parse(JSON.parse(choice.message.tool_calls[0].function.arguments));
        }
      }
      const metrics = await (await fetch(`${speculative.url}/metrics`)).text();
      const drafted = metrics.match(/^metrale_spec_decode_num_draft_tokens_total (\d+)/m);
      assert.ok(drafted && Number(drafted[1]) > 0, 'the drafter proposed nothing: the test checked no draft');
    } finally {
      await speculative.stop();
    }
  });

  test('echo with logprobs, /tokenize, /detokenize, GET /v1/models/{id}', async (server) => {
    const api = openai(server);
    const prompt = 'The quick brown fox';
    const { json: tokenized, status } = await post(server, '/tokenize', { prompt, add_special_tokens: false,
                                                                          return_token_strs: true });
    assert.equal(status, 200);
    assert.equal(tokenized.count, tokenized.tokens.length);
    assert.equal(tokenized.token_strs.length, tokenized.tokens.length);
    assert.ok(tokenized.max_model_len > 0);
    const { json: detokenized } = await post(server, '/detokenize', { tokens: tokenized.tokens });
    assert.equal(detokenized.prompt, prompt);
    const chat = await post(server, '/tokenize', { messages: [{ role: 'user', content: 'hi' }] });
    assert.ok(chat.json.count > 3);
    // Legacy echo: the prompt's tokens lead the logprobs, the first with null; then the generated ones.
    const whole = await api.completions.create({ model: 'default', prompt, max_tokens: 3, echo: true, logprobs: 2,
                                                 temperature: 0 });
    const { tokens, token_logprobs, top_logprobs, text_offset } = whole.choices[0].logprobs;
    const count = tokenized.count;
    assert.equal(tokens.length, count + 3);
    assert.equal(token_logprobs[0], null);
    assert.equal(top_logprobs[0], null);
    assert.ok(token_logprobs.slice(1).every((value) => typeof value === 'number' && value <= 0));
    assert.ok(top_logprobs.slice(1).every((top) => Object.keys(top).length >= 1));
    assert.equal(tokens.slice(0, count).join(''), prompt);
    assert.equal(text_offset[0], 0);
    assert.ok(whole.choices[0].text.startsWith(prompt));
    // A prompt token's logprob is at most the best alternative's, and the same when the prompt ends
    // after it (the rows of a shorter prompt are the same causal positions).
    for (let i = 1; i < count; i += 1) {
      assert.ok(token_logprobs[i] <= Math.max(...Object.values(top_logprobs[i])) + 1e-4, `prompt token ${i}`);
    }
    const shorter = await api.completions.create({ model: 'default', prompt: tokenized.tokens.slice(0, 3), max_tokens: 1,
                                                   echo: true, logprobs: 2, temperature: 0 });
    const short = shorter.choices[0].logprobs.token_logprobs;
    for (let i = 1; i < 3; i += 1) assert.ok(Math.abs(short[i] - token_logprobs[i]) < 1e-3, `${short[i]} vs ${token_logprobs[i]}`);
    // The generated tokens are those of the same request without echo.
    const plain = await api.completions.create({ model: 'default', prompt, max_tokens: 3, logprobs: 2, temperature: 0 });
    assert.deepEqual(tokens.slice(count), plain.choices[0].logprobs.tokens);
    const model = await api.models.retrieve('default');
    assert.equal(model.id, 'default');
    assert.equal(model.object, 'model');
    await assert.rejects(api.models.retrieve('other'), (error) => error.status === 404);
  });
}

// ---------------------------------------------------------------------------------------------
// The Vercel AI SDK.

async function aiSdkTests() {
  const { generateText, streamText, generateObject, tool } = await import('ai');
  const { createOpenAICompatible } = await import('@ai-sdk/openai-compatible');
  const model = (server) =>
    createOpenAICompatible({ name: 'metrale', baseURL: `${server.url}/v1`, supportsStructuredOutputs: true })('default');

  test('generateText and streamText', async (server) => {
    const whole = await generateText({ model: model(server), prompt: 'Say hi', maxOutputTokens: 8, temperature: 0,
                                       maxRetries: 0 });
    assert.equal(typeof whole.text, 'string');
    assert.ok(whole.usage.outputTokens > 0);
    const streamed = streamText({ model: model(server), prompt: 'Say hi', maxOutputTokens: 8, temperature: 0,
                                  maxRetries: 0 });
    let text = '';
    for await (const piece of streamed.textStream) text += piece;
    assert.equal(text, whole.text);
  });

  test('generateObject with a zod schema', async (server) => {
    const { object } = await generateObject({ model: model(server), schema: Person, prompt: 'A person',
                                              maxOutputTokens: 150, maxRetries: 0 });
    Person.parse(object);
  });

  test('a tool call', async (server) => {
    const result = await generateText({
      model: model(server), prompt: 'Weather in Oslo?', maxOutputTokens: 120, maxRetries: 0, toolChoice: 'required',
      tools: { get_weather: tool({ description: 'Weather for a city', inputSchema: WeatherArgs }) },
    });
    assert.equal(result.finishReason, 'tool-calls');
    assert.ok(result.toolCalls.length >= 1);
    for (const call of result.toolCalls) {
      assert.equal(call.toolName, 'get_weather');
      WeatherArgs.parse(call.input);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// LangChain JS.

async function langchainTests() {
  const { ChatOpenAI } = await import('@langchain/openai');
  const chat = (server, extra = {}) =>
    new ChatOpenAI({ model: 'default', apiKey: 'unused', maxRetries: 0, configuration: { baseURL: `${server.url}/v1` },
                     ...extra });

  test('invoke and stream', async (server) => {
    const message = await chat(server, { maxTokens: 8, temperature: 0 }).invoke('Say hi');
    assert.equal(typeof message.content, 'string');
    let text = '';
    for await (const chunk of await chat(server, { maxTokens: 8, temperature: 0 }).stream('Say hi')) text += chunk.content;
    assert.equal(text, message.content);
  });

  test('bindTools', async (server) => {
    const model = chat(server, { maxTokens: 120 }).bindTools([weatherTool], { tool_choice: 'required' });
    const message = await model.invoke('Weather in Rome?');
    assert.ok(message.tool_calls.length >= 1, JSON.stringify(message));
    for (const call of message.tool_calls) {
      assert.equal(call.name, 'get_weather');
      WeatherArgs.parse(call.args);
      assert.match(call.id, /^call_/);
    }
  });

  test('withStructuredOutput (json schema and function calling)', async (server) => {
    for (const method of ['jsonSchema', 'functionCalling']) {
      const model = chat(server, { maxTokens: 150 }).withStructuredOutput(Person, { name: 'person', method });
      Person.parse(await model.invoke('A person'));
    }
  });
}

// ---------------------------------------------------------------------------------------------

if (client === 'openai') openaiTests();
else if (client === 'ai-sdk') await aiSdkTests();
else if (client === 'langchain') await langchainTests();
else {
  console.error(`unknown --client ${client}`);
  process.exit(2);
}

const server = await startServer(metrale, ['--threads', '2', '--kv-cache-memory', '256MiB', '--model', modelDir,
                                           '--served-model-name', 'default']);
let failed = 0;
try {
  for (const { name, fn } of tests) {
    const start = Date.now();
    try {
      await fn(server);
      console.log(`ok   ${client}: ${name} (${Date.now() - start} ms)`);
    } catch (error) {
      failed += 1;
      console.log(`FAIL ${client}: ${name}\n${error.stack ?? error}`);
    }
  }
} finally {
  await server.stop();
}
if (failed > 0) {
  console.log(`${failed} of ${tests.length} failed\n--- server stderr ---\n${server.stderr().slice(-4000)}`);
  process.exit(1);
}
console.log(`all ${tests.length} ${client} client tests passed`);
