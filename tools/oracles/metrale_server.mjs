// A `metrale serve` process for the end-to-end tests: started on a free port, stopped with SIGTERM
// (it must exit 0), with raw HTTP helpers that keep the status and the body.
import { spawn } from 'node:child_process';
import assert from 'node:assert/strict';

export async function startServer(metrale, args, env = {}) {
  const child = spawn(metrale, ['serve', '--port', '0', ...args], {
    stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, ...env },
  });
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

// POST a JSON body; returns { status, json, text }.
export async function post(server, path, body) {
  const response = await fetch(`${server.url}${path}`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(body),
  });
  const text = await response.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* an SSE stream, or checked by the caller */ }
  return { status: response.status, json, text };
}

export async function get(server, path) {
  const response = await fetch(`${server.url}${path}`);
  const text = await response.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* checked by the caller */ }
  return { status: response.status, json, text };
}

// The `data:` payloads of an SSE body, parsed ([DONE] as the string).
export function sseEvents(text) {
  const events = [];
  for (const line of text.split('\n')) {
    if (!line.startsWith('data: ')) continue;
    const data = line.slice(6);
    events.push(data === '[DONE]' ? data : JSON.parse(data));
  }
  return events;
}
