// Helpers shared by the integration tests that drive tandem processes over HTTP.
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { readFileSync } from 'node:fs';
import net from 'node:net';

// A server's Prometheus metrics as {name{labels}: value}, without the model_name label.
export async function metrics(base) {
  const text = await (await fetch(base + '/metrics')).text();
  const m = {};
  for (const line of text.split('\n')) {
    const r = line.match(/^([a-z_]+(?:\{[^}]*\})?) (\S+)$/);
    if (r) m[r[1].replace(/\{model_name="[^"]*"\}/, '')] = Number(r[2]);
  }
  return m;
}

// Wait until f() is true (a deadline bounds the wait, it is not the assertion).
export async function until(f, what, ms = 20000) {
  const end = Date.now() + ms;
  for (;;) {
    if (await f()) return;
    if (Date.now() > end) assert.fail(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 25));
  }
}

// Start `bin args...`; resolves to {url, port, proc, stderr()} once it prints its port
// ("listening on HOST:PORT"), rejects if it exits first. The process is added to procs
// (and removed when it exits), so that the caller can kill what is left at the end.
export function startTandem(bin, args, procs, env = {}) {
  return new Promise((resolve, reject) => {
    const p = spawn(bin, args, { env: { ...process.env, ...env }, stdio: ['ignore', 'ignore', 'pipe'] });
    procs.add(p);
    let err = '';
    p.stderr.on('data', (d) => {
      err += d;
      const m = err.match(/listening on [^\n]*:(\d+)\n/);
      if (m && !p.started) {
        p.started = true;
        resolve({ url: `http://127.0.0.1:${m[1]}`, port: Number(m[1]), proc: p, stderr: () => err });
      }
    });
    p.on('exit', (code) => { procs.delete(p); if (!p.started) reject(new Error(`exited ${code}: ${err}`)); });
  });
}

// POST a JSON body (or a string as it is); resolves to {status, json (null if not JSON), text}.
export async function postJson(base, path, body) {
  const res = await fetch(base + path, {
    method: 'POST', headers: { 'content-type': 'application/json' },
    body: typeof body === 'string' ? body : JSON.stringify(body),
  });
  const text = await res.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* not JSON */ }
  return { status: res.status, json, text };
}

// n prompts as token ids: BOS, then pseudo-random ids in 3..502 (a vocabulary of 512), the
// i-th of length lens[i % lens.length], from the seed.
export function tokenPrompts(n, lens, seed) {
  const out = [];
  for (let i = 0; i < n; i++) {
    const ids = [1];
    let s = seed + i * 104729;
    for (let k = 1; k < lens[i % lens.length]; k++) { s = (s * 1103515245 + 12345) % 2147483648; ids.push(3 + (s % 500)); }
    out.push(ids);
  }
  return out;
}

// The reference output: refText(() => base, gen)(prompt) is the text one engine at base
// gives for the prompt with the sampling fields gen, asked once per prompt and remembered.
// (base is a function: the engine may start after the helper is made.)
export function refText(base, gen) {
  const memo = new Map();
  return async (prompt) => {
    const key = JSON.stringify(prompt);
    if (!memo.has(key)) {
      const r = await postJson(base(), '/v1/completions', { prompt, ...gen });
      assert.equal(r.status, 200, r.text);
      memo.set(key, r.json.choices[0].text);
    }
    return memo.get(key);
  };
}

// A loopback port that nothing listens on, for a server started later on it. It is drawn
// below the kernel's ephemeral range: a port from that range can be taken in the meantime by
// any outgoing connection, even by a client's connect to that very port when nothing listens
// there yet (TCP's self-connect), which then makes the late server's bind fail.
export async function freePort() {
  let lo = 32768;
  try { lo = Number(readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/)[0]); } catch { /* not Linux */ }
  const base = Math.max(1024, Math.min(lo, 65536) - 10000);
  for (let i = 0; i < 200; i++) {
    const port = base + Math.floor(Math.random() * (Math.min(lo, 65536) - base));
    const free = await new Promise((resolve) => {
      const srv = net.createServer();
      srv.once('error', () => resolve(false));
      srv.listen(port, '127.0.0.1', () => srv.close(() => resolve(true)));
    });
    if (free) return port;
  }
  throw new Error('no free loopback port below the ephemeral range');
}
