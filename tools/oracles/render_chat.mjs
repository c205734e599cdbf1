#!/usr/bin/env node
// Differential test of metrale's chat templates (src/text/chat_template.h) against
// @huggingface/jinja, the interpreter transformers.js's apply_chat_template uses.
//
// Every fixture template of tests/text/chat_templates/templates.json renders every conversation of
// tests/text/chat_conversations.json, with add_generation_prompt true and false and with
// enable_thinking unset, true and false, given the variables apply_chat_template passes (messages,
// add_generation_prompt, tools or null, documents null, bos_token, eos_token, then the kwargs).
// The results (rendered text, or the error @huggingface/jinja raised) go to a JSON file that the
// ChatTemplateOracle test of metrale_text_tests reads (METRALE_CHAT_ORACLE_CASES): metrale must
// render the same bytes, and fail where the reference fails.
//
// Usage: node render_chat.mjs --test-binary PATH/metrale_text_tests [--keep FILE]
//        node render_chat.mjs --write FILE      (only writes the cases)
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const repo = path.resolve(here, '../..');
const templatesDir = path.join(repo, 'tests/text/chat_templates');
const conversationsFile = path.join(repo, 'tests/text/chat_conversations.json');

function parseArgs(argv) {
  const args = { 'test-binary': null, keep: null, write: null };
  for (let i = 0; i < argv.length; i++) {
    const key = argv[i].replace(/^--/, '');
    if (!(key in args)) throw new Error(`unknown option ${argv[i]}`);
    args[key] = argv[++i];
  }
  if (!args['test-binary'] && !args.write) throw new Error('--test-binary PATH or --write FILE is required');
  return args;
}

async function loadJinja() {
  try {
    return (await import('@huggingface/jinja')).Template;
  } catch (error) {
    console.error(`chat template oracle: @huggingface/jinja is missing (${error.message.split('\n')[0]}).`);
    console.error('chat template oracle: run scripts/install-deps.sh');
    process.exit(1);
  }
}

function buildCases(Template) {
  const manifest = JSON.parse(fs.readFileSync(path.join(templatesDir, 'templates.json'), 'utf8'));
  const { conversations } = JSON.parse(fs.readFileSync(conversationsFile, 'utf8'));
  const kwargVariants = [{}, { enable_thinking: true }, { enable_thinking: false }];
  const cases = [];
  for (const spec of manifest.templates) {
    const source = fs.readFileSync(path.join(templatesDir, spec.file), 'utf8');
    const template = new Template(source);
    for (const conversation of conversations) {
      for (const addGenerationPrompt of [true, false]) {
        for (const kwargs of kwargVariants) {
          const items = {
            messages: conversation.messages,
            add_generation_prompt: addGenerationPrompt,
            tools: conversation.tools ?? null,
            documents: null,
            bos_token: spec.bos_token,
            eos_token: spec.eos_token,
            ...kwargs,
          };
          const entry = {
            template: spec.name,
            file: spec.file,
            bos_token: spec.bos_token,
            eos_token: spec.eos_token,
            conversation: conversation.name,
            messages: conversation.messages,
            tools: conversation.tools ?? null,
            add_generation_prompt: addGenerationPrompt,
            kwargs,
          };
          try {
            entry.expected = template.render(items);
          } catch (error) {
            entry.error = String(error.message);
            // A message the template itself raised (raise_exception) must be surfaced by metrale.
            entry.raised = source.includes(entry.error);
          }
          cases.push(entry);
        }
      }
    }
  }
  return cases;
}

const args = parseArgs(process.argv.slice(2));
const Template = await loadJinja();
const cases = buildCases(Template);
const failures = cases.filter((c) => c.error !== undefined).length;
console.log(`chat template oracle: ${cases.length} cases (${failures} where @huggingface/jinja raises)`);
const file = args.write ?? args.keep ?? path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'metrale-chat-')), 'cases.json');
fs.writeFileSync(file, JSON.stringify(cases));
if (!args['test-binary']) process.exit(0);
const run = spawnSync(args['test-binary'], ['--gtest_filter=ChatTemplateOracle.*'], {
  env: { ...process.env, METRALE_CHAT_ORACLE_CASES: file },
  stdio: 'inherit',
});
if (!args.keep && !args.write) fs.rmSync(path.dirname(file), { recursive: true, force: true });
if (run.error) throw run.error;
process.exit(run.status ?? 1);
